"""Array I/O: format version 4's data stores (zarr3 sharded arrays in plain folders), and the OCDBT
databases of versions 1 to 3, through TensorStore or, on local disks, :mod:`jaxckpt.arrays.zarr_local`:
the layout and what a save writes here; reading is :mod:`jaxckpt.arrays.store_read`.

With :mod:`jaxckpt.arrays.store_read`, :mod:`jaxckpt.interop.zarr_arrays` (other libraries' zarr
arrays) and :mod:`jaxckpt.storage.kvstore` (whole values in key-value stores), the only modules that import
tensorstore. A checkpoint's data store holds:

- a large leaf as its own zarr3 array at ``a/<n>/``: one file per shard, each cut into inner chunks
  that end in their CRC-32C (the ``sharding_indexed`` and ``crc32c`` codecs), verified on every read;
- small leaves packed, end to end, into 1-D uint8 zarr3 arrays at ``p/<n>/`` (their crc32 is in the
  index), so that ten thousand small leaves cost one write, not ten thousand; on object stores,
  leaves up to BUCKET_PACK_LEAF_LIMIT, so that a checkpoint there is a few large objects.

A checkpoint is untrusted input. Every chunk is written, zeros included, and reading one that is
missing is an error (TensorStore would otherwise return the fill value: silently wrong data).

TensorStore's errors carry a status code; :func:`failure` maps them to jaxckpt's: damage
(``CheckpointCorruptedError``) apart from storage that refused (``StorageError``: permissions, a
full disk, the network), since only the first means the checkpoint is bad.
"""

from __future__ import annotations

import errno
import json
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from jaxckpt._errors import JaxckptError, StorageError
from jaxckpt.arrays import checksums as _checksums
from jaxckpt.arrays import zarr_local, zarr_meta, zarr_write
from jaxckpt.arrays.in_flight import WRITE_AHEAD_BYTES, InFlight
from jaxckpt.format import refs_json
from jaxckpt.format.records import CHECKSUMS_FILE
from jaxckpt.storage import kvstore as _kvstore
from jaxckpt.storage.kvstore import (
    context as _context,
)
from jaxckpt.storage.kvstore import failure, status_code

# Leaves up to this many bytes are packed; larger ones get a zarr3 array of their own.
PACK_LEAF_LIMIT = 1 << 20
# A pack is cut in chunks of this size, so that reading one small leaf reads little.
PACK_CHUNK_BYTES = 4 << 20
# A pack holds at most about this many bytes.
PACK_TARGET_BYTES = 256 << 20
# On object stores (buckets, memory://) every object costs requests, which buckets charge and throttle
# (GCS: about one write a second per object name; S3: 3,500 a second per prefix), so there leaves up
# to this many bytes that process 0 holds, whole or in shards on its devices, go to packs too: a
# checkpoint is then about one object per 64 MiB of data, not two files per array and one per shard.
# An array of its own costs its zarr.json and a shard: two objects, each over 64 MiB on average from
# here. Local disks keep PACK_LEAF_LIMIT, where files are cheap and each array is written in place.
BUCKET_PACK_LEAF_LIMIT = 128 << 20
# A manager's incremental saves on a bucket store an unchanged array by reference (jaxckpt.incremental.refs),
# which only an array of its own can be: there leaves over this go to arrays of their own, so that a
# frozen base of 8-128 MiB weight matrices (most models) is uploaded once. Below it, an object per
# array costs more in requests than uploading it again does.
INCREMENTAL_BUCKET_PACK_LEAF_LIMIT = 8 << 20
# On object stores packs are no smaller than this, so that several upload at once (see pack_target).
BUCKET_PACK_MIN_BYTES = 64 << 20
# Byte alignment of leaves inside a pack, as of the buffers read into: on CPU, jax aliases a
# 64-byte-aligned host buffer instead of copying it.
PACK_ALIGN = 64
ZARR_JSON_LIMIT = 1 << 20  # bytes of an array's zarr.json read, as jaxckpt.arrays.zarr_local reads it

