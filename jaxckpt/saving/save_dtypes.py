"""The dtype of a save's copy of each leaf: ``save_dtypes=`` (Orbax's ``SaveArgs(dtype=...)``), so that
float32 parameters are stored as bfloat16, say, without changing the caller's arrays.

``save_dtypes`` is one of:

- a dtype (``jnp.bfloat16``, ``"bfloat16"``): every floating-point array of the save;
- a tree shaped like the saved one, or like a part of it (a prefix: ``{"params": jnp.bfloat16}``),
  whose leaves are dtypes or None (saved as it is). A dtype on a subtree applies to the floating-point
  arrays in it and leaves the rest (int steps, PRNG keys, Python values) as they are; a dtype on one
  leaf must fit that leaf. A leaf with a ``dtype`` attribute counts as its dtype, so an Orbax
  ``save_args`` tree (``ocp.SaveArgs(dtype=...)``) or a tree of ``jax.ShapeDtypeStruct`` objects works as it is;
- a callable ``(key, leaf) -> dtype | None``, called for every array leaf with its checkpoint key
  (``"params/dense/kernel"``, as ``jaxckpt ls`` shows it).

Only floating-point arrays are cast, to a floating-point dtype: a restore into a template of the
original dtype casts back (float to float), which no other pair would do without loss or surprise.
A dtype that names a key the saved tree lacks, that is no dtype, or that does not fit its leaf is a
ValueError naming the key, raised before anything is written.

The cast is a new array: a ``jax.Array`` is converted on its devices, in its sharding (one more copy
in device memory while the save takes its snapshot); a numpy array on the host. The caller's arrays
are never changed, and the index records the dtype stored. Since the copy is a new object at every
save, a manager's incremental save never links it to an earlier checkpoint's files by identity
(:mod:`jaxckpt.incremental`), and the files of a numpy array are linked only where the cast bytes and
dtype equal those stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxckpt.format.keys import describe
from jaxckpt.format.records import dtype_name
from jaxckpt.saving.snapshot import deleted
from jaxckpt.tree.objects import Flat, flatten

# A dtype, a tree (or prefix of one) of dtypes and None, or a callable (key, leaf) -> dtype | None.
SaveDtypes = Any


def _is_function(spec: SaveDtypes) -> bool:
    """A callable ``(key, leaf) -> dtype``, not a dtype's class (``jnp.bfloat16`` is callable too)."""
    return callable(spec) and not isinstance(spec, type)


def _floating(dtype: Any) -> bool:
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


def target(value: Any, where: str) -> np.dtype | None:
    """The dtype that ``value`` names (None: saved as it is); ``where`` says whose, for the error."""
    if value is None:
        return None
    if not isinstance(value, (str, type, np.dtype)) and hasattr(value, "dtype"):
        value = value.dtype  # ocp.SaveArgs(dtype=...), a ShapeDtypeStruct
        if value is None:
            return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise ValueError(f"save_dtypes: {where} is {value!r}, which is not a dtype (give one, or None).") from None
    if not _floating(dtype) or dtype_name(dtype) is None:
        raise ValueError(
            f"save_dtypes: {where} is {dtype.name}, which is not a floating-point dtype jaxckpt stores. Only "
            "floating-point arrays are cast, to a floating-point dtype (bfloat16, float16, float8_*...), so that a "
            "restore into the original dtype casts back."
        )
    return dtype


def check(spec: SaveDtypes) -> SaveDtypes:
    """``spec`` checked as far as it can be without the saved tree (its dtypes); returned as it is."""
    if spec is None or _is_function(spec):
        return spec
    for key, value in flatten(spec).leaves.items():
        target(value, f"the value at {describe(key)}")
    return spec


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def cast_leaves(flat: Flat, spec: SaveDtypes) -> dict[str, Any]:
    """``flat.leaves`` with the leaves ``spec`` names as copies in their save dtype (see the module's
    docstring); the others, and those already of that dtype, are the same objects."""
    if spec is None:
        return flat.leaves
    leaves = flat.leaves
    out = dict(leaves)
    if _is_function(spec):
        for key, x in leaves.items():
            if _is_array(x):
                dtype = target(spec(key, x), f"the dtype returned for {describe(key)}")
                if dtype is not None:
                    out[key] = _cast(key, x, dtype, direct=True)
        return out
    given = {k: target(v, f"the value at {describe(k)}") for k, v in flatten(spec).leaves.items()}
    unknown = [k for k in given if k not in leaves and k not in flat.nodes]
    if unknown:
        top = sorted({k.split("/", 1)[0] for k in leaves})
        raise ValueError(
            f"save_dtypes names {', '.join(map(describe, unknown[:5]))}, which the saved tree does not have (its "
            f"top-level keys are {top[:20]}). Give a dtype for keys of the tree, or for a subtree of it."
        )
    if not any(d is not None for d in given.values()):
        return out
    for key, x in leaves.items():
        found = _governing(key, given)
        if found is not None:
            at, dtype = found
            if dtype is not None:
                out[key] = _cast(key, x, dtype, direct=at == key)
    return out


def _governing(key: str, given: Mapping[str, np.dtype | None]) -> tuple[str, np.dtype | None] | None:
    """The entry of ``given`` for ``key``: its own, else its nearest ancestor's; None if neither."""
    at = key
    while True:
        if at in given:
            return at, given[at]
        if not at:
            return None
        at = at.rpartition("/")[0]


def _cast(key: str, x: Any, dtype: np.dtype, *, direct: bool) -> Any:
    """``x`` as ``dtype``; a leaf that is not a floating-point array is an error when its dtype was given
    for it (``direct``), else (a subtree's dtype) left as it is."""
    if not _is_array(x) or not _floating(x.dtype):
        if not direct:
            return x
        what = f"an array of {x.dtype}" if _is_array(x) else f"a {type(x).__name__}, not an array"
        raise ValueError(
            f"save_dtypes gives {dtype.name} for {describe(key)}, which is {what}: only floating-point arrays are "
            "cast. Give None there, or give the dtype for the subtree (it then casts only the float arrays in it)."
        )
    if x.dtype == dtype:
        return x  # the same object: a manager's incremental save may still link it
    if isinstance(x, jax.Array):
        if x.is_deleted():
            raise deleted(key)
        if jax.dtypes.canonicalize_dtype(dtype) != dtype:  # float64 with jax_enable_x64 off
            raise ValueError(
                f"save_dtypes gives {dtype.name} for {describe(key)}, which jax cannot hold here (jax_enable_x64 "
                "is off); give a dtype of at most 32 bits."
            )
        out = jax.lax.convert_element_type(x, dtype)
        if out.sharding != x.sharding:
            out = jax.device_put(out, x.sharding)
        return out
    if isinstance(x, np.generic):
        return np.asarray(x).astype(dtype)[()]
    return np.asarray(x).astype(dtype)
