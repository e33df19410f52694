"""Where checkpoints live: local folders and TensorStore kvstores, and how a checkpoint appears atomically.

Every path jaxckpt takes is a :class:`Location`: a local folder (``ckpts/ckpt-3``, ``file://...``), or a
prefix in a TensorStore kvstore: ``s3://bucket/path``, ``gs://bucket/path``, ``memory://path``.

**Local folders.** A save writes everything into a hidden staging folder beside the destination
(``.<name>.partial-<token>``), makes every file and folder in it durable, and renames it to the
destination in one step (replacing an old checkpoint swaps the two folders in one step on Linux).
A crash leaves no checkpoint or a whole one; leftover staging folders are never mistaken for
checkpoints, since a checkpoint is a folder with an index.

A staging folder holds an owner file that its save keeps locked (``flock``) while it runs; the kernel
releases the lock when the process dies, so the next save to the same destination removes staging
folders that no live save owns (a save interrupted by Ctrl-C or killed), and never a running one's.

Local paths go to TensorStore's file driver, which reads ``\\`` as a separator: such paths are refused,
as are paths that are not valid UTF-8 and names longer than 255 bytes.

**Object stores.** There is no rename. A save first writes a marker object (:data:`SAVE_MARKER`)
under the destination, then the data, then the index: one object, which appears whole or not at
all, so the index is the commit; the marker is deleted once the index is written. Leftovers of an
interrupted save (the marker and data stores, no index) are not a checkpoint, and the next save there
removes them. A prefix that holds anything else without an index (a user's ``data/`` folder, or data
whose marker is gone) is refused, never deleted. Replacing a checkpoint (``overwrite=True``) deletes
the old one first, so it is not atomic there.

S3 follows the standard AWS environment: credentials, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, and
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for S3-compatible stores.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
import sys
import uuid
from pathlib import Path
from typing import Any

from jaxckpt import _multihost, _tensorstore
from jaxckpt._errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    NotACheckpointError,
    UnsupportedValueError,
)
from jaxckpt._format import INDEX_FILE

PARTIAL_MARK = ".partial-"  # hidden staging folders: ".<name>.partial-<token>"
REPLACED_MARK = ".replaced-"  # an overwritten checkpoint on its way out: ".<name>.replaced-<random>"
_TMP_MARK = ".tmp-"  # a file being replaced atomically: ".<name>.tmp-<random>"
SAVE_MARKER = ".jaxckpt-save"  # object stores: written first by a save, deleted once its index is written
_OWNER_FILE = ".jaxckpt-owner"  # in a staging folder: locked by the save that writes it, for as long as it runs
NAME_MAX = 255  # bytes in one path component, on every filesystem jaxckpt expects
# Object-store keys an interrupted save can leave: its marker, and OCDBT's own keys in its data stores.
_LEFTOVER_KEY = re.compile(rf"{re.escape(SAVE_MARKER)}|data(\.p[1-9][0-9]*)?/(manifest\.[^/]+|d/.+)")
STATE_READ_LIMIT = 16 << 20  # small files: a manager's state file
INDEX_READ_LIMIT = 1 << 30  # an index: about 10 million leaves


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
        return Location(text, kv={**self.kv, "path": self.kv["path"] + name + "/"})

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
        return dict(self.kv)


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
    path = path.strip("/")
    return bucket, path + "/" if path else ""


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
        return Location(text, kv=spec)
    if scheme in ("gs", "gcs"):
        bucket, key = _bucket_and_path(rest, text)
        return Location(text, kv={"driver": "gcs", "bucket": bucket, "path": key})
    if scheme == "memory":
        path = rest.strip("/")
        return Location(text, kv={"driver": "memory", "path": path + "/" if path else ""})
    raise NotImplementedError(
        f"Storage scheme {scheme!r} in {text!r} is not supported; use a local path, file://, s3://, gs:// or memory://."
    )


# --- small files and listings --------------------------------------------------------------------


def read_file(folder: Location, name: str, limit: int = STATE_READ_LIMIT) -> bytes | None:
    """The bytes of ``name`` in ``folder``, or None if there is no such file.

    Only a regular file (a symlink to one is followed) of at most ``limit`` bytes is read: a FIFO, a
    device such as ``/dev/zero`` or an oversized file is a :class:`CheckpointFormatError`, never a hang
    or a read without end.
    """
    where = str(folder / name)
    if folder.local is not None:
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer that never comes.
            fd = os.open(folder.local / name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointFormatError(
                    f"{where!r} is not a regular file ({_file_kind(info.st_mode)}); jaxckpt reads only regular "
                    "files there. Replace it with the file jaxckpt wrote, or remove it."
                )
            if info.st_size > limit:
                raise _too_large(where, info.st_size, limit)
            data = f.read(info.st_size + 1)  # not limit + 1: read() allocates what it is asked for
            if len(data) > info.st_size:  # it grew since fstat
                data += f.read(limit + 1 - len(data))
        if len(data) > limit:
            raise _too_large(where, len(data), limit)
        return data
    exceeds = _tensorstore.kv_exceeds(folder.spec(), name, limit)  # so that nothing large is fetched
    if exceeds is None:
        return None
    if exceeds:
        raise _too_large(where, None, limit)
    data = _tensorstore.kv_read(folder.spec(), name)
    if data is not None and len(data) > limit:  # replaced by a larger object in between
        raise _too_large(where, len(data), limit)
    return data


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
        _tensorstore.kv_write(folder.spec(), name, data)
        return
    tmp = folder.local / f".{name}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
    try:
        write_durable(tmp, data)
        os.replace(tmp, folder.local / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(folder.local)  # the rename itself must survive a power cut


def children(folder: Location) -> list[str]:
    """Names of what ``folder`` holds (files and folders); empty if it does not exist."""
    if folder.local is not None:
        try:
            return sorted(os.listdir(folder.local))
        except (FileNotFoundError, NotADirectoryError):
            return []
    return sorted({key.split("/", 1)[0] for key in _tensorstore.kv_keys(folder.spec())})


def temp_file_pattern(name: str) -> re.Pattern[str]:
    """The names :func:`write_file_atomic` gives its temp files for ``name``, and no other name."""
    return re.compile(rf"\.{re.escape(name)}{re.escape(_TMP_MARK)}[0-9a-f]{{12}}")


def delete_tree(folder: Location) -> None:
    if folder.local is not None:
        shutil.rmtree(folder.local, ignore_errors=True)
    else:
        _tensorstore.kv_delete_all(folder.spec())


def total_bytes(folder: Location) -> int | None:
    """Bytes of every file under a local folder (as ``du --apparent-size``); None elsewhere or if absent."""
    if folder.local is None or not folder.local.is_dir():
        return None
    total = 0
    for parent, _, files in os.walk(folder.local):
        for name in files:
            try:
                total += (Path(parent) / name).stat().st_size
            except OSError:  # removed while we looked (a manager's retention at work)
                pass
    return total


# --- checkpoints ---------------------------------------------------------------------------------


def is_checkpoint(path: Location) -> bool:
    if path.local is None:
        return read_file(path, INDEX_FILE, INDEX_READ_LIMIT) is not None
    return (path.local / INDEX_FILE).is_file()


def read_index_bytes(path: Location) -> bytes:
    """The raw index of the checkpoint at ``path``, or a clear error saying why there is none."""
    if path.local is not None:
        local = path.local
        if not local.exists():
            raise CheckpointNotFoundError(f"No checkpoint at {str(local)!r}: the path does not exist.")
        if not local.is_dir():
            raise NotACheckpointError(f"{str(local)!r} is a file, not a checkpoint (a folder with {INDEX_FILE}).")
        if (local / INDEX_FILE).is_dir():
            raise NotACheckpointError(f"{str(local)!r} is not a jaxckpt checkpoint: its {INDEX_FILE} is a folder.")
    data = read_file(path, INDEX_FILE, INDEX_READ_LIMIT)
    if data is not None:
        return data
    if path.local is None and not children(path):
        raise CheckpointNotFoundError(f"No checkpoint at {path.text!r}: nothing is stored under that prefix.")
    raise NotACheckpointError(
        f"{path.text!r} is not a jaxckpt checkpoint: it has no {INDEX_FILE}. "
        "If it is a manager's directory, pass one of its checkpoints (see jaxckpt.latest_checkpoint)."
    )


def _only_leftovers(path: Location) -> bool:
    """Object stores: whether ``path`` holds exactly what an interrupted save leaves: its marker, and
    data stores with OCDBT's keys. Without the marker, data is not provably jaxckpt's (a user's
    ``data/`` folder), so it is never taken for leftovers."""
    keys = _tensorstore.kv_keys(path.spec())
    return SAVE_MARKER in keys and all(_LEFTOVER_KEY.fullmatch(k) for k in keys)


def _first_file_above(local: Path) -> Path | None:
    """The nearest existing ancestor of ``local`` if it is not a folder (a file where a folder must go)."""
    for parent in local.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_writable(path: Location, overwrite: bool) -> None:
    """Refuse early to replace what a save must not replace."""
    if path.local is not None:
        blocker = _first_file_above(path.local)
        if blocker is not None:
            raise CheckpointExistsError(
                f"Cannot save at {path.text!r}: {str(blocker)!r} is a file, not a folder. Choose another path."
            )
    if is_checkpoint(path):
        if overwrite:
            return
        raise CheckpointExistsError(
            f"A checkpoint already exists at {path.text!r}; pass overwrite=True to replace it, or save elsewhere."
        )
    if path.local is not None:
        if not path.local.exists() or (path.local.is_dir() and not any(path.local.iterdir())):
            return
    elif not children(path) or _only_leftovers(path):
        return
    raise CheckpointExistsError(
        f"{path.text!r} exists and is not a jaxckpt checkpoint; jaxckpt will not replace it. Choose another path."
        + (
            ""
            if path.local is not None
            else f" (It holds no {INDEX_FILE} and no {SAVE_MARKER} marker of an interrupted jaxckpt save, so what is "
            "there is not provably jaxckpt's; remove it yourself if it is.)"
        )
    )


def clear_for_save(path: Location) -> None:
    """Object stores, primary process only: remove what a save there will replace (an old checkpoint
    when overwriting, or an interrupted save's leftovers), then write the marker that makes this
    save's data recognisable as jaxckpt's, before anything else is written."""
    if path.local is not None:
        return
    if children(path):
        if not (is_checkpoint(path) or _only_leftovers(path)):  # it changed since check_writable
            check_writable(path, overwrite=False)
        delete_tree(path)
    _tensorstore.kv_write(path.spec(), SAVE_MARKER, b"an unfinished jaxckpt save; it has no index.json yet\n")


def _staging_stem(name: str, mark: str = PARTIAL_MARK) -> str:
    """The start of the hidden folder names beside a destination named ``name``: ``.<name><mark>``.

    Shortened with a hash of the name where the whole name (a 12-character token follows) would not
    fit in NAME_MAX bytes.
    """
    stem = f".{name}{mark}"
    if len(os.fsencode(stem)) + 12 <= NAME_MAX:
        return stem
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    short = os.fsencode(name)[: NAME_MAX - 12 - len(mark) - 18].decode("utf-8", "ignore")
    return f".{short}~{digest}{mark}"


# Owner files this process holds locked, by staging folder: released by publish and discard.
_OWNED: dict[Path, int] = {}


def _take_ownership(staging: Path) -> None:
    """Lock a new owner file in ``staging``, made under a temporary name and renamed into place locked,
    so that no other process ever sees an owner file that is not locked yet."""
    tmp = staging / f"{_OWNER_FILE}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
        os.rename(tmp, staging / _OWNER_FILE)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    _OWNED[staging] = fd


def _release(staging: Path) -> None:
    fd = _OWNED.pop(staging, None)
    if fd is not None:
        os.close(fd)


def _remove_stale_staging(path: Path) -> None:
    """Remove the staging folders of ``path`` that no live save owns (their owner file is unlocked).

    A folder without an owner file is left alone: it may be one that a save is publishing.
    """
    mine = re.compile(re.escape(_staging_stem(path.name)) + "[0-9a-f]{12}")
    try:
        names = [n for n in os.listdir(path.parent) if mine.fullmatch(n)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        folder = path.parent / name
        try:
            fd = os.open(folder / _OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live save holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)


def _make_folders(folder: Path) -> None:
    """``mkdir -p``, and the new entries made durable: each created folder's parent is synced."""
    missing = []
    for p in (folder, *folder.parents):
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir()
        except FileExistsError:  # another process made it first
            pass
        fsync_dir(p.parent)


def staging_folder(path: Location, token: str) -> Location:
    """Where a save of ``path`` is assembled (shared by all processes of a save).

    Locally a hidden sibling folder that :func:`publish` renames; in an object store the destination
    itself. The primary process first removes stale staging folders of the same destination, then
    owns the new one until it publishes or discards it.
    """
    if path.local is None:
        return path
    staging = path.local.parent / f"{_staging_stem(path.local.name)}{token}"
    _make_folders(path.local.parent)
    if _multihost.is_primary():
        _remove_stale_staging(path.local)
        try:
            staging.mkdir()
        except FileExistsError:
            pass
        fsync_dir(staging.parent)
        _take_ownership(staging)
    else:
        staging.mkdir(exist_ok=True)
    return Location(str(staging), local=staging)


def discard_staging(path: Location, token: str) -> None:
    """Remove the local staging folder of the save of ``path`` with ``token``, if there is one."""
    if path.local is not None:
        staging = path.local.parent / f"{_staging_stem(path.local.name)}{token}"
        delete_tree(Location(str(staging), local=staging))


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # old kernel or a filesystem without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(staging: Location, path: Location, index: bytes, overwrite: bool) -> None:
    """Write the index, which makes the finished checkpoint in ``staging`` appear at ``path``.

    Locally: the index and every folder are made durable, then the staging folder is renamed into
    place (swapped with an old checkpoint in one step where the OS can; elsewhere the old one is moved
    aside first, so for an instant nothing is at ``path``). In an object store: the index is written.
    """
    if path.local is None:
        _tensorstore.kv_write(path.spec(), INDEX_FILE, index)
        # The checkpoint is complete: the marker is no longer needed to tell its data apart.
        _tensorstore.kv_delete(path.spec(), SAVE_MARKER)
        return
    staged = staging.local
    try:
        _publish_local(staged, path, index, overwrite)
    finally:
        _release(staged)


def _publish_local(staged: Path, path: Location, index: bytes, overwrite: bool) -> None:
    dest = path.local
    write_durable(staged / INDEX_FILE, index)
    # The checkpoint must not carry the owner file. Its lock stays held (on the unlinked file) until
    # the end; a folder without one is never removed as stale, so this is done as late as it can be.
    (staged / _OWNER_FILE).unlink(missing_ok=True)
    for folder, _, _ in os.walk(staged):
        fsync_dir(Path(folder))
    if dest.exists():
        check_writable(path, overwrite)  # the destination may have appeared while we wrote
        if _exchange(staged, dest):
            fsync_dir(dest.parent)
            shutil.rmtree(staged, ignore_errors=True)  # now holds the old checkpoint
            return
        old = dest.parent / f"{_staging_stem(dest.name, REPLACED_MARK)}{uuid.uuid4().hex[:12]}"
        os.rename(dest, old)
    else:
        old = None
    try:
        os.rename(staged, dest)
    except OSError as e:
        if old is not None:
            os.rename(old, dest)
        raise CheckpointExistsError(f"Cannot move the new checkpoint into {str(dest)!r}: {e}") from e
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(staging: Location) -> None:
    """Remove an unfinished save (in an object store: its data under the destination)."""
    try:
        delete_tree(staging)
    finally:
        if staging.local is not None:
            _release(staging.local)
