"""Saving: leaves become index records and array data, written into a staging folder and published."""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import crc32c
import jax
import numpy as np

from jaxckpt._errors import UnsupportedValueError
from jaxckpt._gc_pause import gc_paused, pause
from jaxckpt._version import __version__
from jaxckpt.arrays import store_write
from jaxckpt.format import records as _format
from jaxckpt.format.index_encode import encode_index
from jaxckpt.format.keys import describe
from jaxckpt.format.records import (
    DATA_DIR,
    JAX,
    ArrayLeaf,
    InArray,
    Index,
    InPack,
    Layout,
    Leaf,
    MeshRecord,
    Pack,
    ValueLeaf,
    data_store,
)
from jaxckpt.runtime import multihost
from jaxckpt.runtime.spread import spec_axes
from jaxckpt.saving import process_states
from jaxckpt.saving import staging as _staging
from jaxckpt.saving.reuse import Linked, Reuse, arrays_of_their_own
from jaxckpt.saving.save_dtypes import SaveDtypes, cast_leaves
from jaxckpt.saving.snapshot import (
    Deferred,
    Taker,
    check_live_and_copy,
    own_copy_parts,
    process_of,
    take_leaves,
    whole,
    write_sharding,
)
from jaxckpt.saving.snapshot import owners as _owners
from jaxckpt.saving.snapshot import region as _region
from jaxckpt.storage import locations, statefile
from jaxckpt.storage.local_files import bytes_of
from jaxckpt.tree.objects import Flat
from jaxckpt.tree.structure import flatten_saved


def describe_sharding(x: jax.Array | jax.ShapeDtypeStruct) -> str | None:
    sharding = x.sharding
    if len(sharding.device_set) <= 1:
        return None
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"NamedSharding(mesh={dict(sharding.mesh.shape)}, spec={tuple(sharding.spec)})"
    return f"{type(sharding).__name__}({len(sharding.device_set)} devices)"


class _Packer:
    """Lays small leaves end to end into packs of about ``target`` bytes each."""

    def __init__(self, target: int = store_write.PACK_TARGET_BYTES) -> None:
        self.target = target
        self.packs: list[list[tuple[int, memoryview]]] = []
        self.sizes: list[int] = []
        self._built = 0  # packs before this one were handed to a writer

    def add(self, data: np.ndarray | memoryview) -> InPack:
        """``data``: an array, or the bytes of one (a memoryview of format "B")."""
        raw = data if isinstance(data, memoryview) else bytes_of(np.ascontiguousarray(data))
        size = raw.nbytes
        if self._built == len(self.packs) or self.sizes[-1] + size > self.target:
            self.packs.append([])
            self.sizes.append(0)
        offset = -(-self.sizes[-1] // store_write.PACK_ALIGN) * store_write.PACK_ALIGN
        self.packs[-1].append((offset, raw))
        self.sizes[-1] = offset + size
        return InPack(len(self.packs) - 1, offset, size, crc32c.crc32c(raw))

    def hand_over(self, writer: store_write.Writer, *, last: bool) -> None:
        """Give the writer every complete pack (and the last one too if ``last``: the next leaf then
        starts a new pack), then forget their leaves."""
        end = len(self.packs) if last else len(self.packs) - 1
        for i in range(self._built, end):
            writer.add_pack(f"p/{i}", self.sizes[i], self.packs[i])
            self.packs[i] = []
        self._built = max(self._built, end)


def _layout(
    x: jax.Array | jax.ShapeDtypeStruct, owners: dict[tuple[tuple[int, int], ...], Any], meshes: dict[int, Any]
) -> Layout | None:
    """The layout (mesh and partition spec) that gives exactly these owners' regions, or None when
    the sharding has none (not a NamedSharding, uneven shards, an unusual spec): its regions are then
    listed. ``meshes`` maps id(jax mesh) -> (mesh, MeshRecord), shared by the arrays of one save.
    The sharding is the one the save writes: for an array replicated over processes, the finer one
    that spreads its writes (:func:`jaxckpt.saving.snapshot.write_sharding`)."""
    sharding = write_sharding(x)
    if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return None
    mesh = sharding.mesh
    spec = spec_axes(sharding.spec, x.ndim)
    if not all(isinstance(a, str) for a in mesh.axis_names) or spec is None:
        return None
    known = meshes.get(id(mesh))
    if known is None:
        devices = list(mesh.devices.flat)
        record = MeshRecord(
            tuple(mesh.axis_names),
            tuple(mesh.devices.shape),
            tuple(d.id for d in devices),
            tuple(d.process_index for d in devices),
        )
        for _, other in meshes.values():  # an equal mesh in another object: recorded once
            if (other.axes, other.shape, other.devices) == (record.axes, record.shape, record.devices):
                record = other
                break
    else:
        record = known[1]
    layout = Layout(record, tuple(spec))
    sizes = dict(zip(record.axes, record.shape))
    if any(a not in sizes for axes in spec for a in axes):
        return None
    if any(n % np.prod([sizes[a] for a in axes], dtype=int) for n, axes in zip(x.shape, spec)):
        return None
    computed = {
        tuple(box): store
        for store, box in _format.pieces(InArray("", "", layout=layout), x.shape, [(0, n) for n in x.shape])
    }
    if computed != {region: data_store(process_of(d)) for region, d in owners.items()}:
        return None
    meshes.setdefault(id(mesh), (mesh, record))
    return layout


def host_memory_budget() -> int:
    """Bytes of snapshot copies a save may hold before it writes some out (``JAXCKPT_HOST_MEMORY_BUDGET``)."""
    configured = os.environ.get("JAXCKPT_HOST_MEMORY_BUDGET")
    if configured:
        return int(configured)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):  # not POSIX
        return 4 << 30


