"""Reading a checkpoint's data stores through TensorStore (format version 4 on buckets and
``memory://``, and the OCDBT databases of versions 1 to 3 everywhere), or on local disks through
:mod:`jaxckpt.arrays.zarr_local`; what is written, and the layout, is :mod:`jaxckpt.arrays.store_write`.

An array is opened with the metadata its (checksummed) index record implies as constraints, so a
``zarr.json`` that differs in anything that changes the bytes read (codecs, chunk shape or key
encoding, data type, shape) is refused before a chunk is read or a buffer allocated; with the store's
checksums (format 5) the zarr.json is not even read (see :meth:`Reader.open_arrays`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from jaxckpt._errors import CheckpointCorruptedError, CheckpointFormatError
from jaxckpt.arrays import checksums as _checksums
from jaxckpt.arrays import store_write, zarr_local, zarr_meta
from jaxckpt.arrays.in_flight import Pending
from jaxckpt.format.keys import describe
from jaxckpt.format.records import ArrayLeaf, InArray
from jaxckpt.storage import kvstore as _kvstore
from jaxckpt.storage.kvstore import context as _context
from jaxckpt.storage.kvstore import failure


def _name(key: str, path: str) -> str:
    return f"the data of {describe(key)} (array {path!r} in the checkpoint)" if key else f"{path!r} in the checkpoint"


def _check_open(key: str, path: str, store: ts.TensorStore, shape: Sequence[int], dtype: str, *, padded: bool) -> None:
    if list(store.shape) != list(shape) or store.dtype.name != dtype:
        raise CheckpointCorruptedError(
            f"The stored array of {describe(key) if key else repr(path)} has shape {tuple(store.shape)} and dtype "
            f"{store.dtype.name}, but the index says {tuple(shape)} and {dtype}; the checkpoint is inconsistent."
        )
    # Chunks equal to the fill value may be absent in version 1 checkpoints, and the fill value is the
    # one field not constrained when opening (its JSON form depends on the dtype): jaxckpt writes zero.
    fill = store.fill_value
    if fill is not None and np.asarray(fill).tobytes().strip(b"\0"):
        raise CheckpointCorruptedError(
            f"The stored array of {describe(key) if key else repr(path)} (array {path!r}) has the fill value {fill}, "
            "but jaxckpt writes 0: its metadata is damaged, and its chunks of zeros cannot be trusted."
        )
    if padded:  # version 4: the metadata was constrained to the index's, chunks included
        return
    # Version 1 indexes do not record chunk shapes: a chunk (read whole) must at least fit the array.
    chunks = store.chunk_layout.read_chunk.shape or ()  # None for a rank-0 array
    if len(chunks) != len(shape) or any(c is None or c > max(1, n) for c, n in zip(chunks, shape)):
        raise CheckpointCorruptedError(
            f"The stored array of {describe(key) if key else repr(path)} (array {path!r}) claims chunks of shape "
            f"{chunks}, larger than its shape {tuple(shape)}: its zarr.json is damaged or crafted."
        )


def _array_checksums(
    load: Callable[[], _checksums.StoreChecksums], requests: list[tuple[str, ArrayLeaf, InArray]]
) -> dict[str, Mapping[int, tuple[int, ...]]]:
    """The data store's checksums of each requested array (``load`` reads them, when there is one)."""
    crcs: dict[str, Mapping[int, tuple[int, ...]]] = {}
    sums = None
    for key, _, at in requests:
        try:
            sums = sums or load()
            crcs[at.path] = sums.of_array(at.path)
        except CheckpointFormatError as e:
            raise CheckpointCorruptedError(f"Cannot read {_name(key, at.path)}: {e}") from e
    return crcs


