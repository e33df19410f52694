"""A save's snapshot: what the caller's thread must take before it may change or donate its state.

For every leaf, :meth:`Taker.take` checks that it can be saved (raising the errors a save raises from
its call) and takes its data: for an array on this process's CPU device, a read-only host view of its
buffer (no copy; see :func:`snapshot_parts`); for a numpy array, a copy; for an accelerator array, the
device-to-host copy, started for all before any is waited for (:meth:`Taker.finish`). A Python value
is recorded at once (a state object's ``get_state()`` runs now). Everything else, the index records,
packing and its checksums, is done from what is taken, later and possibly in the background
(``_save``): what is taken is one tuple per array leaf, ``(container, prng impl, array, host, copied)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxckpt._errors import UnsupportedValueError
from jaxckpt.arrays import store_write
from jaxckpt.format.keys import describe
from jaxckpt.format.records import DATA_DIR, JAX, NUMPY, NUMPY_SCALAR, ValueLeaf, data_store, dtype_name
from jaxckpt.runtime.spread import spread
from jaxckpt.tree.objects import is_state_object, not_utf8

# An array's host data is taken in Taker.finish, after every device-to-host copy has started.
LATER = object()

Parts = list[tuple[tuple[slice, ...], np.ndarray]]


class Deferred:
    """An array that a save reads only when it reaches it (``jaxckpt convert``): a value of another
    checkpoint, so that converting holds about one array at a time, not the whole checkpoint."""

    __slots__ = ("dtype", "read", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, read: Callable[[], np.ndarray]) -> None:
        self.shape, self.dtype, self.read = shape, dtype, read


def unsupported(key: str, x: Any, hint: str = "") -> UnsupportedValueError:
    t = type(x)
    return UnsupportedValueError(
        f"Cannot save {describe(key)}: values of type {t.__module__}.{t.__qualname__} are not supported. "
        + (hint or "Save arrays, Python scalars, str, None, pytrees of them, or objects with get_state()/set_state().")
    )


def deleted(key: str) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"Cannot save {describe(key)}: its jax.Array was deleted (donated to a jitted function, or "
        ".delete() was called) before the save. Save the arrays the step returned instead."
    )


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


def value_leaf(key: str, x: Any) -> ValueLeaf | None:
    if x is None:
        return ValueLeaf("none", None)
    if isinstance(x, np.generic):  # np.float64 is a Python float too, but it is stored as NumPy scalars are
        return None
    if isinstance(x, bool):
        return ValueLeaf("bool", x)
    if isinstance(x, int):
        return ValueLeaf("int", _json_int(key, int(x)))
    if isinstance(x, float):
        return ValueLeaf("float", float(x))
    if isinstance(x, str):
        return ValueLeaf("str", _utf8(key, str(x)))
    if isinstance(x, ValueLeaf) and x.type == "state_per_process":  # carried over from a checkpoint (convert)
        return x
    if is_state_object(x):
        state = x.get_state()
        if isinstance(state, (bytes, bytearray, memoryview)):  # grain's DataLoader iterator's, say
            return ValueLeaf("state_bytes", bytes(state))
        try:  # as the index encodes it: UTF-8, so a lone surrogate fails here and not in the background
            json.dumps(state, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise UnsupportedValueError(
                f"Cannot save {describe(key)}: {type(x).__name__}.get_state() returned a value that is not JSON or "
                f"bytes ({e}). Return bytes, or dicts, lists, str, int, finite floats, bool and None."
            ) from e
        return ValueLeaf("state", state)
    return None


def on_cpu(x: jax.Array) -> bool:
    # jax's Device is an alias of jaxlib's extension type, which has no stubs: mypy sees no attributes.
    return all(d.platform == "cpu" for d in x.sharding.device_set)  # type: ignore[attr-defined]


_numpy_of_one_shard: Callable[[Any], tuple[np.ndarray, bool]] | None = None


def one_cpu_view(x: jax.Array) -> np.ndarray:
    """``np.asarray(x)`` of an array on one CPU device (the caller knows it is): a view of its buffer
    that holds it, so that a train step donating ``x`` copies instead. The call that ``np.asarray``
    makes in jax, without its Python steps: 1.6 µs against 5 for a small bfloat16 array, the dtype
    whose arrays export no Python buffer. Checked once against ``np.asarray``; that, if it differs."""
    global _numpy_of_one_shard
    if _numpy_of_one_shard is None:
        _numpy_of_one_shard = _checked_numpy_of_one_shard()
    return _numpy_of_one_shard(x)[0]  # a copy only off the CPU, where np.asarray copies too


def _checked_numpy_of_one_shard() -> Callable[[Any], tuple[np.ndarray, bool]]:
    def usual(x: Any) -> tuple[np.ndarray, bool]:
        return np.asarray(x), False

    try:
        probe = jax.device_put(np.arange(6, dtype=jax.numpy.bfloat16), jax.devices("cpu")[0])
        call = type(probe)._single_device_array_to_np_array_did_copy
        data, copied = call(probe)
        usual_data = np.asarray(probe)
        if copied or not (data.dtype == usual_data.dtype and np.array_equal(data, usual_data)):
            return usual
        if data.__array_interface__["data"][0] != probe.unsafe_buffer_pointer():
            return usual  # not a view of the buffer itself
        return call
    except Exception:  # another jax: np.asarray, as before
        return usual


def region(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def write_sharding(x: jax.Array | jax.ShapeDtypeStruct) -> jax.sharding.Sharding:
    """The sharding whose regions a save writes of ``x``: its own, or where it is replicated over
    processes, the finer one that gives each process an equal share (:func:`jaxckpt.runtime.spread.spread`)."""
    return spread(x.sharding, tuple(x.shape), np.dtype(x.dtype).itemsize) or x.sharding


def owners(x: Any) -> dict[tuple[tuple[int, int], ...], Any]:
    """Each region (shard) of ``x`` -> the device that writes it: the first to hold it, in the
    order of the sharding that the save writes (:func:`write_sharding`), which every process sees
    alike. Host data belongs to process 0. ``x`` may also be the stand-in of a taken array
    (:meth:`Taker._take_host`)."""
    if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or x.sharding is None:
        return {tuple((0, n) for n in np.shape(x)): None}
    devices = x.sharding.device_set
    if len(devices) == 1:  # the common case, and the cost of 10,000 small leaves: no index map
        return {tuple((0, n) for n in x.shape): next(iter(devices))}
    found: dict[tuple[tuple[int, int], ...], Any] = {}
    for device, index in write_sharding(x).devices_indices_map(x.shape).items():
        found.setdefault(region(index, x.shape), device)
    return found


def process_of(device: Any) -> int:
    return 0 if device is None else device.process_index


def _within(box: tuple[tuple[int, int], ...], shard: Any, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], Any]:
    """The region ``box`` of the array, from the addressable ``shard`` that holds it: (its index in
    the array, its host data), a view of the shard's (on CPU, of its buffer)."""
    data = np.asarray(shard.data)
    base = region(shard.index, shape)
    if box == base:
        return shard.index, data
    return tuple(slice(lo, hi) for lo, hi in box), data[
        tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(box, base))
    ]


