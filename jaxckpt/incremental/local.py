"""Incremental checkpoints on local disks: a manager's save hard-links the shard files of an unchanged
``jax.Array`` from the checkpoint that holds them, instead of writing them again.

**What is unchanged.** A ``jax.Array`` is immutable, so the very object a manager last saved, or
that a restore of one of its checkpoints returned, still holds those values. Restores are told to
:func:`loaded`: through the manager's own calls, whatever checkpoint they read; otherwise (TF's
``ckpt.restore(manager.latest_checkpoint)``, ``jaxckpt.restore``, a child assigned later) only a
checkpoint directly in a live manager's directory (one elsewhere is never linked from: another
program may rewrite its files in place). :class:`Memory` (one per manager tier, per process)
remembers, for each array of its own (:func:`jaxckpt.saving.reuse.arrays_of_their_own`) of the last save or restore, a weak
reference to it (never a strong one: that would pin its device memory) and where this process's
shards of it are on disk: each file and the CRC-32C of its inner chunks (from the save that wrote
them, or the restored checkpoint's ``checksums.json``). At the next save a leaf that ``is`` such an
array, not deleted, whose shards this process would write are exactly those remembered (same
shape, dtype, shard shape and shard numbers), is linked. Identity, not value: an equal array that
is another object is written. Packed (small) leaves are always written.

**numpy arrays** are mutable, so only their content tells: a large one (not packed) of the same
key, shape, dtype and shards as the last save wrote (or a restore read, as above) is compared, in
the caller's thread, with those files: its first 64 KiB, then the CRC-32C of each inner chunk
(which that save computed as it wrote them; a restored checkpoint's ``checksums.json``), stopping at the first that differs; only
if every CRC matches are all the bytes compared (a CRC is no identity), and then the files are
linked. Only where host values are written: process 0, or each process writing its own copy.

**Linking, crash-safely.** :meth:`Memory.link` runs in the caller's thread, in the save's snapshot
(while the array is surely alive): it hard-links every remembered file into the save's staging
folder under a temporary name (:data:`LINKS`). If any link fails (the source deleted by retention
meanwhile, another file system, no hard links there) those of the array are removed and the array
is taken and written as any other. The background then renames each link to its place ``a/<n>/c/...``
(:meth:`jaxckpt.arrays.zarr_write.LocalWriter.add_linked`), writes a fresh ``zarr.json``, and lists the
old CRCs in the new ``checksums.json``. Nothing is visible before the atomic publish; a crash
leaves a staging folder that the next manager removes. Each checkpoint stays a whole folder, and
deleting the one that first wrote the data leaves it alive in the others (the link count).

Buckets refer to the data instead (``jaxckpt.incremental.bucket``), as do two tiers' durable copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import stat
import struct
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxckpt.arrays import store_write
from jaxckpt.arrays.checksums import StoreChecksums, hinted_crcs, read_hint
from jaxckpt.arrays.zarr_local import CRC, shard_index, shard_intact, shards_in
from jaxckpt.arrays.zarr_meta import chunk_key, inner_chunk_shape, metadata, numpy_dtype, shard_number
from jaxckpt.arrays.zarr_write import LINKS, ZARR_JSON_LINK, inner_chunks, shards_of
from jaxckpt.format.records import DATA_DIR, NUMPY, ArrayLeaf, InArray, data_store
from jaxckpt.incremental import memories
from jaxckpt.saving.pipeline import grouped_shards
from jaxckpt.saving.reuse import Linked
from jaxckpt.saving.snapshot import held_boxes, owners, process_of, region, whole
from jaxckpt.storage.local_files import aligned_empty, crc32c_of
from jaxckpt.storage.locations import Location

_Read = dict[tuple[Path, str], StoreChecksums | None]  # a data store's checksums, by (folder, save)
_PROBE = 64 << 10  # bytes of a numpy array compared with its file's before any CRC (_same_content)
# Saves in a row that may link an unchanged array's files before one writes them afresh: a copy is
# never shared by more checkpoints than this (1/128 of the unchanged bytes a save, on average).
MAX_GENERATIONS = 128


class Shard(NamedTuple):
    file: str  # the file that holds it (absolute)
    crcs: tuple[int, ...]  # the CRC-32C of each of its inner chunks
    inode: int | None = None  # the file's, when a save wrote it: a file put at its path since is not linked


@dataclasses.dataclass
class _Entry:
    ref: weakref.ref[jax.Array]
    chunks: tuple[int, ...]
    stored: str
    shards: dict[tuple[str, int], Shard] | None = None  # written by a save: (store, number) -> shard
    restored: tuple[Path, str, str] | None = None  # restored: the checkpoint, the array's path, its save
    generation: int = 0  # saves in a row that linked these files (0: written by the last save)


@dataclasses.dataclass
class _Host:
    """A numpy array that the last save wrote, or a restore read, by key: compared by content at the next."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    stored: str
    shards: dict[tuple[str, int], Shard] | None  # None: restored, found from its checkpoint's checksums
    restored: tuple[Path, str, str] | None = None  # the checkpoint, the array's path, its save