class Reader:
    """Reads arrays and pack spans of one checkpoint's data store, many at a time.

    ``version``: the checkpoint's format version. Version 4 stores zarr3 sharded arrays in plain
    folders (read by :mod:`jaxckpt.arrays.zarr_local` on a local disk, by TensorStore elsewhere); versions
    1 to 3 zarr3 arrays in an OCDBT database. From version 2 every chunk was written, so a missing one
    is damage.

    ``pinned``: for a local data store, the checkpoint's folder held open and the store's name in it;
    version 4's files are then opened in that folder, never in one renamed to its path since.
    """

    def __init__(
        self,
        base: dict[str, Any],
        *,
        version: int,
        pinned: tuple[zarr_local.PinnedFolder, str] | None = None,
        checksums: Callable[[], _checksums.StoreChecksums] | None = None,
    ) -> None:
        self._base = base
        self._checksums = checksums
        # Whether every zarr.json is read and checked against the index even where the index alone
        # decides how bytes are read (see open_arrays): jaxckpt verify sets it, as a zarr.json that
        # differs breaks the checkpoint for TensorStore and zarr-python, if not for jaxckpt.
        self.check_zarr_json = False
        self._context = _context()
        self._strict = version >= 2
        self._sharded = version >= 4
        folder = store_write.local_folder(base) if self._sharded else None
        self._local = None
        if folder is not None and pinned is not None:
            self._local = zarr_local.LocalReader(os.path.join(pinned[0].path, pinned[1]), pinned[0])
        elif folder is not None:
            self._local = zarr_local.LocalReader(folder)

    def _open(self, path: str, metadata: dict[str, Any], *, assume: bool = False) -> Any:
        spec: dict[str, Any]
        if self._sharded:
            spec = {"driver": "zarr3", "kvstore": store_write.sub_store(self._base, path), "metadata": metadata}
        else:
            spec = {
                **store_write.ocdbt_spec(self._base, path),
                "metadata": metadata,
                "fill_missing_data_reads": not self._strict,
            }
        # assume_metadata: the zarr.json is not read (see open_arrays and read_pack_spans), or, already
        # checked, names a data type TensorStore lacks.
        return ts.open(spec, open=True, context=self._context, assume_metadata=assume)

    def _array_metadata(self, shape: Sequence[int], dtype: str, chunks: Sequence[int] | None) -> Any:
        """An array's metadata (not a pack's) in this checkpoint's format version."""
        if self._sharded:
            assert chunks is not None  # version 4 indexes record every shard shape
            return store_write.sharded_metadata(shape, dtype, chunks)
        return store_write.ocdbt_metadata(shape, dtype, chunks, checksum=True)

    def open_arrays(self, requests: Iterable[tuple[str, ArrayLeaf, InArray]]) -> dict[str, Any]:
        """Opens the array of each (key, leaf, where the index says it is), its zarr.json checked against them."""
        requests = list(requests)
        crcs = {} if self._checksums is None else _array_checksums(self._checksums, requests)
        if self._local is not None:
            local = self._local
            return {
                key: local.open_array(key, at.path, at.stored, leaf.shape, at.chunks or (), crcs.get(at.path))
                for key, leaf, at in requests
            }
        # With the data store's checksums (format version 5), an array is opened with the metadata its
        # index record implies, assumed: its zarr.json is not read (one request less per array on a
        # bucket). That cannot yield other data than the save wrote: the index (checksummed) alone
        # then decides how the stored bytes are read (shape, data type, shard and chunk layout,
        # codecs), and the bytes are the save's or an error, as each inner chunk is checked by its own
        # CRC-32C and against checksums.json, which names the save of the index. A zarr.json that
        # differs (damaged, or rewritten by another tool) is not used, so it cannot change a value;
        # bytes laid out otherwise than the index says fail those checks. Format 4 has no store
        # checksums: there a zarr.json is still read and checked against the index before use.
        assume = self._sharded and self._checksums is not None and not self.check_zarr_json
        futures, raw = [], []
        for key, leaf, at in requests:
            # A registered name that TensorStore lacks (format 4, written by jaxckpt's own writer and
            # copied here): its zarr.json is checked here, and TensorStore reads the raw bits.
            dtype, chunks = at.stored, at.chunks
            raw.append(dtype not in store_write.TENSORSTORE_NAMES and self._sharded and chunks is not None)
            if not raw[-1]:
                futures.append(self._open(at.path, self._array_metadata(leaf.shape, dtype, chunks), assume=assume))
                continue
            assert chunks is not None
            itemsize = zarr_meta.numpy_dtype(dtype).itemsize
            if not assume:
                self._check_metadata(key, at.path, zarr_meta.metadata(leaf.shape, dtype, chunks, itemsize))
            futures.append(
                self._open(
                    at.path,
                    store_write.sharded_metadata(leaf.shape, store_write.raw_dtype(dtype), chunks),
                    assume=True,
                )
            )
        stores = {}
        for (key, leaf, at), future, by_bits in zip(requests, futures, raw):
            try:
                store = _kvstore.result(future, _name(key, at.path), self._base, at.path + "/")
            except Exception as e:
                raise failure(_name(key, at.path), e, self._base, at.path + "/") from e
            stored = store_write.raw_dtype(at.stored) if by_bits else at.stored
            _check_open(key, at.path, store, leaf.shape, stored, padded=self._sharded)
            opened = _Raw(store, zarr_meta.numpy_dtype(at.stored)) if by_bits else store
            if at.path in crcs:
                read_whole = functools.partial(_read_now, key, at.path, opened, self._base)
                opened = _checksums.Bound(opened, crcs[at.path], leaf.shape, at.chunks or (), read_whole, set())
            stores[key] = opened
        return stores

    def _check_metadata(self, key: str, path: str, expected: dict[str, Any]) -> None:
        folder = store_write.sub_store(self._base, path)
        large = _kvstore.kv_exceeds(
            folder, "zarr.json", store_write.ZARR_JSON_LIMIT
        )  # so that nothing large is fetched
        raw = _kvstore.kv_read(folder, "zarr.json") if large is False else None
        try:
            found = json.loads(raw) if raw is not None and len(raw) <= store_write.ZARR_JSON_LIMIT else None
        except (ValueError, RecursionError):
            found = None
        problem = "it is missing" if large is None else zarr_meta.metadata_problem(found, expected)
        if problem:
            raise CheckpointCorruptedError(
                f"Cannot read {_name(key, path)}: its zarr.json does not match the index: {problem}. The checkpoint's "
                "files are damaged."
            )

    def read_regions(self, key: str, path: str, store: Any, regions: Sequence[tuple[slice, ...]]) -> list[Pending]:
        """Starts reading each region into a fresh aligned buffer."""
        if self._local is not None:
            local = self._local
            return [local.read_region(store, region) for region in regions]
        bound = store if isinstance(store, _checksums.Bound) else None
        if bound is not None:  # each chunk read whole is checked against the data store's checksums too
            store = bound.store
        dtype = None
        if isinstance(store, _Raw):
            store, dtype = store.store, store.dtype
        reads = [_read_into(key, path, store[region], dtype, self._base) for region in regions]
        if bound is None:
            return list(reads)  # list is invariant: Pending, not PendingRead
        name = _name(key, path)
        return [bound.check(name, read, region) for read, region in zip(reads, regions)]

    def read_pack_spans(
        self, path: str, nbytes: int, chunk: int | None, spans: Sequence[tuple[int, int]]
    ) -> list[Pending]:
        """Starts reading byte spans (start, stop) of the pack at ``path`` (``chunk``: bytes per chunk, if known)."""
        if self._local is not None:
            assert chunk is not None  # version 4 indexes record it
            return list(self._local.read_pack_spans(path, nbytes, chunk, spans))
        if self._sharded:
            assert chunk is not None
            metadata = store_write.spec_metadata(zarr_meta.pack_metadata(nbytes, chunk))
        else:
            metadata = store_write.ocdbt_metadata([nbytes], "uint8", None if chunk is None else [chunk], False)
        try:
            # Format 4 on: opened as the index says, its zarr.json not read (one request less on a
            # bucket): every leaf read from a pack is checked against its CRC in the index, so a pack
            # laid out otherwise than the index says is an error, never another leaf's bytes.
            assume = self._sharded and not self.check_zarr_json
            store = _kvstore.result(self._open(path, metadata, assume=assume), _name("", path), self._base, path + "/")
        except Exception as e:
            raise failure(_name("", path), e, self._base, path + "/") from e
        _check_open("", path, store, [nbytes], "uint8", padded=self._sharded)
        return [_read_into("", path, store[a:b], base=self._base) for a, b in spans]