def _holders(x: jax.Array) -> dict[tuple[tuple[int, int], ...], Any]:
    """Each region that a device of this process holds under ``x``'s sharding -> its first shard here."""
    out: dict[tuple[tuple[int, int], ...], Any] = {}
    for s in x.addressable_shards:
        out.setdefault(region(s.index, x.shape), s)
    return out


def _inside(box: tuple[tuple[int, int], ...], holders: dict[tuple[tuple[int, int], ...], Any]) -> Any:
    """The shard here whose region holds ``box`` (an owner's region lies inside one), or None."""
    for r, s in holders.items():
        if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(box, r)):
            return s
    return None


def snapshot_parts(x: jax.Array, owned: dict[tuple[tuple[int, int], ...], Any]) -> tuple[Parts, int]:
    """Host data of the regions of ``x`` that this process owns: ([(region, data)], bytes copied).

    The shards on owning devices here (or the part of one that a spread save writes). On CPU,
    ``np.asarray`` of a shard is a read-only view of its buffer: no copy, and safe even when the
    train step donates the array right after, since XLA does not reuse a buffer that a view holds.
    On an accelerator it is the device-to-host copy.
    """
    here = {s.device: s for s in x.addressable_shards}
    parts = [_within(box, here[d], x.shape) for box, d in owned.items() if d in here]
    return parts, 0 if on_cpu(x) else sum(d.nbytes for _, d in parts)


