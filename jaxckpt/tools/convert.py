"""``jaxckpt convert``: any checkpoint that jaxckpt reads into a jaxckpt checkpoint, or into safetensors.

The source is any format :func:`jaxckpt.restore` reads (a TensorFlow prefix, an Orbax checkpoint,
a Flax msgpack or safetensors file, a jaxckpt checkpoint, or a manager's directory: its latest).
Values are read one array at a time as the writer reaches them, and a jaxckpt destination writes
out what it holds once it passes :data:`BUDGET`, so memory stays near the largest array plus the
budget, not the checkpoint's size. Values with no numpy form (TensorFlow's iterator state) are left
out and reported.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxckpt._errors import CheckpointExistsError, UnsupportedValueError
from jaxckpt.format.keys import unescape_edge
from jaxckpt.format.records import SCALAR_TYPES, ArrayLeaf, ValueLeaf
from jaxckpt.reading.open import open_latest
from jaxckpt.reading.reader import Opened
from jaxckpt.reading.templates import NO_TEMPLATE
from jaxckpt.saving import pipeline
from jaxckpt.storage import locations
from jaxckpt.storage.locations import PathLike
from jaxckpt.tree.objects import build

# Bytes of converted arrays a jaxckpt destination holds before writing them out.
BUDGET = 64 << 20


@dataclasses.dataclass
class Converted:
    """What a conversion wrote: from where, in which format, how many values and bytes, what was left out."""

    source: str
    source_format: str
    destination: str
    values: int = 0
    nbytes: int = 0
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> why


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    overwrite: bool = False,
    on_read: Callable[[int], None] | None = None,
) -> Converted:
    """Write the checkpoint at ``src`` as a new checkpoint at ``dst``: safetensors if ``dst`` ends in
    ``.safetensors``, else a jaxckpt checkpoint. ``on_read(nbytes)`` is called after each array is read."""
    opened = open_latest(locations.location(src))
    result = Converted(str(opened.path), opened.format, os.fspath(dst))
    result.left_out.update({k: f"{e.note} {e.shape}: no numpy form" for k, e in opened.skipped.items()})

    def read(key: str) -> np.ndarray:
        value = opened.load({key: NO_TEMPLATE})[key]
        leaf = opened.index.leaves[key]
        if isinstance(leaf, ArrayLeaf) and leaf.prng_impl:
            import jax

            value = jax.random.key_data(value)
        data = np.asarray(value)
        result.values += 1
        result.nbytes += data.nbytes
        if on_read is not None:
            on_read(data.nbytes)
        return data

    if os.fspath(dst).endswith(".safetensors"):
        _to_safetensors(opened, os.fspath(dst), read, result, overwrite)
    else:
        _to_jaxckpt(opened, dst, read, result, overwrite)
    return result


def _to_jaxckpt(
    opened: Opened, dst: PathLike, read: Callable[[str], np.ndarray], result: Converted, overwrite: bool
) -> None:
    values: dict[str, Any] = {}
    for key, leaf in opened.index.leaves.items():
        if isinstance(leaf, ValueLeaf):
            if leaf.type == "state_per_process":  # every process's state, carried over as such
                values[key] = leaf
            else:
                values[key] = _State(leaf.value) if leaf.type in ("state", "state_bytes") else leaf.value
            result.values += 1
        elif leaf.prng_impl:  # small, and saved as a key array again
            values[key] = opened.load({key: NO_TEMPLATE})[key]
            result.values += 1
        else:
            values[key] = pipeline.Deferred(leaf.shape, leaf.dtype, functools.partial(read, key))
    pipeline.write(locations.location(dst), build(opened.index.nodes, values), overwrite=overwrite, budget=BUDGET)


class _State:
    """A saved object state (``get_state()``), carried over as such."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def get_state(self) -> Any:
        return self._state

    def set_state(self, state: Any) -> None:
        self._state = state


def _to_safetensors(
    opened: Opened, dst: str, read: Callable[[str], np.ndarray], result: Converted, overwrite: bool
) -> None:
    from jaxckpt.interop import safetensors

    if os.path.lexists(dst) and not overwrite:
        raise CheckpointExistsError(f"{dst!r} already exists; pass --overwrite to replace it.")
    specs: list[tuple[str, np.dtype, tuple[int, ...]]] = []
    scalars: dict[str, np.ndarray] = {}
    keys: dict[str, str] = {}  # tensor name -> key
    for key, leaf in opened.index.leaves.items():
        if not isinstance(leaf, ArrayLeaf) and (leaf.type not in SCALAR_TYPES or leaf.type == "str"):
            result.left_out[key] = f"a Python {leaf.type}: safetensors holds only tensors"
            continue
        name = tensor_name(key)
        if name in keys:
            raise UnsupportedValueError(
                f"Cannot write {dst!r}: the keys {keys[name]!r} and {key!r} would both be the tensor {name!r} "
                "(safetensors names are flat, the edges joined by '/'). Rename one of them, then convert."
            )
        keys[name] = key
        if isinstance(leaf, ArrayLeaf):
            specs.append((name, leaf.dtype, leaf.shape))
        else:  # a Python number: a 0-d tensor
            scalars[key] = np.asarray(leaf.value)
            specs.append((name, scalars[key].dtype, ()))

    def produce(name: str) -> np.ndarray:
        key = keys[name]
        if key in scalars:
            result.values += 1
            return scalars[key]
        return read(key)

    metadata = {"jaxckpt.source": result.source, "jaxckpt.source_format": result.source_format}
    safetensors.write(dst, specs, produce, metadata)


def tensor_name(key: str) -> str:
    """The safetensors name of a key: its edges as they were named, joined by ``/``. A name read from
    a safetensors file is one edge (``net/l1/bias`` is the key ``net~1l1~1bias``), so it comes back
    byte for byte; a nested key (``dense/w``) becomes the name ``dense/w``, as Flax and TF spell it."""
    return "/".join(unescape_edge(edge) for edge in key.split("/"))
