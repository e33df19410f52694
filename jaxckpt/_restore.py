"""Restoring: index records and stored bytes become values shaped like what the user holds now.

A *template* is the value an object holds now at a key: a jax.Array (restored with its sharding),
a ``jax.ShapeDtypeStruct`` (becomes a concrete array with its sharding), a numpy array or scalar, a
Python scalar or None, or an object with ``set_state``. Without a template (:data:`NO_TEMPLATE`),
arrays come back as numpy and values as saved.
"""

from __future__ import annotations

import functools
import math
import os
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxckpt import _arrayio, _format, _formats, _statefile, _storage
from jaxckpt._errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    MismatchError,
    MissingKeyError,
    NotACheckpointError,
    UnsupportedValueError,
)
from jaxckpt._format import (
    DATA_DIR,
    INDEX_FILE,
    NUMPY_SCALAR,
    SCALAR_TYPES,
    ArrayLeaf,
    InArray,
    Index,
    InPack,
    Leaf,
    ValueLeaf,
    decode_index,
)
from jaxckpt._tree import describe, is_state_object, unescape_edge

NO_TEMPLATE = object()
# A region to read: its shape, and (data store, region there, where it goes or None) per part.
_Parts = tuple[tuple[int, ...], list[tuple[str, tuple[slice, ...], Any]]]
# Byte gaps up to this size between wanted pack spans are read through rather than split.
_SPAN_GAP = 1 << 20
# Bytes of array reads started but not yet finished.
_READ_AHEAD_BYTES = 128 << 20


def _what(leaf: Leaf) -> str:
    if isinstance(leaf, ValueLeaf):
        return {"none": "None", "state": "an object state (JSON)"}.get(
            leaf.type, f"a Python {leaf.type} ({leaf.value!r})"
        )
    if leaf.prng_impl:
        return f"a PRNG key array ({leaf.prng_impl}) of shape {leaf.shape[: len(leaf.shape) - 1]}"
    return f"a {leaf.dtype.name} array of shape {leaf.shape}"


def _expected(template: Any) -> str:
    if template is None:
        return "None"
    if isinstance(template, (bool, int, float, str)):
        return f"a Python {type(template).__name__}"
    if is_state_object(template):
        return f"an object state (for {type(template).__name__}.set_state)"
    if jax.dtypes.issubdtype(template.dtype, jax.dtypes.prng_key):
        return f"a PRNG key array ({_key_impl(template)}) of shape {tuple(template.shape)}"
    return f"a {np.dtype(template.dtype).name} array of shape {tuple(template.shape)}"


def _key_impl(template: Any) -> str:
    """The PRNG implementation of a key array or of a key-typed ShapeDtypeStruct."""
    if isinstance(template, jax.Array):
        return str(jax.random.key_impl(template))
    return template.dtype._impl.name  # a ShapeDtypeStruct has only the key dtype to ask


def _mismatch(key: str, leaf: Leaf, template: Any, detail: str = "") -> MismatchError:
    return MismatchError(
        f"Cannot restore {describe(key)}: the checkpoint holds {_what(leaf)}, "
        f"but the object expects {_expected(template)}.{detail}"
    )


def _is_array_template(t: Any) -> bool:
    return isinstance(t, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic))