# The zarr data type names that TensorStore's zarr3 driver knows (0.1.86). Every dtype jaxckpt stores
# has a zarr v3 name: a core one or one registered in zarr-extensions (data-types/), both the
# ml_dtypes name, but float8_e4m3fn (OCP FP8 E4M3, no infinities), which has none (zarr's float8_e4m3
# is the IEEE-like type with infinities) and is stored by TensorStore's name. TensorStore lacks the
# registered float8_e4m3, float6_e2m3fn, float6_e3m2fn, uint2 and uint4: where TensorStore writes
# (object stores, memory://) those are stored as unsigned integers of their width (their raw bits);
# jaxckpt's own writer (local disks) stores them by name. Readers take either, as the index says.
# A fixed list, not the installed TensorStore's: every process of a save must choose alike.
TENSORSTORE_NAMES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
    + ["complex64", "complex128", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    + ["float8_e4m3b11fnuz", "float8_e3m4", "float8_e8m0fnu", "int4", "int2", "float4_e2m1fn"]
)


def stored_dtype(dtype: np.dtype, *, local: bool) -> str:
    """The zarr data type an array of ``dtype`` is stored as, by jaxckpt's own writer (``local``) or
    by TensorStore (see :data:`TENSORSTORE_NAMES`)."""
    return dtype.name if local or dtype.name in TENSORSTORE_NAMES else f"uint{8 * dtype.itemsize}"


def raw_dtype(stored: str) -> str:
    """The zarr data type TensorStore opens an array stored as ``stored`` by: the unsigned integer of
    its width where TensorStore has no name for it."""
    return stored if stored in TENSORSTORE_NAMES else f"uint{8 * zarr_meta.numpy_dtype(stored).itemsize}"


def ocdbt_spec(base: dict[str, Any], path: str) -> dict[str, Any]:
    """The zarr3 array at ``path`` in the OCDBT database whose files live at kvstore ``base``."""
    return {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base, "path": path + "/"}}


