"""Where checkpoints live: local folders and TensorStore kvstores; small files and listings there.

How a save appears atomically there is :mod:`jaxckpt.saving.staging`.

Every path jaxckpt takes is a :class:`Location`: a local folder (``ckpts/ckpt-3``, ``file://...``), or a
prefix in a TensorStore kvstore: ``s3://bucket/path``, ``gs://bucket/path``, ``memory://path``.

Local paths go to TensorStore's file driver, which reads ``\\`` as a separator: such paths are refused,
as are paths that are not valid UTF-8 and names longer than 255 bytes.

S3 follows the standard AWS environment: credentials, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, and
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for S3-compatible stores. With ``AWS_ACCESS_KEY_ID`` set,
the credentials are taken from the environment alone (``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``):
TensorStore's default chain would also read ``~/.aws/config`` and ``~/.aws/credentials`` and log an error
on stderr for each missing one, at every store opened. Without it, that chain finds them (a profile,
the instance's role).

Google Cloud Storage follows Google's client libraries: Application Default Credentials, and
``STORAGE_EMULATOR_HOST`` (``http://127.0.0.1:9023`` or ``127.0.0.1:9023``) for an emulator or
another endpoint, reached without credentials. TensorStore (0.1.86) has no endpoint or credentials
in its gcs spec: it reads ``TENSORSTORE_GCS_HTTP_URL`` when it opens a bucket and keeps that driver
(in jaxckpt's one context), and looks up credentials once per process, at its first GCS request
(``GOOGLE_AUTH_TOKEN_FOR_TESTING`` first). So with ``STORAGE_EMULATOR_HOST`` set, the first ``gs://``
path sets ``TENSORSTORE_GCS_HTTP_URL`` to it (unless it is set already) and
``GOOGLE_AUTH_TOKEN_FOR_TESTING`` to a placeholder token, which keeps a user's credentials away from
the emulator and skips the credential search (which probes the GCE metadata server). One process
talks to one GCS endpoint: a ``gs://`` path whose endpoint differs from the one the process already
uses (``STORAGE_EMULATOR_HOST`` set, changed or unset after the first GCS request, or set to another
URL than ``TENSORSTORE_GCS_HTTP_URL``) is a :class:`StorageError`, never a request to the wrong server.

A bucket's name is checked here, before any request, against the provider's rules (S3: 3 to 63
lowercase letters, digits, dots and hyphens; GCS: also underscores, and up to 222 characters in
dot-separated parts of at most 63): a name that no bucket can have is refused with the rule it breaks.

How long a bucket operation may take, and how its requests are retried: :mod:`jaxckpt.storage.kvstore`
(``JAXCKPT_BUCKET_TIMEOUT``, ``JAXCKPT_BUCKET_RETRIES``).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any

import tensorstore as ts

from jaxckpt._errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    NotACheckpointError,
    StorageError,
    UnsupportedValueError,
)
from jaxckpt.format.records import INDEX_FILE
from jaxckpt.storage import kvstore as _kvstore
from jaxckpt.storage import local_files
from jaxckpt.storage.local_tree import remove_local

TMP_MARK = ".tmp-"  # a file being replaced atomically: ".<name>.tmp-<random>"
NAME_MAX = 255  # bytes in one path component, on every filesystem jaxckpt expects
STATE_READ_LIMIT = 16 << 20  # small files: a manager's state file
INDEX_READ_LIMIT = 1 << 30  # an index: about 10 million leaves

# A path as users give it (jaxckpt's calls take either).
PathLike = str | os.PathLike[str]


@dataclasses.dataclass(frozen=True)
class Location:
    """A folder: local (``local`` set) or a prefix in a kvstore (``kv`` set, its path ending in ``/``)."""

    text: str
    local: Path | None = None
    kv: dict[str, Any] | None = None

    def __truediv__(self, name: str) -> Location:
        text = self.text.rstrip("/") + "/" + name
        if self.local is not None:
            return Location(text, local=self.local / name)
        return Location(text, kv={**self.store, "path": self.store["path"] + name + "/"})

    def __str__(self) -> str:
        return self.text

    @property
    def name(self) -> str:
        return self.text.rstrip("/").rsplit("/", 1)[-1]

    def spec(self) -> dict[str, Any]:
        """The TensorStore kvstore spec of this folder."""
        if self.local is not None:
            # TensorStore refuses ".." in a file path, which a user's path may hold ("ckpts/../ckpts/ckpt-1").
            local = self.local.resolve() if ".." in self.local.parts else self.local
            _check_local(str(local), self.text)
            return {"driver": "file", "path": str(local) + "/"}
        return dict(self.store)

    @property
    def store(self) -> dict[str, Any]:
        """The kvstore spec of a prefix in an object store; a local folder has none."""
        if self.kv is None:
            raise ValueError(f"{self.text!r} is a local folder, not a prefix in a kvstore")
        return self.kv


def _bad_path(text: Any, why: str) -> UnsupportedValueError:
    return UnsupportedValueError(f"jaxckpt cannot use the path {text!r}: {why}")


def _check_local(local: str, text: str) -> None:
    """Refuse a local path that TensorStore's file driver would not write where it says.

    The file driver reads ``\\`` as a separator (so ``run\\lr=0.1/ckpt`` would put the arrays in
    ``run/lr=0.1/ckpt``), and paths travel as UTF-8; every other character is written as given.
    """
    if "\\" in local:
        raise _bad_path(
            text, "it contains a backslash, which TensorStore reads as a folder separator. Rename the folder."
        )
    try:
        encoded = local.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad_path(text, "it is not valid UTF-8 (undecodable bytes in a file name). Rename the folder.") from None
    long = [part for part in encoded.split(b"/") if len(part) > NAME_MAX]
    if long:
        raise _bad_path(text, f"the name {long[0][:40]!r}... is {len(long[0])} bytes long; at most {NAME_MAX} fit.")


def _bucket_and_path(rest: str, text: str) -> tuple[str, str]:
    bucket, _, path = rest.partition("/")
    if not bucket:
        raise ValueError(f"{text!r} names no bucket; write it as scheme://bucket/path.")
    problem = bucket_name_problem(text.split("://", 1)[0], bucket)
    if problem:
        raise _bad_path(text, f"{bucket!r} cannot be a bucket's name: {problem}.")
    path = path.strip("/")
    return bucket, path + "/" if path else ""


_IP_ADDRESS = re.compile(r"[0-9]{1,3}(\.[0-9]{1,3}){3}")


def bucket_name_problem(scheme: str, bucket: str) -> str | None:
    """Which naming rule of the provider ``bucket`` breaks (S3's for ``s3``, Google Cloud Storage's for
    ``gs``), or None. S3-compatible stores follow S3's; the few S3 buckets named before 2018 with
    capitals or underscores (us-east-1 allowed them) are refused too."""
    gcs = scheme in ("gs", "gcs")
    allowed = "lowercase letters, digits, dots, hyphens" + (" and underscores" if gcs else "")
    if not re.fullmatch(r"[a-z0-9._-]+" if gcs else r"[a-z0-9.-]+", bucket):
        return f"a bucket's name holds only {allowed}"
    if gcs and "." in bucket:
        if len(bucket) > 222:
            return "a name with dots is at most 222 characters long"
        long = [part for part in bucket.split(".") if len(part) > 63]
        if long:
            return (
                f"each dot-separated part of a name is at most 63 characters long ({long[0][:20]}... is {len(long[0])})"
            )
        if len(bucket) < 3:
            return "a name is 3 to 63 characters long"
    elif not 3 <= len(bucket) <= 63:
        return "a name is 3 to 63 characters long" + (" (or up to 222 with dots)" if gcs else "")
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return "a name must begin and end with a letter or digit"
    if ".." in bucket:
        return "a name has no two dots in a row"
    if _IP_ADDRESS.fullmatch(bucket):
        return "a name is not an IP address"
    if gcs and bucket.startswith("goog"):
        return 'a name does not begin with "goog"'
    if gcs and "google" in bucket:
        return 'a name does not contain "google"'
    return None


def location(path: str | os.PathLike[str] | Location) -> Location:
    """Parse a path or URL given by a user."""
    if isinstance(path, Location):
        return path
    if not isinstance(path, (str, os.PathLike)):
        raise _bad_path(path, f"a path is a str or os.PathLike, not {type(path).__name__}.")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise _bad_path(text, "a path is a str, not bytes. Pass os.fsdecode(path).")
    if "://" not in text or text.startswith("file://"):
        local = Path(text[len("file://") :] if text.startswith("file://") else text).absolute()
        _check_local(str(local), text)
        return Location(text, local=local)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad_path(text, "it is not valid UTF-8.") from None
    scheme, rest = text.split("://", 1)
    if scheme == "s3":
        bucket, key = _bucket_and_path(rest, text)
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
        if os.environ.get("AWS_ACCESS_KEY_ID"):  # quiet: see the module's docstring
            spec["aws_credentials"] = {"type": "environment"}
        return Location(text, kv=spec)
    if scheme in ("gs", "gcs"):
        bucket, key = _bucket_and_path(rest, text)
        _use_gcs_endpoint(text)
        return Location(text, kv={"driver": "gcs", "bucket": bucket, "path": key})
    if scheme == "memory":
        path = rest.strip("/")
        return Location(text, kv={"driver": "memory", "path": path + "/" if path else ""})
    raise NotImplementedError(
        f"Storage scheme {scheme!r} in {text!r} is not supported; use a local path, file://, s3://, gs:// or memory://."
    )


# --- which GCS endpoint TensorStore talks to ---------------------------------------------------

GCS_DEFAULT_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_TOKEN = "jaxckpt-storage-emulator"  # sent as a bearer token; an emulator ignores it
_gcs_emulator_set: str | None = None  # the endpoint this module put in TENSORSTORE_GCS_HTTP_URL


def _gcs_used() -> bool:
    """Whether TensorStore made a GCS request in this process (after which its endpoint and
    credentials are fixed), from its request counters."""
    try:
        return any(
            value.get("value", 0)
            for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/gcs/")
            for value in metric.get("values", [])
        )
    except AttributeError:  # a TensorStore without the counters: assume the worst
        return True


def _use_gcs_endpoint(text: str) -> None:
    """Point TensorStore's gcs driver at ``STORAGE_EMULATOR_HOST`` if set (see the module's docstring),
    or refuse a ``gs://`` path that would reach another endpoint than the process's."""
    global _gcs_emulator_set
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    wanted = (host if "://" in host else "http://" + host).rstrip("/") if host else None
    current = os.environ.get("TENSORSTORE_GCS_HTTP_URL")
    ours = current is not None and current == _gcs_emulator_set
    if wanted is None and not ours:
        return  # Google Cloud Storage, or the user's own TENSORSTORE_GCS_HTTP_URL
    if wanted is not None and current is not None and current.rstrip("/") == wanted:
        return
    used = _gcs_used()
    if ours and not used:  # set here for an earlier STORAGE_EMULATOR_HOST, no request since: undo
        del os.environ["TENSORSTORE_GCS_HTTP_URL"]
        if os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING") == EMULATOR_TOKEN:
            del os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"]
        current = _gcs_emulator_set = None
    if wanted is None and current is None:
        return
    if wanted is not None and current is None and not used:
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = _gcs_emulator_set = wanted
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", EMULATOR_TOKEN)
        return
    if current is not None and not ours:
        why = f"TENSORSTORE_GCS_HTTP_URL is {current!r}"
    else:
        why = (
            f"this process already made requests to {current or GCS_DEFAULT_ENDPOINT!r}, and TensorStore keeps "
            "its first GCS endpoint and credentials"
        )
    raise StorageError(
        f"Cannot use {text!r}: STORAGE_EMULATOR_HOST is {repr(host) if host else 'unset'}, but {why}. Set "
        "STORAGE_EMULATOR_HOST (or TENSORSTORE_GCS_HTTP_URL) to one endpoint before the process's first gs:// "
        "access, and use another process for another endpoint.",
        errno.EINVAL,
    )


