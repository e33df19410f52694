"""Work spread over a pod: a region of an array that several processes hold is written by one of
them and read by one of them, and each does an equal part.

An array replicated over processes (a data-parallel state, or FSDP shards repeated across
data-parallel groups) has regions that several processes hold. A save would have the first of them
write each region, so process 0 would write every replicated byte; a restore would have each of them
read it, so a state replicated on P processes would be read P times. :func:`spread` cuts such an
array finer instead: a dimension is split further over the mesh axes that replicate it across
processes, so that every slab is held by one process alone. A save writes each slab from the process
that holds it (every process an equal share, recorded as a mesh and a partition spec: the index does
not grow with the number of processes); a restore reads each slab on the process that holds it and
moves the slabs to every process that needs them with one of JAX's own collectives (a resharding
``jax.device_put`` over ``jax.distributed``).

Stateless and the same on every process: it depends on the sharding and the shape alone.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax
import numpy as np

# No slab is smaller than this: a save would write many small files or objects (a pod of 256 processes
# would cut a 2 MiB array into objects of 8 KiB), and a restore would pay a request for each. So an
# array of up to twice this size is never spread (a save packs those of up to 1 MiB, see
# jaxckpt.arrays.store_write.PACK_LEAF_LIMIT), and a larger one over as many processes as this allows.
MIN_SLAB_BYTES = 1 << 20


def spread(sharding: Any, shape: tuple[int, ...], itemsize: int) -> jax.sharding.NamedSharding | None:
    """A refinement of ``sharding`` for an array of ``shape`` in which the mesh axes that replicate
    it across processes also split one dimension (the first that divides evenly), so that each
    region is held by one process; None where there is nothing to spread (one process, a small
    array, no such axes, no dimension that they divide, a sharding other than a NamedSharding).
    Where slabs over all those axes would be smaller than :data:`MIN_SLAB_BYTES`, the largest set
    of them that keeps slabs at least that large is used (then a slab may be held by several).

    Each region of the refinement lies inside the region the same device holds under ``sharding``.
    """
    nbytes = math.prod(shape) * itemsize
    if jax.process_count() == 1 or nbytes < 2 * MIN_SLAB_BYTES:
        return None
    if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return None
    return _spread(sharding, tuple(shape), nbytes)


def spec_axes(spec: Any, ndim: int) -> list[tuple[str, ...]] | None:
    """A ``PartitionSpec`` for ``ndim`` dimensions as the mesh axes that split each (empty: not
    split); None for one that names no axes that way (longer than ``ndim``, ``UNCONSTRAINED``)."""
    if len(spec) > ndim:
        return None
    out: list[tuple[str, ...]] = []
    for entry in (*spec, *[None] * (ndim - len(spec))):
        if entry is None:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            out.append(entry)
        else:
            return None
    return out


@functools.lru_cache(maxsize=4096)
def _spread(
    sharding: jax.sharding.NamedSharding, shape: tuple[int, ...], nbytes: int
) -> jax.sharding.NamedSharding | None:
    mesh = sharding.mesh
    spec = spec_axes(sharding.spec, len(shape))
    if spec is None:
        return None
    used = {a for axes in spec for a in axes}
    processes = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    across = tuple(
        name
        for i, name in enumerate(mesh.axis_names)
        if name not in used and isinstance(name, str) and bool((processes != processes.take([0], axis=i)).any())
    )
    if not across:
        return None
    shards = math.prod(sizes[a] for axes in spec for a in axes)  # the array's shards before the cut
    best: tuple[int, int, tuple[str, ...]] | None = None  # (factor, dimension, axes): the largest factor
    for subset in itertools.chain.from_iterable(itertools.combinations(across, k) for k in range(len(across), 0, -1)):
        factor = math.prod(sizes[a] for a in subset)
        if (best is not None and factor <= best[0]) or nbytes // (shards * factor) < MIN_SLAB_BYTES:
            continue
        for d, n in enumerate(shape):
            if n % (math.prod(sizes[a] for a in spec[d]) * factor) == 0:
                best = (factor, d, subset)
                break
    if best is None:
        return None
    _, d, subset = best
    spec[d] = (*spec[d], *subset)  # the new axes minor: each slab inside the device's region
    entries = [axes[0] if len(axes) == 1 else (axes or None) for axes in spec]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries), memory_kind=sharding.memory_kind)
