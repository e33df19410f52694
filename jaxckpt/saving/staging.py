"""How a save appears atomically: a staging folder beside the destination, published in one step.

**Local folders.** A save writes everything into a hidden staging folder beside the destination
(``.<name>.partial-<token>``), makes every file and folder in it durable, and renames it to the
destination in one step (replacing an old checkpoint swaps the two folders in one step on Linux).
A crash leaves no checkpoint or a whole one; leftover staging folders are never mistaken for
checkpoints, since a checkpoint is a folder with an index.

A staging folder holds an owner file that its save keeps locked (``flock``) while it runs; the kernel
releases the lock when the process dies, so the next save to the same destination removes staging
folders that no live save owns (a save interrupted by Ctrl-C or killed), and never a running one's.

**Object stores.** There is no rename. A save first writes a marker object (:data:`SAVE_MARKER`)
under the destination, then the data, then the index: one object, which appears whole or not at
all, so the index is the commit; the marker is deleted once the index is written. Leftovers of an
interrupted save (the marker and data stores, no index) are not a checkpoint, and the next save there
removes them. A prefix that holds anything else without an index (a user's ``data/`` folder, or data
whose marker is gone) is refused, never deleted. Replacing a checkpoint (``overwrite=True``) deletes
the old one first, so it is not atomic there.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import re
import sys
import uuid
from pathlib import Path

from jaxckpt._errors import CheckpointExistsError, StorageError
from jaxckpt.format.records import INDEX_FILE
from jaxckpt.runtime import multihost
from jaxckpt.storage import kvstore, local_tree, locations
from jaxckpt.storage.locations import (
    NAME_MAX,
    TMP_MARK,
    Location,
    delete_tree,
    is_checkpoint,
)

# Owner files this process holds locked, by staging folder: released by publish and discard.
_OWNED: dict[Path, int] = {}
PARTIAL_MARK = ".partial-"  # hidden staging folders: ".<name>.partial-<token>"

REPLACED_MARK = ".replaced-"  # an overwritten checkpoint on its way out: ".<name>.replaced-<random>"

SAVE_MARKER = ".jaxckpt-save"  # object stores: written first by a save, deleted once its index is written

_OWNER_FILE = ".jaxckpt-owner"  # in a staging folder: locked by the save that writes it, for as long as it runs

# Object-store keys an interrupted save can leave: its marker, and its data stores' keys: zarr3
# arrays and packs (format version 4), their checksums and references (versions 5 and 6), or OCDBT's
# files (versions 1 to 3).
_LEFTOVER_KEY = re.compile(
    rf"{re.escape(SAVE_MARKER)}|data(\.p[1-9][0-9]*)?/"
    r"(manifest\.[^/]+|d/.+|checksums\.json|refs\.json|[ap]/[0-9]+/(zarr\.json|c(/[0-9]+)*))"
)


def _only_leftovers(keys: list[str]) -> bool:
    """Object stores: whether the ``keys`` under a prefix are exactly what an interrupted save leaves:
    its marker, and data stores with the keys of its arrays. Without the marker, data is not provably
    jaxckpt's (a user's ``data/`` folder), so it is never taken for leftovers."""
    return SAVE_MARKER in keys and all(_LEFTOVER_KEY.fullmatch(k) for k in keys)


def interrupted_save(path: Location) -> bool:
    """Whether the bucket prefix ``path`` holds exactly what an interrupted save leaves (its marker
    and data, no index): provably jaxckpt's garbage. Never a local folder (a local save is staged in
    a hidden folder of its own)."""
    if path.local is not None:
        return False
    keys = kvstore.kv_keys(path.spec())
    return INDEX_FILE not in keys and _only_leftovers(keys)


def _first_file_above(local: Path) -> Path | None:
    """The nearest existing ancestor of ``local`` if it is not a folder (a file where a folder must go)."""
    for parent in local.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_writable(path: Location, overwrite: bool) -> list[str] | None:
    """Refuse early to replace what a save must not replace. In an object store, returns the keys
    under ``path``, from the one listing that answers every question here (for :func:`clear_for_save`)."""
    keys = None
    if path.local is not None:
        blocker = _first_file_above(path.local)
        if blocker is not None:
            raise CheckpointExistsError(
                f"Cannot save at {path.text!r}: {str(blocker)!r} is a file, not a folder. Choose another path."
            )
    else:
        keys = kvstore.kv_keys(path.spec())
    if (INDEX_FILE in keys) if keys is not None else is_checkpoint(path):
        if overwrite:
            return keys
        raise CheckpointExistsError(
            f"A checkpoint already exists at {path.text!r}; pass overwrite=True to replace it, or save elsewhere."
        )
    if path.local is not None:
        if not path.local.exists() or (path.local.is_dir() and not any(path.local.iterdir())):
            return None
    elif not keys or _only_leftovers(keys):
        return keys
    raise CheckpointExistsError(
        f"{path.text!r} exists and is not a jaxckpt checkpoint; jaxckpt will not replace it. Choose another path."
        + (
            ""
            if path.local is not None
            else f" (It holds no {INDEX_FILE} and no {SAVE_MARKER} marker of an interrupted jaxckpt save, so what is "
            "there is not provably jaxckpt's; remove it yourself if it is.)"
        )
    )


def clear_for_save(path: Location, keys: list[str] | None = None) -> None:
    """Object stores, primary process only: remove what a save there will replace (an old checkpoint
    when overwriting, or an interrupted save's leftovers), then write the marker that makes this
    save's data recognisable as jaxckpt's, before anything else is written.

    ``keys``: what :func:`check_writable` found under ``path`` just before, so that a save lists its
    prefix once (each listing is a request); without them, it is listed and checked here."""
    if path.local is not None:
        return
    if keys is None:
        keys = kvstore.kv_keys(path.spec())
        if keys and not (INDEX_FILE in keys or _only_leftovers(keys)):  # it changed since check_writable
            check_writable(path, overwrite=False)
    base = path.spec()
    if SAVE_MARKER not in (keys or ()):
        kvstore.kv_write(base, SAVE_MARKER, b"an unfinished jaxckpt save; it has no index.json yet\n")
    # The marker first and kept, the old index next: whatever a kill in the middle leaves is an
    # interrupted save's, provably jaxckpt's to remove (by the next save there, or a manager's start).
    if keys and INDEX_FILE in keys:
        kvstore.kv_delete(base, INDEX_FILE)
    for key in keys or ():
        if key not in (SAVE_MARKER, INDEX_FILE):
            kvstore.kv_delete(base, key)


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


def _take_ownership(staging: Path) -> None:
    """Lock a new owner file in ``staging``, made under a temporary name and renamed into place locked,
    so that no other process ever sees an owner file that is not locked yet."""
    tmp = staging / f"{_OWNER_FILE}{TMP_MARK}{uuid.uuid4().hex[:12]}"
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
        if folder.is_symlink():  # jaxckpt makes real folders there: a link's target is not its to delete
            continue
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
            local_tree.remove_local(folder)
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
        locations.fsync_dir(p.parent)


def staging_folder(path: Location, token: str, *, own: bool = False) -> Location:
    """Where a save of ``path`` is assembled (shared by all processes of a save).

    Locally a hidden sibling folder that :func:`publish` renames; in an object store the destination
    itself. The primary process first removes stale staging folders of the same destination, then
    owns the new one until it publishes or discards it. With ``own``, this process is the only
    one that saves there (each process's own copy, on its own disk), and owns it whatever its index.
    """
    if path.local is None:
        return path
    staging = path.local.parent / f"{_staging_stem(path.local.name)}{token}"
    _make_folders(path.local.parent)
    if own or multihost.is_primary():
        _remove_stale_staging(path.local)
        try:
            try:
                staging.mkdir()
            except FileExistsError:
                pass
            # Not synced here, in the caller's thread of an async save: a directory fsync waits for the
            # file system's journal (a retention's deletions, say). publish syncs this folder's parent
            # after the rename, which makes its entry durable; a staging folder lost in a crash was no
            # checkpoint.
            _take_ownership(staging)
        except OSError as e:
            # Not owned, so no later save would remove it as stale: removed here (a token is this save's own).
            local_tree.remove_local(staging)
            raise locations.storage_failure(
                f"Cannot save the checkpoint {path.text!r}: making its staging folder {str(staging)!r} failed",
                e,
                "Nothing was written.",
            ) from e
    else:
        staging.mkdir(exist_ok=True)
    return Location(str(staging), local=staging)


def discard_staging(path: Location, token: str) -> None:
    """Remove the local staging folder of the save of ``path`` with ``token``, if there is one."""
    if path.local is not None:
        staging = path.local.parent / f"{_staging_stem(path.local.name)}{token}"
        delete_tree(Location(str(staging), local=staging))


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


def publish(staging: Location, path: Location, index: bytes | bytearray, overwrite: bool) -> None:
    """Write the index, which makes the finished checkpoint in ``staging`` appear at ``path``.

    Locally: the index and every folder are made durable, then the staging folder is renamed into
    place (swapped with an old checkpoint in one step where the OS can; elsewhere the old one is moved
    aside first, so for an instant nothing is at ``path``). In an object store: the index is written.
    """
    if path.local is None:
        kvstore.kv_write(path.spec(), INDEX_FILE, index)
        # The checkpoint is complete: the marker is no longer needed to tell its data apart.
        kvstore.kv_delete(path.spec(), SAVE_MARKER)
        return
    staged, dest = staging.local, path.local
    if staged is None:
        raise ValueError(f"the staging folder of the local {path.text!r} must be local too, not {staging.text!r}")
    try:
        _publish_local(staged, dest, path, index, overwrite)
    finally:
        _release(staged)


def _publish_local(staged: Path, dest: Path, path: Location, index: bytes | bytearray, overwrite: bool) -> None:
    try:
        locations.write_durable(staged / INDEX_FILE, index)
        # The checkpoint must not carry the owner file. Its lock stays held (on the unlinked file) until
        # the end; a folder without one is never removed as stale, so this is done as late as it can be.
        (staged / _OWNER_FILE).unlink(missing_ok=True)
        for folder, _, _ in os.walk(staged):
            locations.fsync_dir(Path(folder))
    except OSError as e:  # nothing is visible yet: the caller removes the staging folder
        there = "the checkpoint already there is untouched" if dest.exists() else "nothing was saved there"
        raise locations.storage_failure(
            f"Cannot save the checkpoint {path.text!r}: writing its {INDEX_FILE} failed",
            e,
            f"The save is undone; {there}.",
        ) from e
    if dest.exists():
        check_writable(path, overwrite)  # the destination may have appeared while we wrote
        if _exchange(staged, dest):
            locations.fsync_dir(dest.parent)
            local_tree.remove_local(staged)  # now holds the old checkpoint (a symlink: the link alone)
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
    locations.fsync_dir(dest.parent)
    if old is not None:
        local_tree.remove_local(old)


def discard(staging: Location) -> None:
    """Remove an unfinished save (in an object store: its data under the destination, best effort).

    It runs while the save's own error propagates. In an object store that refuses or stopped
    answering (often the very cause), failing to delete is not reported over that error: what is left
    has no index, so it is no checkpoint, and the next save there removes it by its marker.
    """
    try:
        delete_tree(staging)
    except StorageError:
        if staging.local is not None:
            raise
    finally:
        if staging.local is not None:
            _release(staging.local)
