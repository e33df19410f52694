"""What binds the bytes of a data store to their places (format version 5): ``checksums.json``.

Each inner chunk of an array is stored with its CRC-32C, which proves the bytes intact but not that
they belong where they are: two chunks swapped with their checksums, shard files swapped between two
arrays of one shape, or a shard copied from an older checkpoint would read as other values. So each
data store also holds, in ``checksums.json``, the CRC-32C of every inner chunk of every shard it
holds, in order, and the id of the save that wrote it, which the checkpoint's index names too. A
reader compares each chunk it reads with the entry for its place.

The file is written by the process that writes the data store (no process gathers another's
checksums), so the index does not grow with the number of processes or shards, and a restoring
process reads the checksums of the data stores it reads from only. It is canonical JSON with a
checksum of its own, as the index::

    {"checksum": "crc32:<8 hex>", "format": "jaxckpt-checksums", "save": "<the index's save>",
     "arrays": {"a/<n>": {"<shard>": [<CRC-32C of each inner chunk>, ...], ...}, ...}}

where ``<shard>`` is the shard's number in C order of the array's shard grid (``ceil(shape /
chunks)`` shards along each dimension) and the CRC-32C values follow C order of the shard's inner
chunk grid.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxckpt._errors import CheckpointCorruptedError, JaxckptError
from jaxckpt.arrays.in_flight import Pending
from jaxckpt.arrays.zarr_local import bytes_of, crc32c_of, expected_crcs, misplaced, shards_in, view_at
from jaxckpt.arrays.zarr_meta import inner_chunk_shape, shard_number
from jaxckpt.format.checked_json import check_checksum, checksummed_json
from jaxckpt.format.records import CHECKSUMS_FILE, ArrayLeaf, InArray, Index
from jaxckpt.storage.locations import Location, read_file

FORMAT = "jaxckpt-checksums"
_ARRAY = re.compile(r"^a/[0-9]{1,9}$")
_SHARD = re.compile(r"^(0|[1-9][0-9]{0,17})$")

# By array path, then by shard number: the CRC-32C of each inner chunk of the shard, in order.
Written = dict[str, dict[int, list[int]]]


def encode(save: str, arrays: Mapping[str, Mapping[int, list[int]]]) -> bytes:
    """The ``checksums.json`` of a data store written by save ``save``."""
    body = {
        "format": FORMAT,
        "save": save,
        "arrays": {path: {str(n): crcs for n, crcs in sorted(shards.items())} for path, shards in arrays.items()},
    }
    return checksummed_json(body)


def checksums_limit(index: Index) -> int:
    """The most bytes a data store's ``checksums.json`` takes for the arrays of ``index``: about a
    dozen per inner chunk (``4294967295,``) and a few dozen per shard and per array; what a crafted
    file claims beyond that is refused before it is read."""
    total = 1024
    for leaf in index.leaves.values():
        if isinstance(leaf, ArrayLeaf) and isinstance(leaf.at, InArray) and leaf.at.chunks is not None:
            shard = leaf.at.chunks
            inner = inner_chunk_shape(shard, leaf.dtype.itemsize)
            shards = math.prod([-(-n // s) for n, s in zip(leaf.shape, shard)])
            total += 64 + shards * (32 + 12 * math.prod([s // c for s, c in zip(shard, inner)]))
    return total


class StoreChecksums:
    """The parsed ``checksums.json`` of one data store; each array's entry is checked when first asked for."""

    def __init__(self, data: bytes, where: str, save: str) -> None:
        self._where = where
        try:
            body = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise self._damaged(f"it is not valid JSON ({e})") from e
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise self._damaged(f'it has no "format": "{FORMAT}" field')
        check_checksum(data, body, where)
        if body.get("save") != save:
            raise self._damaged(
                f"it was written by save {str(body.get('save'))[:80]!r}, not by save {save!r} that wrote the index: "
                "the data store (or its checksums) was copied from another checkpoint"
            )
        arrays = body.get("arrays")
        if not isinstance(arrays, dict):
            raise self._damaged("its field 'arrays' is not an object")
        self._raw: dict[str, Any] = arrays
        self._parsed: dict[str, dict[int, tuple[int, ...]]] = {}

    def _damaged(self, what: str) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(f"The checksums {self._where} are damaged: {what}.")

    def of_array(self, path: str) -> dict[int, tuple[int, ...]]:
        """Shard number -> the CRC-32C of each of its inner chunks, for the array at ``path`` (empty if
        this data store holds none of its shards)."""
        if path not in self._parsed:
            raw = self._raw.get(path, {})
            ok = _ARRAY.fullmatch(path) and isinstance(raw, dict)
            ok = ok and all(
                _SHARD.fullmatch(n) and isinstance(v, list) and all(type(c) is int and 0 <= c < 1 << 32 for c in v)
                for n, v in raw.items()
            )
            if not ok:
                raise self._damaged(f"its entry for {path!r} is not an object of shard numbers to lists of CRC-32C")
            self._parsed[path] = {int(n): tuple(v) for n, v in raw.items()}
        return self._parsed[path]


