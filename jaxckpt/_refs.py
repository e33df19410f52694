"""References between checkpoints of one manager directory in a bucket (format version 6).

A bucket has no hard links, and TensorStore's s3/gcs kvstores have no server-side copy, so an
incremental save on a bucket (:mod:`jaxckpt._bucket_memory`) stores an unchanged array **by
reference**: its data store holds no object of it, and ``refs.json`` beside ``checksums.json`` says
where its shards are::

    {"checksum": "crc32:<8 hex>", "format": "jaxckpt-refs", "save": "<the index's save>",
     "arrays": {"a/<n>": {"checkpoint": "ckpt-3", "store": "data", "array": "a/<m>",
                         "save": "<save that wrote them>", "shards": {"<shard>": [<CRC-32C>, ...]}}}}

``checkpoint`` is a sibling in the same parent, by a plain name (no ``/``, not ``.`` or ``..``);
the reference always names the checkpoint that holds the bytes, never another reference. A reader
checks that the referenced store's ``checksums.json`` names ``save`` and lists exactly these CRCs
for the shards read, and reads the array with the referencing index's shape, data type and shard
shape (the referenced ``zarr.json`` is read and must match).

**Held data.** The state file lists, for each checkpoint, the siblings it ``uses``. Deleting a
checkpoint that a kept one uses deletes its index first (it is no checkpoint any more), then every
object but the arrays the kept ones refer to and their stores' ``checksums.json``: that is *held
data*, removed by :func:`prune` once no kept checkpoint uses it (at a deletion, or a manager's start).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from jaxckpt import _kvstore, _multihost, _storage, _tensorstore_read
from jaxckpt._checksums import StoreChecksums
from jaxckpt._errors import CheckpointCorruptedError, CheckpointFormatError, JaxckptError
from jaxckpt._format import CHECKSUMS_FILE, INDEX_FILE, ArrayLeaf, InArray
from jaxckpt._index_json import decode_index
from jaxckpt._policies import CheckpointInfo
from jaxckpt._refs_json import REFS_FILE, STORE, Ref, decode
from jaxckpt._tree import describe

READ_LIMIT = 64 << 20  # bytes of a refs.json or a referenced checksums.json read at most


def parent(location: _storage.Location) -> _storage.Location:
    """The folder that holds the checkpoint at ``location`` (its siblings are there)."""
    text = location.text.rstrip("/")
    up = text.rsplit("/", 1)[0] if "/" in text else "."
    if location.local is not None:
        return _storage.Location(up, local=location.local.parent)
    store = location.store
    path = store["path"].rstrip("/")
    return _storage.Location(up, kv={**store, "path": path.rsplit("/", 1)[0] + "/" if "/" in path else ""})


def names_used(token: str, writers: Iterable[Any]) -> tuple[str, ...]:
    """The siblings this save refers to, in every process's data store (all processes call it alike)."""
    mine = sorted({r.checkpoint for w in writers for r in w.refs.values()})
    if _multihost.process_count() > 1:
        mine = sorted({n for text in _multihost.gather(f"refs/{token}", json.dumps(mine)) for n in json.loads(text)})
    return tuple(mine)


# --- reading -------------------------------------------------------------------------------------


class _Via(NamedTuple):
    """A referenced array opened in the checkpoint that holds it."""

    reader: _tensorstore_read.Reader
    array: str
    opened: Any
    what: str  # for messages: this checkpoint's key, and what it refers to


class _Named(NamedTuple):
    read: Any
    what: str

    def result(self) -> Any:
        try:
            return self.read.result()
        except (CheckpointCorruptedError, CheckpointFormatError) as e:
            raise CheckpointCorruptedError(f"{self.what}: {e}") from e


