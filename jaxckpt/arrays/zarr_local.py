"""Array data on a local disk, read by jaxckpt itself as zarr3 sharded arrays (written by
:mod:`jaxckpt.arrays.zarr_write`), and what reading and writing share: the I/O threads and the checksums.

Format version 4 keeps each array in its own zarr3 array (``a/<n>/``) whose outer chunks are the
array's shards (one file per shard, ``c/<i>/<j>...``). The ``sharding_indexed`` codec cuts a shard
into inner chunks of at most 8 MiB, each stored as its bytes followed by their CRC-32C (the zarr3
``crc32c`` codec), and ends the file with an index of (offset, size) per inner chunk, itself followed
by its CRC-32C. This is TensorStore's own layout, so TensorStore alone reads and checks the data;
jaxckpt writes and reads it here without TensorStore on local disks: the checksums cost 0.08 CPU-s
per GiB (the ``crc32c`` package, SSE4.2) instead of the 0.6 of TensorStore's codec chain, and the
bytes go from the arrays' own buffers to the files and back (``pwritev`` / ``preadv``) without a copy.

Everything read is untrusted: a shard's index is checked (its checksum, every offset and size
against the file's length) before a buffer is allocated, and every inner chunk's checksum before its
bytes are used. An inner chunk that is absent is damage, never a fill value.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np

from jaxckpt._errors import CheckpointCorruptedError, JaxckptError, StorageError
from jaxckpt.arrays.zarr_meta import (
    chunk_key,
    inner_chunk_shape,
    metadata,
    metadata_problem,
    numpy_dtype,
    pack_metadata,
    pack_shard,
    shard_number,
)
from jaxckpt.format.keys import describe
from jaxckpt.storage.local_files import (
    PinnedFolder,
    aligned_empty,
    bytes_of,
    crc32c_of,
    crc_bytes,
    io_pool,
    view_at,
)

CRC = 4  # bytes of a CRC-32C
_ENTRY = 16  # bytes of a shard index entry: offset and size, little-endian uint64
# Bytes of an inner chunk read and checksummed at a time (see _read_chunk): the CRC-32C of a piece
# just read runs on bytes still in the core's cache, about half the cost of a pass over memory.
READ_PIECE = 1 << 20
_EMPTY = (1 << 64) - 1  # the index entry of an absent chunk
_ZARR_JSON_LIMIT = 1 << 20


# --- writing ------------------------------------------------------------------------------------


def shards_in(
    box: Sequence[tuple[int, int]], shard: Sequence[int], shape: Sequence[int]
) -> list[tuple[tuple[int, ...], list[tuple[int, int]]]]:
    """The shards that ``box`` covers: (grid position, the part of the box in it)."""
    ranges = [range(lo // s, -(-hi // s)) for (lo, hi), s in zip(box, shard)]
    out = []
    for position in np.ndindex(*map(len, ranges)):
        grid = tuple(r[p] for r, p in zip(ranges, position))
        sub = [(max(lo, g * s), min(hi, (g + 1) * s, max(n, 1))) for (lo, hi), g, s, n in zip(box, grid, shard, shape)]
        if all(hi > lo for lo, hi in sub):
            out.append((grid, sub))
    return out


# --- reading ------------------------------------------------------------------------------------


class LocalArray(NamedTuple):
    """An array of a data store, opened: where its files are and what the index says it is."""

    key: str  # the value it holds ("" for a pack), for messages
    path: str  # in the checkpoint, for messages
    folder: str
    shape: tuple[int, ...]
    dtype: np.dtype  # as stored
    shard: tuple[int, ...]
    chunk: tuple[int, ...]
    checksum: bool  # inner chunks end in a CRC-32C (not in packs)
    # From format version 5, the data store's checksums of the array (jaxckpt.arrays.checksums): shard number
    # in C order of the shard grid -> the CRC-32C of each inner chunk in C order; None before.
    crcs: Mapping[int, tuple[int, ...]] | None = None
    pinned: PinnedFolder | None = None  # the checkpoint's folder, its files opened in it

    def name(self) -> str:
        if self.key:
            return f"the data of {describe(self.key)} (array {self.path!r} in the checkpoint)"
        return f"{self.path!r} in the checkpoint"


class LocalRead:
    """A region being read into ``buffer`` by the I/O threads, once ``start`` hands them the reads
    started so far (the first ``result`` of any of them does)."""

    def __init__(self, buffer: np.ndarray, futures: list[Future[None]], start: Callable[[], None]) -> None:
        self.buffer, self._futures, self._start = buffer, futures, start

    def result(self) -> np.ndarray:
        self._start()
        for future in self._futures:
            future.result()
        return self.buffer


def _damaged(array: LocalArray, what: str) -> CheckpointCorruptedError:
    return CheckpointCorruptedError(f"Cannot read {array.name()}: {what}. The checkpoint's files are damaged.")


def _refused(array: LocalArray, error: OSError) -> JaxckptError:
    if error.errno == errno.ENOENT:
        return CheckpointCorruptedError(
            f"Cannot read {array.name()}: data is missing from the checkpoint ({error.filename} is gone). Files of "
            "it were deleted, or it is being deleted now."
        )
    return StorageError(
        f"Cannot access {array.name()}: the storage refused ({error}). The checkpoint may be intact.",
        error.errno or errno.EIO,
    )


def _open_regular(array: LocalArray, file: str) -> int:
    """A file descriptor of ``file``, which must be a regular file, not a symbolic link: a FIFO or a
    device put in a checkpoint must neither block the open nor be read, and a link would read files
    outside the checkpoint."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(file, flags) if array.pinned is None else array.pinned.open(file, flags)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a symbolic link (what it names is outside what was saved)
            raise _damaged(
                array, f"{file} is not a regular file of the checkpoint (a symbolic link, or one on its way)"
            ) from e
        raise _refused(array, e) from e
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise _refused(array, e) from e
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _damaged(array, f"{file} is not a regular file")
    return fd