# Bytes of a checksums.json read at most as a hint (an incremental save or copy looking for what it may reuse).
HINT_LIMIT = 64 << 20


def read_hint(folder: Location, store: str, save: str) -> StoreChecksums | None:
    """Data store ``store``'s checksums in checkpoint ``folder`` as a hint of where an earlier save's
    bytes are: None if they are missing, over :data:`HINT_LIMIT`, damaged, or not those of ``save``
    (the caller then writes the data instead of reusing it)."""
    try:
        data = read_file(folder, f"{store}/{CHECKSUMS_FILE}", HINT_LIMIT)
        return None if data is None else StoreChecksums(data, repr(str(folder / store)), save)
    except (OSError, JaxckptError):
        return None


def hinted_crcs(sums: StoreChecksums | None, array: str) -> dict[int, tuple[int, ...]]:
    """The CRCs of ``array``'s shards that a hint (:func:`read_hint`) lists; none if its entry is damaged."""
    try:
        return sums.of_array(array) if sums is not None else {}
    except JaxckptError:
        return {}


def misplaced_chunk(
    data: np.ndarray,
    box: Sequence[tuple[int, int]],
    shape: Sequence[int],
    shard: Sequence[int],
    crcs: Mapping[int, tuple[int, ...]],
    read_whole: Callable[[tuple[slice, ...]], np.ndarray],
    checked: set[tuple[int, int]],
) -> str | None:
    """For data read by another reader (TensorStore, which checks each chunk by its own checksum):
    ``data`` holds region ``box`` of an array of ``shape``. What is wrong with the first inner chunk
    the region touches whose CRC-32C, over its bytes as stored (padded with zeros past the array's
    end), is not the one ``crcs`` (the data store's checksums) list for its place; None if none. A
    chunk the region holds whole is checked from ``data``; one it cuts, from ``read_whole`` (its part
    inside the array, read again), once: ``checked`` (by shard and chunk number) remembers."""
    chunk = inner_chunk_shape(shard, data.dtype.itemsize)
    per_shard = [s // c for s, c in zip(shard, chunk)]
    for position, _ in shards_in(box, shard, shape):
        number = shard_number(position, shape, shard)
        expected = expected_crcs(crcs, number, math.prod(per_shard))
        if isinstance(expected, str):
            return expected
        for inner_number, inner in enumerate(np.ndindex(*per_shard)):
            start = [p * s + i * c for p, s, i, c in zip(position, shard, inner, chunk)]
            valid = [(lo, min(lo + c, n)) for lo, c, n in zip(start, chunk, shape)]
            if any(hi <= a or lo >= b or lo >= hi for (lo, hi), (a, b) in zip(valid, box)):
                continue  # the region does not touch it (or it is padding alone)
            if (number, inner_number) in checked:
                continue
            if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(valid, box)):
                view = view_at(data, tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(valid, box)))
            else:
                view = read_whole(tuple(slice(lo, hi) for lo, hi in valid))
            if view.shape != chunk:
                padded = np.zeros(chunk, data.dtype)
                padded[tuple(slice(0, n) for n in view.shape)] = view
                view = padded
            crc = crc32c_of(bytes_of(np.ascontiguousarray(view)))
            if crc != expected[inner_number]:
                return misplaced(f"its inner chunk at {tuple(start)}", crc, expected[inner_number])
            checked.add((number, inner_number))
    return None


class Bound(NamedTuple):
    """An array of format version 5 opened by another reader (TensorStore, for buckets), which checks
    each inner chunk by its own CRC-32C, with its data store's checksums of its shards."""

    store: Any  # the reader's array
    crcs: Mapping[int, tuple[int, ...]]
    shape: tuple[int, ...]  # the array's
    shard: tuple[int, ...]  # its shard shape (the index's chunks)
    read_whole: Callable[[tuple[slice, ...]], np.ndarray]  # a box of the array, read now
    checked: set[tuple[int, int]]  # (shard, inner chunk) numbers found in their places

    def check(self, name: str, read: Pending, region: tuple[slice, ...]) -> _CheckedRead:
        """``read`` (of ``region``), whose chunks that lie wholly inside the region are checked against
        the checksums for their places once it is done."""
        return _CheckedRead(self, name, read, region)


class _CheckedRead(NamedTuple):
    bound: Bound
    name: str  # of the value, for messages
    read: Pending
    region: tuple[slice, ...]

    def result(self) -> np.ndarray:
        data = self.read.result()
        shape = self.bound.shape
        box = [s.indices(n)[:2] for s, n in zip(self.region, shape)]
        bound = self.bound
        wrong = misplaced_chunk(data, box, shape, bound.shard, bound.crcs, bound.read_whole, bound.checked)
        if wrong is not None:
            raise CheckpointCorruptedError(f"Cannot read {self.name}: {wrong}. The checkpoint's files are damaged.")
        return data
