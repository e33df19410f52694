"""Saving: leaves become index records and array data, written into a staging folder and published."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxckpt import _format, _multihost, _staging, _storage, _tensorstore
from jaxckpt._errors import UnsupportedValueError
from jaxckpt._format import (
    DATA_DIR,
    JAX,
    NUMPY,
    NUMPY_SCALAR,
    ArrayLeaf,
    Container,
    InArray,
    Index,
    InPack,
    Layout,
    Leaf,
    MeshRecord,
    Pack,
    ValueLeaf,
    data_store,
    dtype_name,
)
from jaxckpt._index_json import encode_index
from jaxckpt._tree import PathLike, describe, flatten, gc_paused, is_state_object, not_utf8
from jaxckpt._version import __version__


def describe_sharding(x: jax.Array) -> str | None:
    sharding = x.sharding
    if len(sharding.device_set) <= 1:
        return None
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"NamedSharding(mesh={dict(sharding.mesh.shape)}, spec={tuple(sharding.spec)})"
    return f"{type(sharding).__name__}({len(sharding.device_set)} devices)"


def _unsupported(key: str, x: Any, hint: str = "") -> UnsupportedValueError:
    t = type(x)
    return UnsupportedValueError(
        f"Cannot save {describe(key)}: values of type {t.__module__}.{t.__qualname__} are not supported. "
        + (hint or "Save arrays, Python scalars, str, None, pytrees of them, or objects with get_state()/set_state().")
    )


def _array_leaf(key: str, x: Any) -> tuple[ArrayLeaf, Any]:
    """The record of an array leaf (its location filled in later) and the data to store."""
    impl = None
    sharding = None
    container: Container
    if isinstance(x, jax.Array):
        container = JAX
        sharding = describe_sharding(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
    elif isinstance(x, np.generic):
        container, x = NUMPY_SCALAR, np.asarray(x)
    else:
        container = NUMPY
    dtype = np.dtype(x.dtype)
    if dtype_name(dtype) is None:
        raise _unsupported(key, x, f"Its dtype {dtype} cannot be stored; convert it to a numeric dtype.")
    return ArrayLeaf(dtype, tuple(x.shape), container, InArray("", ""), impl, sharding), x


# Python ints are stored as JSON numbers; Python's own parser refuses more than 4300 digits
# (sys.get_int_max_str_digits), so jaxckpt refuses ints it could not read back.
MAX_INT_DIGITS = 4000
_INT_LIMIT = 10**MAX_INT_DIGITS


def _json_int(key: str, x: int) -> int:
    if x.bit_length() > 13_000 and abs(x) >= _INT_LIMIT:  # 10**4000 has 13,288 bits
        raise UnsupportedValueError(
            f"Cannot save {describe(key)}: the Python int has {x.bit_length()} bits, over {MAX_INT_DIGITS} decimal "
            "digits, more than JSON readers accept. Save it as a str, or as an array of digits."
        )
    return x


def _utf8(key: str, x: str) -> str:
    why = not_utf8(x)
    if why is not None:
        raise UnsupportedValueError(
            f"Cannot save {describe(key)}: the str is not valid Unicode ({why}), so it cannot be written as "
            "UTF-8. Remove the lone surrogate, or save bytes as an array."
        )
    return x


def _value_leaf(key: str, x: Any) -> ValueLeaf | None:
    if x is None:
        return ValueLeaf("none", None)
    if isinstance(x, bool):
        return ValueLeaf("bool", x)
    if isinstance(x, int):
        return ValueLeaf("int", _json_int(key, int(x)))
    if isinstance(x, float):
        return ValueLeaf("float", float(x))
    if isinstance(x, str):
        return ValueLeaf("str", _utf8(key, str(x)))
    if is_state_object(x):
        state = x.get_state()
        try:  # as the index encodes it: UTF-8, so a lone surrogate fails here and not in the background
            json.dumps(state, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise UnsupportedValueError(
                f"Cannot save {describe(key)}: {type(x).__name__}.get_state() returned a value that is not JSON ({e}). "
                "Return dicts, lists, str, int, finite floats, bool and None."
            ) from e
        return ValueLeaf("state", state)
    return None


class _Packer:
    """Lays small leaves end to end into packs of about PACK_TARGET_BYTES each."""

    def __init__(self) -> None:
        self.packs: list[list[tuple[int, np.ndarray]]] = []
        self.sizes: list[int] = []
        self._built = 0  # packs before this one were handed to a writer

    def add(self, data: np.ndarray) -> InPack:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if self._built == len(self.packs) or self.sizes[-1] + raw.size > _tensorstore.PACK_TARGET_BYTES:
            self.packs.append([])
            self.sizes.append(0)
        offset = -(-self.sizes[-1] // _tensorstore.PACK_ALIGN) * _tensorstore.PACK_ALIGN
        self.packs[-1].append((offset, raw))
        self.sizes[-1] = offset + raw.size
        return InPack(len(self.packs) - 1, offset, raw.size, zlib.crc32(raw.data))

    def hand_over(self, writer: _tensorstore.Writer, *, last: bool) -> None:
        """Give the writer every complete pack (and the last one too if ``last``: the next leaf then
        starts a new pack), then forget their leaves."""
        end = len(self.packs) if last else len(self.packs) - 1
        for i in range(self._built, end):
            buffer = np.zeros(self.sizes[i], np.uint8)
            for offset, raw in self.packs[i]:
                buffer[offset : offset + raw.size] = raw
            self.packs[i] = []
            writer.add_pack(f"p/{i}", buffer)
        self._built = max(self._built, end)


def _on_cpu(x: jax.Array) -> bool:
    # jax's Device is an alias of jaxlib's extension type, which has no stubs: mypy sees no attributes.
    return all(d.platform == "cpu" for d in x.sharding.device_set)  # type: ignore[attr-defined]


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _owners(x: Any) -> dict[tuple[tuple[int, int], ...], Any]:
    """Each region (shard) of ``x`` -> the device that writes it: the first to hold it, in the
    sharding's device order, which every process sees alike. Host data belongs to process 0."""
    if not isinstance(x, jax.Array):
        return {tuple((0, n) for n in np.shape(x)): None}
    devices = x.sharding.device_set
    if len(devices) == 1:  # the common case, and the cost of 10,000 small leaves: no index map
        return {tuple((0, n) for n in x.shape): next(iter(devices))}
    owners: dict[tuple[tuple[int, int], ...], Any] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        owners.setdefault(_region(index, x.shape), device)
    return owners