def check(key: str, leaf: Leaf, template: Any) -> None:
    """Raise a MismatchError naming ``key`` if ``leaf`` cannot restore into ``template``."""
    if template is NO_TEMPLATE:
        return
    if template is None:
        if not (isinstance(leaf, ValueLeaf) and leaf.type == "none"):
            raise _mismatch(key, leaf, template)
        return
    if is_state_object(template):
        if not (isinstance(leaf, ValueLeaf) and leaf.type == "state"):
            raise _mismatch(key, leaf, template)
        return
    if isinstance(template, (bool, int, float, str)):
        want = type(template).__name__ if type(template).__name__ in SCALAR_TYPES else None
        if isinstance(leaf, ValueLeaf) and leaf.type == want:
            return
        if isinstance(leaf, ArrayLeaf) and leaf.shape == () and not leaf.prng_impl and want != "str":
            kinds = {"bool": "b", "int": "biu", "float": "biuf"}[want]
            if leaf.dtype.kind in kinds:
                return
        raise _mismatch(key, leaf, template)
    if not _is_array_template(template):
        raise UnsupportedValueError(
            f"Cannot restore into {describe(key)}: the object holds a {type(template).__name__}, which jaxckpt "
            "cannot restore into. Hold an array, a jax.ShapeDtypeStruct, a Python scalar or a pytree of them there."
        )
    is_key = jax.dtypes.issubdtype(template.dtype, jax.dtypes.prng_key)
    if isinstance(leaf, ValueLeaf):
        if is_key or template.shape != () or leaf.type not in ("bool", "int", "float"):
            raise _mismatch(key, leaf, template)
        try:
            np.asarray(leaf.value, dtype=template.dtype)
        except OverflowError:  # a Python int that the dtype cannot hold
            raise _mismatch(key, leaf, template, " The value does not fit that dtype.") from None
        return
    if is_key != bool(leaf.prng_impl):
        raise _mismatch(key, leaf, template)
    if is_key:
        impl = _key_impl(template)
        if impl != leaf.prng_impl or tuple(template.shape) != leaf.shape[:-1]:
            raise _mismatch(key, leaf, template)
        return
    if tuple(template.shape) != leaf.shape:
        raise _mismatch(key, leaf, template)
    if np.dtype(template.dtype) != leaf.dtype and _kind(template.dtype) in ("other", None):
        raise _mismatch(key, leaf, template)
    if _kind(template.dtype) != _kind(leaf.dtype):
        raise _mismatch(
            key, leaf, template, " jaxckpt casts float to float and int to int on restore, never across kinds."
        )


def _kind(dtype: Any) -> str | None:
    """Which casts a dtype takes part in: "float" (float64 ... float4, bfloat16, float8), "int" (any
    width, signed or not), None for bool (never cast), "other" (complex: never cast)."""
    if np.dtype(dtype) == np.bool_:
        return None
    if jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return "float"
    if jax.numpy.issubdtype(dtype, jax.numpy.integer):
        return "int"
    return "other"


def _int_range(dtype: np.dtype) -> tuple[int, int]:
    info = ml_dtypes.iinfo(dtype) if dtype.kind == "V" else np.iinfo(dtype)  # int4/int2 are ml_dtypes
    return int(info.min), int(info.max)


def cast(key: str, data: np.ndarray, dtype: Any) -> np.ndarray:
    """``data`` (host) as the template's ``dtype``, as Orbax does: floats round to the nearest value
    the target holds; ints convert exactly, and a value the target cannot hold is a MismatchError
    (never a silent wraparound)."""
    dtype = np.dtype(dtype)
    if data.dtype == dtype:
        return data
    if _kind(dtype) == "int" and data.size:
        lo, hi = _int_range(dtype)
        found_lo, found_hi = int(data.min()), int(data.max())
        if found_lo < lo or found_hi > hi:
            raise MismatchError(
                f"Cannot restore {describe(key)} as {dtype.name}: the checkpoint holds {data.dtype.name} values from "
                f"{found_lo} to {found_hi}, outside {dtype.name}'s range [{lo}, {hi}]. Restore into a wider dtype."
            )
    return data.astype(dtype)


@functools.cache
def _default_sharding(device: Any) -> jax.sharding.Sharding:
    # One object for every leaf: jax.device_put is a third faster on 10,000 leaves that share it.
    return jax.sharding.SingleDeviceSharding(device)


def _cast_for(key: str, leaf: ArrayLeaf, template: Any, data: Any) -> Any:
    """Host ``data`` of ``leaf`` in the dtype of an array template (see :func:`cast`)."""
    if leaf.prng_impl or not _is_array_template(template):
        return data
    return cast(key, np.asarray(data), template.dtype)


def _target_sharding(template: Any, key: str = "") -> jax.sharding.Sharding | None:
    if isinstance(template, jax.Array):
        return template.sharding
    if isinstance(template, jax.ShapeDtypeStruct):
        sharding = template.sharding
        if sharding is None:
            return _default_sharding(jax.devices()[0])
        if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh):
            return _on_mesh_in_context(key, sharding)
        return sharding
    return None


