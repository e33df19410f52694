"""TensorStore's key-value stores (object stores such as ``s3://`` and ``gs://``, and ``memory://``):
whole values read, written, listed and deleted, for the index, state files and markers there; the
one TensorStore context of the process; deadlines and retries of bucket requests; and TensorStore's
errors as jaxckpt's.

**Deadlines.** Every bucket operation has one, so that no save, restore or ``ls`` waits without end
on an endpoint that is down, refuses connections or never answers:

- ``JAXCKPT_BUCKET_TIMEOUT`` (seconds, default 60): the deadline of one operation on the index, a
  state file, a marker, a listing, a deletion, or of opening an array; an operation on data (an
  array's shard, a pack) has that plus one second per MiB it moves. Past it the operation is
  cancelled and a :class:`StorageError` names the URL, the endpoint and what to set.
- ``JAXCKPT_BUCKET_RETRIES`` (default 8): attempts of one request. TensorStore retries what may pass
  (HTTP 429 and 5xx, connection refused or reset, timeouts) with exponential backoff from 0.25 s, the
  delay capped at a twelfth of the deadline (at most 32 s), so that a request that keeps failing
  reports its own cause (a 503, a refused connection) before the deadline would cut it short.
- TensorStore's HTTP client gives up connecting after a sixth of the deadline (at most 10 s) and a
  transfer that moves under 256 bytes/s for half of it (at most 60 s); set
  ``TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS``, ``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS`` and
  ``TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES`` to choose otherwise.

All are read once, when jaxckpt first opens a store. A save that fails or times out publishes
nothing: only its ``index.json``, written last, makes it a checkpoint; its data is removed (best
effort) or recognised by the next save there as an interrupted save's leftovers.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from jaxckpt._errors import CheckpointCorruptedError, JaxckptError, StorageError

# The process's context, and the settings it was made with (one value, so that they never disagree).
_MADE: tuple[ts.Context, Settings] | None = None

TIMEOUT_VARIABLE = "JAXCKPT_BUCKET_TIMEOUT"
RETRIES_VARIABLE = "JAXCKPT_BUCKET_RETRIES"
DEFAULT_TIMEOUT = 60.0
DEFAULT_RETRIES = 8
DATA_SECONDS_PER_MIB = 1.0  # a data operation's deadline grows by this, for the bytes it moves
_FIRST_DELAY = 0.25  # seconds before the first retry


@dataclasses.dataclass(frozen=True)
class Settings:
    """The deadline (seconds) of a bucket operation on metadata, and the attempts of one request."""

    timeout: float = DEFAULT_TIMEOUT
    retries: int = DEFAULT_RETRIES

    def data_timeout(self, nbytes: int) -> float:
        """The deadline of an operation that moves ``nbytes`` bytes of data."""
        return self.timeout + DATA_SECONDS_PER_MIB * nbytes / (1 << 20)

    def retry_resources(self) -> dict[str, Any]:
        """TensorStore's ``s3_request_retries`` and ``gcs_request_retries`` context resources."""
        max_delay = min(32.0, self.timeout / 12)
        first = min(_FIRST_DELAY, max_delay)
        retry = {"max_retries": self.retries, "initial_delay": f"{first:.3f}s", "max_delay": f"{max_delay:.3f}s"}
        return {"s3_request_retries": retry, "gcs_request_retries": retry}

    def curl_defaults(self) -> dict[str, str]:
        """TensorStore's HTTP client settings (environment variables), where the user set none."""
        return {
            "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS": str(max(1, min(10, round(self.timeout / 6)))),
            "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": str(max(1, min(60, round(self.timeout / 2)))),
            "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "256",
        }


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings in ``environ`` (``os.environ`` by default); a malformed one is a ValueError naming it."""
    env = os.environ if environ is None else environ
    timeout, retries = DEFAULT_TIMEOUT, DEFAULT_RETRIES
    text = env.get(TIMEOUT_VARIABLE, "").strip()
    if text:
        try:
            timeout = float(text)
        except ValueError:
            timeout = math.nan
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(
                f"{TIMEOUT_VARIABLE}={text!r}: give the deadline of a bucket operation in seconds, over 0."
            )
    text = env.get(RETRIES_VARIABLE, "").strip()
    if text:
        if not (text.isdigit() and int(text) >= 1):
            raise ValueError(
                f"{RETRIES_VARIABLE}={text!r}: give the attempts of one bucket request, a whole number of 1 or more."
            )
        retries = int(text)
    return Settings(timeout, retries)


def current() -> Settings:
    """The settings of this process's context (read when it was made)."""
    context()
    assert _MADE is not None
    return _MADE[1]