def _process_of(device: Any) -> int:
    return 0 if device is None else device.process_index


def _layout(x: jax.Array, owners: dict[tuple[tuple[int, int], ...], Any], meshes: dict[int, Any]) -> Layout | None:
    """The layout (mesh and partition spec) that gives exactly these owners' regions, or None when
    the sharding has none (not a NamedSharding, uneven shards, an unusual spec): its regions are then
    listed. ``meshes`` maps id(jax mesh) -> (mesh, MeshRecord), shared by the arrays of one save."""
    sharding = x.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return None
    mesh = sharding.mesh
    if not all(isinstance(a, str) for a in mesh.axis_names) or len(sharding.spec) > x.ndim:
        return None
    spec: list[tuple[str, ...]] = []
    for entry in (*sharding.spec, *[None] * (x.ndim - len(sharding.spec))):
        if entry is None:
            spec.append(())
        elif isinstance(entry, str):
            spec.append((entry,))
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            spec.append(entry)
        else:
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
    if computed != {region: data_store(_process_of(d)) for region, d in owners.items()}:
        return None
    meshes.setdefault(id(mesh), (mesh, record))
    return layout


def _snapshot(
    x: Any, owners: dict[tuple[tuple[int, int], ...], Any]
) -> tuple[list[tuple[tuple[slice, ...], np.ndarray]], int]:
    """Host data of the regions of ``x`` that this process owns: ([(region, data)], bytes copied).

    For a jax.Array, the shards on owning devices here. On CPU, ``np.asarray`` of a shard is a
    read-only view of its buffer: no copy, and safe even when the train step donates the array right
    after, since XLA does not reuse a buffer that a view holds. On an accelerator it is the
    device-to-host copy. A numpy array is copied, because its owner may change it in place once the
    save has returned.
    """
    if isinstance(x, jax.Array):
        # A shard is written from its owning device; shards here are on this process's devices.
        parts = [
            (s.index, np.asarray(s.data)) for s in x.addressable_shards if owners[_region(s.index, x.shape)] == s.device
        ]
        return parts, 0 if _on_cpu(x) else sum(d.nbytes for _, d in parts)
    data = np.array(x, copy=True)
    return [(tuple(slice(None) for _ in data.shape), data)], data.nbytes


