"""The reader: one checkpoint opened, its index, and batched reads of its values placed as their
templates want (:mod:`jaxckpt.reading.templates`), for jaxckpt's own checkpoints (:class:`Opened`) and for
the other libraries' formats (:class:`jaxckpt.reading.foreign.ForeignOpened`, over :mod:`jaxckpt.interop.formats`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, NamedTuple

import crc32c
import jax
import numpy as np

from jaxckpt._errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    MissingKeyError,
    NotACheckpointError,
    UnsupportedValueError,
)
from jaxckpt.arrays import store_read, zarr_local
from jaxckpt.arrays.checksums import StoreChecksums, checksums_limit
from jaxckpt.arrays.in_flight import READ_AHEAD_BYTES, InFlight, Pending
from jaxckpt.format import records
from jaxckpt.format.index_json import decode_index
from jaxckpt.format.keys import describe
from jaxckpt.format.records import DATA_DIR, INDEX_FILE, ArrayLeaf, Box, InArray, Index, InForeign, InPack, Leaf
from jaxckpt.interop import formats as _formats
from jaxckpt.reading import refs as _refs
from jaxckpt.reading import shared
from jaxckpt.reading.read_plan import (
    Assembly,
    Region,
    RegionKey,
    RegionPlan,
    c_order_pieces,
    files_overhead,
    pack_overhead,
    pack_spans,
    plan_region,
    region_key,
    stores_in,
)
from jaxckpt.reading.templates import NO_TEMPLATE, cast_for, check_all, put_all, restored_value, target_sharding
from jaxckpt.storage import local_tree, locations
from jaxckpt.storage.locations import PathLike

# Called once the host data of a load is read (with its error, or None), before arrays are placed on
# devices: a two-tier manager's local restore agrees there that every process could read its own copy
# (placing arrays may take every process, through JAX's collectives).
AFTER_READ: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxckpt_after_read", default=None)
# Told of every load's values, as they are returned: jaxckpt.incremental.memories registers itself,
# so that a manager's next save knows which arrays are its checkpoint's (this layer knows no manager).
LOAD_OBSERVERS: list[Callable[[Opened, Mapping[str, Any]], None]] = []
# The arrays of one data store opened for reading: key -> TensorStore array.
_StoreArrays = dict[str, Any]


class _ArrayRead(NamedTuple):
    """One array leaf to read: the regions this process needs of it, and where they go."""

    leaf: ArrayLeaf
    at: InArray
    sharding: jax.sharding.Sharding | None  # None: read whole, kept on the host
    devices: dict[Any, Region]  # with a sharding: each device here -> the region it holds
    regions: dict[RegionKey, RegionPlan]
    final: jax.sharding.Sharding | None = None  # read in a finer sharding, shared, then moved here


def _in_store(leaf: ArrayLeaf) -> InArray | InPack:
    """Where an array leaf of jaxckpt's own index is: InForeign is only in other formats' indexes."""
    assert not isinstance(leaf.at, InForeign), "a foreign leaf in a jaxckpt index"
    return leaf.at


class Opened:
    """One checkpoint opened for reading: its index, and batched reads of its values."""

    format = "jaxckpt"  # or the foreign format's name (ForeignOpened)
    # Values listed that have no numpy form (TensorFlow's iterator state, string tensors): key -> entry
    skipped: Mapping[str, _formats.Entry] = {}
    # Another library's ways of storing what jaxckpt stores otherwise (see ForeignCheckpoint): None
    # values that stand for leafless nodes too, and NNX Variables stored as a node over their value.
    empty_or_none: AbstractSet[str] = frozenset()
    variable_nodes: Mapping[str, str] = {}
    path: PathLike  # how messages name it
    # A local checkpoint's folder, held open from its index on: every file is read from that folder,
    # never from one that an overwriting save renamed to its path since (the index of one save with the
    # arrays of the next). Closed with the last reference to it (see PinnedFolder).
    _pinned: zarr_local.PinnedFolder | None = None

    def __init__(self, location: locations.Location, index: bytes | None = None) -> None:
        """The checkpoint at ``location`` (resolved once, by the public call). ``index``: the bytes of
        the index of a checkpoint in a kvstore, read already (see :func:`jaxckpt.reading.open.probe`),
        so that opening reads it once; a local index is read here."""
        self.location = location
        self.path = self.location.local or self.location.text
        where = repr(str(self.location / INDEX_FILE))
        if index is not None and self.location.local is None:
            self._pinned, raw = None, index
        else:
            self._pinned, raw = self._pin_and_read_index()
        self.index: Index = decode_index(raw, where)
        self._readers: dict[str, Any] = {}  # a Reader, or a ReferringReader
        self._checksums: dict[str, StoreChecksums] = {}
        self._checksums_limit: int | None = None
        self._stored_bytes: dict[str, int] = {}  # per data store, for _check_backed
        self.check_zarr_json = False  # see store_read.Reader.check_zarr_json; set before any read
        self.share_reads: bool | None = None  # see jaxckpt.reading.shared.enabled; set before any read

    def _pin_and_read_index(self) -> tuple[zarr_local.PinnedFolder | None, bytes]:
        """The folder held open, and its index. Opened just as an overwriting save swapped it out, the
        old folder may have lost its index already: then the new one at the path is opened instead."""
        for _ in range(2):
            pinned = locations.pin_folder(self.location)
            try:
                return pinned, locations.read_index_bytes(self.location, pinned)
            except NotACheckpointError:
                if pinned is None or not pinned.replaced():
                    raise
        raise CheckpointReplacedError(
            f"The checkpoint {str(self.path)!r} was replaced twice while it was being opened (saved over with "
            "overwrite=True); nothing was read. Open it again once the saves are done."
        )

    def leaf(self, key: str) -> Leaf:
        try:
            return self.index.leaves[key]
        except KeyError:
            if key in self.skipped:
                raise UnsupportedValueError(self._missing_key_message(key)) from None
            raise MissingKeyError(self._missing_key_message(key)) from None

    def _array_leaf(self, key: str) -> ArrayLeaf:
        leaf = self.leaf(key)
        if not isinstance(leaf, ArrayLeaf):
            raise ValueError(f"{describe(key)} is not an array")
        return leaf

    def _own_array(self, key: str) -> tuple[ArrayLeaf, InArray]:
        """The array leaf at ``key`` and its zarr3 array (it must not be packed)."""
        leaf = self._array_leaf(key)
        at = _in_store(leaf)
        if not isinstance(at, InArray):
            raise ValueError(f"{describe(key)} is packed with other small values, not an array of its own")
        return leaf, at

    def _missing_key_message(self, key: str) -> str:
        import difflib

        what = "checkpoint" if self.format == "jaxckpt" else f"{self.format} checkpoint"
        if key in self.skipped:
            entry = self.skipped[key]
            return (
                f"The {what} {str(self.path)!r} holds {describe(key)} as {entry.note} of shape {entry.shape}, "
                "which has no numpy form; jaxckpt lists it and does not restore it."
            )
        close = difflib.get_close_matches(key, list(self.index.leaves), n=3, cutoff=0.5)
        hint = (
            f" Did you mean {', '.join(map(repr, close))}?"
            if close
            else " jaxckpt.list_variables(path) (or `jaxckpt ls PATH`) lists its keys."
        )
        if key in self.index.nodes:
            hint = f" It is a node; its leaves include {', '.join(map(repr, self.index.keys_under(key)[:3]))}."
        return f"The {what} {str(self.path)!r} has no value {describe(key)}.{hint}"

    def load(self, wanted: Mapping[str, Any], leaves: list[Leaf] | None = None) -> dict[str, Any]:
        """Values for ``{key: template}`` (``leaves``: theirs, if looked up): checked, then read in one batch."""
        leaves = [self.leaf(key) for key in wanted] if leaves is None else leaves
        targets = check_all(wanted, leaves)  # where each plain leaf goes (see check_all), else None
        after_read = AFTER_READ.get()
        try:
            data = self._read(wanted, leaves)
        except BaseException as e:
            if after_read is not None:
                after_read(e)
            raise
        if after_read is not None:  # before placing arrays, which may take every process (collectives)
            after_read(None)
        data = shared.place(data)  # every process read its part (they agreed in _read)
        out: dict[str, Any] = {}
        to_device: list[tuple[str, np.ndarray, jax.sharding.Sharding | None]] = []
        for (key, template), leaf, target, value in zip(wanted.items(), leaves, targets, data):
            if target is not None and type(value) is np.ndarray and value.dtype == template.dtype:  # as stored
                to_device.append((key, value, target))
                continue
            if isinstance(leaf, ArrayLeaf) and not isinstance(value, jax.Array):  # host data
                value = cast_for(key, leaf, template, value)
                if not leaf.prng_impl and isinstance(template, (jax.Array, jax.ShapeDtypeStruct)):
                    to_device.append((key, value, target_sharding(template, key)))
                    continue
            out[key] = restored_value(leaf, template, value)
        if to_device:  # one call for all: per-call overhead dominates for thousands of small leaves
            arrays = put_all([v for _, v, _ in to_device], [s for _, _, s in to_device])
            out.update(zip([k for k, _, _ in to_device], arrays))
        for observe in LOAD_OBSERVERS:
            observe(self, out)
        # Where every value was placed, ``out`` is already in wanted's order.
        return out if len(to_device) == len(wanted) else {key: out[key] for key in wanted}

    def close(self) -> None:
        """Let go of what it holds open (its folder); a read after this opens files by their paths
        again. Restores close what they opened when they return."""
        pinned, self._pinned = self._pinned, None
        self._readers = {}
        if pinned is not None:
            pinned.close()

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exists(self) -> bool:
        """Whether the checkpoint is still there (a failed read may mean it was deleted meanwhile), and
        is still the one read: not replaced by another save (``overwrite=True``)."""
        return locations.is_checkpoint(self.location) and (self._pinned is None or not self._pinned.replaced())

    @contextlib.contextmanager
    def _unless_gone(self) -> Iterator[None]:
        """Damage reported inside, as CheckpointNotFoundError if the checkpoint is gone: deleted, or replaced."""
        try:
            yield
        except CheckpointCorruptedError as e:
            if self.exists():
                raise
            if not locations.is_checkpoint(self.location):
                raise CheckpointNotFoundError(
                    f"The checkpoint {str(self.path)!r} was deleted while it was being read (by its manager's "
                    "retention, say); nothing of it was returned."
                ) from e
            raise CheckpointReplacedError(
                f"The checkpoint {str(self.path)!r} was replaced by another save (overwrite=True) while it was being "
                "read, and the files of the one read were deleted. No value of either was returned; read it again "
                "for the new one."
            ) from e

    def _read(self, wanted: Mapping[str, Any], leaves: list[Leaf]) -> list[Any]:
        """The data (host, or jax.Arrays placed) of the array leaves among ``wanted``, in order; None for others."""
        packed: dict[int, list[tuple[int, str, ArrayLeaf, InPack]]] = defaultdict(list)
        arrays: dict[str, tuple[int, ArrayLeaf, InArray]] = {}
        for i, (key, leaf) in enumerate(zip(wanted, leaves)):
            if isinstance(leaf, ArrayLeaf):
                at = _in_store(leaf)
                if isinstance(at, InPack):
                    packed[at.pack].append((i, key, leaf, at))
                else:
                    arrays[key] = (i, leaf, at)
        values: list[Any] = [None] * len(leaves)
        with self._unless_gone():
            share = shared.enabled(self.location, self.share_reads) and bool(arrays)
            reads = self._plan_arrays({k: (leaf, at, wanted[k]) for k, (_, leaf, at) in arrays.items()}, share)
            sharing = any(read.final is not None for read in reads.values())  # alike on every process
            try:
                needed = stores_in(plan for read in reads.values() for plan in read.regions.values())
                plans = {k: list(read.regions.values()) for k, read in reads.items()}
                backed = [(k, leaf) for k, (_, leaf, _) in arrays.items()] + [
                    e[1:3] for p in packed.values() for e in p
                ]
                self._check_backed(backed, needed, plans)
                for pack, in_pack in packed.items():
                    self._read_packed(pack, in_pack, values)
                for k, value in self._read_arrays({k: wanted[k] for k in arrays}, reads).items():
                    values[arrays[k][0]] = value
            except BaseException as e:
                if sharing:
                    shared.agree(e)
                raise
            if sharing:
                shared.agree(None)
        return values

    @property
    def stores_opened(self) -> list[str]:
        """The data stores this reader has opened or measured so far."""
        return sorted(set(self._readers) | set(self._stored_bytes))

    def _check_backed(
        self, leaves: Sequence[tuple[str, Leaf]], stores: set[str], plans: Mapping[str, list[RegionPlan]] | None = None
    ) -> None:
        """Before any buffer is allocated: the data stores ``stores`` (the read's) hold the bytes the index claims.

        Chunks are stored uncompressed (the codecs are checked on open) and every chunk is written
        (format version 2), so a store holds at least the bytes of the values in it: a crafted index
        that claims a 64 GiB array in a 1 MB checkpoint is refused here, not by running out of memory.
        Local folders only (TensorStore lists object stores without sizes). With ``plans`` (the regions
        a read takes of each array), an array claims the parts read (a two-tier manager's local copy holds
        only its regions); from version 4, also the index and checksums of each shard file it touches.
        """
        if self.index.version < 2 or self.location.local is None or not leaves:
            return
        # A crafted shard shape of all 1s claims no more values, but a million files.
        sharded = self.index.version >= 4
        # Version 6: an array a store refers to is in a sibling's store, whose files are checked as read.
        refs = {s: self._reader_of(s).refs() for s in stores} if self.index.refs else {}
        claims: dict[str, int] = defaultdict(int)
        overhead: dict[str, int] = defaultdict(int)
        largest: dict[str, tuple[int, str]] = {}
        packs: set[int] = set()
        packed, top, top_key = 0, -1, ""  # bytes of packed leaves counted in short, the largest and its key
        for key, leaf in leaves:
            assert isinstance(leaf, ArrayLeaf)
            at = _in_store(leaf)
            extra: dict[str, int] = {}
            if type(at) is InPack and (not sharded or at.pack in packs):  # as below, in short (many leaves)
                packed += at.nbytes  # the leaf's size (the index is refused where they differ)
                if at.nbytes > top or (at.nbytes == top and key > top_key):
                    top, top_key = at.nbytes, key
                continue
            if isinstance(at, InArray):
                boxes: dict[str, list[Box]] = defaultdict(list)
                if plans is not None and key in plans:
                    parts: dict[str, int] = defaultdict(int)
                    read = {(p.store, region_key(p.source)): p for plan in plans[key] for p in plan.parts}
                    for store, source in read:
                        box = [s.indices(n)[:2] for s, n in zip(read[store, source].source, leaf.shape)]
                        parts[store] += math.prod(hi - lo for lo, hi in box) * leaf.dtype.itemsize
                        boxes[store].append(box)
                else:
                    parts = {s: records.store_bytes(at, leaf.shape, leaf.dtype.itemsize, s) for s in stores}
                    if sharded:
                        boxes.update((s, b) for s, b in records.regions(at, leaf.shape).items() if s in stores)
                if sharded:
                    extra = {s: files_overhead(at, leaf.dtype.itemsize, b) for s, b in boxes.items()}
                if refs:
                    parts, extra = (
                        {s: n for s, n in d.items() if at.path not in refs.get(s, {})} for d in (parts, extra)
                    )
            else:
                parts = {DATA_DIR: leaf.nbytes}
                if sharded and at.pack not in packs:  # its pack's index, once
                    packs.add(at.pack)
                    pack = self.index.packs[at.pack]
                    assert pack.chunk is not None  # version 4 indexes record it
                    extra = {DATA_DIR: pack_overhead(pack.nbytes, pack.chunk)}
            for store in parts.keys() | extra.keys():
                nbytes, more = parts.get(store, 0), extra.get(store, 0)
                if not nbytes + more:
                    continue
                claims[store] += nbytes
                overhead[store] += more
                largest[store] = max(largest.get(store, (-1, "")), (nbytes + more, key))
        if packed:
            claims[DATA_DIR] += packed
            largest[DATA_DIR] = max(largest.get(DATA_DIR, (-1, "")), (top, top_key))
        for store in claims:
            claimed, more = claims[store], overhead[store]
            held = self._stored_bytes.get(store)
            if held is None:
                # Bytes the file system holds, not apparent sizes: a sparse file's holes back no claim.
                usage = local_tree.usage(self._store_folder(store))
                held = self._stored_bytes[store] = usage.held if usage is not None else 0
            if claimed + more > held:
                files = f" and {more:,} bytes of chunk indexes and checksums in its files" if more else ""
                raise CheckpointCorruptedError(
                    f"The checkpoint {str(self.path)!r} claims {claimed:,} bytes of values in its data store "
                    f"{store!r} (the largest {describe(largest[store][1])}){files}, but that store holds only "
                    f"{held:,} bytes: its data is missing or truncated, or its index was crafted. Nothing was read."
                    + local_tree.short_because(self.location / store, claimed)
                )

    def _read_packed(self, pack: int, leaves: list[tuple[int, str, ArrayLeaf, InPack]], values: list[Any]) -> None:
        """Read the leaves packed in ``pack``, each ``(place, key, leaf, at)``, into ``values[place]``."""
        by_offset = sorted(leaves, key=lambda entry: entry[3].offset)
        spans = pack_spans((at.offset, at.nbytes) for _, _, _, at in by_offset)
        info = self.index.packs[pack]
        try:
            reader = self._reader_of(DATA_DIR)
            pending = reader.read_pack_spans(info.path, info.nbytes, info.chunk, spans)
            buffers = [(start, p.result()) for (start, _), p in zip(spans, pending)]
        except CheckpointCorruptedError as e:  # name the values packed there, not the pack alone
            names = ", ".join(describe(k) for _, k, _, _ in by_offset[:5])
            more = f" and {len(by_offset) - 5} more" if len(by_offset) > 5 else ""
            raise CheckpointCorruptedError(
                f"Cannot read the data of {names}{more} (packed in {info.path!r} in the checkpoint): {e}"
            ) from e
        checksum = crc32c.crc32c if self.index.version >= 4 else zlib.crc32
        span, (start, buffer) = 0, buffers[0]
        for i, k, leaf, at in by_offset:  # in offset order, as the spans: each leaf lies in the last begun
            while span + 1 < len(buffers) and buffers[span + 1][0] <= at.offset:
                span += 1
                start, buffer = buffers[span]
            raw = buffer[at.offset - start : at.offset - start + at.nbytes]
            if checksum(raw) != at.checksum:
                raise CheckpointCorruptedError(
                    f"The data of {describe(k)} fails its checksum (pack {info.path!r}, bytes {at.offset}.."
                    f"{at.offset + at.nbytes}); the checkpoint is damaged."
                )
            values[i] = raw.view(leaf.dtype).reshape(leaf.shape)

    def _store_folder(self, store: str) -> locations.Location:
        """The folder of data store ``store`` as measured: in the pinned folder, through /proc/self/fd where
        there is one (Linux), so that a folder renamed to the path since is not measured instead."""
        pinned = self._pinned
        if pinned is not None and os.path.isdir(f"/proc/self/fd/{pinned.fd}"):
            return locations.Location(str(self.location / store), local=Path(f"/proc/self/fd/{pinned.fd}", store))
        return self.location / store

    def _reader_of(self, store: str) -> Any:
        if store not in self._readers:
            checksums = None if self.index.save is None else functools.partial(self._checksums_of, store)
            pinned = None if self._pinned is None else (self._pinned, store)
            reader: Any = store_read.Reader(
                (self.location / store).spec(), version=self.index.version, pinned=pinned, checksums=checksums
            )
            if (
                self.index.refs and self.index.save is not None
            ):  # version 6: arrays of siblings (jaxckpt.incremental.refs)
                reader = _refs.ReferringReader(self.location, store, self.index.save, reader)
            reader.check_zarr_json = self.check_zarr_json
            self._readers[store] = reader
        return self._readers[store]

    def _checksums_of(self, store: str) -> StoreChecksums:
        """The checksums of data store ``store`` (format version 5), for the save that wrote the index;
        read once, and no larger than what the index's arrays imply."""
        assert self.index.save is not None
        if store not in self._checksums:
            name = f"{store}/{records.CHECKSUMS_FILE}"
            where = repr(str(self.location / name))
            if self._checksums_limit is None:  # once: it walks the index
                self._checksums_limit = checksums_limit(self.index)
            data = locations.read_file(self.location, name, self._checksums_limit, pinned=self._pinned)
            if data is None:
                raise CheckpointCorruptedError(
                    f"The checksums {where} are missing, so nothing vouches for the arrays in data store {store!r}: "
                    "files of the checkpoint were deleted, or it is being deleted now."
                )
            self._checksums[store] = StoreChecksums(data, where, self.index.save)
        return self._checksums[store]

    @staticmethod
    def _plan_arrays(wanted: Mapping[str, tuple[ArrayLeaf, InArray, Any]], share: bool) -> dict[str, _ArrayRead]:
        """For each array ``{key: (leaf, at, template)}``, which regions are read (those its target's
        devices here hold, or all of it; when sharing, those of the finer sharding that has each
        region held by one process) and the parts of each."""
        out = {}
        for key, (leaf, at, template) in wanted.items():
            sharding = None if leaf.prng_impl else target_sharding(template, key)
            finer = shared.read_sharding(sharding, leaf.shape, leaf.dtype.itemsize) if share else None
            final, sharding = (sharding, finer) if finer is not None else (None, sharding)
            devices: dict[Any, Region] = {}
            if sharding is None:
                regions: dict[RegionKey, Region] = {(): tuple(slice(None) for _ in leaf.shape)}
            else:  # only the regions this process's devices hold (each has one: none is None)
                devices = {
                    d: i for d, i in sharding.addressable_devices_indices_map(leaf.shape).items() if i is not None
                }
                regions = {region_key(i): i for i in devices.values()}
            plans = {h: plan_region(at, leaf.shape, index) for h, index in regions.items()}
            out[key] = _ArrayRead(leaf, at, sharding, devices, plans, final)
        return out

    def _read_arrays(self, wanted: Mapping[str, Any], reads: Mapping[str, _ArrayRead]) -> dict[str, Any]:
        # Open every array in every data store that holds a part this process reads, all at once.
        requests: dict[str, dict[str, tuple[str, ArrayLeaf, InArray]]] = defaultdict(dict)
        for k, read in reads.items():
            for store in stores_in(read.regions.values()):
                requests[store][k] = (k, read.leaf, read.at)
        stores = {store: self._reader_of(store).open_arrays(list(reqs.values())) for store, reqs in requests.items()}
        pending_of: dict[str, dict[RegionKey, Pending]] = {}
        in_flight = InFlight(READ_AHEAD_BYTES)
        for key, read in reads.items():
            pending = {}
            for h, plan in read.regions.items():
                pending[h] = self._start_read(key, read.at, stores, plan)
                in_flight.add(math.prod(plan.shape) * read.leaf.dtype.itemsize, pending[h])
            pending_of[key] = pending
        out = {}
        for key, pending in pending_of.items():
            read = reads[key]
            leaf = read.leaf
            host = {h: cast_for(key, leaf, wanted[key], self._as_logical(leaf, p.result())) for h, p in pending.items()}
            if read.sharding is None:
                out[key] = host[()]
            else:
                arrays = jax.device_put([host[region_key(i)] for i in read.devices.values()], list(read.devices))
                out[key] = jax.make_array_from_single_device_arrays(leaf.shape, read.sharding, arrays)
                if read.final is not None:
                    out[key] = shared.Shared(out[key], read.final)
            del host  # the buffers now belong to the jax arrays (aliased on CPU), or are garbage
        return out

    def read_regions(self, wanted: Mapping[str, list[Region]]) -> dict[str, list[np.ndarray]]:
        """Host data of the given regions of array leaves (stored data: PRNG keys as key data),
        opening only the data stores that hold them. For tools and benchmarks that have no devices
        of the target sharding."""
        plans = {}
        for key, regions in wanted.items():
            leaf, at = self._own_array(key)
            plans[key] = (leaf, at, [plan_region(at, leaf.shape, index) for index in regions])
        out = {}
        with self._unless_gone():
            backed = [(k, leaf) for k, (leaf, _, _) in plans.items()]
            self._check_backed(backed, stores_in(p for _, _, ps in plans.values() for p in ps))
            for key, (leaf, at, regions_plans) in plans.items():
                stores = self._open_for(key, leaf, at, stores_in(regions_plans))
                pending = [self._start_read(key, at, stores, plan) for plan in regions_plans]
                out[key] = [self._as_logical(leaf, p.result()) for p in pending]
        return out

    def _open_for(self, key: str, leaf: ArrayLeaf, at: InArray, needed: Iterable[str]) -> dict[str, _StoreArrays]:
        """The array of ``key`` opened in each of the data stores ``needed``."""
        return {store: self._reader_of(store).open_arrays([(key, leaf, at)]) for store in needed}

    def read_pieces(self, key: str, budget: int) -> Iterator[np.ndarray]:
        """The stored data of the array leaf at ``key`` (PRNG keys as key data), in C-order pieces of
        at most ``budget`` bytes each (or one element row): a large array is never held whole."""
        leaf = self._array_leaf(key)
        at = _in_store(leaf)
        if isinstance(at, InPack) or leaf.nbytes <= budget:
            value = self.load({key: NO_TEMPLATE})[key]
            yield np.asarray(jax.random.key_data(value) if leaf.prng_impl else value)
            return
        with self._unless_gone():
            self._check_backed([(key, leaf)], set(records.stores_of(at)))
            stores = self._open_for(key, leaf, at, records.stores_of(at))
            for index in c_order_pieces(leaf.shape, leaf.dtype.itemsize, budget):
                plan = plan_region(at, leaf.shape, index)
                yield self._as_logical(leaf, self._start_read(key, at, stores, plan).result())

    def _start_read(self, key: str, at: InArray, stores: Mapping[str, _StoreArrays], plan: RegionPlan) -> Pending:
        """Start reading a region of the array from its parts (see :func:`plan_region`): from one
        store, or assembled from the parts of several."""
        if len(plan.parts) == 1 and plan.parts[0].into is None:
            store, source, _ = plan.parts[0]
            return self._reader_of(store).read_regions(key, at.path, stores[store][key], [source])[0]
        parts: list[tuple[Region, Pending]] = []
        for store, source, into in plan.parts:
            assert into is not None  # a region in several parts says where each goes
            parts.append((into, self._reader_of(store).read_regions(key, at.path, stores[store][key], [source])[0]))
        return Assembly(plan.shape, np.dtype(at.stored), parts)

    @staticmethod
    def _as_logical(leaf: ArrayLeaf, data: np.ndarray) -> np.ndarray:
        return data if data.dtype == leaf.dtype else data.view(leaf.dtype)
