"""Reading every value of a checkpoint with bounded memory, and statistics over the values: what
``jaxckpt show``, ``diff``, ``verify`` and ``convert`` share.

Values are read in batches of about :data:`BATCH_BYTES` (a larger array alone), one ``load`` each:
few reads for many small leaves, and memory bounded by the batch or the largest array; an array
over the budget is read in C-order pieces.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxckpt.format.records import ArrayLeaf, InPack
from jaxckpt.reading.reader import Opened
from jaxckpt.reading.templates import NO_TEMPLATE
from jaxckpt.tools.describe import json_value

BATCH_BYTES = 64 << 20


def raw(leaf: ArrayLeaf, value: Any) -> np.ndarray:
    """What ``load`` returned as plain numpy: PRNG keys as their key data."""
    if leaf.prng_impl:
        import jax

        return np.asarray(jax.random.key_data(value))
    return np.asarray(value)


def batches(opened: Opened, keys: Sequence[str], budget: int | None = None) -> Iterator[list[str]]:
    """``keys`` of array leaves in groups of about ``budget`` bytes, each to read with one ``load``.

    Packed leaves are grouped by pack, in offset order, so that a group is one span of its pack.
    Arrays are read whole (``Opened`` reads whole arrays), so a larger array is a group of its own.
    """
    budget = BATCH_BYTES if budget is None else budget
    leaves = {key: array_leaf(opened, key) for key in keys}
    by_pack: dict[int, list[tuple[int, str]]] = defaultdict(list)  # pack -> (offset, key)
    arrays: list[str] = []
    for key, leaf in leaves.items():
        if isinstance(leaf.at, InPack):
            by_pack[leaf.at.pack].append((leaf.at.offset, key))
        else:
            arrays.append(key)
    groups = [[k for _, k in sorted(ks)] for ks in by_pack.values()] + [arrays]
    for group in groups:
        batch: list[str] = []
        size = 0
        for key in group:
            if batch and size + leaves[key].nbytes > budget:
                yield batch
                batch, size = [], 0
            batch.append(key)
            size += leaves[key].nbytes
        if batch:
            yield batch


def read_arrays(opened: Opened, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """The arrays at ``keys`` as numpy (PRNG keys as key data), read and checksummed in one batch."""
    values = opened.load(dict.fromkeys(keys, NO_TEMPLATE))
    return {k: raw(array_leaf(opened, k), v) for k, v in values.items()}


def pieces(opened: Opened, key: str) -> Iterator[np.ndarray]:
    """The array at ``key`` in C-order pieces of at most BATCH_BYTES: memory stays bounded whatever its size."""
    return opened.read_pieces(key, BATCH_BYTES)


def one_large(opened: Opened, batch: Sequence[str]) -> bool:
    return len(batch) == 1 and array_leaf(opened, batch[0]).nbytes > BATCH_BYTES


def array_leaf(opened: Opened, key: str) -> ArrayLeaf:
    """The record of the array at ``key`` (these functions read arrays only)."""
    leaf = opened.index.leaves[key]
    if not isinstance(leaf, ArrayLeaf):
        raise TypeError(f"{key!r} holds a Python value, not an array")
    return leaf


def numeric(data: np.ndarray) -> np.ndarray:
    """Values to compute statistics on: ints stay exact, floats (bfloat16, float8...) become float64."""
    name = data.dtype.name
    if data.dtype == np.bool_:
        return data.astype(np.uint8)
    if name in ("int2", "int4"):
        return data.astype(np.int8)
    if name in ("uint2", "uint4"):
        return data.astype(np.uint8)
    if data.dtype.kind in "iu":
        return data
    if data.dtype.kind == "c":
        return np.abs(data.astype(np.complex128))  # statistics of |x|
    return data.astype(np.float64)


@dataclasses.dataclass
class Stats:
    """Streaming statistics: min, max, mean, std and L2 norm of the finite values, NaN and Inf counts.

    Arrays may be added in parts (slabs of a large array): parts are combined with Chan et al.'s
    parallel update of the mean and the sum of squared deviations, which stays accurate where
    sum-of-squares formulas cancel.
    """

    size: int = 0
    nan: int = 0
    inf: int = 0
    finite: int = 0
    min: Any = None
    max: Any = None
    mean: float = 0.0
    m2: float = 0.0
    sumsq: float = 0.0
    of_abs: bool = False  # complex arrays: statistics of |x|

    def add(self, data: np.ndarray) -> None:
        self.size += data.size
        self.of_abs = self.of_abs or data.dtype.kind == "c"
        values = numeric(data).reshape(-1)
        if values.dtype.kind == "f":
            nan = np.isnan(values)
            inf = np.isinf(values)
            self.nan += int(nan.sum())
            self.inf += int(inf.sum())
            if self.nan or self.inf:
                values = values[~(nan | inf)]
        if not values.size:
            return
        lo, hi = values.min().item(), values.max().item()
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        as_float = values.astype(np.float64)
        n, mean = as_float.size, float(as_float.mean())
        m2 = float(((as_float - mean) ** 2).sum())
        total = self.finite + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.finite * n / total
        self.finite = total
        self.sumsq += float((as_float * as_float).sum())

    def to_json(self) -> dict[str, Any]:
        finite = self.finite > 0
        return {
            "size": self.size,
            "finite": self.finite,
            "nan": self.nan,
            "inf": self.inf,
            "min": json_value(self.min),
            "max": json_value(self.max),
            "mean": self.mean if finite else None,
            "std": math.sqrt(self.m2 / self.finite) if finite else None,
            "norm": math.sqrt(self.sumsq),
            "of_abs": self.of_abs,
        }


def number_text(x: Any) -> str:
    if x is None:
        return "-"
    return str(x) if isinstance(x, int) else f"{x:.6g}"