def _held_parts(
    x: Any, owners: dict[tuple[tuple[int, int], ...], Any]
) -> dict[str, list[tuple[tuple[slice, ...], np.ndarray]]]:
    """An own copy's data: every region of ``x`` this process holds, once each, by the data store of
    the process that owns the region (the store the index names for it)."""
    if not isinstance(x, jax.Array):
        return {DATA_DIR: [(tuple(slice(None) for _ in np.shape(x)), np.array(x, copy=True))]}
    out: dict[str, list[tuple[tuple[slice, ...], np.ndarray]]] = {}
    seen = set()
    for s in x.addressable_shards:
        region = _region(s.index, x.shape)
        if region not in seen:
            seen.add(region)
            out.setdefault(data_store(_process_of(owners[region])), []).append((s.index, np.asarray(s.data)))
    return out


def _on_cpu_data(x: Any) -> bool:
    return isinstance(x, jax.Array) and _on_cpu(x)


class Deferred:
    """An array that a save reads only when it reaches it (``jaxckpt convert``): a value of another
    checkpoint, so that converting holds about one array at a time, not the whole checkpoint."""

    __slots__ = ("dtype", "read", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, read: Callable[[], np.ndarray]) -> None:
        self.shape, self.dtype, self.read = shape, dtype, read


def host_memory_budget() -> int:
    """Bytes of snapshot copies a save may hold before it writes some out (``JAXCKPT_HOST_MEMORY_BUDGET``)."""
    configured = os.environ.get("JAXCKPT_HOST_MEMORY_BUDGET")
    if configured:
        return int(configured)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):  # not POSIX
        return 4 << 30


@dataclasses.dataclass
class Prepared:
    """A save whose snapshot is taken: what remains can run in the background (:func:`write_and_publish`)."""

    path: str
    dest: _storage.Location
    staging: _storage.Location
    token: str
    overwrite: bool
    index: Index
    writer: _tensorstore.Writer
    packer: _Packer
    # Each process's own whole copy on its own disk (a two-tier manager's local tier): every process
    # publishes its folder, with the packs and every region it holds, in the store the index names.
    own_copy: bool = False
    writers: dict[str, _tensorstore.Writer] = dataclasses.field(default_factory=dict)


