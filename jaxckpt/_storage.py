"""Where checkpoints live: resolving paths, and making a checkpoint appear atomically.

A save writes everything into a hidden staging folder beside the destination
(``.<name>.partial-<random>``), makes every file and folder in it durable, and then renames it to the
destination in one step. A crash at any instant leaves either no checkpoint or a whole one; leftover
staging folders are never mistaken for checkpoints, since a checkpoint is a folder with an index.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import uuid
from pathlib import Path

from jaxckpt._errors import CheckpointExistsError, CheckpointNotFoundError, NotACheckpointError
from jaxckpt._format import INDEX_FILE

PARTIAL_MARK = ".partial-"  # hidden staging folders: ".<name>.partial-<random>"
REPLACED_MARK = ".replaced-"  # an overwritten checkpoint on its way out: ".<name>.replaced-<random>"


def local_path(path: str | os.PathLike[str]) -> Path:
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        scheme = text.split("://", 1)[0]
        raise NotImplementedError(f"Storage scheme {scheme!r} is not supported yet in {text!r}; use a local path.")
    return Path(text).absolute()


def is_checkpoint(path: Path) -> bool:
    return (path / INDEX_FILE).is_file()


def read_index_bytes(path: Path) -> bytes:
    """The raw index of the checkpoint at ``path``, or a clear error saying why there is none."""
    if not path.exists():
        raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}: the path does not exist.")
    if not path.is_dir():
        raise NotACheckpointError(
            f"{str(path)!r} is a file, not a checkpoint (a checkpoint is a folder with {INDEX_FILE})."
        )
    try:
        return (path / INDEX_FILE).read_bytes()
    except FileNotFoundError:
        raise NotACheckpointError(
            f"{str(path)!r} is not a jaxckpt checkpoint: it has no {INDEX_FILE}. "
            "If it is a manager's directory, pass one of its checkpoints (see jaxckpt.latest_checkpoint)."
        ) from None
    except IsADirectoryError:
        raise NotACheckpointError(f"{str(path)!r} is not a jaxckpt checkpoint: its {INDEX_FILE} is a folder.") from None


def check_writable(path: Path, overwrite: bool) -> None:
    """Refuse early to replace what a save must not replace."""
    if not path.exists() or (overwrite and is_checkpoint(path)):
        return
    if is_checkpoint(path):
        raise CheckpointExistsError(
            f"A checkpoint already exists at {str(path)!r}; pass overwrite=True to replace it, or save elsewhere."
        )
    if path.is_dir() and not any(path.iterdir()):
        return
    raise CheckpointExistsError(
        f"{str(path)!r} exists and is not a jaxckpt checkpoint; jaxckpt will not replace it. Choose another path."
    )


def staging_folder(path: Path, token: str) -> Path:
    """The hidden folder where a save of ``path`` is assembled (shared by all processes of a save)."""
    staging = path.parent / f".{path.name}{PARTIAL_MARK}{token}"
    staging.mkdir(parents=True, exist_ok=True)
    return staging


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


def publish(staging: Path, path: Path, overwrite: bool) -> None:
    """Make the finished checkpoint in ``staging`` appear at ``path``, durably and atomically.

    Replacing a checkpoint swaps the two folders in one step where the OS can (Linux); elsewhere the
    old one is moved aside first, so for an instant nothing is at ``path`` (it survives as
    ``.<name>.replaced-*`` until the new one is in place).
    """
    for folder, _, _ in os.walk(staging):
        fsync_dir(Path(folder))
    if path.exists():
        check_writable(path, overwrite)  # the destination may have appeared while we wrote
        if _exchange(staging, path):
            fsync_dir(path.parent)
            shutil.rmtree(staging, ignore_errors=True)  # now holds the old checkpoint
            return
        old = path.parent / f".{path.name}{REPLACED_MARK}{uuid.uuid4().hex[:12]}"
        os.rename(path, old)
    else:
        old = None
    try:
        os.rename(staging, path)
    except OSError as e:
        if old is not None:
            os.rename(old, path)
        raise CheckpointExistsError(f"Cannot move the new checkpoint into {str(path)!r}: {e}") from e
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