def context() -> ts.Context:
    """One context for the process: a ``memory://`` store lives in its context, and no cache, since
    every byte is read once and a cache would only hold a second copy in memory. ``file_io_sync``
    (fsync of every file written) is TensorStore's default today; it is set here because a checkpoint
    is published as durable, and a changed default must not silently break that. Bucket requests are
    retried as :class:`Settings` says (module docstring)."""
    global _MADE
    if _MADE is None:
        chosen = settings()
        for name, value in chosen.curl_defaults().items():
            # Read by TensorStore when it makes its HTTP client, at the first request; the user's win.
            os.environ.setdefault(name, value)
        spec = {"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": True, **chosen.retry_resources()}
        _MADE = (ts.Context(spec), chosen)
    return _MADE[0]


def store_url(base: Mapping[str, Any], key: str = "") -> str:
    """The URL of ``key`` under kvstore ``base``, as a user wrote it (``s3://bucket/path/key``), with
    the endpoint it is reached at when not the provider's own."""
    driver, path = base.get("driver"), str(base.get("path", "")) + key
    if driver == "s3":
        url = f"s3://{base.get('bucket')}/{path}"
        endpoint = base.get("endpoint")
    elif driver == "gcs":
        url = f"gs://{base.get('bucket')}/{path}"
        endpoint = base.get("endpoint") or os.environ.get("STORAGE_EMULATOR_HOST")
    elif driver == "memory":
        return f"memory://{path}"
    else:
        return path
    return f"{url} (at {endpoint})" if endpoint else url


def _hint(base: Mapping[str, Any] | None) -> str:
    """What to set, for a bucket that failed."""
    driver = base.get("driver") if base is not None else None
    if driver == "s3":
        return (
            " Check the endpoint (AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3 for an S3-compatible store), the region "
            "(AWS_REGION) and the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, with AWS_SESSION_TOKEN "
            "for temporary ones, or AWS_PROFILE)."
        )
    if driver == "gcs":
        return (
            " Check the endpoint (STORAGE_EMULATOR_HOST for an emulator) and the credentials "
            "(GOOGLE_APPLICATION_CREDENTIALS, or `gcloud auth application-default login`)."
        )
    return ""


def result(future: Any, what: str, base: Mapping[str, Any] | None, key: str = "", seconds: float | None = None) -> Any:
    """``future``'s result within the deadline (:func:`current`'s, or ``seconds``); past it the
    operation is cancelled (TensorStore stops retrying it) and a :class:`StorageError` says so.
    TensorStore's own errors pass through, for the caller to map (:func:`failure`)."""
    limit = current().timeout if seconds is None else seconds
    try:
        return future.result(timeout=limit)
    except TimeoutError:
        future.cancel()
        where = f" at {store_url(base, key)}" if base is not None else ""
        raise StorageError(
            f"Cannot access {what}{where}: no answer within {limit:g} s.{_hint(base)} On a slow or busy link, set "
            f"{TIMEOUT_VARIABLE} (seconds; now {current().timeout:g}) to wait longer.",
            errno.ETIMEDOUT,
        ) from None


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


# What S3 (NoSuchBucket) and GCS ("The specified bucket does not exist.") answer for a missing bucket.
_NO_BUCKET = "bucket does not exist"


def status_code(error: BaseException) -> str | None:
    """The status code TensorStore put in front of its message (``NOT_FOUND``...), or None."""
    code = str(error).split(":", 1)[0]
    return code if code.isupper() and code.replace("_", "").isalpha() else None


