"""References between checkpoints of one manager directory in a bucket (format version 6): which
siblings a save refers to, and the data that retention must hold for them.

A bucket has no hard links, and TensorStore's s3/gcs kvstores have no server-side copy, so an
incremental save on a bucket (:mod:`jaxckpt.incremental.bucket`) stores an unchanged array **by
reference**: its data store holds no object of it, and ``refs.json`` beside ``checksums.json`` says
where its shards are::

    {"checksum": "crc32:<8 hex>", "format": "jaxckpt-refs", "save": "<the index's save>",
     "arrays": {"a/<n>": {"checkpoint": "ckpt-3", "store": "data", "array": "a/<m>",
                         "save": "<save that wrote them>", "shards": {"<shard>": [<CRC-32C>, ...]}}}}

``checkpoint`` is a sibling in the same parent, by a plain name (no ``/``, not ``.`` or ``..``);
the reference always names the checkpoint that holds the bytes, never another reference. How a
reader checks and reads it: :mod:`jaxckpt.reading.refs`.

**Held data.** The state file lists, for each checkpoint, the siblings it ``uses``. Deleting a
checkpoint that a kept one uses deletes its index first (it is no checkpoint any more), then every
object but the arrays the kept ones refer to and their stores' ``checksums.json``: that is *held
data*, removed by :func:`prune` once no kept checkpoint uses it (at a deletion, or a manager's start).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jaxckpt._errors import JaxckptError, caller_level
from jaxckpt.format.index_json import decode_index
from jaxckpt.format.records import CHECKSUMS_FILE, INDEX_FILE, ArrayLeaf, InArray
from jaxckpt.format.refs_json import REFS_FILE, STORE, decode
from jaxckpt.reading.refs import READ_LIMIT
from jaxckpt.runtime import multihost
from jaxckpt.storage import kvstore, local_tree, locations, statefile
from jaxckpt.storage.statefile import CheckpointInfo


def names_used(token: str, writers: Iterable[Any]) -> tuple[str, ...]:
    """The siblings this save refers to, in every process's data store (all processes call it alike)."""
    mine = sorted({r.checkpoint for w in writers for r in w.refs.values()})
    if multihost.process_count() > 1:
        mine = sorted({n for text in multihost.gather(f"refs/{token}", json.dumps(mine)) for n in json.loads(text)})
    return tuple(mine)


# --- reading -------------------------------------------------------------------------------------


def deletions(
    old: Sequence[CheckpointInfo], kept: Sequence[CheckpointInfo], ours: Callable[[str], bool]
) -> dict[str, list[str]]:
    """For deleting what ``kept`` no longer lists of ``old``: each dropped checkpoint, and each held
    one that a dropped checkpoint used and that is not listed, with the kept checkpoints that use it
    (empty: nothing is held of it). Empty when no checkpoint uses another. A held name is included
    only where ``ours(name)``: a checkpoint name of this manager (and its deletion still needs the
    proof that the Deleter asks for: see :func:`jaxckpt.manager.retention.provably_held`)."""
    if not any(c.uses for c in old):
        return {}
    listed = {os.path.basename(c.path) for c in kept}

    def users(name: str) -> list[str]:
        return [os.path.basename(k.path) for k in kept if name in k.uses]

    out = {os.path.basename(c.path): users(os.path.basename(c.path)) for c in old if c not in kept}
    for c in old:
        if c not in kept:
            out.update((u, users(u)) for u in c.uses if u not in listed and u not in out and ours(u))
    return out


def bucket_usage(checkpoint: locations.Location) -> tuple[int | None, int | None, dict[Any, int]]:
    """A checkpoint in an object store: the bytes its index records (its own and the arrays it holds
    or refers to: a listing there has no sizes, and asking each object is a request per object),
    those of the arrays it refers to, and those arrays by (checkpoint, store, array) -> bytes; None,
    None and nothing if it has no index (or one that does not parse)."""
    try:
        raw = locations.read_file(checkpoint, INDEX_FILE, locations.INDEX_READ_LIMIT)
        if raw is None:
            return None, None, {}
        index = decode_index(raw, repr(str(checkpoint / INDEX_FILE)))
        arrays = {
            x.at.path: x.nbytes for x in index.leaves.values() if isinstance(x, ArrayLeaf) and isinstance(x.at, InArray)
        }
        total = len(raw) + sum(leaf.nbytes for leaf in index.leaves.values() if isinstance(leaf, ArrayLeaf))
        referred: dict[Any, int] = {}
        for store in locations.children(checkpoint) if index.refs else ():
            data = (
                locations.read_file(checkpoint, f"{store}/{REFS_FILE}", READ_LIMIT) if STORE.fullmatch(store) else None
            )
            for path, r in (decode(data, repr(str(checkpoint / store)), index.save) if data else {}).items():
                referred[(r.checkpoint, r.store, r.array)] = arrays.get(
                    path, 0
                )  # this store's part: all of it, one process
    except JaxckptError:
        return None, None, {}
    return total, sum(referred.values()), referred


