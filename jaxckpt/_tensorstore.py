"""Array I/O: every byte of array data goes through TensorStore (zarr3 arrays in one OCDBT database).

The only module that imports tensorstore. A checkpoint's arrays live in one OCDBT key-value database
(a handful of files however many arrays it holds):

- a large leaf is its own zarr3 array at ``a/<n>/``, chunked like its shards, each chunk ending in a
  crc32c checksum (the zarr3 ``crc32c`` codec) that TensorStore verifies on every read;
- small leaves are packed, end to end, into 1-D uint8 zarr3 arrays at ``p/<n>/`` (their crc32 is
  in the index), so that ten thousand small leaves cost one write, not ten thousand.

A checkpoint is untrusted input. Every chunk is written, zeros included, and reading one that is
missing is an error (TensorStore would otherwise return the fill value: silently wrong data). An
array is opened with the metadata its (checksummed) index record implies as constraints, so a
``zarr.json`` that differs in anything that changes the bytes read (codecs, chunk shape or key
encoding, data type, shape) is refused before a chunk is read or a buffer allocated.

TensorStore's errors carry a status code; :func:`failure` maps them to jaxckpt's: damage
(``CheckpointCorruptedError``) apart from storage that refused (``StorageError``: permissions, a
full disk, the network), since only the first means the checkpoint is bad.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from jaxckpt._errors import CheckpointCorruptedError, CheckpointFormatError, JaxckptError, StorageError
from jaxckpt._in_flight import WRITE_AHEAD_BYTES, InFlight, Pending
from jaxckpt._tree import describe

# Leaves up to this many bytes are packed; larger ones get a zarr3 array of their own.
PACK_LEAF_LIMIT = 1 << 20
# A pack is cut in chunks of this size, so that reading one small leaf reads little.
PACK_CHUNK_BYTES = 4 << 20
# A pack holds at most about this many bytes.
PACK_TARGET_BYTES = 256 << 20
# Chunks of a large array are its shards, split until each is at most this size: small enough that
# TensorStore checks and copies several at once on different cores, large enough to stay few.
ARRAY_CHUNK_LIMIT = 8 << 20
# Byte alignment of buffers we read into, and of leaves inside a pack: on CPU, jax aliases a
# 64-byte-aligned host buffer instead of copying it.
ALIGN = 64
PACK_ALIGN = ALIGN

# dtypes that the zarr3 driver of TensorStore stores natively; others are stored as unsigned ints
# of the same width and reinterpreted on read.
_NATIVE = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
    + ["complex64", "complex128", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    + ["float8_e4m3b11fnuz", "float8_e3m4", "float8_e8m0fnu", "int4", "int2", "float4_e2m1fn"]
)


def stored_dtype(dtype: np.dtype) -> str:
    return dtype.name if dtype.name in _NATIVE else f"uint{8 * dtype.itemsize}"


_CONTEXT: ts.Context | None = None


def _context() -> ts.Context:
    """One context for the process: a ``memory://`` store lives in its context, and no cache, since
    every byte is read once and a cache would only hold a second copy in memory. ``file_io_sync``
    (fsync of every file written) is TensorStore's default today; it is set here because a checkpoint
    is published as durable, and a changed default must not silently break that."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": True})
    return _CONTEXT


# --- TensorStore's errors as jaxckpt's ------------------------------------------------------------

# Status codes of storage that refused, not of damaged data: the same call may work later.
_REFUSED = {
    "PERMISSION_DENIED": errno.EACCES,
    "UNAUTHENTICATED": errno.EACCES,
    "RESOURCE_EXHAUSTED": errno.ENOSPC,
    "UNAVAILABLE": errno.EIO,
    "DEADLINE_EXCEEDED": errno.ETIMEDOUT,
    "ABORTED": errno.EIO,
    "CANCELLED": errno.ECANCELED,
    "UNKNOWN": errno.EIO,
    "INTERNAL": errno.EIO,
}


def status_code(error: BaseException) -> str | None:
    """The status code TensorStore put in front of its message (``NOT_FOUND``...), or None."""
    code = str(error).split(":", 1)[0]
    return code if code.isupper() and code.replace("_", "").isalpha() else None


def failure(what: str, error: Exception) -> JaxckptError:
    """The jaxckpt error for a TensorStore failure while reading or writing ``what``."""
    if isinstance(error, JaxckptError):
        return error
    code = status_code(error)
    if code in _REFUSED:
        number = _REFUSED[code]
        if code == "RESOURCE_EXHAUSTED" and "space" not in str(error).lower():
            number = errno.ENOMEM
        return StorageError(
            f"Cannot access {what}: the storage refused ({error}). The checkpoint may be intact.", number
        )
    if code == "NOT_FOUND":
        return CheckpointCorruptedError(
            f"Cannot read {what}: data is missing from the checkpoint ({error}). Files or chunks of it were "
            "deleted, or it is being deleted now."
        )
    return CheckpointCorruptedError(f"Cannot read {what}: {error}. The checkpoint's files are damaged or truncated.")