def _on_mesh_in_context(key: str, sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
    """An abstract template's sharding (``nnx.eval_shape`` under ``jax.set_mesh`` gives these) placed
    on the concrete mesh in context."""
    mesh = jax.sharding.get_mesh()
    abstract = sharding.mesh
    if mesh.empty or dict(mesh.shape) != dict(abstract.shape) or mesh.axis_names != abstract.axis_names:
        found = "no mesh is in context" if mesh.empty else f"the mesh in context is {dict(mesh.shape)}"
        raise MismatchError(
            f"Cannot restore {describe(key)}: its template is sharded over an abstract mesh {dict(abstract.shape)} "
            f"(from jax.eval_shape or nnx.eval_shape), and {found}. Restore inside `with jax.set_mesh(mesh):` "
            "with the concrete mesh of those axes."
        )
    return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _finish(leaf: Leaf, template: Any, data: Any) -> Any:
    """The restored value: ``data`` (host numpy or a jax.Array) shaped as ``template`` wants."""
    if isinstance(leaf, ValueLeaf):
        value = leaf.value
        if template is NO_TEMPLATE or template is None or isinstance(template, (bool, int, float, str)):
            return value
        if is_state_object(template):
            template.set_state(value)
            return template
        data = np.asarray(value, dtype=template.dtype)
    if template is NO_TEMPLATE:
        if leaf.prng_impl:
            return jax.random.wrap_key_data(np.asarray(data), impl=leaf.prng_impl)
        return data[()] if leaf.container == NUMPY_SCALAR else data
    if isinstance(template, (bool, int, float)):
        return type(template)(np.asarray(data).item())
    if isinstance(template, np.generic):
        return np.asarray(data)[()]
    if isinstance(template, np.ndarray):
        return np.asarray(data)
    sharding = _target_sharding(template)
    if isinstance(leaf, ArrayLeaf) and leaf.prng_impl:
        keys = jax.random.wrap_key_data(np.asarray(data), impl=leaf.prng_impl)
        return jax.device_put(keys, sharding)
    if isinstance(data, jax.Array):
        return data
    return jax.device_put(np.asarray(data), sharding)


def _hashable(index: tuple[slice, ...]) -> tuple[tuple[Any, Any, Any], ...]:
    return tuple((s.start, s.stop, s.step) for s in index)


class Opened:
    """One checkpoint opened for reading: its index, and batched reads of its values."""

    format = "jaxckpt"  # or the foreign format's name (ForeignOpened)
    # Values listed that have no numpy form (TensorFlow's iterator state, string tensors): key -> entry
    skipped: Mapping[str, _formats.Entry] = {}

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.location = _storage.location(path)
        self.path = self.location.local or self.location.text  # how messages name it
        where = repr(str(self.location / INDEX_FILE))
        self.index: Index = decode_index(_storage.read_index_bytes(self.location), where)
        self._readers: dict[str, _arrayio.Reader] = {}
        self._stored_bytes: dict[str, int] = {}  # per data store, for _check_backed

    def leaf(self, key: str) -> Leaf:
        try:
            return self.index.leaves[key]
        except KeyError:
            if key in self.skipped:
                raise UnsupportedValueError(self._missing_key_message(key)) from None
            raise MissingKeyError(self._missing_key_message(key)) from None

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
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        if key in self.index.nodes:
            hint = f" It is a node; its leaves include {', '.join(map(repr, self.index.keys_under(key)[:3]))}."
        return f"The {what} {str(self.path)!r} has no value {describe(key)}.{hint}"

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        """Values for ``{key: template}``: checked first, then read in one batch."""
        for key, template in wanted.items():
            check(key, self.leaf(key), template)
        data = self._read(wanted)
        out: dict[str, Any] = {}
        to_device: list[tuple[str, np.ndarray, jax.sharding.Sharding]] = []
        for key, template in wanted.items():
            leaf, value = self.index.leaves[key], data.get(key)
            if isinstance(leaf, ArrayLeaf) and not isinstance(value, jax.Array):
                value = _cast_for(key, leaf, template, value)  # a no-op for arrays read below
            if (
                isinstance(leaf, ArrayLeaf)
                and not leaf.prng_impl
                and isinstance(template, (jax.Array, jax.ShapeDtypeStruct))
                and not isinstance(value, jax.Array)
            ):
                to_device.append((key, value, _target_sharding(template, key)))
            else:
                out[key] = _finish(leaf, template, value)
        if to_device:  # one call for all: per-call overhead dominates for thousands of small leaves
            arrays = jax.device_put([v for _, v, _ in to_device], [s for _, _, s in to_device])
            out.update(zip([k for k, _, _ in to_device], arrays))
        return {key: out[key] for key in wanted}

    def exists(self) -> bool:
        """Whether the checkpoint is still there (a failed read may mean it was deleted meanwhile)."""
        return _storage.is_checkpoint(self.location)

    def _read(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        """The data of the array leaves among ``wanted``: host numpy, or jax.Arrays already placed
        as their templates want."""
        packed: dict[int, list[str]] = defaultdict(list)
        arrays: list[str] = []
        for key in wanted:
            leaf = self.index.leaves[key]
            if isinstance(leaf, ArrayLeaf):
                (packed[leaf.at.pack] if isinstance(leaf.at, InPack) else arrays).append(key)
        data: dict[str, Any] = {}
        try:
            targets, plans = self._plan_arrays({k: wanted[k] for k in arrays})
            needed = {store for plan in plans.values() for _, parts in plan.values() for store, _, _ in parts}
            self._check_backed([*arrays, *(k for keys in packed.values() for k in keys)], needed)
            for pack, keys in packed.items():
                data.update(self._read_packed(pack, keys))
            data.update(self._read_arrays({k: wanted[k] for k in arrays}, targets, plans))
        except CheckpointCorruptedError as e:
            if not self.exists():  # not damaged: gone (a manager's retention?)
                raise CheckpointNotFoundError(
                    f"The checkpoint {str(self.path)!r} was deleted while it was being read: {e}"
                ) from e
            raise
        return data

    @property
    def stores_opened(self) -> list[str]:
        """The data stores this reader has opened or measured so far."""
        return sorted(set(self._readers) | set(self._stored_bytes))

    def _check_backed(self, keys: list[str], stores: set[str]) -> None:
        """Before any buffer is allocated: the data stores ``stores`` (those the read will use) hold
        at least the bytes the index claims.

        Chunks are stored uncompressed (the codecs are checked on open) and every chunk is written
        (format version 2), so a store holds at least the bytes of the values in it. A crafted index
        that claims a 64 GiB array in a 1 MB checkpoint is refused here, not by running out of memory.
        Local folders only: TensorStore lists object stores without sizes.
        """
        if self.index.version < 2 or self.location.local is None or not keys:
            return
        claims: dict[str, int] = defaultdict(int)
        largest: dict[str, tuple[int, str]] = {}
        for key in keys:
            leaf = self.index.leaves[key]
            assert isinstance(leaf, ArrayLeaf)
            at = leaf.at
            if isinstance(at, InArray):
                parts = {s: _format.store_bytes(at, leaf.shape, leaf.dtype.itemsize, s) for s in stores}
            else:
                parts = {DATA_DIR: leaf.nbytes}
            for store, nbytes in parts.items():
                if not nbytes:
                    continue
                claims[store] += nbytes
                largest[store] = max(largest.get(store, (-1, "")), (nbytes, key))
        for store, claimed in claims.items():
            held = self._stored_bytes.get(store)
            if held is None:
                held = self._stored_bytes[store] = _storage.total_bytes(self.location / store) or 0
            if claimed > held:
                raise CheckpointCorruptedError(
                    f"The checkpoint {str(self.path)!r} claims {claimed:,} bytes of values in its data store "
                    f"{store!r} (the largest {describe(largest[store][1])}), but that store holds only {held:,} bytes: "
                    "its data is missing or truncated, or its index was crafted. Nothing was read."
                )

    def _read_packed(self, pack: int, keys: list[str]) -> dict[str, np.ndarray]:
        leaves = {k: self.index.leaves[k] for k in keys}
        ordered = sorted(keys, key=lambda k: leaves[k].at.offset)
        spans: list[list[int]] = []
        for k in ordered:
            at = leaves[k].at
            if spans and at.offset - spans[-1][1] <= _SPAN_GAP:
                spans[-1][1] = max(spans[-1][1], at.offset + at.nbytes)
            else:
                spans.append([at.offset, at.offset + at.nbytes])
        info = self.index.packs[pack]
        try:
            reader = self._reader_of(DATA_DIR)
            pending = reader.read_pack_spans(info.path, info.nbytes, info.chunk, [tuple(s) for s in spans])
            buffers = [(start, _arrayio.resolve(p)) for (start, _), p in zip(spans, pending)]
        except CheckpointCorruptedError as e:  # name the values packed there, not the pack alone
            names = ", ".join(map(describe, ordered[:5])) + (
                f" and {len(ordered) - 5} more" if len(ordered) > 5 else ""
            )
            raise CheckpointCorruptedError(
                f"Cannot read the data of {names} (packed in {info.path!r} in the checkpoint): {e.__cause__ or e}. "
                "The checkpoint's files are damaged or truncated."
            ) from e
        out = {}
        for k in ordered:
            leaf, at = leaves[k], leaves[k].at
            start, buffer = next((s, b) for s, b in reversed(buffers) if s <= at.offset)
            raw = buffer[at.offset - start : at.offset - start + at.nbytes]
            if zlib.crc32(raw) != at.crc32:
                raise CheckpointCorruptedError(
                    f"The data of {describe(k)} fails its checksum (pack {info.path!r}, bytes {at.offset}.."
                    f"{at.offset + at.nbytes}); the checkpoint is damaged."
                )
            out[k] = raw.view(leaf.dtype).reshape(leaf.shape)
        return out

    def _reader_of(self, store: str) -> _arrayio.Reader:
        if store not in self._readers:
            self._readers[store] = _arrayio.Reader((self.location / store).spec(), strict=self.index.version >= 2)
        return self._readers[store]

    def _plan_arrays(self, wanted: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[Any, list[Any]]]]:
        """Which regions each array is read in (those its target's devices here hold, or all of it),
        and for each, the parts to read from each data store: ({key: (sharding, devices)},
        {key: {region: [(store, source, into)]}})."""
        targets, plans = {}, {}
        for key, template in wanted.items():
            leaf = self.index.leaves[key]
            sharding = None if leaf.prng_impl else _target_sharding(template, key)
            if sharding is None:
                devices = None
                regions = {(): tuple(slice(None) for _ in leaf.shape)}
            else:  # only the regions this process's devices hold
                devices = sharding.addressable_devices_indices_map(leaf.shape)
                regions = {_hashable(i): i for i in devices.values()}
            targets[key] = (sharding, devices)
            plans[key] = {h: self._sources(leaf, index) for h, index in regions.items()}
        return targets, plans

    @staticmethod
    def _sources(leaf: ArrayLeaf, index: tuple[slice, ...]) -> _Parts:
        """The parts of region ``index`` of an array: its shape, and (data store, region there,
        where it goes in the result, or None when one store holds all of it) for each part."""
        at = leaf.at
        want = [s.indices(n)[:2] for s, n in zip(index, leaf.shape)]
        shape = tuple(hi - lo for lo, hi in want)
        if at.regions is None and at.layout is None:
            return shape, [(DATA_DIR, index, None)]
        return shape, [
            (
                store,
                tuple(slice(lo, hi) for lo, hi in box),
                tuple(slice(lo - w, hi - w) for (lo, hi), (w, _) in zip(box, want)),
            )
            for store, box in _format.pieces(at, leaf.shape, want)
        ]

    def _read_arrays(
        self, wanted: Mapping[str, Any], targets: dict[str, Any], plans: dict[str, dict[Any, list[Any]]]
    ) -> dict[str, Any]:
        leaves = {k: self.index.leaves[k] for k in wanted}
        # Open every array in every data store that holds a part this process reads, all at once.
        requests: dict[str, dict[str, tuple[str, str, str, tuple[int, ...], Any]]] = defaultdict(dict)
        for k, leaf in leaves.items():
            for _, parts in plans[k].values():
                for store, _, _ in parts:
                    requests[store][k] = (k, leaf.at.path, leaf.at.stored, leaf.shape, leaf.at.chunks)
        stores = {store: self._reader_of(store).open_arrays(list(reqs.values())) for store, reqs in requests.items()}
        pending_of = {}
        in_flight = _arrayio.InFlight(_READ_AHEAD_BYTES, _arrayio.resolve)
        for key in wanted:
            leaf = leaves[key]
            pending = {}
            for h, parts in plans[key].items():
                pending[h] = self._start_read(key, leaf, stores, parts)
                size = math.prod(parts[0]) * leaf.dtype.itemsize
                in_flight.add(size, pending[h])
            pending_of[key] = pending
        out = {}
        for key, pending in pending_of.items():
            leaf = leaves[key]
            sharding, devices = targets[key]
            host = {
                h: _cast_for(key, leaf, wanted[key], self._as_logical(leaf, _arrayio.resolve(p)))
                for h, p in pending.items()
            }
            if sharding is None:
                out[key] = host[()]
            else:
                arrays = jax.device_put([host[_hashable(i)] for i in devices.values()], list(devices))
                out[key] = jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)
            del host  # the buffers now belong to the jax arrays (aliased on CPU), or are garbage
        return out

    def read_regions(self, wanted: Mapping[str, list[tuple[slice, ...]]]) -> dict[str, list[np.ndarray]]:
        """Host data of the given regions of array leaves (stored data: PRNG keys as key data),
        opening only the data stores that hold them. For tools and benchmarks that have no devices
        of the target sharding."""
        plans = {k: [self._sources(self.leaf(k), index) for index in v] for k, v in wanted.items()}
        self._check_backed(list(wanted), {store for p in plans.values() for _, parts in p for store, _, _ in parts})
        out = {}
        for key, regions in plans.items():
            leaf = self.index.leaves[key]
            stores = self._open_for(key, leaf, {store for _, parts in regions for store, _, _ in parts})
            pending = [self._start_read(key, leaf, stores, parts) for parts in regions]
            out[key] = [self._as_logical(leaf, _arrayio.resolve(p)) for p in pending]
        return out

    def _open_for(self, key: str, leaf: ArrayLeaf, needed: Iterable[str]) -> dict[str, Any]:
        """The array of ``key`` opened in each of the data stores ``needed``."""
        at = leaf.at
        return {
            store: self._reader_of(store).open_arrays([(key, at.path, at.stored, leaf.shape, at.chunks)])
            for store in needed
        }

    def read_pieces(self, key: str, budget: int) -> Iterator[np.ndarray]:
        """The stored data of the array leaf at ``key`` (PRNG keys as key data), in C-order pieces of
        at most ``budget`` bytes each (or one element row): a large array is never held whole."""
        leaf = self.leaf(key)
        if not isinstance(leaf, ArrayLeaf):
            raise ValueError(f"{describe(key)} is not an array")
        if isinstance(leaf.at, InPack) or leaf.nbytes <= budget:
            value = self.load({key: NO_TEMPLATE})[key]
            yield np.asarray(jax.random.key_data(value) if leaf.prng_impl else value)
            return
        self._check_backed([key], set(_format.stores_of(leaf.at)))
        stores = self._open_for(key, leaf, _format.stores_of(leaf.at))
        for index in _pieces(leaf.shape, leaf.dtype.itemsize, budget):
            parts = self._sources(leaf, index)
            yield self._as_logical(leaf, _arrayio.resolve(self._start_read(key, leaf, stores, parts)))

    def _start_read(self, key: str, leaf: ArrayLeaf, stores: Mapping[str, Any], plan: _Parts) -> Any:
        """Start reading a region of the array from its parts (see :meth:`_sources`): from one
        store, or assembled from the parts of several."""
        at = leaf.at
        shape, parts = plan
        if len(parts) == 1 and parts[0][2] is None:
            store, source, _ = parts[0]
            return self._reader_of(store).read_regions(key, at.path, stores[store][key], [source])[0]
        pieces = [
            (into, self._reader_of(store).read_regions(key, at.path, stores[store][key], [source])[0])
            for store, source, into in parts
        ]
        return (key, at.path, _Assembly(shape, np.dtype(at.stored), pieces))

    @staticmethod
    def _as_logical(leaf: ArrayLeaf, data: np.ndarray) -> np.ndarray:
        return data if data.dtype == leaf.dtype else data.view(leaf.dtype)