# --- small files and listings --------------------------------------------------------------------


def read_file(
    folder: Location, name: str, limit: int = STATE_READ_LIMIT, pinned: local_files.PinnedFolder | None = None
) -> bytes | None:
    """The bytes of ``name`` in ``folder``, or None if there is no such file; with ``pinned`` (the local
    ``folder`` held open), in that folder, whatever is at its path now.

    Only a regular file (a symlink to one is followed, except with ``pinned``: in a checkpoint, none
    is) of at most ``limit`` bytes is read: a FIFO, a device such as ``/dev/zero``, a folder, a symlink
    in a checkpoint or an oversized file is a :class:`CheckpointFormatError`, never a hang or a read
    without end; a storage that refuses is a :class:`StorageError`.
    """
    where = str(folder / name)
    if folder.local is not None:
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer that never comes.
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
            fd = (
                os.open(folder.local / name, flags)
                if pinned is None
                else local_files.open_beneath(pinned.fd, name, flags)
            )
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointFormatError(
                    f"{where!r} is a symbolic link, or a loop of them; jaxckpt reads only regular files there. "
                    "Replace it with the file jaxckpt wrote, or remove it."
                ) from e
            raise StorageError(f"Cannot read {where!r}: the storage refused ({e}).", e.errno or errno.EIO) from e
        try:  # checked before os.fdopen, which refuses a folder with a Python error of its own
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointFormatError(
                    f"{where!r} is not a regular file ({_file_kind(info.st_mode)}); jaxckpt reads only regular "
                    "files there. Replace it with the file jaxckpt wrote, or remove it."
                )
            if info.st_size > limit:
                raise _too_large(where, info.st_size, limit)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            data = f.read(info.st_size + 1)  # not limit + 1: read() allocates what it is asked for
            if len(data) > info.st_size:  # it grew since fstat
                data += f.read(limit + 1 - len(data))
        if len(data) > limit:
            raise _too_large(where, len(data), limit)
        return data
    exceeds = _kvstore.kv_exceeds(folder.spec(), name, limit)  # so that nothing large is fetched
    if exceeds is None:
        return None
    if exceeds:
        raise _too_large(where, None, limit)
    stored = _kvstore.kv_read(folder.spec(), name)
    if stored is not None and len(stored) > limit:  # replaced by a larger object in between
        raise _too_large(where, len(stored), limit)
    return stored


