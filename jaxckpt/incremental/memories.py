"""Which manager hears of a restore: the memories of incremental saves (:mod:`jaxckpt.incremental.local`
on local disks, :mod:`jaxckpt.incremental.bucket` on buckets) remember the arrays a restore returned, so
that the next save links or refers to them instead of writing them again.

A restore through a manager's own call is told to that manager (:func:`restoring`); any other
restore (TensorFlow's ``ckpt.restore(manager.latest_checkpoint)``, ``jaxckpt.restore``) to every
open manager whose directory directly holds the checkpoint (:func:`watch`). :func:`loaded` hears of
every restore's values as one of ``jaxckpt.reading.reader.LOAD_OBSERVERS``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import jax

from jaxckpt.format.records import ArrayLeaf, InArray
from jaxckpt.reading import reader

# The memory of the manager whose restore call is running (Memory.restoring), and every live
# manager's memory, told of the restores of its directory's checkpoints outside its calls.
_RESTORING: contextvars.ContextVar[Remembers | None] = contextvars.ContextVar("jaxckpt_restoring", default=None)
_WATCHING: weakref.WeakSet[Remembers] = weakref.WeakSet()


class Remembers(Protocol):
    """A manager's memory (this module's :class:`Memory`, or a bucket's ``jaxckpt.incremental.bucket``)."""

    @property
    def directory(self) -> str | None:
        """The manager's directory: a resolved local path, or a bucket's URL without the last "/"."""

    def loaded(self, opened: Any, values: Mapping[str, Any]) -> None: ...


def watch(memory: Remembers) -> None:
    """``memory`` hears of every restore of a checkpoint in its directory (until :func:`unwatch`)."""
    _WATCHING.add(memory)


def unwatch(memory: Remembers) -> None:
    _WATCHING.discard(memory)


def read_as_stored(x: Any, leaf: Any) -> bool:
    """``x``, restored for ``leaf``, is a ``jax.Array`` of an array of its own as stored (no cast, no
    PRNG key): its shards are that array's files."""
    return (
        isinstance(x, jax.Array)
        and isinstance(leaf, ArrayLeaf)
        and isinstance(leaf.at, InArray)
        and leaf.at.chunks is not None
        and not leaf.prng_impl
        and x.dtype == leaf.dtype
        and tuple(x.shape) == tuple(leaf.shape)
    )


def loaded(opened: Any, values: Mapping[str, Any]) -> None:
    """Every load's values (by ``jaxckpt.reading.reader``): remembered by the manager whose restore call
    reads them, or else by each live manager whose directory holds the checkpoint (see the module's
    docstring)."""
    memory = _RESTORING.get()
    if memory is not None:
        memory.loaded(opened, values)
        return
    if not _WATCHING:
        return
    folder = opened.location.local
    if folder is not None:
        directory = os.path.dirname(os.path.realpath(folder))
    else:
        directory = opened.location.text.rstrip("/").rsplit("/", 1)[0]
    for memory in list(_WATCHING):
        if memory.directory == directory:
            memory.loaded(opened, values)


reader.LOAD_OBSERVERS.append(loaded)


def restoring(memory: Remembers | None) -> contextlib.AbstractContextManager[None]:
    """``memory`` remembers what the restores inside return (nothing without a memory)."""
    return contextlib.nullcontext() if memory is None else _restoring(memory)


@contextlib.contextmanager
def _restoring(memory: Remembers) -> Iterator[None]:
    token = _RESTORING.set(memory)
    try:
        yield
    finally:
        _RESTORING.reset(token)