def _pieces(shape: tuple[int, ...], itemsize: int, budget: int) -> Iterator[tuple[slice, ...]]:
    """Regions covering ``shape`` in C order, each at most ``budget`` bytes (or one element row)."""
    if not shape or math.prod(shape) * itemsize <= budget:
        yield tuple(slice(0, n) for n in shape)
        return
    inner = math.prod(shape[1:]) * itemsize
    if inner <= budget or len(shape) == 1:
        rows = max(1, budget // max(1, inner))
        for start in range(0, shape[0], rows):
            yield (slice(start, min(start + rows, shape[0])), *(slice(0, n) for n in shape[1:]))
        return
    for i in range(shape[0]):
        for rest in _pieces(shape[1:], itemsize, budget):
            yield (slice(i, i + 1), *rest)


class _Assembly:
    """One region of an array, put together from pieces read from several data stores."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, pieces: list[tuple[tuple[slice, ...], Any]]) -> None:
        self._shape, self._dtype, self._pieces = shape, dtype, pieces
        self._out: np.ndarray | None = None

    def result(self) -> np.ndarray:
        if self._out is None:  # resolved once, however often asked
            out = _arrayio.aligned_empty(self._shape, self._dtype)
            for into, pending in self._pieces:
                out[into] = _arrayio.resolve(pending)
            self._out, self._pieces = out, []
        return self._out


class ForeignOpened(Opened):
    """A checkpoint that another library wrote (``jaxckpt._formats``), read through the same calls.

    Values are read whole, then placed as their templates want, as for jaxckpt's own checkpoints.
    """

    def __init__(self, checkpoint: _formats.ForeignCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.format = checkpoint.name
        self.skipped = checkpoint.skipped
        self.path = checkpoint.path
        self.location = _storage.location(checkpoint.path)
        self.index = checkpoint.index
        self._read_keys: set[str] = set()

    def exists(self) -> bool:
        return os.path.exists(self.path) or os.path.exists(self.path + ".index")

    def _read(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key in wanted:
            if isinstance(self.index.leaves[key], ArrayLeaf):
                out[key] = self.checkpoint.read(key)
                self._read_keys.add(key)
        return out

    @property
    def stores_opened(self) -> list[str]:
        return []

    def read_regions(self, wanted: Mapping[str, list[tuple[slice, ...]]]) -> dict[str, list[np.ndarray]]:
        return {key: [self.checkpoint.read(key)[index] for index in regions] for key, regions in wanted.items()}

    def read_pieces(self, key: str, budget: int) -> Iterator[np.ndarray]:
        leaf = self.leaf(key)
        if not isinstance(leaf, ArrayLeaf):
            raise ValueError(f"{describe(key)} is not an array")
        data = self.checkpoint.read(key)  # foreign formats are read whole; then handed on in pieces
        for index in _pieces(leaf.shape, leaf.dtype.itemsize, budget):
            yield data[index]


def open_checkpoint(path: str | os.PathLike[str]) -> Opened:
    """The checkpoint at ``path``, in whichever format is on disk: jaxckpt's own (a folder with an
    index), or a TensorFlow, Orbax, Flax msgpack or safetensors checkpoint (local paths)."""
    location = _storage.location(path)
    if location.local is not None and not _storage.is_checkpoint(location):
        module = _formats.detect(location.local)
        if module is not None:
            return ForeignOpened(_formats.ForeignCheckpoint(module.open(str(location.local))))
    try:
        return Opened(path)
    except NotACheckpointError as e:
        if location.local is None:
            raise
        raise NotACheckpointError(
            f"{e} Nor is it a checkpoint of another library that jaxckpt reads: a TensorFlow prefix (with "
            "PREFIX.index beside it), an Orbax checkpoint folder, a Flax msgpack or a safetensors file."
        ) from None


KeyMap = Callable[[str, Any], "tuple[str, Any] | None"]


class _Mapped:
    """A checkpoint seen through a user's ``key_map``: a :class:`~jaxckpt._formats.Foreign` reader
    whose values are the source's, each read once and renamed, changed or dropped by the function."""

    def __init__(self, opened: Opened, key_map: KeyMap) -> None:
        self.name, self.path = opened.format, str(opened.path)
        self.mapped: dict[str, str] = {}  # source key -> key it became
        self.dropped: list[str] = []
        self._entries: list[_formats.Entry] = []
        self._values: dict[str, np.ndarray] = {}
        source = opened.index.keys_under("")
        values = opened.load(dict.fromkeys(source, NO_TEMPLATE))
        became: dict[str, str] = {}  # new key -> source key, to name both in a collision
        for key in source:
            value = values.pop(key)  # each value is held once: either dropped here or kept as mapped
            result = key_map(key, value)
            if result is None:
                self.dropped.append(key)
                continue
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str) and result[0]):
                raise TypeError(
                    f"key_map({key!r}, value) returned {type(result).__name__} {result!r:.80}; it must return "
                    "(new_key, new_value) with a non-empty str key, or None to drop the value."
                )
            new_key, new_value = result
            if new_key in became:
                raise ValueError(
                    f"key_map maps both {became[new_key]!r} and {key!r} to {new_key!r}; each key may receive one value."
                )
            became[new_key] = key
            self.mapped[key] = new_key
            self._entries.append(
                _formats.Entry(tuple(unescape_edge(e) for e in new_key.split("/")), self._leaf(new_key, new_value))
            )

    def _leaf(self, key: str, value: Any) -> Leaf:
        if value is None:
            return ValueLeaf("none", None)
        if type(value) in SCALAR_TYPES.values():
            return ValueLeaf(type(value).__name__, value)
        impl = None
        if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            impl, value = str(jax.random.key_impl(value)), jax.random.key_data(value)  # stored as key data
        data = np.asarray(value)
        self._values[key] = data
        return ArrayLeaf(data.dtype, data.shape, _format.NUMPY, _format.InForeign(key), impl)

    def entries(self) -> list[_formats.Entry]:
        return self._entries

    def read(self, key: str, leaf: ArrayLeaf) -> np.ndarray:
        return self._values[leaf.at.ref]