def _shard_index(array: LocalArray, fd: int, file: str, chunks: int, stored_bytes: int) -> np.ndarray:
    """The (offset, size) of each inner chunk of a shard file, checked against the file."""
    entries = shard_index(fd, file, chunks, stored_bytes)
    if isinstance(entries, str):
        raise _damaged(array, entries)
    return entries


def shard_index(fd: int, file: str, chunks: int, stored_bytes: int) -> np.ndarray | str:
    """The (offset, size) of each inner chunk of the shard file open as ``fd``, checked against the
    file (its own CRC-32C, every chunk within the file, of ``stored_bytes``, none overlapping); or
    what is wrong with it."""
    size = os.fstat(fd).st_size
    length = chunks * _ENTRY + CRC
    if size < length:
        return f"{file} is {size} bytes, too short for its index of {chunks} chunks"
    raw = os.pread(fd, length, size - length)
    if len(raw) != length or crc_bytes(memoryview(raw[:-CRC])) != raw[-CRC:]:
        return f"the chunk index of {file} fails its checksum"
    entries = np.frombuffer(raw[:-CRC], "<u8").reshape(chunks, 2)
    end = size - length
    offsets, sizes = entries[:, 0], entries[:, 1]
    if (offsets == _EMPTY).any():
        return f"chunks of {file} are missing"
    # Compared so that nothing wraps around in uint64: the size first, then the offset against what it leaves.
    if (sizes != stored_bytes).any() or stored_bytes > end or (offsets > end - stored_bytes).any():
        return f"the chunk index of {file} names chunks outside the file or of the wrong size"
    starts = np.sort(offsets)
    if (starts[1:] - starts[:-1] < stored_bytes).any():
        return f"the chunk index of {file} names chunks that overlap"
    return entries


