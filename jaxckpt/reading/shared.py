"""Restores that read each byte once on a pod, then share it.

With several processes, an array that several of them need (replicated over processes: a
data-parallel state, FSDP shards repeated across data-parallel groups) would be read by each of
them. When sharing, each process reads instead only its slab of the finer sharding that
:func:`jaxckpt.runtime.spread.spread` gives (each slab held by one process, so each byte read by one
process, every process an equal share, checked against its checksums there like any read), and one
resharding ``jax.device_put`` over ``jax.distributed`` (JAX's own collectives) brings every process
the rest of its regions.

Before that collective every process says whether its reads succeeded, and all raise if any failed:
a process that raised alone would leave the others waiting in the collective.

When: a restore from a bucket (``s3://``, ``gs://``, ...) with several processes shares; a local
path (a local disk, or a file system that every host mounts) does not, since each host reads it at
disk speed without the network round of a collective. ``share_reads=`` of :func:`jaxckpt.restore`,
or ``JAXCKPT_SHARE_READS=1`` / ``0`` for every restore, forces either.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from jaxckpt._errors import JaxckptError
from jaxckpt.runtime import multihost
from jaxckpt.runtime.spread import spread
from jaxckpt.storage import locations

SHARE_READS_ENV = "JAXCKPT_SHARE_READS"
_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Shared(NamedTuple):
    """An array read in the finer sharding, this process's slabs only, to be moved to ``final``."""

    array: jax.Array
    final: jax.sharding.Sharding


def enabled(location: locations.Location, setting: bool | None) -> bool:
    """Whether a restore of the checkpoint at ``location`` shares its reads (see the module's docstring)."""
    if setting is None:
        said = os.environ.get(SHARE_READS_ENV, "").strip().lower()
        if said and said not in _YES + _NO:  # refused with one process too: a typo shows before the pod
            raise JaxckptError(
                f"{SHARE_READS_ENV}={os.environ[SHARE_READS_ENV]!r} is neither on (1) nor off (0); "
                "leave it unset for jaxckpt to choose (share reads from buckets)."
            )
        setting = (said in _YES) if said else location.local is None
    return setting and jax.process_count() > 1


def check_setting(setting: Any) -> bool | None:
    """``share_reads=`` as a public call takes it: True, False, or None (jaxckpt chooses)."""
    if setting is not None and not isinstance(setting, bool):
        raise TypeError(f"share_reads must be True, False or None (jaxckpt chooses), not {setting!r}.")
    return setting


def read_sharding(sharding: Any, shape: tuple[int, ...], itemsize: int) -> jax.sharding.NamedSharding | None:
    """The finer sharding an array of the target ``sharding`` is read in, or None to read it as it is."""
    if sharding is None or sharding.is_fully_addressable:
        return None
    return spread(sharding, shape, itemsize)


def agree(error: BaseException | None) -> None:
    """Every process says how its reads went; raise where another's failed (the caller raises its own)."""
    multihost.outcome("read", "its part of a restore that shares reads", error)


def place(values: list[Any]) -> list[Any]:
    """``values`` with every :class:`Shared` array moved to its final sharding, all in one call."""
    at = [i for i, v in enumerate(values) if type(v) is Shared]
    if at:
        moved: Sequence[jax.Array] = jax.device_put([values[i].array for i in at], [values[i].final for i in at])
        for i, array in zip(at, moved, strict=True):
            values[i] = array
    return values
