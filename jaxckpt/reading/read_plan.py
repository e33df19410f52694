"""What a read of jaxckpt's checkpoint asks of its data stores: the parts of a region of an array
(which data store holds each, and where it goes), the byte spans of a pack that its wanted leaves
need, and the C-order pieces in which a large array is handed on. Geometry only: the reads
themselves are :mod:`jaxckpt.arrays.store_write`'s, started by :class:`jaxckpt.reading.reader.Opened`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from jaxckpt._errors import CheckpointFormatError
from jaxckpt.arrays import store_write
from jaxckpt.arrays.in_flight import Pending
from jaxckpt.arrays.zarr_meta import inner_chunk_shape
from jaxckpt.format.records import DATA_DIR, Box, InArray, grid_cells, pieces, tiling_problem

# Byte gaps up to this size between wanted pack spans are read through rather than split.
SPAN_GAP = 1 << 20
# Format version 4's shard files (see jaxckpt.arrays.zarr_local): each inner chunk ends in a CRC-32C (not
# in packs), and the file in an index of (offset, size) per inner chunk, then its own CRC-32C.
_CRC = 4
_INDEX_ENTRY = 16

Region = tuple[slice, ...]  # a region of an array, as numpy indexes it
RegionKey = tuple[tuple[Any, Any, Any], ...]  # a region as a dict key (slices are not hashable)


def region_key(index: Region) -> RegionKey:
    return tuple((s.start, s.stop, s.step) for s in index)


class Part(NamedTuple):
    """The part of a region that one data store holds."""

    store: str
    source: Region  # the part, in the array's coordinates
    into: Region | None  # where it goes in the region read; None: it is the whole region


class RegionPlan(NamedTuple):
    """A region of an array to read: its shape, and its parts."""

    shape: tuple[int, ...]
    parts: list[Part]


def plan_region(at: InArray, shape: tuple[int, ...], index: Region) -> RegionPlan:
    """The parts of region ``index`` of the array stored ``at`` (of ``shape``): one, when one data
    store holds all of it."""
    want = [(lo, hi) for lo, hi, _ in (s.indices(n) for s, n in zip(index, shape))]
    region_shape = tuple(hi - lo for lo, hi in want)
    if at.regions is None and at.layout is None:
        return RegionPlan(region_shape, [Part(DATA_DIR, index, None)])
    parts = pieces(at, shape, want)
    into = [[(lo - w, hi - w) for (lo, hi), (w, _) in zip(box, want)] for _, box in parts]
    # The index's parser checked that the regions tile the array; a region read from parts that do
    # not tile it would come back with a part that nothing wrote (uninitialised memory).
    problem = tiling_problem(into, region_shape)
    if problem:
        raise CheckpointFormatError(
            f"Cannot read region {want} of the array {at.path!r} in the checkpoint: {problem}. Its index is crafted."
        )
    return RegionPlan(
        region_shape,
        [
            Part(store, tuple(slice(lo, hi) for lo, hi in box), tuple(slice(lo, hi) for lo, hi in local))
            for (store, box), local in zip(parts, into)
        ],
    )


def files_overhead(at: InArray, itemsize: int, boxes: list[Box]) -> int:
    """The fewest bytes besides their values that the shard files holding ``boxes`` of an array of
    format version 4 have: every shard touched is a file of all its inner chunks, each with its
    checksum, and its index. What a read of them claims of its data store before it plans a read of
    each shard (see :meth:`jaxckpt.reading.reader.Opened._check_backed`)."""
    assert at.chunks is not None  # version 4 indexes record every shard shape
    inner = inner_chunk_shape(at.chunks, itemsize)
    chunks = math.prod(s // c for s, c in zip(at.chunks, inner))
    return grid_cells(boxes, at.chunks) * ((_INDEX_ENTRY + _CRC) * chunks + _CRC)


def pack_overhead(nbytes: int, chunk: int) -> int:
    """The bytes of the index of a pack's one shard file (format version 4)."""
    return _INDEX_ENTRY * max(1, -(-nbytes // chunk)) + _CRC


def stores_in(plans: Iterable[RegionPlan]) -> set[str]:
    """The data stores that reading these regions opens."""
    return {part.store for plan in plans for part in plan.parts}


def pack_spans(leaves: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte spans (start, stop) of a pack to read for leaves at (offset, nbytes), sorted by
    offset: one span for leaves closer together than :data:`SPAN_GAP`."""
    spans: list[list[int]] = []
    for offset, nbytes in leaves:
        if spans and offset - spans[-1][1] <= SPAN_GAP:
            spans[-1][1] = max(spans[-1][1], offset + nbytes)
        else:
            spans.append([offset, offset + nbytes])
    return [(start, stop) for start, stop in spans]


def c_order_pieces(shape: tuple[int, ...], itemsize: int, budget: int) -> Iterator[Region]:
    """Regions covering ``shape`` in C order, each at most ``budget`` bytes (or one element row)."""
    if not shape or math.prod(shape) * itemsize <= budget:
        yield tuple(slice(0, n) for n in shape)
        return
    inner = math.prod(shape[1:]) * itemsize
    if inner <= budget or len(shape) == 1:
        rows = max(1, budget // max(1, inner))
        for start in range(0, shape[0], rows):
            yield (slice(start, min(start + rows, shape[0])), *(slice(0, n) for n in shape[1:]))
        return
    for i in range(shape[0]):
        for rest in c_order_pieces(shape[1:], itemsize, budget):
            yield (slice(i, i + 1), *rest)


class Assembly:
    """One region of an array, put together from reads of its parts in several data stores."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, parts: list[tuple[Region, Pending]]) -> None:
        self._shape, self._dtype, self._parts = shape, dtype, parts
        self._out: np.ndarray | None = None

    def result(self) -> np.ndarray:
        if self._out is None:  # resolved once, however often asked
            out = store_write.aligned_empty(self._shape, self._dtype)
            for into, pending in self._parts:
                out[into] = pending.result()
            self._out, self._parts = out, []
        return self._out