class ReferringReader:
    """:class:`jaxckpt._tensorstore_read.Reader` of a data store of format version 6: the arrays its
    ``refs.json`` lists are read from the sibling that holds them, the rest from the store itself."""

    def __init__(self, location: _storage.Location, store: str, save: str, plain: _tensorstore_read.Reader) -> None:
        self._location, self._store, self._save, self._plain = location, store, save, plain
        self._refs: dict[str, Ref] | None = None
        self._targets: dict[tuple[str, str, str], _tensorstore_read.Reader] = {}

    @property
    def check_zarr_json(self) -> bool:
        return self._plain.check_zarr_json

    @check_zarr_json.setter
    def check_zarr_json(self, value: bool) -> None:
        self._plain.check_zarr_json = value

    def refs(self) -> dict[str, Ref]:
        if self._refs is None:
            name = f"{self._store}/{REFS_FILE}"
            data = _storage.read_file(self._location, name, READ_LIMIT)
            self._refs = {} if data is None else decode(data, repr(str(self._location / name)), self._save)
        return self._refs

    def open_arrays(self, requests: Iterable[tuple[str, ArrayLeaf, InArray]]) -> dict[str, Any]:
        requests = list(requests)
        refs = self.refs()
        own = [r for r in requests if r[2].path not in refs]
        out = self._plain.open_arrays(own) if own else {}
        for key, leaf, at in requests:
            if at.path in refs:
                out[key] = self._open_referenced(key, leaf, at, refs[at.path])
        return out

    def _open_referenced(self, key: str, leaf: ArrayLeaf, at: InArray, ref: Ref) -> _Via:
        target = parent(self._location) / ref.checkpoint
        what = (
            f"Cannot read {describe(key)} of the checkpoint {str(self._location)!r}: it refers to array {ref.array!r} "
            f"of data store {ref.store!r} of the checkpoint {str(target)!r} (save {ref.save})"
        )
        sums: list[StoreChecksums] = []

        def load() -> StoreChecksums:
            name = f"{ref.store}/{CHECKSUMS_FILE}"
            data = _storage.read_file(target, name, READ_LIMIT)
            if data is None:
                raise CheckpointCorruptedError(
                    f"the checksums {str(target / name)!r} are missing: its data was deleted"
                )
            sums.append(StoreChecksums(data, repr(str(target / name)), ref.save))
            return sums[-1]

        slot = (ref.checkpoint, ref.store, ref.save)
        if slot not in self._targets:
            self._targets[slot] = _tensorstore_read.Reader((target / ref.store).spec(), version=5, checksums=load)
            self._targets[slot].check_zarr_json = True  # its shape, type and shards: the index's, checked
        reader = self._targets[slot]
        try:
            opened = reader.open_arrays([(key, leaf, dataclasses.replace(at, path=ref.array))])[key]
            found = (sums[-1] if sums else load()).of_array(ref.array)
        except (CheckpointCorruptedError, CheckpointFormatError) as e:
            raise CheckpointCorruptedError(f"{what}, which cannot be read: {e}") from e
        except JaxckptError as e:  # a storage failure stays what it is, named
            raise type(e)(f"{what}: {e}") from e
        wrong = [n for n, crcs in ref.shards.items() if found.get(n) != tuple(crcs)]
        if wrong:
            raise CheckpointCorruptedError(
                f"{what}, but that store's checksums list other data for its shard {wrong[0]}: the data referred to "
                "was replaced or damaged."
            )
        return _Via(reader, ref.array, opened, what)

    def read_regions(self, key: str, path: str, store: Any, regions: Sequence[tuple[slice, ...]]) -> list[Any]:
        if isinstance(store, _Via):
            return [_Named(p, store.what) for p in store.reader.read_regions(key, store.array, store.opened, regions)]
        return self._plain.read_regions(key, path, store, regions)

    def read_pack_spans(self, *args: Any) -> Any:
        return self._plain.read_pack_spans(*args)


# --- held data -----------------------------------------------------------------------------------