class PendingRead(NamedTuple):
    """A read started by :class:`Reader` into ``buffer``: of the array at ``path``, which holds the
    value of ``key`` ("" for a pack), named by them if it fails."""

    key: str
    path: str
    copy: ts.WriteFutures  # TensorStore's copy of the stored data into ``buffer``
    buffer: np.ndarray
    base: dict[str, Any] | None = None  # the data store's kvstore, to name it by its URL

    def result(self) -> np.ndarray:
        """The data, once read (within the deadline of its bytes, see :mod:`jaxckpt.storage.kvstore`); a
        failure as jaxckpt's error (see :func:`failure`)."""
        name, key = _name(self.key, self.path), self.path + "/"
        try:
            _kvstore.result(self.copy, name, self.base, key, _kvstore.current().data_timeout(self.buffer.nbytes))
        except Exception as e:
            raise failure(name, e, self.base, key) from e
        return self.buffer


class _Raw(NamedTuple):
    """An array opened by its raw bits (a data type TensorStore lacks), read as ``dtype``."""

    store: ts.TensorStore
    dtype: np.dtype


def _read_now(key: str, path: str, store: Any, base: dict[str, Any] | None, box: tuple[slice, ...]) -> np.ndarray:
    """A box of an opened array (raw bits viewed as their type), read at once."""
    if isinstance(store, _Raw):
        return _read_into(key, path, store.store[box], store.dtype, base).result()
    return _read_into(key, path, store[box], base=base).result()


def _read_into(
    key: str, path: str, source: ts.TensorStore, dtype: np.dtype | None = None, base: dict[str, Any] | None = None
) -> PendingRead:
    buffer = store_write.aligned_empty(source.shape, source.dtype.numpy_dtype)
    view = buffer if dtype is None else buffer.view(dtype)  # the same bytes, of the stored type
    return PendingRead(key, path, ts.array(buffer).write(source), view, base)
