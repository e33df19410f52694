"""Local folders walked and removed without recursion and without following symlinks: what a
checkpoint's files take on disk (sparse files' holes excluded where the file system reports them
truthfully), and removal of a folder however deep, never of what a symlink in it points to."""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

from jaxckpt._errors import CheckpointCorruptedError


class Location(Protocol):
    """What this module reads of a :class:`jaxckpt.storage.locations.Location` (which uses this module
    to remove folders, so it cannot be imported here)."""

    @property
    def text(self) -> str: ...

    @property
    def local(self) -> Path | None: ...

    @property
    def name(self) -> str: ...


def remove_local(path: Path) -> None:
    """Remove the local folder ``path`` (best effort). A symlink there (a checkpoint of another run linked
    into a manager's directory) is unlinked: what it points to is not this folder's to delete."""
    try:
        if os.path.islink(path):
            os.unlink(path)
        else:
            rmtree(path)
    except OSError:
        pass


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def rmtree(path: Path) -> None:
    """``shutil.rmtree`` without recursion; raises the first OSError.

    Python 3.11's rmtree recurses once per level, so a checkpoint holding a folder 1,100 levels deep
    was a RecursionError in a manager's retention and at its start. As rmtree does, every folder is
    opened relative to its parent's descriptor and never through a symlink (a symlink inside is
    unlinked, never followed); one descriptor is open at a time, and going back up through ``..`` is
    checked to reach the folder that was left.
    """
    fd = os.open(path, _DIR_FLAGS)
    # Per folder from ``path`` down to the open one: its identity, its name in its parent, and the
    # subfolders still to remove.
    levels: list[tuple[tuple[int, int], str, list[str]]] = []
    try:
        levels.append((_identity(fd), "", _remove_files(fd)))
        while True:
            _, _, pending = levels[-1]
            if pending:
                name = pending.pop()
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue
                os.close(fd)
                fd = child
                levels.append((_identity(fd), name, _remove_files(fd)))
                continue
            _, name, _ = levels.pop()
            if not levels:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            if _identity(fd) != levels[-1][0]:
                raise OSError(f"{str(path)!r} changed while it was being deleted")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _remove_files(fd: int) -> list[str]:
    """Unlink what the open folder ``fd`` holds but folders (symlinks included); return the folders' names."""
    folders = []
    with os.scandir(fd) as found:
        for entry in found:
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.name)
            else:
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
    return folders


# Bounds of a walk through a checkpoint's folders, far above what any checkpoint holds (format 4: data/a/<n>/c/
# then one level per dimension, at most 64; earlier formats are flatter), so that a crafted folder ends it with
# an error instead of a RecursionError or a walk without end.
MAX_DEPTH = 128
MAX_ENTRIES = 1 << 26
# File systems whose st_blocks counts the blocks a file really holds, without transparent compression
# (statfs f_type): ext2/3/4, XFS, tmpfs. Elsewhere (ZFS and btrfs may compress, so that a file of zeros
# holds almost nothing; network and FUSE file systems report what they like) apparent sizes count.
_TRUTHFUL_BLOCKS = frozenset({0xEF53, 0x58465342, 0x01021994})
_INLINE_MAX = 4096  # ext4's inline_data keeps a file this small in its inode: no blocks, all bytes held


class Usage(NamedTuple):
    """What the files under a folder take: ``held``, the bytes a file system holds for them (apparent
    sizes less the holes of sparse files, where it reports them truthfully), and ``apparent``."""

    held: int
    apparent: int
    # Apparent bytes of the files with other hard links (on a manager's local disk: files that other
    # checkpoints share, see jaxckpt.incremental.local), and those files by (st_dev, st_ino) -> size.
    shared: int
    linked: dict[tuple[int, int], int]


def total_bytes(folder: Location) -> int | None:
    """Bytes of every file under a local folder (as ``du --apparent-size``); None elsewhere, if absent,
    or if ``folder`` is a symlink. See :func:`usage` for what is walked."""
    found = usage(folder)
    return None if found is None else found.apparent


