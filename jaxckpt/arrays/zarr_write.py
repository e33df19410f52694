"""Format version 4's data stores written on a local disk: each shard's file from the array's own
buffer (``pwritev``), every inner chunk followed by its CRC-32C and the shard's index at the end
(see :mod:`jaxckpt.arrays.zarr_local`), packs from their leaves' buffers, on the I/O threads."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jaxckpt._errors import StorageError
from jaxckpt.arrays import checksums as _checksums
from jaxckpt.arrays.zarr_local import CRC, shards_in
from jaxckpt.arrays.zarr_meta import chunk_key, inner_chunk_shape, metadata, pack_metadata, pack_shard, shard_number
from jaxckpt.format.records import CHECKSUMS_FILE
from jaxckpt.storage.local_files import bytes_of, crc32c_of, crc_bytes, fsync_path, io_pool, view_at

_IOV_MAX = 512  # buffers per pwritev call (Linux allows 1024)
# A shard hard-linked from an earlier checkpoint: the link, its chunk key, the CRC-32C of its chunks.
Linked = tuple[str, str, tuple[int, ...]]
LINKS = ".links"  # the folder of a data store where links wait for their array's number (jaxckpt.incremental.local)
ZARR_JSON_LINK = -1  # in the links of an array, not a shard: its zarr.json, linked too where it is the same


class _Shard(NamedTuple):
    array: str  # the array's path in the data store
    number: int  # its place in the array's shard grid (C order)
    file: str  # its path
    data: np.ndarray  # C-contiguous, the shard's shape (padded where the array ends inside it)
    chunk: tuple[int, ...]  # inner chunk shape


def inner_chunks(data: np.ndarray, chunk: Sequence[int]) -> list[memoryview]:
    """The bytes of each inner chunk of a C-contiguous shard, in C order of its chunk grid, in place:
    a shard is cut along its leading dimensions only, so every inner chunk is contiguous."""
    grid = [n // c for n, c in zip(data.shape, chunk)]
    return [
        bytes_of(np.ascontiguousarray(view_at(data, tuple(slice(p * c, (p + 1) * c) for p, c in zip(position, chunk)))))
        for position in np.ndindex(*grid)
    ]


def shards_of(
    shape: Sequence[int], stored: np.dtype, shard: Sequence[int], parts: Sequence[tuple[tuple[slice, ...], np.ndarray]]
) -> list[tuple[int, tuple[int, ...], np.ndarray]]:
    """The shards in ``parts`` (each whole shards, at a region whose start is a multiple of the shard
    shape): (number in the shard grid, position, C-contiguous data of the shard's full shape)."""
    out = []
    for index, data in parts:
        box = [s.indices(n)[:2] for s, n in zip(index, shape)]
        for position, sub in shards_in(box, shard, shape):
            piece = view_at(data, tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(sub, box)))
            out.append((shard_number(position, shape, shard), position, _padded(piece.view(stored), sub, shard)))
    return out


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


def _write_shard(shard: _Shard) -> list[int]:
    """Write a shard's file; the CRC-32C of each of its inner chunks, in order."""
    pieces: list[memoryview | bytes] = []
    entries: list[tuple[int, int]] = []
    crcs = []
    offset = 0
    for view in inner_chunks(shard.data, shard.chunk):
        crcs.append(crc32c_of(view))
        pieces += [view, struct.pack("<I", crcs[-1])]
        entries.append((offset, len(view) + CRC))
        offset += len(view) + CRC
    index = np.array(entries, "<u8").reshape(-1, 2).tobytes()
    _write_file(shard.file, [*pieces, index, crc_bytes(memoryview(index))])
    return crcs


def _padded(data: np.ndarray, box: Sequence[tuple[int, int]], shard: Sequence[int]) -> np.ndarray:
    """The shard at ``box`` (clipped to the array) as a C-contiguous array of the shard's full shape."""
    data = np.ascontiguousarray(data)
    if tuple(hi - lo for lo, hi in box) == tuple(shard):
        return data
    out = np.zeros(shard, data.dtype)
    out[tuple(slice(0, hi - lo) for lo, hi in box)] = data
    return out