def _too_large(where: str, size: int | None, limit: int) -> CheckpointFormatError:
    found = f"{size:,} bytes" if size is not None else "more"
    return CheckpointFormatError(
        f"{where!r} holds {found}, over jaxckpt's limit of {limit:,} bytes for that file; it is not a file that "
        "jaxckpt wrote. Replace or remove it."
    )


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a file"


def write_file_atomic(folder: Location, name: str, data: bytes) -> None:
    """Replace ``name`` in ``folder`` whole: a crash leaves the old bytes or the new, durably."""
    if folder.local is None:
        _kvstore.kv_write(folder.spec(), name, data)
        return
    tmp = folder.local / f".{name}{TMP_MARK}{uuid.uuid4().hex[:12]}"
    try:
        write_durable(tmp, data)
        os.replace(tmp, folder.local / name)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise storage_failure(f"Cannot write {str(folder / name)!r}", e, "It holds what it held before.") from e
        raise
    try:
        fsync_dir(folder.local)  # the rename itself must survive a power cut
    except OSError as e:
        raise storage_failure(f"Cannot make {str(folder / name)!r} durable", e, "") from e


def children(folder: Location) -> list[str]:
    """Names of what ``folder`` holds (files and folders); empty if it does not exist."""
    if folder.local is not None:
        try:
            return sorted(os.listdir(folder.local))
        except (FileNotFoundError, NotADirectoryError):
            return []
    return sorted({key.split("/", 1)[0] for key in _kvstore.kv_keys(folder.spec())})