def shard_intact(fd: int, file: str, crcs: Sequence[int], chunk_bytes: int) -> bool:
    """Whether the shard file open as ``fd`` is whole as saved: its chunk index checked (see
    :func:`shard_index`), and each inner chunk's bytes and the CRC-32C stored after it those of
    ``crcs``. Reads the whole file, :data:`READ_PIECE` bytes at a time; before a file is shared by
    another checkpoint (an incremental save's hard link), so that damage is found, not spread."""
    entries = shard_index(fd, file, len(crcs), chunk_bytes + CRC)
    if isinstance(entries, str):
        return False
    buffer = aligned_empty((chunk_bytes,), np.dtype(np.uint8))
    view = buffer.data.cast("B")
    for (offset, _), expected in zip(entries.tolist(), crcs):
        if _read_chunk(fd, view, offset, checksum=True) != expected:
            return False
    return True


def _read_chunk(fd: int, into: memoryview, offset: int, checksum: bool) -> int | None:
    """Read a chunk (and its checksum) into ``into``: its CRC-32C if it was all there and matches
    the checksum stored after it (0 where chunks carry none), else None. Read and checksummed
    :data:`READ_PIECE` bytes at a time, so that each piece is checked while it is still in the
    core's cache (a pass over a whole 8 MiB chunk afterwards reads it from memory again)."""
    if not checksum:
        return 0 if os.preadv(fd, [into], offset) == len(into) else None
    stored = bytearray(CRC)
    crc, size = 0, len(into)
    for start in range(0, size or 1, READ_PIECE):
        piece = into[start : start + READ_PIECE]
        last = start + READ_PIECE >= size
        if os.preadv(fd, [piece, stored] if last else [piece], offset + start) != len(piece) + CRC * last:
            return None
        crc = crc32c_of(piece, crc)
    return crc if struct.pack("<I", crc) == stored else None


def expected_crcs(crcs: Mapping[int, tuple[int, ...]], number: int, chunks: int) -> tuple[int, ...] | str:
    """The CRC-32C of each inner chunk of shard ``number`` (of ``chunks`` chunks) that the data store's
    checksums list, or what is wrong with them."""
    found = crcs.get(number)
    if found is None:
        return f"the data store's checksums list no shard {number} of it"
    if len(found) != chunks:
        return f"the data store's checksums list {len(found)} inner chunks for shard {number} of it, not {chunks}"
    return found


def misplaced(where: str, crc: int, expected: int) -> str:
    return (
        f"{where} is intact but not the data the index records for that place (CRC-32C {crc:08x}, where the "
        f"checksums of its data store record {expected:08x}): chunks or shard files were moved, swapped or copied "
        "from another checkpoint"
    )


def _check_chunk(
    array: LocalArray, file: str, piece: _Piece, expected: tuple[int, ...] | None, crc: int | None
) -> None:
    """A chunk read is intact (``crc``: what :func:`_read_chunk` gave) and is the one that belongs at
    its place (``expected``: the CRC-32C of each chunk of its shard, from version 5)."""
    if crc is None:
        raise _damaged(array, f"chunk {piece.grid} of {file} fails its checksum")
    if expected is not None and expected[piece.number] != crc:
        raise _damaged(array, misplaced(f"chunk {piece.grid} of {file}", crc, expected[piece.number]))


class _Piece(NamedTuple):
    """One inner chunk of a shard that a read wants (all of it, or part)."""

    grid: list[int]  # its place in the shard's chunk grid
    number: int  # its entry in the shard's index
    target: np.ndarray  # where its wanted part goes
    source: tuple[slice, ...]  # which part of it that is
    direct: bool  # all of it, into a contiguous target: read in place


class _PartPlan(NamedTuple):
    file: str  # the shard's file
    chunks: int  # inner chunks in the shard
    number: int  # the shard's number in C order of the array's shard grid
    pieces: list[_Piece]


