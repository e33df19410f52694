"""Array data on a local disk, written and read by jaxckpt itself as zarr3 sharded arrays.

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

import ctypes
import errno
import json
import math
import os
import queue
import stat
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import crc32c
import numpy as np

from jaxckpt._errors import CheckpointCorruptedError, JaxckptError, StorageError
from jaxckpt._tree import describe
from jaxckpt._zarr_meta import (
    chunk_key,
    inner_chunk_shape,
    metadata,
    metadata_problem,
    numpy_dtype,
    pack_metadata,
    pack_shard,
)

_CRC = 4  # bytes of a CRC-32C
_ENTRY = 16  # bytes of a shard index entry: offset and size, little-endian uint64
_EMPTY = (1 << 64) - 1  # the index entry of an absent chunk
_ALIGN = 64
_IOV_MAX = 512  # buffers per pwritev / preadv call (Linux allows 1024)
_ZARR_JSON_LIMIT = 1 << 20
_THREADS = 4
_READ_AHEAD = True


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-order array whose data starts on a 64-byte boundary (on CPU,
    ``jax.device_put`` aliases such a buffer instead of copying it)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class _Pool:
    """A few daemon threads doing file I/O. Not concurrent.futures' executor: that one refuses work
    once the interpreter starts exiting, which is when a pending save is finished."""

    def __init__(self, threads: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"jaxckpt-io-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((fn, args, future))
        return future

    def _work(self) -> None:
        while True:
            fn, args, future = self._jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)
            del fn, args, future  # a finished job's buffers must not wait here for the next job


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _Pool(_THREADS)
        return _POOL


def _crc(view: memoryview) -> bytes:
    return struct.pack("<I", crc32c.crc32c(view))


def _at(array: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    """``array[index]`` as a view, rank 0 included (there ``array[()]`` would be a scalar copy)."""
    return array[index] if index else array[...]


def _bytes_of(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, in place (as uint8: ml_dtypes' types have no buffer format)."""
    return array.reshape(-1).view(np.uint8).data if array.size else memoryview(b"")


# --- writing ------------------------------------------------------------------------------------


class _Shard(NamedTuple):
    file: str  # its path
    data: np.ndarray  # C-contiguous, the shard's shape (padded where the array ends inside it)
    chunk: tuple[int, ...]  # inner chunk shape


def _libc_sync_file_range() -> Callable[[int], object] | None:
    """Linux's ``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)``: start writing a file's dirty pages
    to disk without waiting (None elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd: call(fd, 0, 0, 2)


_START_WRITEBACK = _libc_sync_file_range() if sys.platform.startswith("linux") else None


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, pieces: Iterable[memoryview | bytes]) -> None:
    """Write ``pieces`` end to end into a new file at ``path``, and start writing it to disk: the
    disk works while the next files are checksummed and copied, and :func:`fsync_path` later
    finds little left to wait for (an fsync right away would idle the disk between files)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        batch: list[memoryview | bytes] = []
        position = 0
        for piece in [*pieces, None]:
            if piece is not None:
                batch.append(piece)
            if batch and (piece is None or len(batch) == _IOV_MAX):
                want = sum(len(b) for b in batch)
                done = os.pwritev(fd, batch, position)
                while done < want:  # a short write: finish it piece by piece
                    rest = b"".join(bytes(b) for b in batch)[done:]
                    done += os.pwrite(fd, rest, position + done)
                position += want
                batch = []
        if _START_WRITEBACK is not None:
            _START_WRITEBACK(fd)
    finally:
        os.close(fd)


