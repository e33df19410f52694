"""Other libraries' zarr arrays (Orbax's), opened and read through TensorStore for :mod:`jaxckpt.interop.formats`.

The readers of other formats build TensorStore specs (plain dicts) themselves and check every field
they pass; these functions only run them, and name what failed by ``what`` (the key, the file): a
missing or damaged chunk is CheckpointCorruptedError, a refusing storage StorageError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt._errors import CheckpointFormatError
from jaxckpt.arrays.store_write import aligned_empty, failure, status_code
from jaxckpt.storage import kvstore as _kvstore

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
                **_kvstore.current().retry_resources(),  # buckets: jaxckpt's retries and deadlines
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
        what = requests[0][1] if requests else "a data store"
        store = _kvstore.result(ts.KvStore.open(base, context=_foreign_context()), what, base)
    except Exception as e:
        raise failure(what, e, base) from e
    probes = [store.read(key, byte_range=slice(limit, limit + 1)) for key, _ in requests]
    present = []
    for (_, what), probe in zip(requests, probes):
        try:
            beyond = _kvstore.result(probe, what, base)
        except Exception as e:
            if status_code(e) != "OUT_OF_RANGE":  # OUT_OF_RANGE: shorter than the limit
                raise failure(what, e, base) from e
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
            seconds = _kvstore.current().data_timeout(limit)
            result = _kvstore.result(read, what, base, seconds=seconds) if read is not None else None
        except Exception as e:
            raise failure(what, e, base) from e
        out.append(bytes(result.value) if result is not None and result.state == "value" else None)
    return out


def open_foreign_array(spec: dict[str, Any], what: str) -> ts.TensorStore:
    """Open (never create) the array of ``spec``; its metadata must match the constraints in it."""
    try:
        return _kvstore.result(ts.open(spec, open=True, context=_foreign_context()), what, None)
    except Exception as e:
        raise failure(what, e) from e


def read_foreign(store: ts.TensorStore, dtype: np.dtype, what: str) -> np.ndarray:
    """The whole array of ``store``, in a fresh aligned buffer of ``dtype`` (the numpy dtype of the
    store's: ml_dtypes' ``bfloat16`` for its ``bfloat16``, which ``store.dtype.numpy_dtype`` is not)."""
    buffer = aligned_empty(store.shape, dtype)
    try:
        seconds = _kvstore.current().data_timeout(buffer.nbytes)
        _kvstore.result(ts.array(buffer).write(store), what, None, seconds=seconds)
    except Exception as e:
        raise failure(what, e) from e
    return buffer