def plan(x: jax.Array, me: int, own_copy: bool) -> tuple[tuple[int, ...], dict[tuple[str, int], str]] | None:
    """The shard shape of ``x`` and the shards this process writes of it on a local disk, as ``_save``
    decides them: (store, shard number) -> chunk key; None if it is packed (no files of its own)."""
    owned = owners(x)
    if x.nbytes <= store_write.PACK_LEAF_LIMIT and {process_of(d) for d in owned.values()} == {0}:
        return None
    shape = tuple(x.shape)
    shards = [max(b - a for a, b in dims) for dims in zip(*owned)] if shape else []
    chunks = tuple(store_write.chunk_shape(shape, shards, np.dtype(x.dtype).itemsize))
    if own_copy:  # every region held here, in the store of the process that owns it
        boxes = [(box, data_store(process_of(device))) for box, device, _ in held_boxes(x, owned)]
    else:
        here = {s.device for s in x.addressable_shards}
        boxes = [(box, data_store(me)) for box, d in owned.items() if d in here and process_of(d) == me]
    out = {}
    for box, store in boxes:
        for position, _ in shards_in(box, chunks, shape):
            out[(store, shard_number(position, shape, chunks))] = chunk_key(position)
    return chunks, out


class Memory:
    """What one manager tier last saved or restored, in this process (see the module's docstring)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self._entries: dict[int, _Entry] = {}
        self._restored: dict[int, _Entry] = {}
        self._host: dict[str, _Host] = {}
        self._generations: dict[int, int] = {}  # the arrays the save being made links, by id: their generation
        # The manager's directory (resolved): restores of its checkpoints outside its calls count too.
        self.directory = None if directory is None else os.path.realpath(directory)
        if directory is not None:
            memories.watch(self)

    def close(self) -> None:
        """The manager is closed: it saves no more, so it remembers nothing more."""
        memories.unwatch(self)
        self._entries, self._restored, self._host = {}, {}, {}

    by_reference = False  # hard links: each file is found where it is

    def link(
        self, leaves: Mapping[str, Any], into: Location, me: int, pack_limit: int, own_copy: bool
    ) -> dict[str, Linked] | None:
        """Link the files of every leaf that is a remembered array into the staging folder ``into``;
        the leaves linked. None where ``into`` is not on a local disk."""
        if into.local is None:
            return None
        staging = Path(into.local)
        out: dict[str, Linked] = {}
        if not (self._entries or self._restored or self._host):
            return out
        read: _Read = {}  # the checksums.json of each restored data store, read once in this save
        for key, x in leaves.items():
            if isinstance(x, np.ndarray):
                host = self._host.get(key) if me == 0 or own_copy else None  # who writes it
                if host is not None and (same := _link_host(x, host, staging, len(out), read)) is not None:
                    out[key] = same
                continue
            entry = self._entries.get(id(x)) or self._restored.get(id(x))
            if entry is None or entry.ref() is not x or not isinstance(x, jax.Array):
                continue
            if x.is_deleted() or not isinstance(x.dtype, np.dtype):  # a deleted one is refused as ever
                continue
            if entry.generation >= MAX_GENERATIONS:  # written afresh now and then: no copy is shared forever
                continue
            planned = plan(x, me, own_copy)
            if planned is None or planned[0] != entry.chunks or entry.stored != np.dtype(x.dtype).name:
                continue
            sources = self._sources(entry, planned[1], read)
            crcs = None if sources is None else {number: s.crcs for (_, number), s in sources.items()}
            if crcs is not None and in_host_memory(x) and not same_crcs(x, entry.chunks, crcs):
                continue  # its buffer may be a host array's, changed in place since (may_alias, dlpack)
            if sources is not None:
                itemsize = np.dtype(x.dtype).itemsize
                meta = json.dumps(metadata(x.shape, entry.stored, entry.chunks, itemsize)).encode()
                chunk_bytes = math.prod(inner_chunk_shape(entry.chunks, itemsize)) * itemsize
                linked = _link_all(sources, planned[1], staging, len(out), meta, chunk_bytes)
                if linked is not None:
                    out[key] = Linked(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), planned[0], linked)
                    self._generations[id(x)] = entry.generation + 1
        return out

    def _sources(
        self, entry: _Entry, wanted: Mapping[tuple[str, int], str], read: _Read
    ) -> dict[tuple[str, int], Shard] | None:
        """Where each wanted shard is, or None if one is not known."""
        if entry.shards is not None:
            found = {k: entry.shards[k] for k in wanted if k in entry.shards}
            return found if len(found) == len(wanted) else None
        assert entry.restored is not None
        folder, array, save = entry.restored
        out: dict[tuple[str, int], Shard] = {}
        stores: dict[str, dict[int, tuple[int, ...]]] = {}
        names = sorted(n for n in _listdir(folder) if n.startswith("data")) if wanted else []
        for (store, number), key in wanted.items():
            # The checkpoint restored may have been saved by other processes or another mesh: any of
            # its data stores that holds the shard will do (the same store first). Its checksums name
            # the save restored, so a checkpoint saved at that path since is not linked from.
            for name in [store, *(n for n in names if n != store)]:
                if name not in stores:
                    stores[name] = _checksums_of(folder / name, array, save, read)
                if number in stores[name]:
                    out[(store, number)] = Shard(str(folder / name / array / key), stores[name][number])
                    break
            else:
                return None
        return out

    @staticmethod
    def uses(token: str, writers: Iterable[Any]) -> tuple[str, ...]:
        """None: a hard link is a file of the checkpoint's own."""
        return ()

    def remember(
        self,
        published: Location,
        token: str,
        refs: Mapping[str, weakref.ref[jax.Array]],
        leaves: Mapping[str, Any],
        writers: Mapping[str, Any],
    ) -> None:
        """After a save published at ``published``: its arrays' files (this process's), in place of what
        was remembered."""
        if published.local is None:
            return
        dest = Path(published.local)
        entries: dict[int, _Entry] = {}
        self._host = {}
        for key, leaf in leaves.items():  # numpy arrays with files of their own (written by process 0)
            if isinstance(leaf, ArrayLeaf) and leaf.container == NUMPY and isinstance(leaf.at, InArray):
                if leaf.at.chunks is not None and (shards := _written(dest, leaf, writers)):
                    self._host[key] = _Host(tuple(leaf.shape), tuple(leaf.at.chunks), leaf.at.stored, shards)
        for key, ref in refs.items():
            leaf, x = leaves.get(key), ref()
            if (
                x is None
                or not isinstance(leaf, ArrayLeaf)
                or not isinstance(leaf.at, InArray)
                or leaf.at.chunks is None
            ):
                continue
            generation = self._generations.get(id(x), 0)
            shards = _written(dest, leaf, writers)
            entries[id(x)] = _Entry(ref, tuple(leaf.at.chunks), leaf.at.stored, shards=shards, generation=generation)
        self._entries, self._restored, self._generations = entries, {}, {}

    def loaded(self, opened: Any, values: Mapping[str, Any]) -> None:
        """A restore's values (:func:`loaded`): the arrays read unchanged from a local checkpoint of format 5."""
        index, folder = opened.index, opened.location.local
        if folder is None or index.save is None or not self._holds(folder):
            return
        if len(self._restored) > len(values):  # restores without a save between: forget the arrays gone
            self._restored = {i: e for i, e in self._restored.items() if e.ref() is not None}
        for key, x in values.items():
            leaf = index.leaves.get(key)
            if (
                isinstance(x, np.ndarray)
                and isinstance(leaf, ArrayLeaf)
                and leaf.container == NUMPY
                and isinstance(leaf.at, InArray)
                and leaf.at.chunks is not None
            ):
                where = (Path(folder), leaf.at.path, index.save)
                self._host[key] = _Host(tuple(leaf.shape), tuple(leaf.at.chunks), leaf.at.stored, None, where)
            elif memories.read_as_stored(x, leaf):
                ref, at = weakref.ref(x), leaf.at
                self._restored[id(x)] = _Entry(ref, at.chunks, at.stored, restored=(Path(folder), at.path, index.save))

    def restoring(self) -> contextlib.AbstractContextManager[None]:
        """Remember what the restores inside return."""
        return memories.restoring(self)

    def _holds(self, folder: str | os.PathLike[str]) -> bool:
        """Whether the checkpoint ``folder`` is directly in the manager's directory, itself and every
        folder on its way no symlink: another run's checkpoint reached through a link is never linked from."""
        if self.directory is None:
            return False
        path = os.path.abspath(folder)
        return os.path.realpath(path) == path and os.path.dirname(path) == self.directory