def ocdbt_metadata(shape: Sequence[int], dtype: str, chunks: Sequence[int] | None, checksum: bool) -> dict[str, Any]:
    """The zarr3 metadata jaxckpt writes; as constraints when opening, every field that decides which
    bytes are read and how (None ``chunks``: any chunk shape, for version 1 indexes)."""
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if checksum:
        codecs.append({"name": "crc32c"})
    out = {"shape": list(shape), "data_type": dtype, "codecs": codecs, "chunk_key_encoding": {"name": "default"}}
    if chunks is not None:
        out["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [max(1, c) for c in chunks]}}
    return out


def pack_chunk(nbytes: int) -> int:
    """Bytes per (inner) chunk of a pack of ``nbytes`` bytes."""
    return max(1, min(nbytes, PACK_CHUNK_BYTES))


def pack_target(data_bytes: int, largest: int) -> int:
    """The bytes a pack holds at most on an object store, for a save of about ``data_bytes`` bytes of
    arrays whose largest packed leaf is ``largest`` bytes: packs of two fifths of the data or more
    (and at least twice the largest leaf, so that every pack but the last is over half full), so
    that a checkpoint of up to 512 MiB stays within 8 objects (three packs of a zarr.json and a
    shard each, and the index); several packs are written at once, up to WRITE_AHEAD_BYTES in flight."""
    return max(BUCKET_PACK_MIN_BYTES, min(PACK_TARGET_BYTES, max(data_bytes * 2 // 5, 2 * largest)))


def bucket_shard(shape: Sequence[int], shard: Sequence[int], itemsize: int) -> list[int]:
    """The shard shape of an array that one process holds in device shards of ``shard`` shape, on an
    object store: blocks of whole device shards, grown along the leading dimensions first until a
    shard holds BUCKET_PACK_MIN_BYTES or the whole array, so that eight shards of 16 MiB are one
    object of 128 MiB, not eight (and a zarr.json)."""
    out = [max(1, s) for s in shard]
    for d, n in enumerate(shape):
        while math.prod(out) * itemsize < BUCKET_PACK_MIN_BYTES and out[d] < n:
            count = -(-n // out[d])  # device shards along d in each block: grow by the least factor
            factor = next(f for f in range(2, count + 1) if count % f == 0)
            out[d] = min(n, out[d] * factor)
    return out


def chunk_shape(shape: Sequence[int], shard: Sequence[int], itemsize: int) -> list[int]:
    """The shard shape (zarr3 outer chunk) the index records for an array of ``shape`` whose regions
    are ``shard`` in size (format version 4; see :func:`jaxckpt.arrays.zarr_meta.shard_shape`)."""
    return list(zarr_meta.shard_shape(shape, shard, itemsize))


def sharded_metadata(shape: Sequence[int], stored: str, shard: Sequence[int]) -> dict[str, Any]:
    """Format version 4's zarr3 metadata of an array, as TensorStore takes it in a spec."""
    return spec_metadata(zarr_meta.metadata(shape, stored, shard, zarr_meta.numpy_dtype(stored).itemsize))


def spec_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """A ``zarr.json``'s content as TensorStore takes it in a spec."""
    return {k: v for k, v in meta.items() if k not in ("zarr_format", "node_type")}


def sub_store(base: dict[str, Any], path: str) -> dict[str, Any]:
    """The kvstore spec of folder ``path`` under kvstore ``base``."""
    return {**base, "path": base.get("path", "") + path + "/"}


def local_folder(base: dict[str, Any]) -> str | None:
    return str(base["path"]) if base.get("driver") == "file" else None


class Writer:
    """Writes the arrays and packs of one checkpoint's data store at kvstore ``base`` (format version 4:
    zarr3 sharded arrays, one file per shard; see :mod:`jaxckpt.arrays.zarr_local`).

    ``add_*`` only records what to write; :meth:`flush` writes it all at once, so per-array costs
    overlap instead of adding up. The given host buffers are read in place (no copy): callers hand
    over buffers that nobody changes, and :meth:`flush` drops them once written, so a caller can
    bound host memory by flushing. On a local disk jaxckpt writes the files itself; elsewhere
    (object stores, ``memory://``) TensorStore writes the same layout.

    Writes are not transactional: nothing is visible until the caller publishes the checkpoint's
    index.
    """

    def __init__(self, base: dict[str, Any]) -> None:
        self._base = base
        folder = local_folder(base)
        self._local = zarr_write.LocalWriter(folder) if folder is not None else None
        self._context = _context()
        self._planned: list[tuple[str, dict[str, Any], list[tuple[Any, np.ndarray]] | _PackParts]] = []
        self._checksums: _checksums.Written = {}
        # Arrays stored by reference to a sibling checkpoint (buckets; see jaxckpt.incremental.refs): path -> Ref.
        self.refs: dict[str, Any] = {}
        self.incremental = False  # a manager's incremental save (see INCREMENTAL_BUCKET_PACK_LEAF_LIMIT)

    @property
    def checksums(self) -> _checksums.Written:
        """The CRC-32C of every inner chunk of the arrays written so far."""
        return self._local.checksums if self._local is not None else self._checksums

    def finish(self, save: str) -> None:
        """Write the data store's checksums (:mod:`jaxckpt.arrays.checksums`), once every array is flushed."""
        if self._local is not None:
            self._local.finish(save)
            return
        if self._checksums:
            _kvstore.kv_write(self._base, CHECKSUMS_FILE, _checksums.encode(save, self._checksums))
        if self.refs:
            _kvstore.kv_write(self._base, refs_json.REFS_FILE, refs_json.encode(save, self.refs))

    @property
    def local(self) -> bool:
        """Whether jaxckpt's own writer writes the files (a local disk), not TensorStore (an object store)."""
        return self._local is not None

    @property
    def pack_leaf_limit(self) -> int:
        """Leaves of up to this many bytes that process 0 holds go to packs (see BUCKET_PACK_LEAF_LIMIT)."""
        if self._local is not None:
            return PACK_LEAF_LIMIT
        return (
            min(BUCKET_PACK_LEAF_LIMIT, INCREMENTAL_BUCKET_PACK_LEAF_LIMIT)
            if self.incremental
            else BUCKET_PACK_LEAF_LIMIT
        )

    def stored_dtype(self, dtype: np.dtype) -> str:
        """The zarr data type this writer stores an array of ``dtype`` as (see :func:`stored_dtype`)."""
        return stored_dtype(dtype, local=self._local is not None)

    def add_array(
        self,
        path: str,
        shape: Sequence[int],
        dtype: np.dtype,
        chunks: Sequence[int],
        parts: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    ) -> None:
        """Record a zarr3 array of ``shape`` in shards of ``chunks`` (see :func:`chunk_shape`), and the
        (region, data) to write: whole shards."""
        stored = self.stored_dtype(dtype)
        if stored != dtype.name:
            parts = [(index, data.view(stored)) for index, data in parts]
        if math.prod(shape) == 0:
            parts = []
        as_stored = dtype if stored == dtype.name else np.dtype(stored)
        if self._local is not None:
            self._local.add_array(path, shape, as_stored, chunks, parts)
            return
        # TensorStore checks each inner chunk by its own CRC-32C; the data store's checksums.json also
        # lists them in order, computed here over the same bytes (the shards as TensorStore writes
        # them, padding included).
        inner = zarr_meta.inner_chunk_shape(chunks, as_stored.itemsize)
        shards = self._checksums.setdefault(path, {})  # listed even with no shards written
        for number, _, data in zarr_write.shards_of(shape, as_stored, chunks, parts):
            shards[number] = [zarr_local.crc32c_of(view) for view in zarr_write.inner_chunks(data, inner)]
        self._planned.append((path, sharded_metadata(shape, stored, chunks), list(parts)))

    def add_linked(self, path: str, shape: Sequence[int], dtype: np.dtype, chunks: Sequence[int], links: Any) -> None:
        """Record an array whose shards are hard links already made (local disks; see
        :mod:`jaxckpt.incremental.local`): shard number -> (the link, its chunk key, its CRC-32C); on a
        bucket, ``links`` is a reference to the sibling that holds them (:mod:`jaxckpt.incremental.refs`)."""
        if self._local is None:
            if links:  # none where this process holds no shard of it
                self.refs[path] = links
            return
        self._local.add_linked(path, shape, dtype, chunks, links)  # stored by its own name locally

    def add_pack(self, path: str, nbytes: int, pieces: Sequence[tuple[int, memoryview]]) -> None:
        """Record a pack of ``nbytes`` bytes holding ``pieces`` (offset, bytes); zeros between them."""
        chunk = pack_chunk(nbytes)
        if self._local is not None:  # written from the leaves' own buffers
            self._local.add_pack(path, nbytes, pieces, chunk)
            return
        metadata = spec_metadata(zarr_meta.pack_metadata(nbytes, chunk))
        self._planned.append((path, metadata, _PackParts(nbytes, list(pieces))))

    def flush(self) -> None:
        """Create and write everything recorded so far, durably; then forget it."""
        if self._local is not None:
            self._local.flush()
            return
        planned, self._planned = self._planned, []
        opens = [_create(self._base, path, metadata, self._context) for path, metadata, _ in planned]
        in_flight = InFlight(WRITE_AHEAD_BYTES)
        try:
            for i, ((path, _, parts), future) in enumerate(zip(planned, opens)):
                store = _Timed(future, 0, f"array {path!r} of the checkpoint's data", self._base, path + "/").result()
                if isinstance(parts, _PackParts):  # its buffer made only now, within the bytes in flight
                    parts = parts.build()
                planned[i] = (planned[i][0], planned[i][1], [])  # what is written is not held beyond its write
                for index, data in parts:
                    write = store[index].write(data, can_reference_source_data_indefinitely=True)
                    in_flight.add(
                        data.nbytes, _Timed(write, data.nbytes, f"the data of array {path!r}", self._base, path + "/")
                    )
            in_flight.drain()
        except BaseException as e:
            _settle([_Timed(f, 0, "", self._base) for f in opens] + in_flight.pending(), cancel=_timed_out(e))
            if isinstance(e, Exception) and status_code(e) is not None:
                raise _write_failure(e, self._base) from e
            raise


class _Created(NamedTuple):
    """An array being created: its ``zarr.json`` being written, and the array opened for writing."""

    metadata: Any  # the write of zarr.json
    store: Any  # the array

    def result(self, timeout: float | None = None) -> ts.TensorStore:
        """Both done within ``timeout`` seconds in all (TimeoutError past it, as a TensorStore future)."""
        start = time.monotonic()
        self.metadata.result(timeout=timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return self.store.result(timeout=left)

    def cancel(self) -> None:
        self.metadata.cancel()
        self.store.cancel()


def _create(base: dict[str, Any], path: str, metadata: dict[str, Any], context: ts.Context) -> _Created:
    """Create the zarr3 array at ``path`` under kvstore ``base``: one write of its ``zarr.json``, as
    jaxckpt's own writer writes it. TensorStore's ``create=True`` reads the zarr.json first and makes
    a conditional write (a GET, a HEAD and a PUT on a bucket); a save writes into a prefix it has
    cleared, where nothing is to be checked, and publishes nothing until its index is written."""
    document = json.dumps({"zarr_format": 3, "node_type": "array", **metadata}).encode()
    folder = ts.KvStore.open(sub_store(base, path), context=context).result()  # no request
    written = folder.write("zarr.json", document)
    # Chunks of zeros are stored too: a reader then treats any missing chunk as damage.
    spec = {
        "driver": "zarr3",
        "kvstore": sub_store(base, path),
        "metadata": metadata,
        "store_data_equal_to_fill_value": True,
    }
    return _Created(written, ts.open(spec, open=True, assume_metadata=True, context=context))


class _PackParts(NamedTuple):
    """A pack to write from its leaves (offset, bytes): its one buffer is made as it is written."""

    nbytes: int
    pieces: list[tuple[int, memoryview]]

    def build(self) -> list[tuple[tuple[slice, ...], np.ndarray]]:
        if not self.nbytes:
            return []
        buffer = np.empty(self.nbytes, np.uint8)
        at = 0
        for offset, data in self.pieces:
            buffer[at:offset] = 0
            buffer[offset : offset + data.nbytes] = data
            at = offset + data.nbytes
        buffer[at:] = 0
        return [((slice(None),), buffer)]


class _Timed:
    """A TensorStore operation with its deadline (:mod:`jaxckpt.storage.kvstore`: the deadline of metadata
    plus a second per MiB of ``nbytes``), counted from when it is waited for: operations are waited
    for oldest first, so the time one spent queued behind others is not counted against it."""

    def __init__(self, future: Any, nbytes: int, what: str, base: dict[str, Any], key: str = "") -> None:
        self.future, self.nbytes, self.what, self.base, self.key = future, nbytes, what, base, key

    def result(self) -> Any:
        seconds = _kvstore.current().data_timeout(self.nbytes)
        return _kvstore.result(self.future, self.what, self.base, self.key, seconds)

    def cancel(self) -> None:
        self.future.cancel()


def _timed_out(error: BaseException) -> bool:
    return isinstance(error, StorageError) and error.errno == errno.ETIMEDOUT


def _settle(started: Sequence[Any], *, cancel: bool) -> None:
    """Let every started write settle before the caller removes the folder: one still running would
    create files in it again (a full disk fails some writes, not all at once). Each wait is bounded
    by its deadline; once one is past it (or ``cancel``: the failure was a deadline), the rest are
    cancelled instead, so that a store that stopped answering costs one deadline, not one per write.
    (A request already sent may still land: such data, without an index, is never a checkpoint.)"""
    for op in started:
        if cancel:
            op.cancel()
        try:
            op.result()
        except Exception as e:
            cancel = cancel or _timed_out(e)


def _write_failure(error: Exception, base: dict[str, Any]) -> JaxckptError:
    found = failure("the checkpoint's data store for writing", error, base)
    if isinstance(found, StorageError):
        return found
    # Anything else TensorStore reports while writing is not damage of a checkpoint (none exists yet).
    return StorageError(f"Cannot write the checkpoint's data at {_kvstore.store_url(base)}: {error}", errno.EIO)


# Buffers that reads fill: 64-byte aligned, so that jax aliases them on CPU instead of copying.
aligned_empty = zarr_local.aligned_empty
