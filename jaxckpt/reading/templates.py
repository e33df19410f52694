"""Templates: what the user holds now at a key, and how a stored value becomes what it wants.

A *template* is the value an object holds now at a key: a jax.Array (restored with its sharding),
a ``jax.ShapeDtypeStruct`` (becomes a concrete array with its sharding), a numpy array or scalar, a
Python scalar or None, or an object with ``set_state``. Without a template (:data:`NO_TEMPLATE`),
arrays come back as numpy and values as saved. :func:`check` says whether a stored record can
restore into a template; :func:`cast_for` and :func:`restored_value` make the value it wants.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxckpt._errors import MismatchError, UnsupportedValueError
from jaxckpt.format.keys import describe
from jaxckpt.format.records import NUMPY_SCALAR, ArrayLeaf, Leaf, ValueLeaf, scalar_type
from jaxckpt.reading import fast_put
from jaxckpt.tree.objects import is_state_object

NO_TEMPLATE = object()


class _Placeholder:
    """The type of :data:`PLACEHOLDER`."""

    def __repr__(self) -> str:
        return "jaxckpt.PLACEHOLDER"

    def __reduce__(self) -> str:
        return "PLACEHOLDER"


#: In a template, a leaf or a whole subtree that a restore leaves out (Orbax's ``ocp.PLACEHOLDER``):
#: nothing of the checkpoint's under its key is read or required, and the restored tree holds
#: ``PLACEHOLDER`` there, as the template did.
PLACEHOLDER = _Placeholder()


def held_text(leaf: Leaf) -> str:
    if isinstance(leaf, ValueLeaf):
        if leaf.type == "state_per_process":
            return f"the object states of {len(leaf.value)} processes"
        return {"none": "None", "state": "an object state (JSON)", "state_bytes": "an object state (bytes)"}.get(
            leaf.type, f"a Python {leaf.type} ({leaf.value!r})"
        )
    if leaf.prng_impl:
        return f"a PRNG key array ({leaf.prng_impl}) of shape {leaf.value_shape}"
    return f"a {leaf.dtype.name} array of shape {leaf.shape}"


def _python_scalar(template: Any) -> bool:
    """A Python bool, int, float or str (np.float64 subclasses float, but is a NumPy scalar)."""
    return isinstance(template, (bool, int, float, str)) and not isinstance(template, np.generic)


def expected_text(template: Any) -> str:
    if template is None:
        return "None"
    if _python_scalar(template):
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
        f"Cannot restore {describe(key)}: the checkpoint holds {held_text(leaf)}, "
        f"but the object expects {expected_text(template)}.{detail}"
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
        if not (isinstance(leaf, ValueLeaf) and leaf.type in ("state", "state_bytes", "state_per_process")):
            raise _mismatch(key, leaf, template)
        if leaf.type == "state_per_process":
            _check_process_count(key, len(leaf.value))
        return
    if _python_scalar(template):
        want = scalar_type(template)
        if isinstance(leaf, ValueLeaf) and leaf.type == want:
            return
        if isinstance(leaf, ArrayLeaf) and leaf.shape == () and not leaf.prng_impl and want in _SCALAR_FROM:
            if leaf.dtype.kind in _SCALAR_FROM[want]:
                return
        raise _mismatch(key, leaf, template)
    if not _is_array_template(template):
        raise UnsupportedValueError(
            f"Cannot restore into {describe(key)}: the object holds a {type(template).__name__}, which jaxckpt "
            "cannot restore into. Hold an array, a jax.ShapeDtypeStruct, a Python scalar or a pytree of them there."
        )
    is_key = _is_key(template.dtype)
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
        if impl != leaf.prng_impl or tuple(template.shape) != leaf.value_shape:
            raise _mismatch(key, leaf, template)
        return
    if tuple(template.shape) != leaf.shape:
        raise _mismatch(key, leaf, template)
    if np.dtype(template.dtype) != leaf.dtype and _kind(template.dtype) in ("other", None):
        raise _mismatch(key, leaf, template)
    if _kind(template.dtype) != _kind(leaf.dtype) and (_kind(leaf.dtype), _kind(template.dtype)) != ("float", "int"):
        raise _mismatch(
            key,
            leaf,
            template,
            " jaxckpt casts float to float and int to int on restore, and float to int where every value is a "
            "whole number the int holds; never int to float or anything else across kinds.",
        )


def check_all(wanted: Mapping[str, Any], leaves: Sequence[Leaf]) -> list[jax.sharding.Sharding | None]:
    """:func:`check` of each ``{key: template}`` against its leaf (``leaves``, in the same order).
    Returns, for each, where it goes when it is plain (an array template of the leaf's own shape and
    dtype, not a PRNG key: read as stored, then placed on :func:`target_sharding`), else None.

    A plain leaf passes every check of :func:`check`, so it is known by a few comparisons: a million
    leaves restored through ``check``, ``cast_for`` and ``target_sharding`` spent about 2 us each there."""
    out: list[jax.sharding.Sharding | None] = []
    placed: dict[int, jax.sharding.Sharding] = {}  # id(template's sharding) -> where its arrays go
    held = []  # the shardings looked up by id, alive until the call returns
    for (key, template), leaf in zip(wanted.items(), leaves):
        if (
            isinstance(template, _PLACED)
            and type(leaf) is ArrayLeaf
            and not leaf.prng_impl
            and template.dtype == leaf.dtype
            and template.shape == leaf.shape
        ):
            sharding = template.sharding
            target = placed.get(id(sharding))
            if target is None:
                target = target_sharding(template, key)
                assert target is not None
                placed[id(sharding)] = target
                held.append(sharding)
            out.append(target)
            continue
        check(key, leaf, template)
        out.append(None)
    return out


_PLACED = (jax.ShapeDtypeStruct, jax.Array)


@functools.cache
def _is_key(dtype: Any) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


# The numpy dtype kinds of a stored 0-d array that restores into a Python scalar of each type.
_SCALAR_FROM: dict[str | None, str] = {"bool": "b", "int": "biu", "float": "biuf"}


@functools.cache  # per dtype, not per leaf: jax's issubdtype is the most of a 10,000-leaf check
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
    (never a silent wraparound). Floats into an int (Orbax's guide restores a float32 array as int16)
    only where every value is a whole number: a fraction, NaN or infinity is a MismatchError, never
    truncated."""
    dtype = np.dtype(dtype)
    if data.dtype == dtype:
        return data
    if _kind(dtype) == "int" and _kind(data.dtype) == "float" and data.size:
        wide = data.astype(np.float64)
        bad = ~np.isfinite(wide) | (wide != np.trunc(wide))
        if bad.any():
            first = float(wide.reshape(-1)[int(np.argmax(bad.reshape(-1)))])
            raise MismatchError(
                f"Cannot restore {describe(key)} as {dtype.name}: the checkpoint holds {data.dtype.name} values that "
                f"are not whole numbers (such as {first!r}); jaxckpt casts floats to ints only where nothing is lost. "
                "Restore it as a float and round it as you mean to."
            )
        data = wide
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


