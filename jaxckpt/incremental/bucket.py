"""Incremental checkpoints on buckets: a manager's save stores an unchanged ``jax.Array`` by
reference to the sibling checkpoint that holds its shards (:mod:`jaxckpt.incremental.refs`), instead of
uploading it again.

What is unchanged is decided as on local disks (:mod:`jaxckpt.incremental.local`): the very object the
manager last saved or restored (a weak reference to it), not deleted, whose shards this process
would write are exactly those remembered (same shape, stored type, shard shape and shard numbers).
:class:`BucketMemory` remembers, for each such array, the *holder* of its bytes: the checkpoint
that wrote them (never one that refers to them: no chains), its data store, array, save and the
CRCs of its shards. A reference needs nothing from the bucket at save time; its shards stay as long
as a kept checkpoint uses them (held data, see :mod:`jaxckpt.incremental.refs`): the manager's last save is
always kept, and it either holds or refers to everything remembered. ``delete(step)`` may drop it,
so the manager makes its memory forget then (:meth:`BucketMemory.forget`).

Leaves that a bucket save packs (up to ``BUCKET_PACK_LEAF_LIMIT`` on process 0) are always written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxckpt._errors import JaxckptError
from jaxckpt.arrays import store_write
from jaxckpt.arrays.checksums import StoreChecksums, hinted_crcs, read_hint
from jaxckpt.arrays.zarr_local import shards_in
from jaxckpt.arrays.zarr_meta import shard_number
from jaxckpt.format.records import ArrayLeaf, InArray, data_store
from jaxckpt.format.refs_json import REFS_FILE, Ref, decode
from jaxckpt.incremental import memories
from jaxckpt.incremental.local import Memory, in_host_memory, same_crcs
from jaxckpt.incremental.refs import names_used
from jaxckpt.reading.refs import READ_LIMIT, parent
from jaxckpt.saving.reuse import Linked
from jaxckpt.saving.snapshot import owners, process_of
from jaxckpt.storage import locations


@dataclasses.dataclass
class _Entry:
    ref: weakref.ref[jax.Array]
    chunks: tuple[int, ...]
    stored: str
    holder: Ref | None = None  # saved: where its shards (this process's) are
    restored: tuple[locations.Location, str, str, int] | None = None  # restored: checkpoint, array, save, version


def plan(x: jax.Array, me: int, pack_limit: int) -> tuple[tuple[int, ...], set[int]] | None:
    """The shard shape of ``x`` on a bucket and the numbers of the shards this process writes, as
    ``_save`` decides them; None if it is packed."""
    owned = owners(x)
    procs = {process_of(d) for d in owned.values()}
    if x.nbytes <= pack_limit and procs == {0}:
        return None
    shape, itemsize = tuple(x.shape), np.dtype(x.dtype).itemsize
    shards = [max(b - a for a, b in dims) for dims in zip(*owned)] if shape else []
    grouped = procs == {0} and len(owned) > 1 and all(lo % s == 0 for box in owned for (lo, _), s in zip(box, shards))
    if grouped:
        shards = store_write.bucket_shard(shape, shards, itemsize)
    chunks = tuple(store_write.chunk_shape(shape, shards, itemsize))
    numbers = {
        shard_number(position, shape, chunks)
        for box, device in owned.items()
        if process_of(device) == me
        for position, _ in shards_in(box, chunks, shape)
    }
    return chunks, numbers


class BucketMemory:
    """What one bucket manager last saved or restored, in this process (see the module's docstring)."""

    def __init__(self, directory: locations.Location) -> None:
        self.directory = directory.text.rstrip("/")
        self._entries: dict[int, _Entry] = {}
        self._restored: dict[int, _Entry] = {}
        self._stores: dict[tuple[str, str], tuple[dict[str, Ref], StoreChecksums | None]] = {}
        memories.watch(self)  # restores of its checkpoints outside its calls count too (TF's idiom)

    @staticmethod
    def uses(token: str, writers: Iterable[Any]) -> tuple[str, ...]:
        """The siblings a save refers to, in every process's data store (every process calls it alike)."""
        return names_used(token, writers)

    def forget(self) -> None:
        self._entries, self._restored, self._stores = {}, {}, {}

    def close(self) -> None:
        """The manager is closed: it saves no more, so it remembers nothing more."""
        memories.unwatch(self)
        self.forget()

    by_reference = True

    def link(
        self, leaves: Mapping[str, Any], staging: locations.Location, me: int, pack_limit: int, own_copy: bool
    ) -> dict[str, Linked] | None:
        """The leaves that are remembered arrays, each as a reference to the shards that hold it; None
        for a save to a local disk or of a process's own copy."""
        if staging.local is not None or own_copy:
            return None
        out: dict[str, Linked] = {}
        if not (self._entries or self._restored):
            return out
        store = data_store(me)
        for key, x in leaves.items():
            entry = self._entries.get(id(x)) or self._restored.get(id(x))
            if entry is None or entry.ref() is not x or not isinstance(x, jax.Array):
                continue
            if x.is_deleted() or not isinstance(x.dtype, np.dtype):  # a deleted one is refused as ever
                continue
            planned = plan(x, me, pack_limit)
            stored = store_write.stored_dtype(np.dtype(x.dtype), local=False)
            if planned is None or planned[0] != entry.chunks or entry.stored != stored or not planned[1]:
                continue
            holder = entry.holder if entry.restored is None else self._holder_of_restored(entry, store)
            if holder is None or not planned[1] <= set(holder.shards):
                continue
            ref = holder._replace(shards={n: holder.shards[n] for n in sorted(planned[1])})
            if in_host_memory(x) and not same_crcs(x, entry.chunks, ref.shards):
                continue  # its buffer may be a host array's, changed in place since (may_alias, dlpack)
            out[key] = Linked(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), planned[0], {store: ref})
        return out

    def _holder_of_restored(self, entry: _Entry, store: str) -> Ref | None:
        """Where the shards of a restored array are: what its checkpoint refers to, or that checkpoint."""
        assert entry.restored is not None
        folder, array, save, version = entry.restored
        slot = (folder.text, store)
        if slot not in self._stores:
            try:
                refs: dict[str, Ref] = {}
                if version >= 6:
                    data = locations.read_file(folder, f"{store}/{REFS_FILE}", READ_LIMIT)
                    refs = {} if data is None else decode(data, repr(str(folder / store / REFS_FILE)), save)
            except (OSError, JaxckptError):
                refs = {}
            self._stores[slot] = (refs, read_hint(folder, store, save))
        refs, sums = self._stores[slot]
        if array in refs:
            return refs[array]
        shards = hinted_crcs(sums, array)
        return Ref(folder.name, store, array, save, shards) if shards else None

    def remember(
        self,
        dest: locations.Location,
        save: str,
        refs: Mapping[str, weakref.ref[jax.Array]],
        leaves: Mapping[str, Any],
        writers: Mapping[str, Any],
    ) -> None:
        """After a save published at ``dest``: where this process's shards of its arrays are."""
        entries: dict[int, _Entry] = {}
        for key, weak in refs.items():
            leaf, x = leaves.get(key), weak()
            if x is None or not isinstance(leaf, ArrayLeaf) or not isinstance(leaf.at, InArray) or not leaf.at.chunks:
                continue
            at = leaf.at
            for store, writer in writers.items():
                holder = writer.refs.get(at.path)
                if holder is None and writer.checksums.get(at.path):
                    holder = Ref(dest.name, store, at.path, save, dict(writer.checksums[at.path]))
                if holder is not None:
                    entries[id(x)] = _Entry(weak, tuple(at.chunks or ()), at.stored, holder=holder)
        self._entries, self._restored, self._stores = entries, {}, {}

    def loaded(self, opened: Any, values: Mapping[str, Any]) -> None:
        """A restore's values (``memories.loaded``): the arrays read unchanged from a sibling in this directory."""
        index, location = opened.index, opened.location
        if location.local is not None or index.save is None or parent(location).text.rstrip("/") != self.directory:
            return
        for key, x in values.items():
            leaf = index.leaves.get(key)
            if memories.read_as_stored(x, leaf):
                restored = (location, leaf.at.path, index.save, index.version)
                self._restored[id(x)] = _Entry(weakref.ref(x), tuple(leaf.at.chunks), leaf.at.stored, restored=restored)

    def restoring(self) -> contextlib.AbstractContextManager[None]:
        """Remember what the restores inside return."""
        return memories.restoring(self)


def memory_for(path: locations.Location) -> Memory | BucketMemory | None:
    """An incremental manager's memory: hard links on a local disk, references in an s3:// or gs:// bucket."""
    if path.local is not None:
        return Memory(path.local)
    return BucketMemory(path) if path.text.startswith(("s3://", "gs://")) else None