@gc_paused
def prepare(
    path: PathLike, root: Any, *, overwrite: bool = False, budget: int | None = None, own_copy: bool = False
) -> Prepared:
    """The blocking part of a save: check the destination, record every leaf, snapshot array data.

    Every process of a multi-process run calls it alike; each snapshots the regions it owns. When
    the snapshot's copies outgrow the host memory budget, what is recorded so far is written out
    first, so a state larger than the budget costs a longer call, not more memory. ``budget``
    overrides :func:`host_memory_budget`. ``own_copy``: each process writes a whole checkpoint of
    its own at ``path`` (its own disk), holding the packs and every region it has (see :class:`Prepared`).
    """
    dest = _storage.location(path)
    _staging.check_writable(dest, overwrite)
    flat = flatten(root)
    _check_live_and_copy(flat.leaves)
    me = _multihost.process_index()
    if own_copy and dest.local is None:
        raise ValueError(f"A process's own copy goes to its local disk, not to {dest.text!r}.")
    if me == 0:
        _staging.clear_for_save(dest)  # object stores: before the token lets the others write
    token = _multihost.shared_token()
    staging = _staging.staging_folder(dest, token, own=own_copy)
    try:
        writer = _tensorstore.Writer((staging / data_store(me)).spec())
        records = _Records(
            writer, me, host_memory_budget() if budget is None else budget, staging if own_copy else None
        )
        for key, x in flat.leaves.items():
            records.add(key, x)
        if own_copy:
            records.writer_for(DATA_DIR)  # opened now: write_and_publish hands the last pack to it
        packs = [Pack(f"p/{i}", size, _tensorstore.pack_chunk(size)) for i, size in enumerate(records.packer.sizes)]
        index = Index(
            flat.nodes,
            records.leaves,
            packs,
            {"writer": f"jaxckpt {__version__}"},
            meshes=list({id(r): r for _, r in records.meshes.values()}.values()),
            aliases=flat.aliases,
        )
    except BaseException:
        if me == 0 or own_copy:  # the others may be writing into it; a manager removes what is left
            _staging.discard(staging)
        raise
    return Prepared(
        os.fspath(path), dest, staging, token, overwrite, index, writer, records.packer, own_copy, records.writers
    )


def _check_live_and_copy(leaves: dict[str, Any]) -> None:
    """Refuse deleted arrays; then start every device-to-host copy before waiting for any."""
    for key, x in leaves.items():
        if isinstance(x, jax.Array) and x.is_deleted():
            raise UnsupportedValueError(
                f"Cannot save {describe(key)}: its jax.Array was deleted (donated to a jitted function, or "
                ".delete() was called) before the save. Save the arrays the step returned instead."
            )
    for x in leaves.values():
        if isinstance(x, jax.Array) and not _on_cpu(x) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x.copy_to_host_async()