def _nothing() -> None:
    pass


@dataclasses.dataclass
class Prepared:
    """A save whose snapshot is taken: what remains can run in the background (:func:`write_and_publish`)."""

    path: str
    dest: locations.Location
    staging: locations.Location
    token: str
    overwrite: bool
    records: _Records
    flat: Flat
    # What the snapshot took, by key, not recorded yet (None once recorded): write_and_publish records
    # it first, so that an async save's caller waits only for the snapshot.
    taken: dict[str, Any] | None
    index: Index | None = None
    # Each process's own whole copy on its own disk (a two-tier manager's local tier): every process
    # publishes its folder, with the packs and every region it holds, in the store the index names.
    own_copy: bool = False
    # Mark the checkpoint unlisted (statefile.UNRECORDED) until a state file lists it: set by the
    # primary of a manager's or Checkpoint.save's save. Written by write_and_publish, which removes
    # the staging folder if that fails too.
    unlisted: bool = False
    end_pause: Callable[[], None] = _nothing  # ends prepare's pause of the garbage collector
    # A manager's incremental saves: what it remembers, and the arrays of this save, for the next.
    memory: Reuse | None = None
    refs: dict[str, Any] = dataclasses.field(default_factory=dict)
    uses: tuple[str, ...] = ()  # the siblings it refers to (buckets: jaxckpt.incremental.refs)