def _plan_part(
    array: LocalArray,
    position: tuple[int, ...],
    sub: list[tuple[int, int]],
    box: list[tuple[int, int]],
    out: np.ndarray,
) -> _PartPlan:
    """The chunks of the shard at ``position`` that hold ``sub``, and where each goes in ``out`` (``box``)."""
    chunk = array.chunk
    per_shard = [s // c for s, c in zip(array.shard, chunk)]
    origin = [p * s for p, s in zip(position, array.shard)]
    local = [(lo - o, hi - o) for (lo, hi), o in zip(sub, origin)]  # within the shard
    ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(local, chunk)]
    pieces = []
    for inner in np.ndindex(*map(len, ranges)):
        grid = [r[i] for r, i in zip(ranges, inner)]
        start = [o + g * c for o, g, c in zip(origin, grid, chunk)]  # of the chunk, in the array
        want = [(max(lo, s), min(hi, s + c)) for (lo, hi), s, c in zip(sub, start, chunk)]
        target = view_at(out, tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(want, box)))
        direct = all(hi - lo == c for (lo, hi), c in zip(want, chunk)) and target.flags.c_contiguous
        source = tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(want, start))
        number = int(np.ravel_multi_index(grid, per_shard)) if grid else 0
        pieces.append(_Piece(grid, number, target, source, direct))
    number = shard_number(position, array.shape, array.shard)
    return _PartPlan(os.path.join(array.folder, chunk_key(position)), math.prod(per_shard), number, pieces)