class _Records:
    """The index records of one save's leaves, made as they are met, and the data they hand over:
    small leaves to packs, large ones to the writer as arrays of their own."""

    def __init__(
        self, writer: _tensorstore.Writer, me: int, budget: int, own_copy: _storage.Location | None = None
    ) -> None:
        self.writer, self.me, self.budget = writer, me, budget
        self.own_copy = own_copy  # the staging folder of this process's own copy, if it writes one
        self.writers = {data_store(me): writer}  # by data store: an own copy writes several
        self.packer = _Packer()
        self.leaves: dict[str, Leaf] = {}
        self.meshes: dict[int, tuple[Any, MeshRecord]] = {}
        self._held = 0  # bytes of snapshot copies not written yet
        self._arrays = 0

    def add(self, key: str, x: Any) -> None:
        fresh = isinstance(x, Deferred)
        if fresh:  # read only now; no one else holds it, so it needs no snapshot copy
            x = _checked_read(key, x)
        value = _value_leaf(key, x)
        if value is not None:
            self.leaves[key] = value
            return
        if isinstance(x, jax.ShapeDtypeStruct):
            raise _unsupported(key, x, "A ShapeDtypeStruct is a restore template with no data; save a concrete array.")
        if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
            raise _unsupported(key, x)
        record, data = _array_leaf(key, x)
        at = self._store(record, data, fresh)
        self.leaves[key] = ArrayLeaf(
            record.dtype, record.shape, record.container, at, record.prng_impl, record.sharding
        )
        if self._held > self.budget:  # write out what is held so far, the pack being filled included
            self.packer.hand_over(self.pack_writer, last=True)
            for w in self.writers.values():
                w.flush()
            self._held = 0

    @property
    def pack_writer(self) -> _tensorstore.Writer:
        return self.writer_for(DATA_DIR) if self.own_copy is not None else self.writer

    def writer_for(self, store: str) -> _tensorstore.Writer:
        """An own copy's writer of ``store`` (the process that owns a region names its store)."""
        if store not in self.writers:
            assert self.own_copy is not None
            self.writers[store] = _tensorstore.Writer((self.own_copy / store).spec())
        return self.writers[store]

    def _store(self, record: ArrayLeaf, data: Any, fresh: bool) -> InArray | InPack:
        """Where the array goes: a pack or an array of its own, its data handed over (this process's part)."""
        me = self.me
        owners = _owners(data)
        by_process: dict[int, list[tuple[tuple[int, int], ...]]] = {}
        for region, device in owners.items():
            by_process.setdefault(_process_of(device), []).append(region)
        # Every process takes the same decisions here, so array numbers agree across processes.
        if record.nbytes <= _tensorstore.PACK_LEAF_LIMIT and set(by_process) == {0}:
            # A jax.Array's host view is immutable; a numpy array is copied, as in _snapshot.
            small = np.asarray(data) if isinstance(data, jax.Array) else np.array(data, copy=True)
            packs = me == 0 or self.own_copy is not None
            if packs and not (isinstance(data, jax.Array) and _on_cpu(data)):
                self._held += small.nbytes  # a copy, held until its pack is written
            return self.packer.add(small) if packs else InPack(0, 0, 0, 0)
        regions, layout = None, None
        if set(by_process) != {0}:  # the sharding says where its regions are, or they are listed
            layout = _layout(data, owners, self.meshes)
            if layout is None:
                regions = {data_store(p): [list(r) for r in rs] for p, rs in sorted(by_process.items())}
        shards = [max(b - a for a, b in dims) for dims in zip(*owners)] if record.shape else []
        chunks = tuple(_tensorstore.chunk_shape(record.shape, shards, record.dtype.itemsize))
        at = InArray(f"a/{self._arrays}", _tensorstore.stored_dtype(record.dtype), regions, chunks, layout)
        self._arrays += 1
        if self.own_copy is not None and not fresh:
            for store, held in _held_parts(data, owners).items():
                self.writer_for(store).add_array(at.path, record.shape, record.dtype, chunks, held)
                self._held += sum(d.nbytes for _, d in held) if not _on_cpu_data(data) else 0
            return at
        if fresh:
            parts, copied = [(tuple(slice(None) for _ in data.shape), data)], data.nbytes
        else:
            parts, copied = _snapshot(data, owners) if me in by_process else ([], 0)
        self.writer.add_array(at.path, record.shape, record.dtype, chunks, parts)
        self._held += copied
        return at


def write_and_publish(p: Prepared) -> str:
    """The rest of a save: write the data, wait for every process, then the primary writes the index
    and publishes; returns the path once the checkpoint is visible."""
    primary = _multihost.is_primary() or p.own_copy
    try:
        p.packer.hand_over(p.writers.get(DATA_DIR, p.writer) if p.own_copy else p.writer, last=True)
        for writer in p.writers.values() or [p.writer]:
            writer.flush()
        _multihost.barrier(f"{p.token}/written")  # every process's bytes are durable
        if primary:
            _staging.publish(p.staging, p.dest, encode_index(p.index), p.overwrite)
        _multihost.barrier(f"{p.token}/published")
    except BaseException:
        if primary:  # the others may still be writing into it; a manager removes what is left
            _staging.discard(p.staging)
        raise
    return p.path


def write(path: PathLike, root: Any, *, overwrite: bool = False, budget: int | None = None) -> str:
    """Saves ``root`` as a new checkpoint at ``path``; returns ``path``."""
    return write_and_publish(prepare(path, root, overwrite=overwrite, budget=budget))


def _checked_read(key: str, x: Deferred) -> np.ndarray:
    data = x.read()
    if data.shape != x.shape or data.dtype != x.dtype:
        raise UnsupportedValueError(
            f"Cannot save {describe(key)}: its source gave a {data.dtype} array of shape {data.shape}, "
            f"where {x.dtype} of shape {x.shape} was announced."
        )
    return data