def usage(folder: Location) -> Usage | None:
    """What the regular files under a local folder take; None elsewhere, if absent, or if a symlink.

    A checkpoint is untrusted: no symlink is followed, ``folder`` included (a symlinked ``data/`` to
    ``/`` would have every file of the machine stat'ed, and a symlinked file would back bytes that the
    checkpoint does not hold); the walk keeps its own stack (a folder 1,100 levels deep is no
    RecursionError), and past :data:`MAX_DEPTH` levels or :data:`MAX_ENTRIES` entries it stops with a
    :class:`CheckpointCorruptedError` naming the folder.
    """
    if folder.local is None:
        return None
    try:
        if not stat.S_ISDIR(os.lstat(folder.local).st_mode):
            return None
    except OSError:
        return None
    held = apparent = shared = 0
    linked: dict[tuple[int, int], int] = {}
    truthful: dict[int, bool] = {}  # by st_dev
    for entry in walk_files(folder):
        try:
            if not entry.is_file(follow_symlinks=False):
                continue  # a symlink, FIFO or device holds none of the checkpoint's bytes
            info = entry.stat(follow_symlinks=False)
        except OSError:  # removed while we looked (a manager's retention at work)
            continue
        apparent += info.st_size
        held += _held(info, entry.path, truthful)
        if info.st_nlink > 1:
            shared += info.st_size
            linked[(info.st_dev, info.st_ino)] = info.st_size
    return Usage(held, apparent, shared, linked)


def walk_files(folder: Location) -> Iterator[os.DirEntry[str]]:
    """Every entry under the local folder ``folder`` that is not a folder (files, symlinks, FIFOs...),
    without following a symlink and without recursion; past :data:`MAX_DEPTH` levels or
    :data:`MAX_ENTRIES` entries, a :class:`CheckpointCorruptedError` naming the folder. Folders that
    vanish meanwhile are skipped."""
    assert folder.local is not None
    entries = 0
    stack = [(os.fspath(folder.local), 0)]
    while stack:
        path, depth = stack.pop()
        try:
            with os.scandir(path) as found:
                for entry in found:
                    entries += 1
                    if entries > MAX_ENTRIES:
                        raise _walk_bound(folder, f"more than {MAX_ENTRIES:,} files and folders", path)
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        continue
                    if not is_dir:
                        yield entry
                    elif depth >= MAX_DEPTH:
                        raise _walk_bound(folder, f"folders nested over {MAX_DEPTH} levels deep", entry.path)
                    else:
                        stack.append((entry.path, depth + 1))
        except (FileNotFoundError, NotADirectoryError):
            continue


def _walk_bound(folder: Location, what: str, where: str) -> CheckpointCorruptedError:
    return CheckpointCorruptedError(
        f"The checkpoint folder {folder.text!r} holds {what} (at {where[:300]!r}); no jaxckpt checkpoint does, "
        "so it was crafted or damaged. Remove what does not belong there, or the checkpoint."
    )


def _held(info: os.stat_result, path: str, truthful: dict[int, bool]) -> int:
    """The bytes of a regular file that its file system holds: a sparse file's holes hold nothing, so
    they back no claim (a 64 GiB file of holes is a few blocks). Where st_blocks may understate what a
    genuine file holds (compression, inline data), the apparent size counts: never less than the truth."""
    blocks = getattr(info, "st_blocks", None)
    if blocks is None:
        return info.st_size
    if info.st_dev not in truthful:
        truthful[info.st_dev] = _fs_type(path) in _TRUTHFUL_BLOCKS
    if not truthful[info.st_dev] or (blocks == 0 and info.st_size <= _INLINE_MAX):
        return info.st_size
    return min(info.st_size, blocks * 512)


def _fs_type(path: str) -> int | None:
    """Linux's statfs ``f_type`` of the file system holding ``path``; None elsewhere or if unknown."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None
    buffer = ctypes.create_string_buffer(512)  # struct statfs, whose first field is f_type (a long)
    if statfs(os.fsencode(path), buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value


def short_because(store: Location, claimed: int) -> str:
    """Why a data store holds fewer bytes than claimed, where it is not plain missing data."""
    if store.local is not None and os.path.islink(store.local):
        return (
            f" ({store.name!r} is a symlink, which jaxckpt does not follow inside a checkpoint: copy what it "
            "points to into the checkpoint.)"
        )
    found = usage(store)
    if found is not None and found.apparent >= claimed:
        return (
            f" (Its files are sparse: their sizes add up to {found.apparent:,} bytes, but the file system holds "
            f"only {found.held:,} of them; the holes read as zeros. A copy made with holes (cp --sparse=always, "
            "rsync -S) of a genuine checkpoint can be copied again without them: cp -r --sparse=never.)"
        )
    return ""