def cast_for(key: str, leaf: ArrayLeaf, template: Any, data: Any) -> Any:
    """Host ``data`` of ``leaf`` in the dtype of an array template (see :func:`cast`)."""
    if leaf.prng_impl or not _is_array_template(template):
        return data
    return cast(key, np.asarray(data), template.dtype)


def target_sharding(template: Any, key: str = "") -> jax.sharding.Sharding | None:
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


def put_all(values: list[Any], shardings: list[Any]) -> list[jax.Array]:
    """``values`` placed on ``shardings`` at once: jax's cost per array, not per call, dominates for
    many small leaves, and :func:`jaxckpt.reading.fast_put.put_many` pays it once per kind of array."""
    return fast_put.put_many(values, shardings)


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


def _check_process_count(key: str, saved: int) -> None:
    running = jax.process_count()
    if saved != running:  # never another process's data iterator position, silently
        raise MismatchError(
            f"Cannot restore {describe(key)}: the checkpoint holds the object states of {saved} processes, one "
            f"each (their data iterators differed), but this run has {running} process{'es' if running > 1 else ''}. "
            f"Restore it with {saved} processes, or restore without this object and start its state afresh."
        )


def restored_value(leaf: Leaf, template: Any, data: Any) -> Any:
    """The restored value: ``data`` (host numpy or a jax.Array) shaped as ``template`` wants."""
    if isinstance(leaf, ValueLeaf) and leaf.type == "state_per_process":
        if template is NO_TEMPLATE:  # every process's state, in process order
            return [state.value for state in leaf.value]
        own = leaf.value[jax.process_index()]  # this process's own; check() refused another process count
        template.set_state(_state_for(template, own))
        return template
    if isinstance(leaf, ValueLeaf):
        value = leaf.value
        if template is NO_TEMPLATE or template is None or _python_scalar(template):
            return value
        if is_state_object(template):
            template.set_state(_state_for(template, leaf))
            return template
        return _as_array_template(template, np.asarray(value, dtype=template.dtype), None)
    if template is NO_TEMPLATE:
        if leaf.prng_impl:
            return _wrap_keys(data, leaf.prng_impl)
        return data[()] if leaf.container == NUMPY_SCALAR else data
    return _as_array_template(template, data, leaf.prng_impl)


def _state_for(template: Any, leaf: ValueLeaf) -> Any:
    """What ``template.set_state`` takes of a saved state. A JSON state into an iterator of grain's
    that is not a ``DatasetIterator`` (a ``DataLoader``'s, whose state is bytes) is given as the
    JSON's bytes, as grain's own checkpoint handler does: Orbax runs save such states as JSON."""
    if leaf.type == "state" and _wants_bytes(type(template)):
        return json.dumps(leaf.value, indent=4).encode()
    return leaf.value


def _wants_bytes(cls: type) -> bool:
    """grain's iterators other than ``DatasetIterator``s: their ``get_state()`` is bytes (grain's
    handler tells them apart the same way). Known by name: grain is not imported for it."""
    grain = [c for c in cls.__mro__ if c.__module__.partition(".")[0] == "grain"]
    return bool(grain) and not any(c.__name__ == "DatasetIterator" for c in grain)


def _as_array_template(template: Any, data: Any, prng_impl: str | None) -> Any:
    """Array ``data`` (key data if ``prng_impl``) as an array or scalar template wants."""
    if _python_scalar(template) and not isinstance(template, str):
        return type(template)(np.asarray(data).item())
    if isinstance(template, np.generic):
        return np.asarray(data)[()]
    if isinstance(template, np.ndarray):
        return np.asarray(data)
    sharding = target_sharding(template)
    if prng_impl:
        return jax.device_put(_wrap_keys(data, prng_impl), sharding)
    if isinstance(data, jax.Array):
        return data
    return jax.device_put(np.asarray(data), sharding)


def _wrap_keys(data: Any, impl: str) -> jax.Array:
    # jax's stub asks for a jax.Array; any array-like works, and host numpy is placed by the caller.
    return jax.random.wrap_key_data(np.asarray(data), impl=impl)  # type: ignore[arg-type]
