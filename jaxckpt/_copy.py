"""Copying a finished local checkpoint to another place (a durable folder or a bucket), atomically.

The copy is a save without device memory: it reuses the files that the local save wrote. It
follows the save's own protocol (:mod:`jaxckpt._staging`): the destination is checked, data files
go into a staging folder (in an object store: under the destination, after the save marker), and
the index is written last, so a copy interrupted at any point leaves no checkpoint there, only
leftovers that the next save or copy removes.

A copy that runs in the background must not lose its source to the local tier's retention: the
manager keeps the source until its copy is done (:func:`jaxckpt._retention.retain`'s ``also_keep``).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from jaxckpt import _kvstore, _local_tree, _multihost, _staging, _storage
from jaxckpt._errors import CheckpointCorruptedError
from jaxckpt._format import INDEX_FILE, data_store
from jaxckpt._storage import Location


def data_files(source: Path) -> list[str]:
    """The files of the checkpoint at ``source`` but its index (relative, ``/``-separated), sorted:
    regular files only, reached through no symlink (a symlink in a local checkpoint is refused: the
    copy would carry what it names, from outside the checkpoint)."""
    out = []
    for entry in _local_tree.walk_files(_storage.location(source)):
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise CheckpointCorruptedError(
                f"Cannot copy the checkpoint {str(source)!r}: {entry.path!r} is not a regular file (a symbolic link, "
                "FIFO or device); a checkpoint holds only the files jaxckpt wrote."
            )
        rel = os.path.relpath(entry.path, source).replace(os.sep, "/")
        if rel != INDEX_FILE:
            out.append(rel)
    return sorted(out)


def copy_checkpoint(
    source: Path,
    dest: Location,
    *,
    overwrite: bool = False,
    on_file: Callable[[int], None] | None = None,
    tag: str | None = None,
) -> None:
    """Copy the finished checkpoint at ``source`` (a local folder) to ``dest``; the index last.

    In a multi-process run every process calls it with the same ``tag`` (unique to this copy, alike
    on every process): each copies the data store it wrote (``data.p<n>``; process 0 ``data`` and the
    index), so that ``dest`` becomes the checkpoint that a save by all of them there would have made.
    ``on_file(nbytes)`` is called after each file is copied (progress, and tests that interrupt).
    Memory holds one file at a time: the largest is the largest shard of an array (format 4), or a
    data file of the OCDBT database (versions 1 to 3).
    """
    me, many = _multihost.process_index(), _multihost.process_count() > 1
    mine = data_store(me)
    files = [f for f in data_files(source) if not many or f.split("/", 1)[0] == mine]
    name = tag if tag is not None else uuid.uuid4().hex
    token = hashlib.sha256(name.encode()).hexdigest()[:12]  # the same on every process, without a round trip
    if me == 0:  # first, so that a stale staging folder of the same token is gone before others write
        _staging.check_writable(dest, overwrite)
        _staging.clear_for_save(dest)
        staging = _staging.staging_folder(dest, token)
    _multihost.barrier(f"{name}/staged")
    if me != 0:
        staging = _staging.staging_folder(dest, token)
    try:
        for rel in files:
            size = _copy_file(source / rel, staging, rel)
            if on_file is not None:
                on_file(size)
        _multihost.barrier(f"{name}/written")
        if me == 0:
            index = (source / INDEX_FILE).read_bytes()
            _staging.publish(staging, dest, index, overwrite)
            if on_file is not None:
                on_file(len(index))
        _multihost.barrier(f"{name}/published")
    except BaseException:
        if me == 0:
            _staging.discard(staging)
        raise


def _copy_file(path: Path, staging: Location, rel: str) -> int:
    data = path.read_bytes()
    if staging.local is not None:
        target = staging.local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        _storage.write_durable(target, data)  # publish syncs the folders; each file is synced here
    else:
        _kvstore.kv_write(staging.spec(), rel, data)
    return len(data)
