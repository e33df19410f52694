"""TensorStore's key-value stores (object stores such as ``s3://`` and ``gs://``, and ``memory://``):
whole values read, written, listed and deleted, for the index, state files and markers there; the
one TensorStore context of the process; and TensorStore's errors as jaxckpt's.
"""

from __future__ import annotations

import errno
from typing import Any

import tensorstore as ts

from jaxckpt._errors import CheckpointCorruptedError, JaxckptError, StorageError

_CONTEXT: ts.Context | None = None


def context() -> ts.Context:
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
REFUSED = {
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
    if code in REFUSED:
        number = REFUSED[code]
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


# --- plain key-value access, for index and state files in object stores ------------------------


def _kv(base: dict[str, Any]) -> ts.KvStore:
    return ts.KvStore.open(base, context=context()).result()


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
    """Delete the value at ``key`` (if any): one request (a range delete lists the range first)."""
    _kv_call(repr(key), lambda: _kv(base).write(key, None).result())


def kv_keys(base: dict[str, Any]) -> list[str]:
    """Every key under kvstore ``base``."""
    return [k.decode("utf-8", "replace") for k in _kv_call("a listing", lambda: _kv(base).list().result())]


def kv_delete_all(base: dict[str, Any]) -> None:
    """Delete every key under kvstore ``base``."""
    _kv_call("a deletion", lambda: _kv(base).delete_range(ts.KvStore.KeyRange()).result())
