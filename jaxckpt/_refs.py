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
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from jaxckpt import _kvstore, _multihost, _storage, _tensorstore_read
from jaxckpt._checked_json import check_checksum, checksummed_json
from jaxckpt._checksums import StoreChecksums
from jaxckpt._errors import CheckpointCorruptedError, CheckpointFormatError, JaxckptError
from jaxckpt._format import CHECKSUMS_FILE, ArrayLeaf, InArray
from jaxckpt._policies import CheckpointInfo
from jaxckpt._tree import describe

REFS_FILE = "refs.json"
FORMAT = "jaxckpt-refs"
READ_LIMIT = 64 << 20  # bytes of a refs.json or a referenced checksums.json read at most
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")  # a sibling: no "/", not "." or ".."
_STORE = re.compile(r"^data(\.p[1-9][0-9]{0,5})?$")
_ARRAY = re.compile(r"^a/[0-9]{1,9}$")
_SAVE = re.compile(r"^[0-9a-f]{1,64}$")
_SHARD = re.compile(r"^(0|[1-9][0-9]{0,17})$")


class Ref(NamedTuple):
    """Where the shards of an array are: array ``array`` of data store ``store`` of the sibling
    ``checkpoint``, written by save ``save``; ``shards``: shard number -> CRC-32C of its inner chunks."""

    checkpoint: str
    store: str
    array: str
    save: str
    shards: Mapping[int, tuple[int, ...]]


def is_plain_name(name: object) -> bool:
    return isinstance(name, str) and bool(_NAME.fullmatch(name))


def encode(save: str, refs: Mapping[str, Ref]) -> bytes:
    arrays = {
        path: {
            "checkpoint": r.checkpoint,
            "store": r.store,
            "array": r.array,
            "save": r.save,
            "shards": {str(n): list(c) for n, c in sorted(r.shards.items())},
        }
        for path, r in refs.items()
    }
    return checksummed_json({"format": FORMAT, "save": save, "arrays": arrays})


def decode(data: bytes, where: str, save: str | None) -> dict[str, Ref]:
    """The references of a ``refs.json``, every field checked; ``save``: the index's (None: not checked)."""

    def damaged(what: str) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(f"The references {where} are damaged: {what}.")

    try:
        body = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise damaged(f"it is not valid JSON ({e})") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise damaged(f'it has no "format": "{FORMAT}" field')
    check_checksum(data, body, where)
    if save is not None and body.get("save") != save:
        raise damaged(f"it was written by save {str(body.get('save'))[:80]!r}, not by save {save!r} of the index")
    arrays = body.get("arrays")
    if not isinstance(arrays, dict):
        raise damaged("its field 'arrays' is not an object")
    out = {}
    for path, raw in arrays.items():
        ok = isinstance(raw, dict) and _ARRAY.fullmatch(path) and set(raw) == set(Ref._fields)
        ok = ok and is_plain_name(raw["checkpoint"]) and isinstance(raw["store"], str) and isinstance(raw["array"], str)
        ok = ok and bool(_STORE.fullmatch(raw["store"]) and _ARRAY.fullmatch(raw["array"]))
        ok = ok and isinstance(raw["save"], str) and bool(_SAVE.fullmatch(raw["save"]))
        shards = raw.get("shards") if isinstance(raw, dict) else None
        shards = shards if isinstance(shards, dict) else {}
        ok = ok and bool(shards)
        ok = ok and all(
            _SHARD.fullmatch(n) and isinstance(v, list) and all(type(c) is int and 0 <= c < 1 << 32 for c in v)
            for n, v in shards.items()
        )
        if not ok:
            raise damaged(
                f"its entry for {str(path)[:80]!r} is not a reference (a plain sibling name, a data store, an array "
                "a/<n>, a save id and shard CRCs)"
            )
        out[path] = Ref(
            raw["checkpoint"], raw["store"], raw["array"], raw["save"], {int(n): tuple(v) for n, v in shards.items()}
        )
    return out


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


def prune(target: _storage.Location, users: Sequence[_storage.Location]) -> None:
    """Remove every object of ``target`` (no longer a checkpoint: its index is gone) but the arrays
    that ``users`` refer to and their data stores' checksums. A user's references that cannot be
    read keep everything (the next deletion or start-up tries again)."""
    held: set[tuple[str, str]] = set()
    for user in users:
        for store in _storage.children(user):
            if not _STORE.fullmatch(store):
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