def _spec(base: dict[str, Any], path: str) -> dict[str, Any]:
    """The zarr3 array at ``path`` in the OCDBT database whose files live at kvstore ``base``."""
    return {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base, "path": path + "/"}}


# --- plain key-value access, for index and state files in object stores ------------------------


def _kv(base: dict[str, Any]) -> ts.KvStore:
    return ts.KvStore.open(base, context=_context()).result()


def _kv_call(what: str, call: Any) -> Any:
    try:
        return call()
    except Exception as e:  # TensorStore reports storage failures as ValueError with a status code
        raise failure(what, e) from e


def kv_read(base: dict[str, Any], key: str) -> bytes | None:
    """The value at ``key`` under kvstore ``base``, or None if there is none."""
    result = _kv_call(repr(key), lambda: _kv(base).read(key).result())
    return bytes(result.value) if result.state == "value" else None


def kv_exceeds(base: dict[str, Any], key: str, limit: int) -> bool | None:
    """Whether the value at ``key`` is over ``limit`` bytes (None if there is none), fetching one byte:
    the one just past the limit, present only in a larger value."""
    try:
        beyond = _kv(base).read(key, byte_range=slice(limit, limit + 1)).result()
    except Exception as e:
        if status_code(e) == "OUT_OF_RANGE":  # shorter than the limit
            return False
        raise failure(repr(key), e) from e
    if beyond.state == "missing":
        return None
    return bool(beyond.value)


def kv_write(base: dict[str, Any], key: str, value: bytes) -> None:
    """Write one value (one object: replaced whole or not at all)."""
    _kv_call(repr(key), lambda: _kv(base).write(key, value).result())


def kv_delete(base: dict[str, Any], key: str) -> None:
    """Delete the value at ``key`` (if any)."""
    _kv_call(repr(key), lambda: _kv(base).delete_range(ts.KvStore.KeyRange(key, key + "\0")).result())


def kv_keys(base: dict[str, Any]) -> list[str]:
    """Every key under kvstore ``base``."""
    return [k.decode("utf-8", "replace") for k in _kv_call("a listing", lambda: _kv(base).list().result())]


def kv_delete_all(base: dict[str, Any]) -> None:
    """Delete every key under kvstore ``base``."""
    _kv_call("a deletion", lambda: _kv(base).delete_range(ts.KvStore.KeyRange()).result())


def _metadata(shape: Sequence[int], dtype: str, chunks: Sequence[int] | None, checksum: bool) -> dict[str, Any]:
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
    """Bytes per chunk of a pack of ``nbytes`` bytes."""
    return max(1, min(nbytes, PACK_CHUNK_BYTES))