def _written(dest: Path, leaf: ArrayLeaf, writers: Mapping[str, Any]) -> dict[tuple[str, int], Shard]:
    """The shard files of ``leaf`` that this process's ``writers`` wrote into the checkpoint at ``dest``."""
    assert isinstance(leaf.at, InArray) and leaf.at.chunks is not None
    at, grid = leaf.at, [-(-n // s) for n, s in zip(leaf.shape, leaf.at.chunks)]
    shards = {}
    for store, writer in writers.items():
        for number, crcs in writer.checksums.get(at.path, {}).items():
            file = dest / store / at.path / chunk_key(np.unravel_index(number, grid) if grid else ())
            try:
                shards[(store, number)] = Shard(str(file), tuple(crcs), os.stat(file).st_ino)
            except OSError:  # not there (deleted already?): not linked from
                continue
    return shards


def _link_host(x: np.ndarray, host: _Host, staging: Path, n: int, read: _Read) -> Linked | None:
    """Links to the files of a numpy array whose content is that of ``host`` (see the module's
    docstring), or None: it is written."""
    shape, dtype = tuple(x.shape), x.dtype
    # The dtype stored, byte order included ('>f4' is named float32 too): the same bytes, the same values.
    if shape != host.shape or dtype != numpy_dtype(host.stored) or x.nbytes <= store_write.PACK_LEAF_LIMIT:
        return None
    chunks = tuple(store_write.chunk_shape(shape, shape, dtype.itemsize))
    if chunks != host.chunks:
        return None
    known = host.shards if host.shards is not None else _restored_shards(host, read)
    inner, keys, sources = inner_chunk_shape(chunks, dtype.itemsize), {}, {}
    for number, position, data in shards_of(shape, dtype, chunks, [(whole(shape), x)]):
        shard = known.get((DATA_DIR, number))
        inode = None if shard is None else _same_content(inner_chunks(data, inner), shard)
        if shard is None or inode is None:
            return None
        keys[(DATA_DIR, number)] = chunk_key(position)
        sources[(DATA_DIR, number)] = shard._replace(inode=inode)  # the file compared is the one linked
    if len(keys) != len(known):
        return None
    meta = json.dumps(metadata(shape, host.stored, chunks, dtype.itemsize)).encode()
    links = _link_all(sources, keys, staging, n, meta)
    stand_in = np.broadcast_to(np.zeros((), dtype), shape)  # its shape and dtype, no data
    return None if links is None else Linked(stand_in, chunks, links, NUMPY)


def _restored_shards(host: _Host, read: _Read) -> dict[tuple[str, int], Shard]:
    """The shard files of a restored numpy array, with the CRCs its checkpoint lists for the save restored."""
    assert host.restored is not None
    folder, array, save = host.restored
    grid = [-(-n // s) for n, s in zip(host.shape, host.chunks)]
    crcs = _checksums_of(folder / DATA_DIR, array, save, read)
    out = {}
    for number, c in crcs.items():
        position = [int(i) for i in np.unravel_index(number, grid)]
        out[(DATA_DIR, number)] = Shard(str(folder / DATA_DIR / array / chunk_key(position)), c)
    return out


def _same_content(views: list[memoryview], shard: Shard) -> int | None:
    """The inode of ``shard``'s file if ``views`` (a shard's inner chunks) are its bytes, else None
    (``shard.inode``, where known, must be the file's). Cheapest first:
    the first :data:`_PROBE` bytes against the file's (an array changed everywhere differs there);
    then each chunk's CRC in turn (a change anywhere, found at its chunk without reading the file);
    then, every CRC matching, all the bytes against the file's (a CRC is no identity)."""
    if len(views) != len(shard.crcs) or not views:
        return None
    try:
        fd = os.open(shard.file, os.O_RDONLY)
    except OSError:
        return None
    try:
        inode = os.fstat(fd).st_ino
        if shard.inode is not None and inode != shard.inode:
            return None
        buffer = aligned_empty((max(len(v) for v in views) + CRC,), np.dtype(np.uint8))
        probe = min(_PROBE, len(views[0]))
        if os.preadv(fd, [buffer.data[:probe]], 0) != probe or not _equal(buffer[:probe], views[0][:probe]):
            return None
        if any(crc32c_of(v) != crc for v, crc in zip(views, shard.crcs)):
            return None
        # The file as it is now, all of it, before another checkpoint shares it: its chunk index, each
        # chunk's bytes and the CRC stored after it (a flipped bit there would be linked on otherwise).
        stored = len(views[0]) + CRC  # each chunk is followed by its CRC (jaxckpt.arrays.zarr_write)
        entries = shard_index(fd, shard.file, len(views), stored)
        if isinstance(entries, str) or entries[:, 0].tolist() != [i * stored for i in range(len(views))]:
            return None
        offset = 0
        for view, crc in zip(views, shard.crcs):
            if os.preadv(fd, [buffer.data[:stored]], offset) != stored or not _equal(buffer[: len(view)], view):
                return None
            if bytes(buffer[len(view) : stored]) != struct.pack("<I", crc):
                return None
            offset += stored
        return inode
    except OSError:
        return None
    finally:
        os.close(fd)


def _libc_memcmp() -> Any:
    try:
        call = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    call.argtypes, call.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    return call


_MEMCMP = _libc_memcmp()  # about 4x numpy's array_equal, without its array of booleans


def _equal(a: np.ndarray, b: memoryview) -> bool:
    other = np.frombuffer(b, np.uint8)
    if len(other) != len(a):
        return False
    if _MEMCMP is not None:
        return bool(_MEMCMP(a.ctypes.data, other.ctypes.data, len(a)) == 0)
    return bool(np.array_equal(a, other))


def _listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _checksums_of(store: Path, array: str, save: str, read: _Read) -> dict[int, tuple[int, ...]]:
    """The CRCs of ``array``'s shards that data store ``store`` lists for save ``save`` (none if
    unreadable). ``read``: the stores' checksums read so far in this save, each file read once."""
    if (store, save) not in read:
        read[(store, save)] = read_hint(Location(str(store.parent), local=store.parent), store.name, save)
    return hinted_crcs(read[(store, save)], array)


def _read_small(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16)
    except OSError:
        return None


def _link_all(
    sources: Mapping[tuple[str, int], Shard],
    keys: Mapping[tuple[str, int], str],
    staging: Path,
    n: int,
    meta: bytes,
    chunk_bytes: int | None = None,
) -> dict[str, dict[int, tuple[str, str, tuple[int, ...]]]] | None:
    """Hard-link every source into ``<staging>/<store>/.links/``; None (and no link left) if one fails.
    A source's ``zarr.json`` is linked too where it holds exactly ``meta`` (else the save writes it).
    ``chunk_bytes``: each linked file is read and checked whole first (its chunk index, every inner
    chunk's bytes and stored CRC-32C against the shard's CRCs), so that a damaged file is written
    afresh, not shared with one more checkpoint; None where the caller compared it already."""
    made: list[str] = []
    out: dict[str, dict[int, tuple[str, str, tuple[int, ...]]]] = {}
    try:
        for (store, number), shard in sources.items():
            folder = staging / store / LINKS
            folder.mkdir(parents=True, exist_ok=True)
            link = str(folder / f"{n}-{number}")
            os.link(shard.file, link, follow_symlinks=False)
            made.append(link)
            linked = os.lstat(link)
            if not stat.S_ISREG(linked.st_mode):  # a symlink planted in its place: never shared on
                raise FileNotFoundError(f"{shard.file} is not a regular file")
            if shard.inode is not None and linked.st_ino != shard.inode:
                raise FileNotFoundError(f"{shard.file} is another file than the one saved")
            if chunk_bytes is not None and not _intact(link, shard, chunk_bytes):
                raise FileNotFoundError(f"{shard.file} is damaged")
            out.setdefault(store, {})[number] = (link, keys[(store, number)], shard.crcs)
            if ZARR_JSON_LINK not in out[store]:
                source = os.path.join(shard.file[: -len(keys[(store, number)]) - 1], "zarr.json")
                if _read_small(source) == meta:
                    os.link(source, f"{link}-zarr.json")
                    made.append(f"{link}-zarr.json")
                    out[store][ZARR_JSON_LINK] = (f"{link}-zarr.json", "zarr.json", ())
    except OSError:
        for link in made:
            with contextlib.suppress(OSError):
                os.unlink(link)
        return None
    return out


def _intact(path: str, shard: Shard, chunk_bytes: int) -> bool:
    """Whether the shard file at ``path`` (a link just made) is whole, with ``shard``'s CRCs."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return shard_intact(fd, path, shard.crcs, chunk_bytes)
    finally:
        os.close(fd)


def in_host_memory(x: jax.Array) -> bool:
    """Whether ``x``'s buffers are in host memory (CPU devices): they may be a numpy array's, or a
    DLPack producer's, that its owner changes in place (``jax.device_put(buf, may_alias=True)``,
    ``jax.dlpack.from_dlpack``), so its identity is no proof that its values are those saved."""
    return any(getattr(d, "platform", None) == "cpu" for d in x.sharding.device_set)


def same_crcs(x: jax.Array, chunks: tuple[int, ...], crcs: Mapping[int, Sequence[int]]) -> bool:
    """Whether the bytes of ``x`` in each shard of ``crcs`` (its number in the shard grid -> the
    CRC-32C of each of its inner chunks) still have those CRC-32Cs."""
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    inner = inner_chunk_shape(chunks, dtype.itemsize)
    parts = {region(s.index, shape): (s.index, np.asarray(s.data)) for s in x.addressable_shards}
    held = list(parts.values())
    if any(hi - lo < c and hi < n for box in parts for (lo, hi), c, n in zip(box, chunks, shape)):
        held = grouped_shards(held, shape, dtype, chunks)  # a bucket's shards of several device shards
    wanted = {number: tuple(c) for number, c in crcs.items()}
    seen = set()
    for number, _, data in shards_of(shape, dtype, chunks, held):
        if number in wanted and number not in seen:
            if tuple(crc32c_of(v) for v in inner_chunks(data, inner)) != wanted[number]:
                return False
            seen.add(number)
    return seen == set(wanted)