class LocalWriter:
    """Writes the arrays of one checkpoint's data store in a local folder (see :class:`jaxckpt.arrays.store_write.Writer`)."""

    def __init__(self, folder: str) -> None:
        self._folder = folder
        self._files: list[tuple[str, list[memoryview | bytes]]] = []  # written as they are: path, pieces
        self._shards: list[_Shard] = []
        self._links: list[tuple[str, str]] = []  # hard links made in the snapshot -> their place
        self.checksums: _checksums.Written = {}  # of the arrays written so far

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
        self.checksums.setdefault(path, {})  # listed even with no shards here (or none at all)
        for number, position, data in shards_of(shape, stored, shard, parts):
            self._shards.append(_Shard(path, number, os.path.join(folder, chunk_key(position)), data, chunk))

    def add_linked(
        self, path: str, shape: Sequence[int], stored: np.dtype, shard: Sequence[int], links: Mapping[int, Linked]
    ) -> None:
        """Record the array at ``path`` whose shards are hard links made already (see
        :mod:`jaxckpt.incremental.local`): shard number -> (the link, its chunk key, the CRC-32C of its chunks);
        its ``zarr.json`` is written unless linked too (:data:`ZARR_JSON_LINK`: no write, no fsync)."""
        folder = os.path.join(self._folder, path)
        if ZARR_JSON_LINK not in links:
            meta = metadata(shape, stored.name, shard, stored.itemsize)
            self._files.append((os.path.join(folder, "zarr.json"), [json.dumps(meta).encode()]))
        shards = self.checksums.setdefault(path, {})
        for number, (link, key, crcs) in links.items():
            self._links.append((link, os.path.join(folder, key)))
            if number != ZARR_JSON_LINK:
                shards[number] = list(crcs)

    def add_pack(self, path: str, nbytes: int, pieces: Sequence[tuple[int, memoryview]], chunk: int) -> None:
        """Record a pack of ``nbytes`` bytes: ``pieces`` are (offset, bytes), in order and apart,
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
            out.append(data)
            at = offset + data.nbytes
        if shard > at:
            out.append(bytes(shard - at))
        index = np.array([(i * chunk, chunk) for i in range(shard // chunk)], "<u8").tobytes()
        self._files.append((os.path.join(folder, chunk_key([0])), [*out, index, crc_bytes(memoryview(index))]))

    def flush(self) -> None:
        """Write everything recorded so far, durably; then forget it."""
        shards, self._shards = self._shards, []
        files, self._files = self._files, []
        links, self._links = self._links, []
        try:  # durable as they are; publish makes their folders durable
            for link, place in links:
                os.makedirs(os.path.dirname(place), exist_ok=True)
                os.rename(link, place)
        except OSError as e:
            raise StorageError(f"Cannot write the checkpoint's data: {e}", e.errno or errno.EIO) from e
        jobs: list[Callable[[], object]] = [lambda s=s: _write_shard(s) for s in shards]  # type: ignore[misc]
        jobs += [lambda f=f, b=b: _write_file(f, b) for f, b in files]  # type: ignore[misc]
        futures = [io_pool().submit(job) for job in jobs]
        errors = []
        for i, future in enumerate(futures):  # every write settles before the caller may remove the folder
            try:
                crcs = future.result()
            except OSError as e:
                errors.append(e)
                continue
            if i < len(shards):
                self.checksums.setdefault(shards[i].array, {})[shards[i].number] = crcs
        if not errors:  # then durably, all at once
            written = [s.file for s in shards] + [f for f, _ in files]
            futures = [io_pool().submit(fsync_path, f) for f in written]
            for future in futures:
                try:
                    future.result()
                except OSError as e:
                    errors.append(e)
        if errors:
            first = errors[0]
            raise StorageError(f"Cannot write the checkpoint's data: {first}", first.errno or errno.EIO) from first

    def finish(self, save: str) -> None:
        """Write, durably, the data store's checksums (see :mod:`jaxckpt.arrays.checksums`), once every array is
        flushed; none where it holds no array (only packs, or nothing)."""
        with contextlib.suppress(OSError):  # the folder of the hard links, empty now
            os.rmdir(os.path.join(self._folder, LINKS))
        if not self.checksums:
            return
        file = os.path.join(self._folder, CHECKSUMS_FILE)
        try:
            _write_file(file, [_checksums.encode(save, self.checksums)])
            fsync_path(file)
        except OSError as e:
            raise StorageError(f"Cannot write the checkpoint's data: {e}", e.errno or errno.EIO) from e