def temp_file_pattern(name: str) -> re.Pattern[str]:
    """The names :func:`write_file_atomic` gives its temp files for ``name``, and no other name."""
    return re.compile(rf"\.{re.escape(name)}{re.escape(TMP_MARK)}[0-9a-f]{{12}}")


def delete_tree(folder: Location) -> None:
    """Remove ``folder`` and what it holds, best effort; a symlink is removed alone, never what it points to."""
    if folder.local is not None:
        remove_local(folder.local)
    else:
        _kvstore.kv_delete_all(folder.spec())


def is_symlink(folder: Location) -> bool:
    """Whether the local ``folder`` is a symlink (a manager never writes, marks or deletes through one)."""
    return folder.local is not None and os.path.islink(folder.local)


# --- checkpoints ---------------------------------------------------------------------------------


def is_checkpoint(path: Location) -> bool:
    if path.local is None:
        # One request, of one byte: whether there is an index, not what it holds (whoever reads it
        # next reads it bounded, and says if it is too large).
        return _kvstore.kv_exceeds(path.spec(), INDEX_FILE, INDEX_READ_LIMIT) is not None
    return (path.local / INDEX_FILE).is_file()


def pin_folder(path: Location) -> local_files.PinnedFolder | None:
    """The local checkpoint folder at ``path`` held open, so that what is read of it is read from it
    alone even if another save replaces it meanwhile (None in a kvstore); or a clear error saying why
    there is none."""
    if path.local is None:
        return None
    local = path.local
    try:
        return local_files.PinnedFolder(str(local))
    except (FileNotFoundError, NotADirectoryError):
        if not local.exists():
            raise CheckpointNotFoundError(f"No checkpoint at {str(local)!r}: the path does not exist.") from None
        if not local.is_dir():
            raise NotACheckpointError(
                f"{str(local)!r} is a file, not a checkpoint (a folder with {INDEX_FILE})."
            ) from None
        raise