def chunk_shape(shape: Sequence[int], shard: Sequence[int], itemsize: int) -> list[int]:
    """The shard shape, halved along its largest dimension until a chunk is at most the limit."""
    chunks = [max(1, c) for c in shard]
    while math.prod(chunks) * itemsize > ARRAY_CHUNK_LIMIT and max(chunks) > 1:
        i = max(range(len(chunks)), key=chunks.__getitem__)
        chunks[i] = -(-chunks[i] // 2)
    return chunks


class Writer:
    """Writes the arrays and packs of one checkpoint into the OCDBT database at kvstore ``base``.

    ``add_*`` only records what to write; :meth:`flush` opens every recorded array at once and
    writes them all, so per-array costs overlap instead of adding up. TensorStore reads the given
    host buffers in place (no copy of its own): callers hand over buffers that nobody changes, and
    :meth:`flush` drops them once written, so a caller can bound host memory by flushing.

    Writes are not transactional: nothing is visible until the caller publishes the checkpoint's
    index, and a transaction would hold every byte in memory until its commit.
    """

    def __init__(self, base: dict[str, Any]) -> None:
        self._base = base
        self._context = _context()
        self._planned: list[tuple[str, dict[str, Any], list[tuple[Any, np.ndarray]]]] = []

    def add_array(
        self,
        path: str,
        shape: Sequence[int],
        dtype: np.dtype,
        chunks: Sequence[int],
        parts: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    ) -> None:
        """Record a zarr3 array of ``shape`` in ``chunks`` (see :func:`chunk_shape`), and the (region, data) to write."""
        stored = stored_dtype(dtype)
        if stored != dtype.name:
            parts = [(index, data.view(stored)) for index, data in parts]
        if math.prod(shape) == 0:
            parts = []
        self._planned.append((path, _metadata(shape, stored, chunks, checksum=True), list(parts)))

    def add_pack(self, path: str, buffer: np.ndarray) -> None:
        metadata = _metadata([buffer.size], "uint8", [pack_chunk(buffer.size)], checksum=False)
        self._planned.append((path, metadata, [((slice(None),), buffer)] if buffer.size else []))

    def flush(self) -> None:
        """Create and write everything recorded so far, durably; then forget it."""
        planned, self._planned = self._planned, []
        # Chunks of zeros are stored too: a reader then treats any missing chunk as damage.
        opens = [
            ts.open(
                {**_spec(self._base, path), "metadata": metadata, "store_data_equal_to_fill_value": True},
                create=True,
                context=self._context,
            )
            for path, metadata, _ in planned
        ]
        in_flight = InFlight(WRITE_AHEAD_BYTES)
        try:
            for (_, _, parts), future in zip(planned, opens):
                store = future.result()
                for index, data in parts:
                    in_flight.add(data.nbytes, store[index].write(data, can_reference_source_data_indefinitely=True))
            in_flight.drain()
        except BaseException as e:
            # Let every started write settle before the caller removes the folder: one still running
            # would create files in it again (a full disk fails some writes, not all at once).
            started: list[Pending] = [*opens, *in_flight.pending()]
            for op in started:
                try:
                    op.result()
                except Exception:
                    pass
            if isinstance(e, Exception) and status_code(e) is not None:
                raise _write_failure(e) from e
            raise


def _write_failure(error: Exception) -> JaxckptError:
    if status_code(error) in _REFUSED:
        return failure("the checkpoint's data store for writing", error)
    # Anything else TensorStore reports while writing is not damage of a checkpoint (none exists yet).
    return StorageError(f"Cannot write the checkpoint's data: {error}", errno.EIO)


def _name(key: str, path: str) -> str:
    return f"the data of {describe(key)} (array {path!r} in the checkpoint)" if key else f"{path!r} in the checkpoint"


def _check_open(key: str, path: str, store: ts.TensorStore, shape: Sequence[int], dtype: str) -> None:
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
    # Version 1 indexes do not record chunk shapes: a chunk (read whole) must at least fit the array.
    chunks = store.chunk_layout.read_chunk.shape or ()  # None for a rank-0 array
    if len(chunks) != len(shape) or any(c is None or c > max(1, n) for c, n in zip(chunks, shape)):
        raise CheckpointCorruptedError(
            f"The stored array of {describe(key) if key else repr(path)} (array {path!r}) claims chunks of shape "
            f"{chunks}, larger than its shape {tuple(shape)}: its zarr.json is damaged or crafted."
        )


class Reader:
    """Reads arrays and pack spans of one checkpoint's data store, many at a time.

    ``strict`` (format version 2 and later): every chunk was written, so a missing one is damage.
    """

    def __init__(self, base: dict[str, Any], *, strict: bool = True) -> None:
        self._base = base
        self._context = _context()
        self._strict = strict

    def _open(self, path: str, metadata: dict[str, Any]) -> Any:
        spec = {**_spec(self._base, path), "metadata": metadata, "fill_missing_data_reads": not self._strict}
        return ts.open(spec, open=True, context=self._context)

    def open_arrays(
        self, requests: Iterable[tuple[str, str, str, Sequence[int], Sequence[int] | None]]
    ) -> dict[str, ts.TensorStore]:
        """Opens each (key, path, stored dtype, shape, chunk shape or None), its zarr.json checked against them."""
        requests = list(requests)
        futures = [
            self._open(path, _metadata(shape, dtype, chunks, checksum=True))
            for _, path, dtype, shape, chunks in requests
        ]
        stores = {}
        for (key, path, dtype, shape, _), future in zip(requests, futures):
            try:
                store = future.result()
            except Exception as e:
                raise failure(_name(key, path), e) from e
            _check_open(key, path, store, shape, dtype)
            stores[key] = store
        return stores

    def read_regions(
        self, key: str, path: str, store: ts.TensorStore, regions: Sequence[tuple[slice, ...]]
    ) -> list[PendingRead]:
        """Starts reading each region into a fresh aligned buffer."""
        return [_read_into(key, path, store[region]) for region in regions]

    def read_pack_spans(
        self, path: str, nbytes: int, chunk: int | None, spans: Sequence[tuple[int, int]]
    ) -> list[PendingRead]:
        """Starts reading byte spans (start, stop) of the pack at ``path`` (``chunk``: bytes per chunk, if known)."""
        try:
            store = self._open(path, _metadata([nbytes], "uint8", None if chunk is None else [chunk], False)).result()
        except Exception as e:
            raise failure(_name("", path), e) from e
        _check_open("", path, store, [nbytes], "uint8")
        return [_read_into("", path, store[a:b]) for a, b in spans]


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-order array whose data starts on a 64-byte boundary.

    On CPU, ``jax.device_put`` of such a buffer aliases it instead of copying, so a restored
    jax.Array costs no second copy of its bytes.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class PendingRead(NamedTuple):
    """A read started by :class:`Reader` into ``buffer``: of the array at ``path``, which holds the
    value of ``key`` ("" for a pack), named by them if it fails."""

    key: str
    path: str
    copy: ts.WriteFutures  # TensorStore's copy of the stored data into ``buffer``
    buffer: np.ndarray

    def result(self) -> np.ndarray:
        """The data, once read; a failure as jaxckpt's error (see :func:`failure`)."""
        try:
            self.copy.result()
        except Exception as e:
            raise failure(_name(self.key, self.path), e) from e
        return self.buffer


def _read_into(key: str, path: str, source: ts.TensorStore) -> PendingRead:
    buffer = aligned_empty(source.shape, source.dtype.numpy_dtype)
    return PendingRead(key, path, ts.array(buffer).write(source), buffer)


# --- foreign arrays: zarr arrays that another library wrote (jaxckpt._formats) ---------------------
#
# The readers of other formats build TensorStore specs (plain dicts) themselves and check every
# field they pass; these functions only run them, and name what failed by ``what`` (the key, the
# file): a missing or damaged chunk is CheckpointCorruptedError, a refusing storage StorageError.

# The cache that OCDBT databases of foreign checkpoints keep their manifest and B-tree nodes in:
# without it every array opened re-reads them (Orbax keeps a model's thousands of arrays in one
# database, so opening each would cost milliseconds). Chunks are still not cached.
_FOREIGN_INDEX_CACHE = "cache_pool#foreign_index"
_FOREIGN_INDEX_CACHE_BYTES = 32 << 20
_FOREIGN_CONTEXT: ts.Context | None = None


def _foreign_context() -> ts.Context:
    global _FOREIGN_CONTEXT
    if _FOREIGN_CONTEXT is None:
        _FOREIGN_CONTEXT = ts.Context(
            {
                "cache_pool": {"total_bytes_limit": 0},
                _FOREIGN_INDEX_CACHE: {"total_bytes_limit": _FOREIGN_INDEX_CACHE_BYTES},
            }
        )
    return _FOREIGN_CONTEXT


def foreign_ocdbt(folder: str) -> dict[str, Any]:
    """The kvstore spec of the OCDBT database in local ``folder`` (its ``manifest.ocdbt``)."""
    return {
        "driver": "ocdbt",
        "base": {"driver": "file", "path": folder.rstrip("/") + "/"},
        "cache_pool": _FOREIGN_INDEX_CACHE,
    }


def read_foreign_files(base: dict[str, Any], requests: Sequence[tuple[str, str]], limit: int) -> list[bytes | None]:
    """The value of each (key, what) under kvstore ``base`` (None where there is none), all read at
    once; one over ``limit`` bytes is refused with CheckpointFormatError naming its ``what``. Only the
    byte past the limit is fetched before that is known, so a crafted huge file costs nothing."""
    try:
        store = ts.KvStore.open(base, context=_foreign_context()).result()
    except Exception as e:
        raise failure(requests[0][1] if requests else "a data store", e) from e
    probes = [store.read(key, byte_range=slice(limit, limit + 1)) for key, _ in requests]
    present = []
    for (_, what), probe in zip(requests, probes):
        try:
            beyond = probe.result()
        except Exception as e:
            if status_code(e) != "OUT_OF_RANGE":  # OUT_OF_RANGE: shorter than the limit
                raise failure(what, e) from e
        else:
            if beyond.state == "missing":
                present.append(False)
                continue
            if beyond.value:
                raise CheckpointFormatError(f"{what} is larger than {limit} bytes: it is damaged or crafted.")
        present.append(True)
    reads = [store.read(key) if here else None for (key, _), here in zip(requests, present)]
    out: list[bytes | None] = []
    for (_, what), read in zip(requests, reads):
        try:
            result = read.result() if read is not None else None
        except Exception as e:
            raise failure(what, e) from e
        out.append(bytes(result.value) if result is not None and result.state == "value" else None)
    return out


def open_foreign_array(spec: dict[str, Any], what: str) -> ts.TensorStore:
    """Open (never create) the array of ``spec``; its metadata must match the constraints in it."""
    try:
        return ts.open(spec, open=True, context=_foreign_context()).result()
    except Exception as e:
        raise failure(what, e) from e


def read_foreign(store: ts.TensorStore, dtype: np.dtype, what: str) -> np.ndarray:
    """The whole array of ``store``, in a fresh aligned buffer of ``dtype`` (the numpy dtype of the
    store's: ml_dtypes' ``bfloat16`` for its ``bfloat16``, which ``store.dtype.numpy_dtype`` is not)."""
    buffer = aligned_empty(store.shape, dtype)
    try:
        ts.array(buffer).write(store).result()
    except Exception as e:
        raise failure(what, e) from e
    return buffer