def uses_of(checkpoint: locations.Location, ours: Callable[[str], bool] | None = None) -> tuple[str, ...]:
    """The siblings whose data the checkpoint at ``checkpoint`` refers to, from its data stores'
    ``refs.json`` (for a checkpoint that a manager adopts: the state file did not list it yet).

    Only what the checkpoint can prove: its index must be of version 6 and say it refers to others,
    and each ``refs.json`` must name that index's save; a name that is not a checkpoint of this
    manager (``ours``; by default any ``<name>-<number>``) is left out with a warning, so that a
    copied-in checkpoint can never make retention delete a user's folder or prefix."""
    raw = locations.read_file(checkpoint, INDEX_FILE, locations.INDEX_READ_LIMIT)
    if raw is None:
        return ()
    index = decode_index(raw, repr(str(checkpoint / INDEX_FILE)))
    if not index.refs or index.save is None:
        return ()
    names: set[str] = set()
    for store in locations.children(checkpoint):
        if STORE.fullmatch(store):
            data = locations.read_file(checkpoint, f"{store}/{REFS_FILE}", READ_LIMIT)
            if data is not None:
                where = repr(str(checkpoint / store / REFS_FILE))
                names.update(r.checkpoint for r in decode(data, where, index.save).values())
    accepted = ours if ours is not None else statefile.CHECKPOINT_NAME.fullmatch
    refused = sorted(n for n in names if not accepted(n))
    if refused:
        warnings.warn(
            f"The checkpoint {checkpoint.text!r} refers to data of {', '.join(map(repr, refused))}, which "
            "is no checkpoint of this manager: that data is not held for it (its arrays there do not "
            "restore), and nothing there is ever deleted by this manager.",
            stacklevel=caller_level(),
        )
    return tuple(sorted(n for n in names if accepted(n)))


def prune(target: locations.Location, users: Sequence[locations.Location]) -> None:
    """Remove every file or object of ``target`` (no longer a checkpoint: its index is gone) but the
    arrays that ``users`` refer to, their data stores' checksums and the mark that it was dropped
    (:data:`jaxckpt.storage.statefile.UNRECORDED`, the proof that it is this manager's to delete).
    A user's references that cannot be read keep everything (the next deletion or start-up tries again).
    Local folders and buckets alike: a run moved from one to the other keeps its held data."""
    name = target.name
    held: set[tuple[str, str]] = set()
    for user in users:
        for store in locations.children(user):
            if not STORE.fullmatch(store):
                continue
            try:
                data = locations.read_file(user, f"{store}/{REFS_FILE}", READ_LIMIT)
                refs = {} if data is None else decode(data, repr(str(user / store / REFS_FILE)), None)
            except (JaxckptError, OSError):
                return
            held.update((r.store, r.array) for r in refs.values() if r.checkpoint == name)
    if not held and not statefile.is_marked(target):
        return  # nothing of it is held for them and no mark proves it this manager's: not touched
    _mark(target)  # held data carries the mark, which proves it this manager's to delete once unused
    stores = {s for s, _ in held}

    def kept(key: str) -> bool:
        store, _, rest = key.partition("/")
        if key == statefile.UNRECORDED:
            return True
        return store in stores and (rest == CHECKSUMS_FILE or any(key.startswith(f"{s}/{a}/") for s, a in held))

    if target.local is None:
        base = target.spec()
        for key in kvstore.kv_keys(base):
            if not kept(key):
                kvstore.kv_delete(base, key)
        return
    root = os.fspath(target.local)
    for entry in list(local_tree.walk_files(target)):
        if not kept(os.path.relpath(entry.path, root).replace(os.sep, "/")):
            os.unlink(entry.path)
    for folder, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):  # the emptied folders, deepest first
        if folder != root:
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _mark(target: locations.Location) -> None:
    """Put retention's mark on ``target`` where it is not there yet."""
    if statefile.is_marked(target):
        return
    if target.local is not None:
        (target.local / statefile.UNRECORDED).touch()
    else:
        kvstore.kv_write(target.spec(), statefile.UNRECORDED, b"held data of kept checkpoints\n")
