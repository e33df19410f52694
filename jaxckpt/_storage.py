"""Where checkpoints live: local folders and TensorStore kvstores, and how a checkpoint appears atomically.

Every path jaxckpt takes is a :class:`Location`: a local folder (``ckpts/ckpt-3``, ``file://...``), or a
prefix in a TensorStore kvstore: ``s3://bucket/path``, ``gs://bucket/path``, ``memory://path``.

**Local folders.** A save writes everything into a hidden staging folder beside the destination
(``.<name>.partial-<token>``), makes every file and folder in it durable, and renames it to the
destination in one step (replacing an old checkpoint swaps the two folders in one step on Linux).
A crash leaves no checkpoint or a whole one; leftover staging folders are never mistaken for
checkpoints, since a checkpoint is a folder with an index.

**Object stores.** There is no rename. A save writes the data under the destination and the index
last: one object, which appears whole or not at all, so the index is the commit. Leftovers of an
interrupted save (data without an index) are not a checkpoint, and the next save there removes them.
Replacing a checkpoint (``overwrite=True``) deletes the old one first, so it is not atomic there.

S3 follows the standard AWS environment: credentials, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, and
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for S3-compatible stores.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from jaxckpt import _arrayio
from jaxckpt._errors import CheckpointExistsError, CheckpointNotFoundError, NotACheckpointError
from jaxckpt._format import INDEX_FILE

PARTIAL_MARK = ".partial-"  # hidden staging folders: ".<name>.partial-<token>"
REPLACED_MARK = ".replaced-"  # an overwritten checkpoint on its way out: ".<name>.replaced-<random>"
_TMP_MARK = ".tmp-"  # a file being replaced atomically: ".<name>.tmp-<random>"


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
            return {"driver": "file", "path": str(local) + "/"}
        return dict(self.kv)


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
    text = os.fspath(path)
    if "://" not in text or text.startswith("file://"):
        local = Path(text[len("file://") :] if text.startswith("file://") else text).absolute()
        return Location(text, local=local)
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


def read_file(folder: Location, name: str) -> bytes | None:
    """The bytes of ``name`` in ``folder``, or None if there is no such file."""
    if folder.local is not None:
        try:
            return (folder.local / name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
    return _arrayio.kv_read(folder.spec(), name)


def write_file_atomic(folder: Location, name: str, data: bytes) -> None:
    """Replace ``name`` in ``folder`` whole: a crash leaves the old bytes or the new, durably."""
    if folder.local is None:
        _arrayio.kv_write(folder.spec(), name, data)
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
    return sorted({key.split("/", 1)[0] for key in _arrayio.kv_keys(folder.spec())})


def is_temp_file(name: str) -> bool:
    return _TMP_MARK in name and name.startswith(".")


def delete_tree(folder: Location) -> None:
    if folder.local is not None:
        shutil.rmtree(folder.local, ignore_errors=True)
    else:
        _arrayio.kv_delete_all(folder.spec())


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
    return read_file(path, INDEX_FILE) is not None if path.local is None else (path.local / INDEX_FILE).is_file()


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
    data = read_file(path, INDEX_FILE)
    if data is not None:
        return data
    if path.local is None and not children(path):
        raise CheckpointNotFoundError(f"No checkpoint at {path.text!r}: nothing is stored under that prefix.")
    raise NotACheckpointError(
        f"{path.text!r} is not a jaxckpt checkpoint: it has no {INDEX_FILE}. "
        "If it is a manager's directory, pass one of its checkpoints (see jaxckpt.latest_checkpoint)."
    )


def _only_leftovers(path: Location) -> bool:
    """Whether everything under ``path`` is what an interrupted save leaves (data stores, no index)."""
    return all(name == "data" or name.startswith("data.p") for name in children(path))


def check_writable(path: Location, overwrite: bool) -> None:
    """Refuse early to replace what a save must not replace."""
    if is_checkpoint(path):
        if overwrite:
            return
        raise CheckpointExistsError(
            f"A checkpoint already exists at {path.text!r}; pass overwrite=True to replace it, or save elsewhere."
        )
    if path.local is not None:
        if not path.local.exists() or (path.local.is_dir() and not any(path.local.iterdir())):
            return
    elif _only_leftovers(path):
        return
    raise CheckpointExistsError(
        f"{path.text!r} exists and is not a jaxckpt checkpoint; jaxckpt will not replace it. Choose another path."
    )


def clear_for_save(path: Location) -> None:
    """Object stores, primary process only: remove what a save there will replace (an old checkpoint
    when overwriting, or an interrupted save's data) before anything new is written."""
    if path.local is None and children(path):
        delete_tree(path)


def staging_folder(path: Location, token: str) -> Location:
    """Where a save of ``path`` is assembled (shared by all processes of a save).

    Locally a hidden sibling folder that :func:`publish` renames; in an object store the destination itself.
    """
    if path.local is None:
        return path
    staging = path.local.parent / f".{path.local.name}{PARTIAL_MARK}{token}"
    staging.mkdir(parents=True, exist_ok=True)
    return Location(str(staging), local=staging)


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
        _arrayio.kv_write(path.spec(), INDEX_FILE, index)
        return
    staged, dest = staging.local, path.local
    write_durable(staged / INDEX_FILE, index)
    for folder, _, _ in os.walk(staged):
        fsync_dir(Path(folder))
    if dest.exists():
        check_writable(path, overwrite)  # the destination may have appeared while we wrote
        if _exchange(staged, dest):
            fsync_dir(dest.parent)
            shutil.rmtree(staged, ignore_errors=True)  # now holds the old checkpoint
            return
        old = dest.parent / f".{dest.name}{REPLACED_MARK}{uuid.uuid4().hex[:12]}"
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
    delete_tree(staging)
