"""Two tiers: the durable copy of a local checkpoint uploads only what the durable tier lacks.

A local incremental save hard-links the shard files of an unchanged array (:mod:`jaxckpt.incremental.local`),
so a local file that is the very file (same device and inode) that an earlier copy copied holds
the same bytes. :class:`CopyMemory` (one per two-tier manager, per process) remembers what the last
durable copy put where, and the next copy does not copy such files again:

- **to a bucket**, an array whose every shard file is one the last copy copied (or referred to) as
  one array is stored by reference to the durable checkpoint that holds it (:mod:`jaxckpt.incremental.refs`):
  none of its objects is uploaded, and ``<store>/refs.json`` says where they are;
- **to a local folder** on the same file system, the shard files of such an array are hard-linked
  from the durable checkpoint's copies of them, if those are still the files copied (same inode);
  otherwise they are copied.

In both cases the array's CRC-32Cs that the new checkpoint's ``checksums.json`` lists must equal
those of the array copied before, and each local file's size and modification time too (an
incremental save's hard link keeps both; a new file has its own). An inode
alone does not name a file's bytes: the file system gives the inode of a file that local retention
deleted to a new file, often in the very next save, and a pack (rewritten at every save) would then
be linked with the old checkpoint's bytes. Packs, ``zarr.json`` files and the index are always copied.

Only the last copy is remembered: the durable tier's retention always keeps the latest checkpoint,
which holds or refers to everything remembered; ``delete`` makes the manager forget.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from jaxckpt.arrays.checksums import StoreChecksums, hinted_crcs, read_hint
from jaxckpt.format.refs_json import STORE, Ref
from jaxckpt.storage.locations import Location

# An array's shard files: (chunk key, device, inode, size, modification time), sorted. An inode alone
# is weak evidence (see the module's docstring), for a bucket's durable tier as for a local one.
_Key = tuple[tuple[str, int, int, int, int], ...]


def _arrays(files: Sequence[str]) -> dict[str, list[str]]:
    """The array folders ``<store>/a/<n>`` among ``files`` (relative paths) -> their files."""
    out: dict[str, list[str]] = {}
    for rel in files:
        parts = rel.split("/")
        if len(parts) >= 4 and STORE.fullmatch(parts[0]) and parts[1] == "a":
            out.setdefault("/".join(parts[:3]), []).append(rel)
    return out


def _shards(array: str, files: Sequence[str]) -> list[str]:
    return [rel for rel in files if rel.startswith(f"{array}/c/")]


def _key(source: Path, array: str, files: Sequence[str]) -> _Key | None:
    shards = []
    for rel in _shards(array, files):
        try:
            st = os.stat(source / rel)
        except OSError:
            return None
        shards.append((rel[len(array) + 1 :], st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(sorted(shards)) or None


def _copied(source: Path, dest: Path, rel: str) -> Copied:
    st = os.stat(source / rel)
    return Copied(str(dest / rel), os.stat(dest / rel).st_ino, st.st_size, st.st_mtime_ns)


def link(target: Path, path: Path, copied: Copied) -> bool:
    """Local: hard-link ``copied`` (see :meth:`CopyMemory.linkable`) to ``target`` if ``path`` is still the
    file copied then and the copy still the one made; whether it did."""
    try:
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns) != (copied.size, copied.mtime_ns):
            return False
        os.link(copied.copy, target)
        if os.stat(target).st_ino == copied.inode:
            return True
        os.unlink(target)  # another file was put at the copy's path since
    except OSError:
        pass
    return False


class Copied(NamedTuple):
    """A shard file that the last copy copied to a local folder."""

    copy: str  # the durable checkpoint's copy of it
    inode: int  # the copy's inode then
    size: int  # the local file's size and modification time then
    mtime_ns: int


class CopyMemory:
    """What the last durable copy (of this process) copied or referred to (see the module's docstring)."""

    def __init__(self) -> None:
        self._refs: dict[_Key, Ref] = {}  # bucket: an array's shard files -> where its bytes are
        # local: an array's shard files -> its listed CRCs, and each shard file's copy by chunk key
        self._copies: dict[_Key, tuple[dict[int, tuple[int, ...]], dict[str, Copied]]] = {}

    def forget(self) -> None:
        self._refs, self._copies = {}, {}

    def refer(self, source: Path, files: Sequence[str], save: str) -> dict[str, dict[str, Ref]]:
        """Bucket: the arrays of ``files`` to store by reference, by data store -> array -> Ref."""
        out: dict[str, dict[str, Ref]] = {}
        sums: dict[str, StoreChecksums | None] = {}
        for array, key, crcs in self._known(source, files, save, self._refs, sums):
            ref = self._refs[key]
            if set(crcs) <= set(ref.shards) and all(ref.shards[n] == c for n, c in crcs.items()):
                store, path = array.split("/", 1)
                out.setdefault(store, {})[path] = ref._replace(shards=crcs)
        return out

    def linkable(self, source: Path, files: Sequence[str], save: str) -> dict[str, Copied]:
        """Local: the shard files of ``files`` (relative paths) that the last copy copied, as arrays
        whose listed CRCs are unchanged -> their copies, to hard-link (:func:`link`)."""
        out: dict[str, Copied] = {}
        for array, key, crcs in self._known(source, files, save, self._copies, {}):
            listed, copies = self._copies[key]
            if crcs == listed:
                out.update({f"{array}/{chunk}": copied for chunk, copied in copies.items()})
        return out

    @staticmethod
    def _known(
        source: Path, files: Sequence[str], save: str, known: Mapping[_Key, Any], sums: dict[str, StoreChecksums | None]
    ) -> list[tuple[str, _Key, dict[int, tuple[int, ...]]]]:
        """The arrays of ``files`` whose shard files are those of an array in ``known``, with their
        key there and the CRCs the checkpoint lists for them (arrays it lists none for are left out)."""
        out = []
        for array, array_files in _arrays(files).items():
            key = _key(source, array, array_files)
            if key is None or key not in known:
                continue
            store, path = array.split("/", 1)
            crcs = _crcs(source, store, path, save, sums)
            if crcs:
                out.append((array, key, crcs))
        return out

    def remember(
        self, source: Path, files: Sequence[str], dest: Location, save: str, refs: Mapping[str, Mapping[str, Ref]]
    ) -> None:
        """After a copy of ``files`` of ``source`` published at ``dest`` (which refers to ``refs``)."""
        sums: dict[str, StoreChecksums | None] = {}
        if dest.local is not None:
            self._copies = {}
            for array, array_files in _arrays(files).items():
                key = _key(source, array, array_files)
                store, path = array.split("/", 1)
                crcs = _crcs(source, store, path, save, sums) if key is not None else None
                if key is None or not crcs:
                    continue
                try:
                    self._copies[key] = (
                        crcs,
                        {
                            rel[len(array) + 1 :]: _copied(source, dest.local, rel)
                            for rel in _shards(array, array_files)
                        },
                    )
                except OSError:
                    continue
            return
        remembered: dict[_Key, Ref] = {}
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
