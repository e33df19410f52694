"""Array I/O: every byte of array data goes through TensorStore (zarr3 arrays in one OCDBT database).

The only module that imports tensorstore. A checkpoint's arrays live in one OCDBT key-value database
(a handful of files however many arrays it holds):

- a large leaf is its own zarr3 array at ``a/<n>/``, chunked like its shards, each chunk ending in a
  crc32c checksum (the zarr3 ``crc32c`` codec) that TensorStore verifies on every read;
- small leaves are packed, end to end, into 1-D uint8 zarr3 arrays at ``p/<n>/`` (their crc32 is
  in the index), so that ten thousand small leaves cost one write, not ten thousand.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt._errors import CheckpointCorruptedError, JaxckptError
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
# Bytes of writes started but not yet durable.
WRITE_AHEAD_BYTES = 256 << 20
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
    every byte is read once and a cache would only hold a second copy in memory."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    return _CONTEXT


def _spec(base: dict[str, Any], path: str) -> dict[str, Any]:
    """The zarr3 array at ``path`` in the OCDBT database whose files live at kvstore ``base``."""
    return {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base, "path": path + "/"}}


# --- plain key-value access, for index and state files in object stores ------------------------


def _kv(base: dict[str, Any]) -> ts.KvStore:
    return ts.KvStore.open(base, context=_context()).result()


def kv_read(base: dict[str, Any], key: str) -> bytes | None:
    """The value at ``key`` under kvstore ``base``, or None if there is none."""
    result = _kv(base).read(key).result()
    return bytes(result.value) if result.state == "value" else None


def kv_write(base: dict[str, Any], key: str, value: bytes) -> None:
    """Write one value (one object: replaced whole or not at all)."""
    _kv(base).write(key, value).result()


def kv_keys(base: dict[str, Any]) -> list[str]:
    """Every key under kvstore ``base``."""
    return [k.decode("utf-8", "replace") for k in _kv(base).list().result()]


def kv_delete_all(base: dict[str, Any]) -> None:
    """Delete every key under kvstore ``base``."""
    _kv(base).delete_range(ts.KvStore.KeyRange()).result()


def _metadata(shape: Sequence[int], dtype: str, chunks: Sequence[int], checksum: bool) -> dict[str, Any]:
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if checksum:
        codecs.append({"name": "crc32c"})
    return {
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, c) for c in chunks]}},
        "codecs": codecs,
    }


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
        shards: Sequence[int],
        parts: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    ) -> None:
        """Record a zarr3 array of ``shape``, chunked like ``shards``, and the (region, data) to write."""
        stored = stored_dtype(dtype)
        if stored != dtype.name:
            parts = [(index, data.view(stored)) for index, data in parts]
        if math.prod(shape) == 0:
            parts = []
        metadata = _metadata(shape, stored, chunk_shape(shape, shards, dtype.itemsize), checksum=True)
        self._planned.append((path, metadata, list(parts)))

    def add_pack(self, path: str, buffer: np.ndarray) -> None:
        metadata = _metadata([buffer.size], "uint8", [min(buffer.size, PACK_CHUNK_BYTES)], checksum=False)
        self._planned.append((path, metadata, [((slice(None),), buffer)] if buffer.size else []))

    def flush(self) -> None:
        """Create and write everything recorded so far, durably; then forget it."""
        planned, self._planned = self._planned, []
        opens = [
            ts.open({**_spec(self._base, path), "metadata": metadata}, create=True, context=self._context)
            for path, metadata, _ in planned
        ]
        in_flight: deque[tuple[int, Any]] = deque()
        held = 0
        try:
            for (_, _, parts), future in zip(planned, opens):
                store = future.result()
                for index, data in parts:
                    write = store[index].write(data, can_reference_source_data_indefinitely=True)
                    in_flight.append((data.nbytes, write))
                    held += data.nbytes
                    # Bound the bytes in flight: each chunk is encoded (with its checksum) into a buffer
                    # of its own that OCDBT holds until written, so starting every write at once would
                    # hold the checkpoint twice.
                    while held > WRITE_AHEAD_BYTES and len(in_flight) > 1:
                        size, done = in_flight.popleft()
                        done.result()
                        held -= size
            while in_flight:
                in_flight.popleft()[1].result()
        except BaseException:
            # Let every started write settle before the caller removes the folder: one still running
            # would create files in it again (a full disk fails some writes, not all at once).
            for future in [*opens, *(w for _, w in in_flight)]:
                try:
                    future.result()
                except Exception:
                    pass
            raise


def _corrupted(key: str, path: str, error: Exception) -> CheckpointCorruptedError:
    return CheckpointCorruptedError(
        f"Cannot read the data of {describe(key)} (array {path!r} in the checkpoint): {error}. "
        "The checkpoint's files are damaged or truncated."
    )


class Reader:
    """Reads arrays and pack spans of one checkpoint's data store, many at a time."""

    def __init__(self, base: dict[str, Any]) -> None:
        self._base = base
        self._context = _context()

    def open_arrays(self, requests: Iterable[tuple[str, str, str, Sequence[int]]]) -> dict[str, ts.TensorStore]:
        """Opens each (key, path, stored dtype, shape), checking its metadata against the index."""
        requests = list(requests)
        futures = [ts.open(_spec(self._base, path), open=True, context=self._context) for _, path, _, _ in requests]
        stores = {}
        for (key, path, dtype, shape), future in zip(requests, futures):
            try:
                store = future.result()
            except Exception as e:  # TensorStore reports damage as ValueError and friends
                raise _corrupted(key, path, e) from e
            if list(store.shape) != list(shape) or store.dtype.name != dtype:
                raise CheckpointCorruptedError(
                    f"The stored array of {describe(key)} has shape {tuple(store.shape)} and dtype "
                    f"{store.dtype.name}, but the index says {tuple(shape)} and {dtype}; the checkpoint is inconsistent."
                )
            # Chunks equal to the fill value are not stored, and zarr.json has no checksum: a flipped bit in
            # its fill value would silently turn those chunks into other values. jaxckpt always writes zero.
            fill = store.fill_value
            if fill is not None and np.asarray(fill).tobytes().strip(b"\0"):
                raise CheckpointCorruptedError(
                    f"The stored array of {describe(key)} (array {path!r}) has the fill value {fill}, but jaxckpt "
                    "writes 0: its metadata is damaged, and its chunks of zeros cannot be trusted."
                )
            stores[key] = store
        return stores

    def read_regions(
        self, key: str, path: str, store: ts.TensorStore, regions: Sequence[tuple[slice, ...]]
    ) -> list[Any]:
        """Starts reading each region into a fresh aligned buffer; resolve each with :func:`resolve`."""
        return [_read_into(key, path, store[region]) for region in regions]

    def read_pack_spans(self, path: str, nbytes: int, spans: Sequence[tuple[int, int]]) -> list[Any]:
        """Starts reading byte spans (start, stop) of the pack at ``path``."""
        try:
            store = ts.open(_spec(self._base, path), open=True, context=self._context).result()
        except Exception as e:
            raise _corrupted("", path, e) from e
        if list(store.shape) != [nbytes] or store.dtype.name != "uint8":
            raise CheckpointCorruptedError(
                f"The pack {path!r} is not {nbytes} bytes of uint8; the checkpoint is inconsistent."
            )
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


def _read_into(key: str, path: str, source: ts.TensorStore) -> tuple[str, str, Any, np.ndarray]:
    buffer = aligned_empty(source.shape, source.dtype.numpy_dtype)
    return key, path, ts.array(buffer).write(source), buffer


def resolve(pending: Any) -> np.ndarray:
    """The data of a read started by :class:`Reader` (or of an object with ``result()``)."""
    key, path, future, *buffer = pending
    try:
        result = future.result()
    except JaxckptError:
        raise
    except Exception as e:
        raise _corrupted(key, path, e) from e
    return buffer[0] if buffer else result
