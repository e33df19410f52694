"""Copying a finished local checkpoint to another place (a durable folder or a bucket), atomically.

The copy is a save without device memory: it reuses the files that the local save wrote. It
follows the save's own protocol (:mod:`jaxckpt._staging`): the destination is checked, data files
go into a staging folder (in an object store: under the destination, after the save marker), and
the index is written last, so a copy interrupted at any point leaves no checkpoint there, only
leftovers that the next save or copy removes.

A copy that runs in the background must not lose its source to the local tier's retention: it
first *pins* the source by hard-linking its files into a hidden sibling folder (the files of a
finished checkpoint never change, so the links are a snapshot), copies from the pin, and removes
it when done.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from jaxckpt import _staging, _storage, _tensorstore
from jaxckpt._errors import CheckpointNotFoundError
from jaxckpt._format import INDEX_FILE
from jaxckpt._storage import Location

PIN_MARK = ".copying-"  # a pinned source: ".<name>.copying-<random>", beside the checkpoint


def pin(source: Path) -> Path:
    """Hard links of every file of the finished checkpoint ``source`` in a hidden sibling folder."""
    if not (source / INDEX_FILE).is_file():
        raise CheckpointNotFoundError(
            f"Cannot copy {str(source)!r}: it is not a finished checkpoint (no {INDEX_FILE})."
        )
    pinned = source.parent / f".{source.name}{PIN_MARK}{uuid.uuid4().hex[:12]}"
    try:
        for folder, _, files in os.walk(source):
            here = pinned / os.path.relpath(folder, source)
            here.mkdir(parents=True, exist_ok=True)
            for name in files:
                os.link(os.path.join(folder, name), here / name)
    except BaseException:
        shutil.rmtree(pinned, ignore_errors=True)
        raise
    return pinned


def unpin(pinned: Path) -> None:
    shutil.rmtree(pinned, ignore_errors=True)


def files_of(source: Path) -> list[str]:
    """The files of the checkpoint at ``source`` (relative, ``/``-separated), the index last."""
    out = []
    for folder, _, files in os.walk(source):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), source).replace(os.sep, "/")
            if rel != INDEX_FILE:
                out.append(rel)
    return [*sorted(out), INDEX_FILE]


def copy_checkpoint(
    source: Path, dest: Location, *, overwrite: bool = False, on_file: Callable[[int], None] | None = None
) -> None:
    """Copy the finished checkpoint at ``source`` (a local folder) to ``dest``; the index last.

    ``on_file(nbytes)`` is called after each file is copied (progress, and tests that interrupt).
    Memory holds one file at a time: the largest is a data file of the OCDBT database.
    """
    files = files_of(source)
    index = (source / INDEX_FILE).read_bytes()
    _staging.check_writable(dest, overwrite)
    _staging.clear_for_save(dest)
    token = uuid.uuid4().hex[:12]
    staging = _staging.staging_folder(dest, token)
    try:
        for rel in files[:-1]:
            size = _copy_file(source / rel, staging, rel)
            if on_file is not None:
                on_file(size)
        _staging.publish(staging, dest, index, overwrite)
    except BaseException:
        _staging.discard(staging)
        raise
    if on_file is not None:
        on_file(len(index))


def _copy_file(path: Path, staging: Location, rel: str) -> int:
    data = path.read_bytes()
    if staging.local is not None:
        target = staging.local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        _storage.write_durable(target, data)  # publish syncs the folders; each file is synced here
    else:
        _tensorstore.kv_write(staging.spec(), rel, data)
    return len(data)
