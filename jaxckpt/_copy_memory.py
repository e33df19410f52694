"""Two tiers: the durable copy of a local checkpoint uploads only what the durable tier lacks.

A local incremental save hard-links the shard files of an unchanged array (:mod:`jaxckpt._incremental`),
so a local file that is the very file (same device and inode) that an earlier copy copied holds
the same bytes. :class:`CopyMemory` (one per two-tier manager, per process) remembers what the last
durable copy put where, and the next copy does not copy such files again:

- **to a bucket**, an array whose every shard file is one the last copy copied (or referred to) as
  one array is stored by reference to the durable checkpoint that holds it (:mod:`jaxckpt._refs`):
  none of its objects is uploaded, and ``<store>/refs.json`` says where they are;
- **to a local folder** on the same file system, such a file is hard-linked from the durable
  checkpoint's copy of it, if that is still the file copied (same inode); otherwise it is copied.

Only the last copy is remembered: the durable tier's retention always keeps the latest checkpoint,
which holds or refers to everything remembered; ``delete`` makes the manager forget.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxckpt._checksums import StoreChecksums, hinted_crcs, read_hint
from jaxckpt._refs_json import STORE, Ref
from jaxckpt._storage import Location

_Key = tuple[tuple[str, int, int], ...]  # an array's shard files: (chunk key, device, inode), sorted


def _arrays(files: Sequence[str]) -> dict[str, list[str]]:
    """The array folders ``<store>/a/<n>`` among ``files`` (relative paths) -> their files."""
    out: dict[str, list[str]] = {}
    for rel in files:
        parts = rel.split("/")
        if len(parts) >= 4 and STORE.fullmatch(parts[0]) and parts[1] == "a":
            out.setdefault("/".join(parts[:3]), []).append(rel)
    return out


def _key(source: Path, array: str, files: Sequence[str]) -> _Key | None:
    shards = []
    for rel in files:
        if rel.startswith(f"{array}/c/"):
            try:
                st = os.stat(source / rel)
            except OSError:
                return None
            shards.append((rel[len(array) + 1 :], st.st_dev, st.st_ino))
    return tuple(sorted(shards)) or None


class CopyMemory:
    """What the last durable copy (of this process) copied or referred to (see the module's docstring)."""

    def __init__(self) -> None:
        self._refs: dict[_Key, Ref] = {}  # bucket: an array's shard files -> where its bytes are
        self._files: dict[tuple[int, int], tuple[str, int]] = {}  # local: (device, inode) -> (copy, its inode)

    def forget(self) -> None:
        self._refs, self._files = {}, {}

    def refer(self, source: Path, files: Sequence[str], save: str) -> dict[str, dict[str, Ref]]:
        """Bucket: the arrays of ``files`` to store by reference, by data store -> array -> Ref."""
        out: dict[str, dict[str, Ref]] = {}
        sums: dict[str, StoreChecksums | None] = {}
        for array, array_files in _arrays(files).items():
            key = _key(source, array, array_files)
            ref = self._refs.get(key) if key is not None else None
            if ref is None:
                continue
            store, path = array.split("/", 1)
            crcs = _crcs(source, store, path, save, sums)
            if crcs and set(crcs) <= set(ref.shards) and all(ref.shards[n] == c for n, c in crcs.items()):
                out.setdefault(store, {})[path] = ref._replace(shards=crcs)
        return out

    def link(self, target: Path, path: Path) -> bool:
        """Local: hard-link the copy of ``path`` that the last copy made to ``target``; whether it did."""
        try:
            st = os.stat(path)
            copied = self._files.get((st.st_dev, st.st_ino))
            if copied is None:
                return False
            os.link(copied[0], target)
            if os.stat(target).st_ino == copied[1]:
                return True
            os.unlink(target)  # another file was put at the copy's path since
        except OSError:
            pass
        return False

    def remember(
        self, source: Path, files: Sequence[str], dest: Location, save: str, refs: Mapping[str, Mapping[str, Ref]]
    ) -> None:
        """After a copy of ``files`` of ``source`` published at ``dest`` (which refers to ``refs``)."""
        if dest.local is not None:
            found: dict[tuple[int, int], tuple[str, int]] = {}
            for rel in files:
                try:
                    st, copy = os.stat(source / rel), os.stat(dest.local / rel)
                except OSError:
                    continue
                found[(st.st_dev, st.st_ino)] = (str(dest.local / rel), copy.st_ino)
            self._files = found
            return
        remembered: dict[_Key, Ref] = {}
        sums: dict[str, StoreChecksums | None] = {}
        for array, array_files in _arrays(files).items():
            key = _key(source, array, array_files)
            store, path = array.split("/", 1)
            ref = refs.get(store, {}).get(path)
            if ref is None:
                crcs = _crcs(source, store, path, save, sums)
                ref = Ref(dest.name, store, path, save, crcs) if crcs else None
            if key is not None and ref is not None:
                remembered[key] = ref
        self._refs = remembered


def _crcs(
    source: Path, store: str, path: str, save: str, sums: dict[str, StoreChecksums | None]
) -> dict[int, tuple[int, ...]]:
    """The CRCs that the local checkpoint's ``checksums.json`` lists for array ``path`` of ``store``."""
    if store not in sums:
        sums[store] = read_hint(Location(str(source), local=source), store, save)
    return dict(hinted_crcs(sums[store], path))


def uses(refs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    return sorted({r.checkpoint for by_array in refs.values() for r in by_array.values()})