def read_index_bytes(path: Location, pinned: local_files.PinnedFolder | None = None) -> bytes:
    """The raw index of the checkpoint at ``path`` (with ``pinned``, see :func:`pin_folder`: of that
    folder), or a clear error saying why there is none."""
    if path.local is not None:
        local = path.local
        if pinned is None:  # pin_folder checks these
            if not local.exists():
                raise CheckpointNotFoundError(f"No checkpoint at {str(local)!r}: the path does not exist.")
            if not local.is_dir():
                raise NotACheckpointError(f"{str(local)!r} is a file, not a checkpoint (a folder with {INDEX_FILE}).")
        try:
            found = os.stat(local / INDEX_FILE) if pinned is None else os.stat(INDEX_FILE, dir_fd=pinned.fd)
        except OSError:
            found = None  # read_file says why
        if found is not None and stat.S_ISDIR(found.st_mode):
            raise NotACheckpointError(f"{str(local)!r} is not a jaxckpt checkpoint: its {INDEX_FILE} is a folder.")
    data = read_file(path, INDEX_FILE, INDEX_READ_LIMIT, pinned)
    if data is not None:
        return data
    raise no_index(path)


def no_index(path: Location) -> CheckpointNotFoundError | NotACheckpointError:
    """The error for ``path``, which has no index: nothing there (a prefix in a kvstore that holds
    nothing), or something that is not a checkpoint."""
    if path.local is None and not children(path):
        maybe = " (or the bucket does not exist)" if path.store.get("driver") == "gcs" else ""  # read as empty there
        return CheckpointNotFoundError(f"No checkpoint at {path.text!r}: nothing is stored under that prefix{maybe}.")
    return NotACheckpointError(
        f"{path.text!r} is not a jaxckpt checkpoint: it has no {INDEX_FILE}. "
        "Nor is it a manager's directory, which holds a state file ('checkpoint') naming its checkpoints."
    )


def write_durable(path: Path, data: bytes | bytearray) -> None:
    """Write the file ``path`` and make its bytes durable; a refusing storage (a full disk, no
    permission) is a :class:`StorageError` naming the file, as for the data a save writes."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise storage_failure(f"Cannot write {str(path)!r}", e, "") from e


def storage_failure(what: str, error: OSError, note: str) -> StorageError:
    """``what`` failed because the storage refused with ``error``: a :class:`StorageError` with its
    errno, saying why and what to do (``note``: what the failure left as it was)."""
    if isinstance(error, StorageError) and isinstance(error.__cause__, OSError):
        error = error.__cause__  # say why once, not "Cannot write X: Cannot write X: ..."
    number = error.errno or errno.EIO
    why = os.strerror(error.errno) if error.errno else str(error)
    return StorageError(
        f"{what}: {why}.{' ' + note if note else ''} Free space on that disk (or make it writable), then try again.",
        number,
    )


def fsync_dir(path: Path) -> None:
    local_files.fsync_path(path)