def mapped(opened: Opened, key_map: KeyMap) -> ForeignOpened:
    """``opened`` with its keys and values as ``key_map`` makes them (see :func:`jaxckpt.restore`)."""
    view = ForeignOpened(_formats.ForeignCheckpoint(_Mapped(opened, key_map)))
    view.skipped = opened.skipped
    return view


def open_latest(path: str | os.str | os.PathLike[str][str]) -> Opened:
    """The checkpoint at ``path``; a manager's directory (a state file, no index) means its latest
    checkpoint, as TensorFlow's ``load_variable`` takes a directory. So does a directory that
    TensorFlow's, Orbax's or Flax's manager keeps."""
    location = _storage.location(path)
    if not _storage.is_checkpoint(location):
        foreign = _foreign_manager(location)  # first: TensorFlow's state file has jaxckpt's name
        if foreign is not None:
            module, latest = foreign
            if latest is None:
                raise CheckpointNotFoundError(
                    f"{os.fspath(path)!r} is a {module.NAME} manager's directory with no complete checkpoint in it."
                )
            return open_checkpoint(latest)
        infos = _statefile.read_state(os.fspath(path))  # None: no state file, so not a manager's directory
        if infos is not None:
            if not infos:
                raise CheckpointNotFoundError(
                    f"{os.fspath(path)!r} is a CheckpointManager's directory that lists no checkpoint yet."
                )
            return Opened(infos[-1].path)
    return open_checkpoint(path)


