"""Reading an array that a checkpoint stores by reference (format version 6, buckets): its shards are
in a sibling checkpoint of the same parent, which ``<store>/refs.json`` names (its encoding and
parser: :mod:`jaxckpt.format.refs_json`).

A reader checks that the referenced store's ``checksums.json`` names the save the reference names and
lists exactly its CRCs for the shards read, and reads the array with the referencing index's shape,
data type and shard shape (the referenced ``zarr.json`` is read and must match). What writes such
references, and which data retention must keep for them, is :mod:`jaxckpt.incremental`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from jaxckpt._errors import CheckpointCorruptedError, CheckpointFormatError, JaxckptError
from jaxckpt.arrays import store_read
from jaxckpt.arrays.checksums import StoreChecksums
from jaxckpt.format.keys import describe
from jaxckpt.format.records import CHECKSUMS_FILE, ArrayLeaf, InArray
from jaxckpt.format.refs_json import REFS_FILE, Ref, decode
from jaxckpt.storage import locations

READ_LIMIT = 64 << 20  # bytes of a refs.json or a referenced checksums.json read at most


def parent(location: locations.Location) -> locations.Location:
    """The folder that holds the checkpoint at ``location`` (its siblings are there)."""
    text = location.text.rstrip("/")
    up = text.rsplit("/", 1)[0] if "/" in text else "."
    if location.local is not None:
        return locations.Location(up, local=location.local.parent)
    store = location.store
    path = store["path"].rstrip("/")
    return locations.Location(up, kv={**store, "path": path.rsplit("/", 1)[0] + "/" if "/" in path else ""})


class _Via(NamedTuple):
    """A referenced array opened in the checkpoint that holds it."""

    reader: store_read.Reader
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
    """:class:`jaxckpt.arrays.store_read.Reader` of a data store of format version 6: the arrays its
    ``refs.json`` lists are read from the sibling that holds them, the rest from the store itself."""

    def __init__(self, location: locations.Location, store: str, save: str, plain: store_read.Reader) -> None:
        self._location, self._store, self._save, self._plain = location, store, save, plain
        self._refs: dict[str, Ref] | None = None
        self._targets: dict[tuple[str, str, str], store_read.Reader] = {}

    @property
    def check_zarr_json(self) -> bool:
        return self._plain.check_zarr_json

    @check_zarr_json.setter
    def check_zarr_json(self, value: bool) -> None:
        self._plain.check_zarr_json = value

    def refs(self) -> dict[str, Ref]:
        if self._refs is None:
            name = f"{self._store}/{REFS_FILE}"
            data = locations.read_file(self._location, name, READ_LIMIT)
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
            data = locations.read_file(target, name, READ_LIMIT)
            if data is None:
                raise CheckpointCorruptedError(
                    f"the checksums {str(target / name)!r} are missing: its data was deleted"
                )
            sums.append(StoreChecksums(data, repr(str(target / name)), ref.save))
            return sums[-1]

        slot = (ref.checkpoint, ref.store, ref.save)
        if slot not in self._targets:
            self._targets[slot] = store_read.Reader((target / ref.store).spec(), version=5, checksums=load)
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