def prepare(
    dest: locations.Location,
    root: Any,
    *,
    overwrite: bool = False,
    budget: int | None = None,
    own_copy: bool = False,
    memory: Reuse | None = None,
    save_dtypes: SaveDtypes = None,
) -> Prepared:
    """The blocking part of a save: check the destination and every leaf, and take the snapshot
    (:mod:`jaxckpt.saving.snapshot`); the records, packs and index are made by :func:`write_and_publish`.

    Every process of a multi-process run calls it alike; each snapshots the regions it owns. When
    the snapshot's copies would outgrow the host memory budget, the leaves are recorded here instead,
    and what is recorded so far is written out first, so a state larger than the budget costs a
    longer call, not more memory. ``budget`` overrides :func:`host_memory_budget`. ``own_copy``: each
    process writes a whole checkpoint of its own at ``dest`` (its own disk), holding the packs and
    every region it has (see :class:`Prepared`). ``memory``: a manager's, whose unchanged arrays are
    hard-linked on local disks, referred to on buckets (:mod:`jaxckpt.saving.reuse`). ``save_dtypes``:
    the dtype of the saved copy of some leaves (:mod:`jaxckpt.saving.save_dtypes`).

    The garbage collector stays paused until what was taken is recorded: the collection it put off
    (of every object the snapshot made) then runs there, not in the caller's thread as the call ends.
    """
    end_pause = pause()
    try:
        p = _prepare(dest, root, overwrite, budget, own_copy, memory, save_dtypes)
    except BaseException:
        end_pause()
        raise
    if p.taken is None:
        end_pause()
    else:
        p.end_pause = end_pause
        weakref.finalize(p, end_pause)  # a save dropped unwritten (every process's agreement failed)
    return p


def _prepare(
    dest: locations.Location,
    root: Any,
    overwrite: bool,
    budget: int | None,
    own_copy: bool,
    memory: Reuse | None,
    save_dtypes: SaveDtypes,
) -> Prepared:
    keys = _staging.check_writable(dest, overwrite)  # in an object store: what is there, listed once
    flat = flatten_saved(root)
    if save_dtypes is not None:  # copies, before any leaf is linked or taken: a cast is never the array itself
        flat.leaves = cast_leaves(flat, save_dtypes)
    me = multihost.process_index()
    if own_copy and dest.local is None:
        raise ValueError(f"A process's own copy goes to its local disk, not to {dest.text!r}.")
    if me == 0:
        _staging.clear_for_save(dest, keys)  # object stores: before the token lets the others write
    token = multihost.shared_token()
    staging = _staging.staging_folder(dest, token, own=own_copy)
    try:
        limit = host_memory_budget() if budget is None else budget
        writer = store_write.Writer((staging / data_store(me)).spec())
        writer.incremental = memory is not None and memory.by_reference  # alike in every process: array numbers agree
        records = _Records(writer, me, limit, staging if own_copy else None)
        if not writer.local:  # an object store: packs sized by the data (see store_write.pack_target)
            records.packer.target = _pack_target(flat, writer.pack_leaf_limit)
        linked: dict[str, Linked] = {}
        if memory is not None:  # None where it does not apply here: nothing to remember for the next either
            found = memory.link(flat.leaves, staging, me, writer.pack_leaf_limit, own_copy)
            memory, linked = (None, {}) if found is None else (memory, found)
        rest = {k: x for k, x in flat.leaves.items() if k not in linked} if linked else flat.leaves
        not_arrays = flat.not_arrays if rest is flat.leaves else None
        taken = take_leaves(rest, me, own_copy, limit, writer.pack_leaf_limit, not_arrays)
        if taken is not None and linked:  # in leaf order, as every process records them
            taken = {k: linked[k] if k in linked else taken[k] for k in flat.leaves}
        p = Prepared(dest.text, dest, staging, token, overwrite, records, flat, taken, own_copy=own_copy)
        if memory is not None:  # what the next save may link or refer to
            p.memory, p.refs = memory, arrays_of_their_own(flat.leaves, writer.pack_leaf_limit)
        if p.taken is None:  # over the budget: recorded, and written out in parts, here
            taker = Taker(me, own_copy, eager=True, pack_limit=writer.pack_leaf_limit)
            check_live_and_copy(rest)
            for key, x in flat.leaves.items():
                records.add(key, linked[key] if key in linked else taker.take(key, x))
            p.index = records.index(flat)
        if own_copy:
            records.writer_for(DATA_DIR)  # opened now: write_and_publish hands the last pack to it
        # Taken: holding the leaves would keep the caller's old arrays (and device memory) alive
        # until the background is done.
        flat.leaves = {}
    except BaseException:
        if me == 0 or own_copy:  # the others may be writing into it; a manager removes what is left
            _staging.discard(staging)
        raise
    return p