def _foreign_manager(location: _storage.Location) -> tuple[Any, str | None] | None:
    """(format module, its latest checkpoint or None) if a foreign format's manager keeps the folder."""
    if location.local is None or _formats.detect(location.local) is not None:
        return None  # an Orbax step folder is one checkpoint, not a manager's directory
    module = _formats.manager_of(location.local)
    return None if module is None else (module, module.latest(str(location.local)))


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The latest checkpoint in ``directory``, or None if it holds none.

    For a :class:`~jaxckpt.CheckpointManager`'s directory it reads only the state file (no lock
    needed: it is replaced atomically)::

        path = jaxckpt.latest_checkpoint("ckpts")   # "ckpts/ckpt-10"
        if path is not None:
            ckpt.restore(path)

    It sees what is recorded on disk now: a manager's asynchronous ``save()`` records its checkpoint
    in the background, so right after ``save()`` returns this may still name the previous one. Call
    ``manager.wait_until_finished()`` first, or ask the manager (``manager.latest_checkpoint`` waits).

    It also reads the directories that other libraries' managers keep: TensorFlow's (its
    ``checkpoint`` file: ``".../tf_ckpts/ckpt-5"``), Orbax's (the newest finished step folder) and
    ``flax.training.checkpoints``' (the newest ``checkpoint_<step>`` file).
    """
    foreign = _foreign_manager(_storage.location(directory))
    return _statefile.latest_checkpoint(directory) if foreign is None else foreign[1]
