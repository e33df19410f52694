"""Placing many host arrays on devices for less than ``jax.device_put`` costs per array.

``jax.device_put(list, sharding)`` spends 18-28 us of Python per array in jax 0.10.2 (flattening,
abstractifying, checking and deferring each one, growing with the count: 18 us at 10,000, 28 us at
100,000), and ends in one C++ call per array, ``xla_client.batched_device_put``, that costs about 3
us. Here the work jax repeats for each array is done once per (shape, dtype, sharding): the abstract
value, the sharding's checks, its devices and each device's slice; then that C++ call is made per
array. What comes back is what ``jax.device_put`` gives (a committed ``jax.Array`` on the sharding,
aliasing an aligned numpy buffer on CPU as it does), which :func:`_agrees` checks once per process
against ``jax.device_put`` itself.

The C++ call is private to jax. Where it or the helpers are missing or behave otherwise (another jax
version), where jax is tracing, or for a value or sharding outside the plain case (not a numpy array,
a dtype jax would change, an extended dtype, a sharding with devices of other processes),
``jax.device_put`` places the arrays as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

try:  # private to jax: each use is checked by _agrees, with jax.device_put as the fallback
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src.lib import xla_client as _xc

    _batched: Callable[..., Any] | None = _xc.batched_device_put
    _abstractify: Callable[[Any], Any] | None = _core.shaped_abstractify
    _clean: Callable[[], bool] | None = _core.trace_state_clean
    _dp_aval: Callable[[Any, Any], Any] | None = _dispatch.update_dp_aval
except (ImportError, AttributeError):  # pragma: no cover - another jax
    _batched = _abstractify = _clean = _dp_aval = None

# The dtypes placed here: numpy's numbers and ml_dtypes' whole-byte floats (of kind "V"). Others,
# (4-bit and 2-bit types, strings), go through jax.device_put.
_DTYPES = frozenset(
    [np.dtype(t) for t in "?bBhHiIlLqQefdFD"]
    + [np.dtype(getattr(ml_dtypes, n)) for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2") if hasattr(ml_dtypes, n)]
)
# A plan per (shape, dtype, sharding): (aval, devices, each device's slice or None for all of it).
_Plan = tuple[Any, list[Any], list[Any] | None]


def put_many(values: Sequence[Any], shardings: Sequence[Any]) -> list[jax.Array]:
    """``values`` (host arrays) placed on ``shardings``, one each: ``jax.device_put(values, shardings)``."""
    one = shardings[0] if shardings else None
    same = all(s is one for s in shardings)
    if not values or not _usable():
        return list(jax.device_put(list(values), one if same else list(shardings)))
    plans: dict[tuple[Any, ...], _Plan | None] = {}
    out: list[Any] = [None] * len(values)
    rest: list[int] = []  # placed by jax.device_put
    for i, (x, s) in enumerate(zip(values, shardings)):
        if type(x) is not np.ndarray:
            rest.append(i)
            continue
        key = (x.shape, x.dtype, s)  # equal shardings (one per template) share a plan
        plan = plans[key] if key in plans else plans.setdefault(key, _plan(x, s))
        if plan is None:
            rest.append(i)
            continue
        aval, devices, slices = plan
        shards = [x] * len(devices) if slices is None else [x[index] for index in slices]
        out[i] = _batched(aval, s, shards, devices, True)  # type: ignore[misc]
    if rest:
        placed = jax.device_put([values[i] for i in rest], [shardings[i] for i in rest])
        for i, array in zip(rest, placed):
            out[i] = array
    return out


def _plan(x: np.ndarray, sharding: Any) -> _Plan | None:
    """What placing arrays like ``x`` on ``sharding`` needs, worked out once; None: not the plain case."""
    if not isinstance(sharding, jax.sharding.Sharding) or not sharding.is_fully_addressable:
        return None
    dtype = x.dtype
    if dtype not in _DTYPES or jax.dtypes.canonicalize_dtype(dtype) != dtype:
        return None  # a dtype jax does not take as it is (64-bit ones without x64 are cast)
    assert _abstractify is not None and _dp_aval is not None
    aval = _dp_aval(_abstractify(x), sharding)
    sharding.shard_shape(x.shape)  # raises as jax.device_put does where the shape does not divide
    indices = sharding.addressable_devices_indices_map(x.shape)
    devices = list(indices)
    slices = None if sharding.is_fully_replicated else list(indices.values())
    return aval, devices, slices


def _usable() -> bool:
    return _batched is not None and _clean is not None and _clean() and _agrees()


@functools.cache
def _agrees() -> bool:
    """Whether this jax's private calls give what ``jax.device_put`` gives: tried once per process."""
    try:
        x = np.arange(16, dtype=np.float32)
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        plan = _plan(x, sharding)
        if plan is None or _batched is None:
            return False
        aval, devices, _ = plan
        ours, theirs = _batched(aval, sharding, [x], devices, True), jax.device_put(x, sharding)
        return bool(
            type(ours) is type(theirs)
            and ours.aval == theirs.aval
            and ours.sharding == theirs.sharding
            and ours.committed == theirs.committed
            and np.array_equal(np.asarray(ours), x)
        )
    except Exception:  # any failure of a private call means: use jax.device_put
        return False