def _pack_target(flat: Flat, pack_limit: int) -> int:
    """The bytes a pack holds at most on an object store (:func:`jaxckpt.arrays.store_write.pack_target`),
    from the arrays' sizes: the same in every process, whatever each holds."""
    total = largest = 0
    for x in flat.leaves.values():
        try:
            nbytes = math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
        except (AttributeError, TypeError, ValueError):  # a Python value, or a PRNG key (small)
            continue
        total += nbytes
        if nbytes <= pack_limit:
            largest = max(largest, nbytes)
    return store_write.pack_target(total, largest)


class _Records:
    """The index records of one save's leaves, made from what was taken, and the data they hand
    over: small leaves to packs, large ones to the writer as arrays of their own."""

    def __init__(
        self, writer: store_write.Writer, me: int, budget: int, own_copy: locations.Location | None = None
    ) -> None:
        self.writer, self.me, self.budget = writer, me, budget
        self.own_copy = own_copy  # the staging folder of this process's own copy, if it writes one
        self.writers = {data_store(me): writer}  # by data store: an own copy writes several
        self.packer = _Packer()
        self.leaves: dict[str, Leaf] = {}
        self.meshes: dict[int, tuple[Any, MeshRecord]] = {}
        self._held = 0  # bytes of snapshot copies not written yet
        self._arrays = 0
        self._formats: dict[str, np.dtype] = {}  # a buffer's format -> the dtype numpy reads it as
        # Bytes each process writes, as every process reckons them alike: the deadline of the wait for
        # the others' writes (jaxckpt.runtime.multihost.timeout_ms).
        self.loads: dict[int, int] = defaultdict(int)

    def add(self, key: str, item: Any) -> None:
        """Record one leaf from what :meth:`Taker.take` gave for it."""
        if isinstance(item, ValueLeaf):
            self.leaves[key] = item
            return
        if type(item) is memoryview and 0 < item.nbytes <= self.writer.pack_leaf_limit:
            # A small jax.Array on process 0's CPU device, viewed (Taker.take_all): its bytes to a pack, as they are.
            dtype = self._formats.get(item.format) or self._formats.setdefault(item.format, np.asarray(item).dtype)
            self.leaves[key] = ArrayLeaf(dtype, item.shape or (), JAX, self.packer.add(item.cast("B")), None, None)
            return
        if isinstance(item, (np.ndarray, memoryview)):  # a jax.Array on process 0's CPU device: a view (take_all)
            view = np.asarray(item)
            item = [JAX, None, view, view, 0]
        elif isinstance(item, Linked):  # hard links to an earlier checkpoint's files
            item = [item.container, None, item.struct, item, 0]
        container, impl, x, host, copied = item
        fresh = isinstance(x, Deferred)
        if fresh:  # read only now; no one else holds it, so it needs no snapshot copy
            x = host = _checked_read(key, x)
            copied = host.nbytes
        dtype, shape = np.dtype(x.dtype), tuple(x.shape)
        sharding = describe_sharding(x) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
        at = self._store(dtype, shape, x, host, fresh)
        self.leaves[key] = ArrayLeaf(dtype, shape, container, at, impl, sharding)
        self._held += copied
        if self._held > self.budget:  # write out what is held so far, the pack being filled included
            self.packer.hand_over(self.pack_writer, last=True)
            for w in self.writers.values():
                w.flush()
            self._held = 0

    @property
    def pack_writer(self) -> store_write.Writer:
        return self.writer_for(DATA_DIR) if self.own_copy is not None else self.writer

    def writer_for(self, store: str) -> store_write.Writer:
        """An own copy's writer of ``store`` (the process that owns a region names its store)."""
        if store not in self.writers:
            assert self.own_copy is not None
            self.writers[store] = store_write.Writer((self.own_copy / store).spec())
        return self.writers[store]

    def _store(self, dtype: np.dtype, shape: tuple[int, ...], x: Any, host: Any, fresh: bool) -> InArray | InPack:
        """Where the array goes: a pack or an array of its own, its data handed over (this process's part)."""
        me = self.me
        owned = _owners(x)
        by_process: dict[int, list[tuple[tuple[int, int], ...]]] = {}
        for region, device in owned.items():
            by_process.setdefault(process_of(device), []).append(region)
            self.loads[process_of(device)] += math.prod(hi - lo for lo, hi in region) * dtype.itemsize
        # Every process takes the same decisions here, so array numbers agree across processes.
        if math.prod(shape) * dtype.itemsize <= self.writer.pack_leaf_limit and set(by_process) == {0}:
            packs = me == 0 or self.own_copy is not None
            return self.packer.add(host) if packs else InPack(0, 0, 0, 0)
        regions, layout = None, None
        if set(by_process) != {0}:  # the sharding says where its regions are, or they are listed
            layout = _layout(x, owned, self.meshes)
            if layout is None:
                regions = {data_store(p): [list(r) for r in rs] for p, rs in sorted(by_process.items())}
        shards = [max(b - a for a, b in dims) for dims in zip(*owned)] if shape else []
        # On an object store, an array that process 0 holds in shards on its devices is written in
        # shards of several of them, so that each object has about 64 MiB or more (where the device
        # shards lie on a grid of their shape, so that blocks of them hold each whole).
        grouped = (
            not self.writer.local
            and set(by_process) == {0}
            and len(owned) > 1
            and all(lo % s == 0 for box in owned for (lo, _), s in zip(box, shards))
        )
        if grouped:
            shards = store_write.bucket_shard(shape, shards, dtype.itemsize)
        chunks = tuple(store_write.chunk_shape(shape, shards, dtype.itemsize))
        at = InArray(f"a/{self._arrays}", self.writer.stored_dtype(dtype), regions, chunks, layout)
        self._arrays += 1
        if isinstance(host, Linked):
            assert host.chunks == chunks, f"linked in shards of {host.chunks}, recorded in {chunks}"
            for store, links in (host.links or {data_store(me): {}}).items():  # none here: as add_array's []
                self.writer_for(store).add_linked(at.path, shape, dtype, chunks, links)
            return at
        if self.own_copy is not None and not fresh:
            for store, held in own_copy_parts(x, host).items():
                self.writer_for(store).add_array(at.path, shape, dtype, chunks, held)
            return at
        if isinstance(host, np.ndarray):  # taken whole: a numpy array, or one on this process's device
            parts = [(whole(shape), host)] if me in by_process else []
        else:
            parts = host
        if grouped and parts:
            parts = grouped_shards(parts, shape, dtype, chunks)
            self._held += sum(data.nbytes for _, data in parts)
        self.writer.add_array(at.path, shape, dtype, chunks, parts)
        return at

    def index(self, flat: Flat) -> Index:
        packs = [Pack(f"p/{i}", size, store_write.pack_chunk(size)) for i, size in enumerate(self.packer.sizes)]
        return Index(
            flat.nodes,
            self.leaves,
            packs,
            {"writer": f"jaxckpt {__version__}"},
            meshes=list({id(r): r for _, r in self.meshes.values()}.values()),
            aliases=flat.aliases,
        )