def deletions(old: Sequence[CheckpointInfo], kept: Sequence[CheckpointInfo]) -> dict[str, list[str]]:
    """For deleting what ``kept`` no longer lists of ``old``: each dropped checkpoint, and each held
    one that a dropped checkpoint used and that is not listed, with the kept checkpoints that use it
    (empty: nothing is held of it). Empty when no checkpoint uses another."""
    if not any(c.uses for c in old):
        return {}
    listed = {os.path.basename(c.path) for c in kept}

    def users(name: str) -> list[str]:
        return [os.path.basename(k.path) for k in kept if name in k.uses]

    out = {os.path.basename(c.path): users(os.path.basename(c.path)) for c in old if c not in kept}
    for c in old:
        if c not in kept:
            out.update((u, users(u)) for u in c.uses if u not in listed and u not in out)
    return out


def bucket_usage(checkpoint: _storage.Location) -> tuple[int | None, int | None, dict[Any, int]]:
    """A checkpoint in an object store: the bytes its index records (its own and the arrays it holds
    or refers to: a listing there has no sizes, and asking each object is a request per object),
    those of the arrays it refers to, and those arrays by (checkpoint, store, array) -> bytes; None,
    None and nothing if it has no index (or one that does not parse)."""
    try:
        raw = _storage.read_file(checkpoint, INDEX_FILE, _storage.INDEX_READ_LIMIT)
        if raw is None:
            return None, None, {}
        index = decode_index(raw, repr(str(checkpoint / INDEX_FILE)))
        arrays = {
            x.at.path: x.nbytes for x in index.leaves.values() if isinstance(x, ArrayLeaf) and isinstance(x.at, InArray)
        }
        total = len(raw) + sum(leaf.nbytes for leaf in index.leaves.values() if isinstance(leaf, ArrayLeaf))
        referred: dict[Any, int] = {}
        for store in _storage.children(checkpoint) if index.refs else ():
            data = (
                _storage.read_file(checkpoint, f"{store}/{REFS_FILE}", READ_LIMIT) if STORE.fullmatch(store) else None
            )
            for path, r in (decode(data, repr(str(checkpoint / store)), index.save) if data else {}).items():
                referred[(r.checkpoint, r.store, r.array)] = arrays.get(
                    path, 0
                )  # this store's part: all of it, one process
    except JaxckptError:
        return None, None, {}
    return total, sum(referred.values()), referred


def uses_of(checkpoint: _storage.Location) -> tuple[str, ...]:
    """The siblings whose data the checkpoint at ``checkpoint`` refers to, from its data stores'
    ``refs.json`` (for a checkpoint that a manager adopts: the state file did not list it yet)."""
    names: set[str] = set()
    for store in _storage.children(checkpoint):
        if STORE.fullmatch(store):
            data = _storage.read_file(checkpoint, f"{store}/{REFS_FILE}", READ_LIMIT)
            if data is not None:
                names.update(
                    r.checkpoint for r in decode(data, repr(str(checkpoint / store / REFS_FILE)), None).values()
                )
    return tuple(sorted(names))


def prune(target: _storage.Location, users: Sequence[_storage.Location]) -> None:
    """Remove every object of ``target`` (no longer a checkpoint: its index is gone) but the arrays
    that ``users`` refer to and their data stores' checksums. A user's references that cannot be
    read keep everything (the next deletion or start-up tries again)."""
    held: set[tuple[str, str]] = set()
    for user in users:
        for store in _storage.children(user):
            if not STORE.fullmatch(store):
                continue
            try:
                data = _storage.read_file(user, f"{store}/{REFS_FILE}", READ_LIMIT)
                refs = {} if data is None else decode(data, repr(str(user / store / REFS_FILE)), None)
            except (JaxckptError, OSError):
                return
            held.update((r.store, r.array) for r in refs.values() if r.checkpoint == target.name)
    stores = {s for s, _ in held}
    base = target.spec()
    for key in _kvstore.kv_keys(base):
        store, _, rest = key.partition("/")
        if store in stores and (rest == CHECKSUMS_FILE or any(key.startswith(f"{s}/{a}/") for s, a in held)):
            continue
        _kvstore.kv_delete(base, key)