def held_boxes(
    x: jax.Array, owned: dict[tuple[tuple[int, int], ...], Any]
) -> list[tuple[tuple[tuple[int, int], ...], Any, Any]]:
    """Every region of ``owned`` that this process holds: (region, its owner, the shard here that
    holds it)."""
    holders = _holders(x)
    finer = write_sharding(x) is not x.sharding  # a spread save's regions lie inside the shards
    out = []
    for box, device in owned.items():
        shard = _inside(box, holders) if finer else holders.get(box)
        if shard is not None:
            out.append((box, device, shard))
    return out


def held_parts(x: jax.Array, owned: dict[tuple[tuple[int, int], ...], Any]) -> dict[str, Parts]:
    """An own copy's data: every region of ``x`` this process holds, once each, by the data store of
    the process that owns the region (the store the index names for it)."""
    out: dict[str, Parts] = {}
    for box, device, shard in held_boxes(x, owned):
        out.setdefault(data_store(process_of(device)), []).append(_within(box, shard, x.shape))
    return out


def check_live_and_copy(leaves: dict[str, Any]) -> None:
    """Refuse deleted arrays; then start every device-to-host copy before waiting for any."""
    for key, x in leaves.items():
        if isinstance(x, jax.Array) and x.is_deleted():
            raise deleted(key)
    for x in leaves.values():
        if isinstance(x, jax.Array) and not on_cpu(x) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x.copy_to_host_async()