class LocalReader:
    """Reads arrays and packs of one data store in a local folder, many at a time, on I/O threads."""

    def __init__(self, folder: str, pinned: PinnedFolder | None = None) -> None:
        self._folder = folder  # with ``pinned``: a path under its path, opened in it
        self._pinned = pinned
        self._lock = threading.Lock()
        # (shard file, chunk number) -> [reads that want part of it and have not had it, its Future
        # once one of them reads it]
        self._partial: dict[tuple[str, int], list[Any]] = {}
        self._queued: list[tuple[LocalArray, _PartPlan, Future[None]]] = []  # reads not handed over yet

    def open_array(
        self,
        key: str,
        path: str,
        stored: str,
        shape: Sequence[int],
        shard: Sequence[int],
        crcs: Mapping[int, tuple[int, ...]] | None = None,
    ) -> LocalArray:
        """The array at ``path``, its ``zarr.json`` checked against what the index implies (``crcs``:
        its data store's checksums of it, see :attr:`LocalArray.crcs`)."""
        dtype = numpy_dtype(stored)
        chunk = inner_chunk_shape(shard, dtype.itemsize)
        folder = os.path.join(self._folder, path)
        expected = metadata(shape, stored, shard, dtype.itemsize)
        array = LocalArray(key, path, folder, tuple(shape), dtype, tuple(shard), chunk, True, crcs, self._pinned)
        return self._opened(array, expected)

    def _opened(self, array: LocalArray, expected: dict[str, Any]) -> LocalArray:
        file = os.path.join(array.folder, "zarr.json")
        fd = _open_regular(array, file)
        try:
            raw = os.read(fd, _ZARR_JSON_LIMIT + 1)
        except OSError as e:
            raise _refused(array, e) from e
        finally:
            os.close(fd)
        try:
            found = json.loads(raw) if len(raw) <= _ZARR_JSON_LIMIT else None
        except (ValueError, RecursionError):
            found = None
        problem = metadata_problem(found, expected)
        if problem:
            raise _damaged(array, f"its zarr.json does not match the index: {problem}")
        return array

    def read_region(self, array: LocalArray, region: Sequence[slice]) -> LocalRead:
        """Start reading ``region`` of the array into a fresh aligned buffer."""
        box = [s.indices(n)[:2] for s, n in zip(region, array.shape)]
        out = aligned_empty([hi - lo for lo, hi in box], array.dtype)
        futures: list[Future[None]] = []
        if out.size:
            for position, sub in shards_in(box, array.shard, array.shape):
                plan = _plan_part(array, position, sub, box, out)
                futures.append(Future())
                with self._lock:  # a chunk that several reads want part of is read once for all of them
                    for piece in plan.pieces:
                        if not piece.direct:
                            self._partial.setdefault((plan.file, piece.number), [0, None])[0] += 1
                    self._queued.append((array, plan, futures[-1]))
        return LocalRead(out, futures, self._start)

    def _start(self) -> None:
        """Hand the reads started so far to the I/O threads. Held back until a result is wanted, so
        that every region started before then has said which shared chunks it wants: a chunk is
        never let go by its first reader before a later one has asked for it."""
        with self._lock:
            queued, self._queued = self._queued, []
        for array, plan, future in queued:
            io_pool().submit(self._run, array, plan, future)

    def _run(self, array: LocalArray, plan: _PartPlan, future: Future[None]) -> None:
        try:
            self._read_part(array, plan)
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(None)

    def _read_part(self, array: LocalArray, plan: _PartPlan) -> None:
        """Read the chunks of one shard that ``plan`` lists into their places."""
        file, chunk = plan.file, array.chunk
        shared = {piece.number for piece in plan.pieces if not piece.direct}
        try:
            expected = None if array.crcs is None else expected_crcs(array.crcs, plan.number, plan.chunks)
            if isinstance(expected, str):
                raise _damaged(array, expected)
            fd = _open_regular(array, file)
            try:
                entries = _shard_index(
                    array, fd, file, plan.chunks, math.prod(chunk) * array.dtype.itemsize + CRC * array.checksum
                )
                if len(plan.pieces) > 1:
                    # Read ahead of the chunks, in file order, twice the device's read-ahead at a time
                    # (from a cold page cache). Not POSIX_FADV_WILLNEED: Linux reads only one read-ahead
                    # (8 MiB here) of it at once, and a cold 1 GiB restore took 15-20% longer with it.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                for piece in plan.pieces:
                    offset = int(entries[piece.number, 0])
                    if piece.direct:
                        crc = _read_chunk(fd, bytes_of(piece.target), offset, array.checksum)
                        _check_chunk(array, file, piece, expected, crc)
                        continue
                    whole = self._shared_chunk(array, fd, plan.file, piece, offset, expected)
                    piece.target[...] = view_at(whole, piece.source)
                    self._release(plan.file, piece.number)
                    shared.discard(piece.number)
            except OSError as e:
                raise _refused(array, e) from e
            finally:
                os.close(fd)
        finally:
            for number in shared:  # not reached: this read failed first
                self._release(plan.file, number)

    def _shared_chunk(
        self, array: LocalArray, fd: int, file: str, piece: _Piece, offset: int, expected: tuple[int, ...] | None
    ) -> np.ndarray:
        """A chunk that reads want part of, read and checked by the first of them; the others wait for
        it (the reader never waits while it reads, so no two reads wait for each other)."""
        with self._lock:
            entry = self._partial[(file, piece.number)]
            mine = entry[1] is None
            if mine:
                entry[1] = Future()
        future: Future[np.ndarray] = entry[1]
        if not mine:
            return future.result()
        try:
            whole = np.empty(array.chunk, array.dtype)
            _check_chunk(array, file, piece, expected, _read_chunk(fd, bytes_of(whole), offset, array.checksum))
        except BaseException as e:
            future.set_exception(e)
            raise
        future.set_result(whole)
        return whole

    def _release(self, file: str, number: int) -> None:
        with self._lock:
            entry = self._partial[(file, number)]
            entry[0] -= 1
            if entry[0] == 0:  # its last read has it: let it go
                del self._partial[(file, number)]

    def read_pack_spans(self, path: str, nbytes: int, chunk: int, spans: Sequence[tuple[int, int]]) -> list[LocalRead]:
        """Start reading byte spans (start, stop) of the pack at ``path``."""
        shard = pack_shard(nbytes, chunk)
        folder = os.path.join(self._folder, path)
        uint8 = np.dtype("uint8")
        array = self._opened(
            LocalArray("", path, folder, (nbytes,), uint8, (shard,), (chunk,), False, pinned=self._pinned),
            pack_metadata(nbytes, chunk),
        )
        return [self.read_region(array, (slice(a, b),)) for a, b in spans]