def grouped_shards(
    parts: list[tuple[tuple[slice, ...], np.ndarray]], shape: tuple[int, ...], dtype: np.dtype, shard: tuple[int, ...]
) -> list[tuple[tuple[slice, ...], np.ndarray]]:
    """The shards of ``shard`` shape (each a block of whole device shards, see
    :func:`jaxckpt.arrays.store_write.bucket_shard`) put together from the device shards ``parts``."""
    out: dict[tuple[int, ...], tuple[tuple[slice, ...], np.ndarray]] = {}
    for index, data in parts:
        box = _region(index, shape)
        position = tuple(lo // s for (lo, _), s in zip(box, shard))
        if position not in out:
            bounds = tuple(slice(p * s, min((p + 1) * s, n)) for p, s, n in zip(position, shard, shape))
            out[position] = (bounds, np.empty([b.stop - b.start for b in bounds], dtype))
        bounds, buffer = out[position]
        buffer[tuple(slice(lo - b.start, hi - b.start) for (lo, hi), b in zip(box, bounds))] = data
    return [out[p] for p in sorted(out)]


@gc_paused
def _record(p: Prepared) -> Index:
    """Record what the snapshot took, in leaf order (as every process does), letting go of each
    leaf's data once it is handed over."""
    taken = p.taken
    assert taken is not None
    p.taken = None
    # Two lists, not pops from the dict: each pop probes a table of every leaf (a cache miss at 1M).
    keys, items = list(taken), list(taken.values())
    taken.clear()
    try:
        add = p.records.add
        for i, key in enumerate(keys):
            item, items[i] = items[i], None
            add(key, item)
        return p.records.index(p.flat)
    finally:
        p.end_pause()


def write_and_publish(p: Prepared) -> str:
    """The rest of a save: record what the snapshot took (:func:`prepare`), write the data, wait for
    every process, then the primary writes the index and publishes; returns the path once the
    checkpoint is visible."""
    primary = multihost.is_primary() or p.own_copy
    try:
        try:
            if p.unlisted:
                statefile.mark_unrecorded(p.staging)
            if p.index is None:
                p.index = _record(p)
            nbytes = max(p.records.loads.values(), default=0)
            multihost.phase(f"writing its part of save {p.token} (the largest part: {multihost.size(nbytes)})")
            p.records.packer.hand_over(p.records.pack_writer, last=True)
            for writer in p.records.writers.values():
                writer.flush()
                writer.finish(p.token)  # the checksums of its arrays, which the index's save names
            if p.memory is not None and p.memory.by_reference:  # every process alike
                p.uses = p.memory.uses(p.token, p.records.writers.values())
                p.index.refs = bool(p.uses)
        except BaseException as e:
            multihost.written(p.token, e, 0)  # the others wait at the barrier below: come, and say why this one failed
            raise
        multihost.written(p.token, None, nbytes)  # every process's bytes are durable, or all raise
        if not p.own_copy:  # an own copy holds this process's states only, as they are
            process_states.gather(p.token, p.index)
        if primary:
            multihost.phase(f"publishing save {p.token}")
            p.index.save = p.token
            _staging.publish(p.staging, p.dest, encode_index(p.index), p.overwrite)
        multihost.barrier(f"{p.token}/published")
        if p.memory is not None:  # the next save links from this one, or refers to it
            p.memory.remember(p.dest, p.token, p.refs, p.index.leaves, p.records.writers)
    except BaseException:
        if primary:  # the others may still be writing into it; a manager removes what is left
            _staging.discard(p.staging)
        raise
    finally:
        p.end_pause()
    return p.path


def write(dest: locations.Location, root: Any, *, overwrite: bool = False, budget: int | None = None) -> str:
    """Saves ``root`` as a new checkpoint at ``dest``; returns its path."""
    return write_and_publish(prepare(dest, root, overwrite=overwrite, budget=budget))


def _checked_read(key: str, x: Deferred) -> np.ndarray:
    data = x.read()
    if data.shape != x.shape or data.dtype != x.dtype:
        raise UnsupportedValueError(
            f"Cannot save {describe(key)}: its source gave a {data.dtype} array of shape {data.shape}, "
            f"where {x.dtype} of shape {x.shape} was announced."
        )
    return data