class Taker:
    """Takes one save's leaves (see the module's docstring). ``eager``: an array's host data is taken
    at once (the caller started every device-to-host copy first, :func:`check_live_and_copy`);
    otherwise arrays not on this process's CPU are left for :meth:`finish`."""

    def __init__(self, me: int, own_copy: bool, eager: bool, pack_limit: int | None = None) -> None:
        self.me, self.own_copy, self.eager = me, own_copy, eager
        # Arrays of up to this many bytes that process 0 holds go to packs, whole (the writer's limit).
        self.pack_limit = store_write.PACK_LEAF_LIMIT if pack_limit is None else pack_limit
        self.copied = 0  # bytes of copies taken (a CPU array's view costs none)
        self.later: list[tuple[str, list[Any]]] = []
        # Whether a sharding is one CPU device of this process: by id (the sharding held, so that its id
        # stays its own), and by equality (arrays out of a jitted step each have their own sharding).
        self._by_id: dict[int, tuple[Any, bool]] = {}
        self._local_cpu: dict[Any, bool] = {}
        # Dtypes checked -> how a view of a CPU array of it is taken: a memoryview (its buffer, the
        # quickest) where jax exports numpy's own dtypes, else one_cpu_view (bfloat16, float8...).
        self._dtypes: dict[Any, Callable[[Any], Any]] = {}

    def take_all(
        self, leaves: dict[str, Any], budget: int, not_arrays: list[str] | None = None
    ) -> dict[str, Any] | None:
        """Every leaf taken, or None as soon as the copies pass ``budget`` bytes. An array on process
        0's CPU device is taken as just a view of its buffer (a memoryview or an ndarray; its record
        is that of a jax.Array on one device): the cheapest snapshot there is, and the common case
        of many small leaves. ``not_arrays``: the keys of the leaves that are not jax's ArrayImpl,
        where known (:func:`jaxckpt.tree.structure.flatten_saved`): then the arrays are viewed in one pass."""
        # With several processes, an array replicated over them has one buffer here too, which jax
        # exports: a view of it would be taken as process 0's alone (see owners: such arrays are spread).
        alone = jax.process_count() == 1
        views = self._views(leaves, not_arrays) if not_arrays is not None and self.me == 0 and alone else None
        if views is not None:
            taken = dict(zip(leaves, views))
            for key in not_arrays or ():
                taken[key] = self.take(key, leaves[key])
                if self.copied > budget:
                    return None
            return taken
        taken = {}
        by_id, local_cpu, dtypes, primary = self._by_id, self._local_cpu, self._dtypes, self.me == 0
        for key, x in leaves.items():
            if isinstance(x, jax.Array) and primary and (alone or x.is_fully_addressable):
                view = dtypes.get(x.dtype)
                if view is memoryview:  # jax exports only an array of one shard in host memory: no check needed
                    try:
                        taken[key] = memoryview(x)
                        continue
                    except BufferError:  # several shards, or on an accelerator: taken below
                        pass
                    except RuntimeError:
                        if x.is_deleted():
                            raise deleted(key) from None
                        raise
                elif view is not None:
                    sharding = x.sharding
                    known = by_id.get(id(sharding))
                    if known[1] if known is not None else local_cpu.get(sharding):  # as _take_jax
                        try:
                            taken[key] = view(x)
                            continue
                        except RuntimeError:
                            if x.is_deleted():
                                raise deleted(key) from None
                            raise
            taken[key] = self.take(key, x)
            if self.copied > budget:
                return None
        return taken

    @staticmethod
    def _views(leaves: dict[str, Any], not_arrays: list[str]) -> list[Any] | None:
        """A memoryview of every array's one buffer (a placeholder for the other leaves), made in
        one pass in C; None if any array has none (several shards, on an accelerator, a dtype that
        Python's buffers lack, deleted), and then every leaf is taken one by one, as usual.

        jax exports a buffer only for an array of one shard in host memory, in its numpy dtype (it
        refuses bfloat16 and the like), so each view is the array's whole data as it is stored."""
        arrays = leaves
        if not_arrays:
            arrays = leaves.copy()
            for key in not_arrays:
                arrays[key] = b""
        try:
            return list(map(memoryview, arrays.values()))  # type: ignore[arg-type]
        except (BufferError, TypeError, RuntimeError):
            return None

    def take(self, key: str, x: Any) -> Any:
        """A ValueLeaf, or an array leaf's ``[container, prng impl, array, host data, bytes copied]``."""
        if isinstance(x, jax.Array):
            return self._take_jax(key, x)
        if isinstance(x, np.ndarray):
            self._check_dtype(key, x, x.dtype)
            copy = np.array(x, copy=True)  # its owner may change it in place once the save returned
            self.copied += copy.nbytes
            return [NUMPY, None, copy, copy, copy.nbytes]
        value = value_leaf(key, x)
        if value is not None:
            return value
        if isinstance(x, np.generic):
            data = np.array(x)
            self._check_dtype(key, x, data.dtype)
            return [NUMPY_SCALAR, None, data, data, data.nbytes]
        if isinstance(x, Deferred):  # read only when recorded: no one else holds it, so no snapshot
            return [NUMPY, None, x, None, 0]
        if isinstance(x, jax.ShapeDtypeStruct):
            raise unsupported(key, x, "A ShapeDtypeStruct is a restore template with no data; save a concrete array.")
        raise unsupported(key, x)

    def _check_dtype(self, key: str, x: Any, dtype: Any) -> None:
        if dtype not in self._dtypes:
            if not isinstance(dtype, np.dtype) or dtype_name(dtype) is None:
                raise unsupported(key, x, f"Its dtype {dtype} cannot be stored; convert it to a numeric dtype.")
            self._dtypes[dtype] = memoryview if dtype.isbuiltin == 1 and dtype.kind in "biufc" else one_cpu_view

    def _take_jax(self, key: str, x: jax.Array) -> list[Any]:
        if x.is_deleted():
            raise deleted(key)
        impl = None
        if not isinstance(x.dtype, np.dtype) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        self._check_dtype(key, x, x.dtype)
        sharding = x.sharding
        here = self._local_cpu.get(sharding)
        if here is None:  # shardings are equal where their devices are (each array may have its own)
            devices = sharding.device_set
            device = next(iter(devices))
            here = len(devices) == 1 and device.platform == "cpu" and device.process_index == self.me  # type: ignore[attr-defined]
            self._local_cpu[sharding] = here
        self._by_id[id(sharding)] = (sharding, here)
        if here:  # the cheapest snapshot: one view of its one buffer, which it keeps alive
            return [JAX, impl, x, one_cpu_view(x), 0]
        item = [JAX, impl, x, LATER, 0]
        if self.eager:
            self._take_host(item)
        else:
            self.later.append((key, item))
        return item

    def later_bytes(self) -> int:
        """At most the bytes that :meth:`finish` would copy (each array's whole size)."""
        return sum(item[2].nbytes for _, item in self.later if not on_cpu(item[2]) or self._gathered(item[2]))

    def _gathered(self, x: jax.Array) -> bool:
        """Whether a CPU array is copied whole to go into a pack: it has shards on several devices."""
        return x.nbytes <= self.pack_limit and len(x.sharding.device_set) > 1

    def finish(self) -> None:
        """Take the host data of the arrays left for now, after starting every device-to-host copy."""
        for _, item in self.later:
            if not on_cpu(item[2]):
                item[2].copy_to_host_async()
        for _, item in self.later:
            self._take_host(item)
        self.later.clear()

    def _take_host(self, item: list[Any]) -> None:
        """The host data of a jax.Array that a save writes from this process, as ``_save`` will use it:
        the whole array if it goes into a pack, an own copy's held parts, or the owned parts."""
        x = item[2]
        owned = owners(x)
        by_process = {process_of(d) for d in owned.values()}
        cpu = on_cpu(x)
        if x.nbytes <= self.pack_limit and by_process == {0}:
            if self.me == 0 or self.own_copy:
                host = np.asarray(x)  # shards on several devices: gathered into one copy
                item[3], item[4] = host, 0 if cpu and len(owned) == 1 else host.nbytes
            else:
                item[3] = None
        elif self.own_copy:
            held = held_parts(x, owned)
            item[3], item[4] = held, 0 if cpu else sum(d.nbytes for parts in held.values() for _, d in parts)
        elif self.me in by_process:
            item[3], item[4] = snapshot_parts(x, owned)
        else:
            item[3] = []
        self.copied += item[4]
        # What is left to know of the array: holding it would keep its device memory (the caller's
        # old state, on an accelerator) until the background is done with the host copies.
        item[2] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def take_leaves(
    leaves: dict[str, Any], me: int, own_copy: bool, budget: int, pack_limit: int, not_arrays: list[str] | None
) -> dict[str, Any] | None:
    """Every leaf taken (see :class:`Taker`), or None if the copies would outgrow ``budget``."""
    taker = Taker(me, own_copy, eager=False, pack_limit=pack_limit)
    taken = taker.take_all(leaves, budget, not_arrays)
    if taken is None:
        return None
    if taker.later:
        if taker.copied + taker.later_bytes() > budget:
            return None
        taker.finish()
    return taken


def whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in shape)


def own_copy_parts(x: Any, host: Any) -> dict[str, Parts]:
    """An own copy's parts of an array taken whole (a numpy array, or one on a single device)."""
    if isinstance(host, dict):
        return host
    (device,) = owners(x).values()
    return {data_store(process_of(device)) if device is not None else DATA_DIR: [(whole(host.shape), host)]}