def _write_shard(shard: _Shard) -> None:
    data = shard.data
    rows = shard.chunk  # cut along leading dimensions only: every inner chunk is contiguous
    grid = [n // c for n, c in zip(data.shape, rows)]
    pieces: list[memoryview | bytes] = []
    entries: list[tuple[int, int]] = []
    offset = 0
    for position in np.ndindex(*grid):
        view = _bytes_of(
            np.ascontiguousarray(_at(data, tuple(slice(p * c, (p + 1) * c) for p, c in zip(position, rows))))
        )
        pieces += [view, _crc(view)]
        entries.append((offset, len(view) + _CRC))
        offset += len(view) + _CRC
    index = np.array(entries, "<u8").reshape(-1, 2).tobytes()
    _write_file(shard.file, [*pieces, index, _crc(memoryview(index))])


def _padded(data: np.ndarray, box: Sequence[tuple[int, int]], shard: Sequence[int]) -> np.ndarray:
    """The shard at ``box`` (clipped to the array) as a C-contiguous array of the shard's full shape."""
    data = np.ascontiguousarray(data)
    if tuple(hi - lo for lo, hi in box) == tuple(shard):
        return data
    out = np.zeros(shard, data.dtype)
    out[tuple(slice(0, hi - lo) for lo, hi in box)] = data
    return out


class LocalWriter:
    """Writes the arrays of one checkpoint's data store in a local folder (see :class:`jaxckpt._tensorstore.Writer`)."""

    def __init__(self, folder: str) -> None:
        self._folder = folder
        self._files: list[tuple[str, list[memoryview | bytes]]] = []  # written as they are: path, pieces
        self._shards: list[_Shard] = []

    def add_array(
        self,
        path: str,
        shape: Sequence[int],
        stored: np.dtype,
        shard: Sequence[int],
        parts: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    ) -> None:
        """Record the array at ``path`` (shards of shape ``shard``) and the parts to write: each part is
        whole shards, at a region whose start is a multiple of the shard shape."""
        folder = os.path.join(self._folder, path)
        meta = metadata(shape, stored.name, shard, stored.itemsize)
        self._files.append((os.path.join(folder, "zarr.json"), [json.dumps(meta).encode()]))
        chunk = inner_chunk_shape(shard, stored.itemsize)
        for index, data in parts:
            box = [s.indices(n)[:2] for s, n in zip(index, shape)]
            for position, sub in _split(box, shard, shape):
                piece = _at(data, tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(sub, box)))
                file = os.path.join(folder, chunk_key(position))
                self._shards.append(_Shard(file, _padded(piece.view(stored), sub, shard), chunk))

    def add_pack(self, path: str, nbytes: int, pieces: Sequence[tuple[int, np.ndarray]], chunk: int) -> None:
        """Record a pack of ``nbytes`` bytes: ``pieces`` are (offset, uint8 data), in order and apart,
        written straight from their buffers; the bytes between them are zeros."""
        shard = pack_shard(nbytes, chunk)
        folder = os.path.join(self._folder, path)
        meta = pack_metadata(nbytes, chunk)
        self._files.append((os.path.join(folder, "zarr.json"), [json.dumps(meta).encode()]))
        if not nbytes:
            return
        out: list[memoryview | bytes] = []
        at = 0
        for offset, data in pieces:
            if offset > at:
                out.append(bytes(offset - at))
            out.append(_bytes_of(data))
            at = offset + data.size
        if shard > at:
            out.append(bytes(shard - at))
        index = np.array([(i * chunk, chunk) for i in range(shard // chunk)], "<u8").tobytes()
        self._files.append((os.path.join(folder, chunk_key([0])), [*out, index, _crc(memoryview(index))]))

    def flush(self) -> None:
        """Write everything recorded so far, durably; then forget it."""
        shards, self._shards = self._shards, []
        files, self._files = self._files, []
        jobs: list[Callable[[], None]] = [lambda s=s: _write_shard(s) for s in shards]  # type: ignore[misc]
        jobs += [lambda f=f, b=b: _write_file(f, b) for f, b in files]  # type: ignore[misc]
        futures = [_pool().submit(job) for job in jobs]
        errors = []
        for future in futures:  # every write settles before the caller may remove the folder
            try:
                future.result()
            except OSError as e:
                errors.append(e)
        if not errors:  # then durably, all at once
            written = [s.file for s in shards] + [f for f, _ in files]
            futures = [_pool().submit(fsync_path, f) for f in written]
            for future in futures:
                try:
                    future.result()
                except OSError as e:
                    errors.append(e)
        if errors:
            first = errors[0]
            raise StorageError(f"Cannot write the checkpoint's data: {first}", first.errno or errno.EIO) from first


def _split(
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

    def name(self) -> str:
        if self.key:
            return f"the data of {describe(self.key)} (array {self.path!r} in the checkpoint)"
        return f"{self.path!r} in the checkpoint"


class LocalRead:
    """A region being read into ``buffer`` by the I/O threads."""

    def __init__(self, buffer: np.ndarray, futures: list[Future[None]]) -> None:
        self.buffer, self._futures = buffer, futures

    def result(self) -> np.ndarray:
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
    """A file descriptor of ``file``, which must be a regular file (a symlink to one is followed): a
    FIFO or a device put in a checkpoint must neither block the open nor be read."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
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
    size = os.fstat(fd).st_size
    length = chunks * _ENTRY + _CRC
    if size < length:
        raise _damaged(array, f"{file} is {size} bytes, too short for its index of {chunks} chunks")
    raw = os.pread(fd, length, size - length)
    if len(raw) != length or _crc(memoryview(raw[:-_CRC])) != raw[-_CRC:]:
        raise _damaged(array, f"the chunk index of {file} fails its checksum")
    entries = np.frombuffer(raw[:-_CRC], "<u8").reshape(chunks, 2)
    end = size - length
    offsets, sizes = entries[:, 0], entries[:, 1]
    if (offsets == _EMPTY).any():
        raise _damaged(array, f"chunks of {file} are missing")
    if (sizes != stored_bytes).any() or (offsets > end - sizes).any():
        raise _damaged(array, f"the chunk index of {file} names chunks outside the file or of the wrong size")
    return entries


def _read_chunk(fd: int, into: memoryview, offset: int, checksum: bool) -> bool:
    """Read a chunk (and its checksum) into ``into``; whether it was all there and matches."""
    if not checksum:
        return os.preadv(fd, [into], offset) == len(into)
    stored = bytearray(_CRC)
    if os.preadv(fd, [into, stored], offset) != len(into) + _CRC:
        return False
    return _crc(into) == bytes(stored)


class LocalReader:
    """Reads arrays and packs of one data store in a local folder, many at a time, on I/O threads."""

    def __init__(self, folder: str) -> None:
        self._folder = folder

    def open_array(self, key: str, path: str, stored: str, shape: Sequence[int], shard: Sequence[int]) -> LocalArray:
        """The array at ``path``, its ``zarr.json`` checked against what the index implies."""
        dtype = numpy_dtype(stored)
        chunk = inner_chunk_shape(shard, dtype.itemsize)
        folder = os.path.join(self._folder, path)
        expected = metadata(shape, stored, shard, dtype.itemsize)
        return self._opened(LocalArray(key, path, folder, tuple(shape), dtype, tuple(shard), chunk, True), expected)

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
        if out.size == 0:
            return LocalRead(out, [])
        jobs = []
        for position, sub in _split(box, array.shard, array.shape):
            jobs.append(_pool().submit(self._read_shard_part, array, position, sub, box, out))
        return LocalRead(out, jobs)

    def _read_shard_part(
        self,
        array: LocalArray,
        position: tuple[int, ...],
        sub: list[tuple[int, int]],
        box: list[tuple[int, int]],
        out: np.ndarray,
    ) -> None:
        """Read the part ``sub`` of the shard at ``position`` into its place in ``out`` (``box``)."""
        file = os.path.join(array.folder, chunk_key(position))
        chunk, itemsize = array.chunk, array.dtype.itemsize
        per_shard = [s // c for s, c in zip(array.shard, chunk)]
        chunk_bytes = math.prod(chunk) * itemsize
        origin = [p * s for p, s in zip(position, array.shard)]
        fd = _open_regular(array, file)
        try:
            entries = _shard_index(array, fd, file, math.prod(per_shard), chunk_bytes + _CRC * array.checksum)
            local = [(lo - o, hi - o) for (lo, hi), o in zip(sub, origin)]  # within the shard
            ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(local, chunk)]
            spare: np.ndarray | None = None
            wanted = [[r[i] for r, i in zip(ranges, inner)] for inner in np.ndindex(*map(len, ranges))]
            numbers = [int(np.ravel_multi_index(grid, per_shard)) if grid else 0 for grid in wanted]
            if len(numbers) > 1 and _READ_AHEAD:  # a cold page cache: ask the disk for all of it at once
                first, last = min(entries[numbers, 0]), max(entries[numbers, 0] + entries[numbers, 1])
                os.posix_fadvise(fd, int(first), int(last - first), os.POSIX_FADV_WILLNEED)
            for grid, number in zip(wanted, numbers):
                start = [o + g * c for o, g, c in zip(origin, grid, chunk)]  # of the chunk, in the array
                want = [(max(lo, s), min(hi, s + c)) for (lo, hi), s, c in zip(sub, start, chunk)]
                target = _at(out, tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(want, box)))
                whole = all(hi - lo == c for (lo, hi), c in zip(want, chunk))
                if whole and target.flags.c_contiguous:
                    into = _bytes_of(target)
                    if not _read_chunk(fd, into, int(entries[number, 0]), array.checksum):
                        raise _damaged(array, f"chunk {grid} of {file} fails its checksum")
                    continue
                if spare is None:
                    spare = np.empty(chunk, array.dtype)
                if not _read_chunk(fd, _bytes_of(spare), int(entries[number, 0]), array.checksum):
                    raise _damaged(array, f"chunk {grid} of {file} fails its checksum")
                target[...] = _at(spare, tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(want, start)))
        except OSError as e:
            raise _refused(array, e) from e
        finally:
            os.close(fd)

    def read_pack_spans(self, path: str, nbytes: int, chunk: int, spans: Sequence[tuple[int, int]]) -> list[LocalRead]:
        """Start reading byte spans (start, stop) of the pack at ``path``."""
        shard = pack_shard(nbytes, chunk)
        folder = os.path.join(self._folder, path)
        uint8 = np.dtype("uint8")
        array = self._opened(
            LocalArray("", path, folder, (nbytes,), uint8, (shard,), (chunk,), False), pack_metadata(nbytes, chunk)
        )
        return [self.read_region(array, (slice(a, b),)) for a, b in spans]
