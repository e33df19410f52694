"""Comparing two checkpoints key by key: what ``jaxckpt diff`` prints."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import numpy as np

from jaxckpt.format.records import ArrayLeaf, Leaf, ValueLeaf
from jaxckpt.reading.open import open_latest
from jaxckpt.reading.reader import Opened
from jaxckpt.storage import locations
from jaxckpt.tools.describe import json_value, key_matcher, leaf_shape, leaf_type, selected
from jaxckpt.tools.progress import Progress
from jaxckpt.tools.scan import array_leaf, batches, number_text, numeric, one_large, pieces, read_arrays


@dataclasses.dataclass
class Diff:
    """How checkpoint B differs from checkpoint A."""

    added: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    changed: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # key, A's kind, B's kind
    different: list[tuple[str, float | None, str]] = dataclasses.field(default_factory=list)  # key, max |a-b|, text
    same: list[str] = dataclasses.field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed or self.different)


def _kind(leaf: Leaf) -> str:
    if isinstance(leaf, ValueLeaf):
        return leaf.type
    return f"{leaf_type(leaf)} {leaf_shape(leaf)}"


def _comparable(x: np.ndarray) -> np.ndarray:
    """Values that compare exactly: ints as ints, every float type as float64, complex as complex128."""
    return x.astype(np.complex128) if x.dtype.kind == "c" else numeric(x)


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| of two arrays of one dtype and shape; NaN where NaN meets a number, NaN == NaN."""
    a, b = _comparable(a), _comparable(b)
    equal = a == b
    if a.dtype.kind in "fc":
        equal |= np.isnan(a) & np.isnan(b)
    if equal.all():
        return 0.0
    to = np.complex128 if a.dtype.kind == "c" else np.float64  # floats: no integer wraparound
    d = np.abs(a[~equal].astype(to) - b[~equal].astype(to))
    return float("nan") if np.isnan(d).any() else float(d.max())


def diff(
    a: str | Opened,
    b: str | Opened,
    patterns: Sequence[str] = (),
    *,
    atol: float = 0.0,
    progress: Progress | None = None,
) -> Diff:
    """Compare the values of two checkpoints key by key (only the keys matching ``patterns``, if any);
    each a path or a checkpoint opened already."""
    ra, rb = (x if isinstance(x, Opened) else open_latest(locations.location(x)) for x in (a, b))
    match = key_matcher(patterns)
    la, lb = (
        {k: r.index.leaves[k] for k in r.index.keys_under("") if match is None or selected(k, match)} for r in (ra, rb)
    )
    out = Diff()
    out.removed = [k for k in la if k not in lb]
    out.added = [k for k in lb if k not in la]
    nodes_b = rb.index.nodes
    for key, info in ra.index.nodes.items():  # a list that became a tuple, a dict that became a module...
        if key in nodes_b and info.kind != nodes_b[key].kind and (match is None or selected(key, match)):
            out.changed.append((key, info.kind, nodes_b[key].kind))
    progress = progress or Progress(0, "", enabled=False)
    verdicts: dict[str, tuple[float | None, str] | None] = {}  # key -> None (same) or (max |a-b|, text)
    comparable: list[str] = []  # arrays of one dtype and shape on both sides
    for key, x in la.items():
        y = lb.get(key)
        if y is None:
            continue
        if isinstance(x, ArrayLeaf) and isinstance(y, ArrayLeaf):
            if _kind(x) != _kind(y) or x.prng_impl != y.prng_impl:
                out.changed.append((key, _kind(x), _kind(y)))
            else:
                comparable.append(key)
        elif isinstance(x, ValueLeaf) and isinstance(y, ValueLeaf) and x.type == y.type:
            if _json(x.value, sort_keys=True) == _json(y.value, sort_keys=True):
                verdicts[key] = None
            else:
                verdicts[key] = (None, f"{_json(x.value)} -> {_json(y.value)}")
        else:
            out.changed.append((key, _kind(x), _kind(y)))
    for batch in batches(ra, comparable):
        if one_large(ra, batch):  # piece by piece, never whole
            (key,) = batch
            worst = 0.0
            for pa, pb in zip(pieces(ra, key), pieces(rb, key)):
                worst = max(worst, _max_abs_diff(pa, pb), key=lambda d: (math.isnan(d), d))
                progress.update(pa.nbytes)
            if math.isnan(worst) or worst > atol:
                verdicts[key] = (worst, _difference(array_leaf(ra, key), worst))
            else:
                verdicts[key] = None
            continue
        xs, ys = read_arrays(ra, batch), read_arrays(rb, batch)
        for key in batch:
            worst = _max_abs_diff(xs[key], ys[key])
            if math.isnan(worst) or worst > atol:
                verdicts[key] = (worst, _difference(array_leaf(ra, key), worst))
            else:
                verdicts[key] = None
        progress.update(sum(x.nbytes for x in xs.values()))
    for key in la:  # report in graph order
        if key in verdicts:
            verdict = verdicts[key]
            if verdict is None:
                out.same.append(key)
            else:
                out.different.append((key, *verdict))
    return out


def _json(value: object, sort_keys: bool = False) -> str:
    return json.dumps(json_value(value), ensure_ascii=False, sort_keys=sort_keys)


def _difference(leaf: ArrayLeaf, worst: float) -> str:
    return "different keys" if leaf.prng_impl else f"max |a - b| = {number_text(worst)}"