def failure(what: str, error: Exception, base: Mapping[str, Any] | None = None, key: str = "") -> JaxckptError:
    """The jaxckpt error for a TensorStore failure while reading or writing ``what`` (``key`` under
    kvstore ``base``, when known: named by its URL)."""
    if isinstance(error, JaxckptError):
        return error
    code = status_code(error)
    bucket = base is not None and base.get("driver") in ("s3", "gcs")
    where = f" at {store_url(base, key)}" if base is not None and bucket else ""
    if code in REFUSED:
        number = REFUSED[code]
        if code == "RESOURCE_EXHAUSTED" and "space" not in str(error).lower():
            number = errno.ENOMEM
        return StorageError(
            f"Cannot access {what}{where}: the storage refused ({error}).{_hint(base)} The checkpoint may be intact.",
            number,
        )
    if code == "NOT_FOUND" and _NO_BUCKET in str(error):
        return StorageError(
            f"Cannot access {what}{where}: the bucket {base.get('bucket') if base else ''!r} does not exist "
            f"({error}). Create it, or check the bucket's name and the endpoint.{_hint(base)}",
            errno.ENOENT,
        )
    if code == "NOT_FOUND":
        return CheckpointCorruptedError(
            f"Cannot read {what}: data is missing from the checkpoint ({error}). Files or chunks of it were "
            "deleted, or it is being deleted now."
        )
    return CheckpointCorruptedError(f"Cannot read {what}: {error}. The checkpoint's files are damaged or truncated.")


# --- plain key-value access, for index and state files in object stores ------------------------


def _kv(base: dict[str, Any], what: str, key: str = "") -> ts.KvStore:
    try:
        return result(ts.KvStore.open(base, context=context()), what, base, key)
    except Exception as e:
        raise failure(what, e, base, key) from e


def _kv_call(what: str, base: dict[str, Any], key: str, call: Any) -> Any:
    """``call(store)``'s future's result within the deadline, TensorStore's errors as jaxckpt's."""
    try:
        return result(call(_kv(base, what, key)), what, base, key)
    except Exception as e:  # TensorStore reports storage failures as ValueError with a status code
        raise failure(what, e, base, key) from e


def kv_read(base: dict[str, Any], key: str) -> bytes | None:
    """The value at ``key`` under kvstore ``base``, or None if there is none."""
    read = _kv_call(repr(key), base, key, lambda kv: kv.read(key))
    return bytes(read.value) if read.state == "value" else None


def kv_exceeds(base: dict[str, Any], key: str, limit: int) -> bool | None:
    """Whether the value at ``key`` is over ``limit`` bytes (None if there is none), fetching one byte:
    the one just past the limit, present only in a larger value."""
    store = _kv(base, repr(key), key)
    try:
        beyond = result(store.read(key, byte_range=slice(limit, limit + 1)), repr(key), base, key)
    except Exception as e:
        if status_code(e) == "OUT_OF_RANGE":  # shorter than the limit
            return False
        raise failure(repr(key), e, base, key) from e
    if beyond.state == "missing":
        return None
    return bool(beyond.value)


def kv_write(base: dict[str, Any], key: str, value: bytes | bytearray) -> None:
    """Write one value (one object: replaced whole or not at all)."""
    _kv_call(repr(key), base, key, lambda kv: kv.write(key, value))


def kv_delete(base: dict[str, Any], key: str) -> None:
    """Delete the value at ``key`` (if any): one request (a range delete lists the range first)."""
    _kv_call(repr(key), base, key, lambda kv: kv.write(key, None))


def kv_keys(base: dict[str, Any]) -> list[str]:
    """Every key under kvstore ``base``."""
    return [k.decode("utf-8", "replace") for k in _kv_call("a listing", base, "", lambda kv: kv.list())]


def kv_delete_all(base: dict[str, Any]) -> None:
    """Delete every key under kvstore ``base``."""
    _kv_call("a deletion", base, "", lambda kv: kv.delete_range(ts.KvStore.KeyRange()))
