"""The seam between a save and what a manager remembers (incremental saves): a save asks a
:class:`Reuse` which leaves an earlier checkpoint already holds, records those as :class:`Linked`
(hard links on a local disk, references on a bucket) and tells it what it wrote once published.

Which arrays are unchanged, and where their bytes are, is decided in :mod:`jaxckpt.incremental`
alone; a save only knows this protocol, so that it never imports the manager's layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol

import jax

from jaxckpt.format.records import JAX
from jaxckpt.saving.snapshot import owners, process_of
from jaxckpt.storage.locations import Location


class Linked(NamedTuple):
    """A leaf taken as links: what a save records for it, and the links to put in place.

    ``links``: by data store, on a local disk each shard's number -> (link, chunk key, CRCs); on a
    bucket the reference to the sibling checkpoint that holds its shards.
    """

    struct: Any  # its shape, dtype and sharding: a jax.ShapeDtypeStruct, or a numpy array's stand-in
    chunks: tuple[int, ...]
    links: dict[str, Any]
    container: str = JAX  # NUMPY for a numpy array


class Reuse(Protocol):
    """A manager's memory of what its last save wrote and its restores read, in this process."""

    @property
    def by_reference(self) -> bool:
        """Arrays are stored by reference to a sibling checkpoint (a bucket): then every process
        numbers its arrays alike, whatever it links."""

    def link(
        self, leaves: Mapping[str, Any], staging: Location, me: int, pack_limit: int, own_copy: bool
    ) -> dict[str, Linked] | None:
        """The ``leaves`` whose bytes an earlier checkpoint holds, linked (or referred to) into
        ``staging``; None where this memory does not apply to such a save (then it learns nothing)."""

    def uses(self, token: str, writers: Iterable[Any]) -> tuple[str, ...]:
        """The sibling checkpoints this save (``token``) refers to, in every process's data stores."""

    def remember(
        self,
        dest: Location,
        token: str,
        refs: Mapping[str, weakref.ref[jax.Array]],
        leaves: Mapping[str, Any],
        writers: Mapping[str, Any],
    ) -> None:
        """After the save ``token`` published at ``dest``: where this process's bytes of its arrays are
        (``refs``: its arrays of their own, see :func:`arrays_of_their_own`; ``leaves``: the index's records)."""


def arrays_of_their_own(leaves: Mapping[str, Any], pack_limit: int) -> dict[str, weakref.ref[jax.Array]]:
    """Weak references to the ``jax.Array`` leaves that a save may store as arrays of their own: those
    over ``pack_limit``, and with several processes any that process 0 does not hold whole (never
    packed, whatever its size)."""
    several = jax.process_count() > 1
    return {
        k: weakref.ref(x)
        for k, x in leaves.items()
        if isinstance(x, jax.Array)
        and (x.nbytes > pack_limit or (several and {process_of(d) for d in owners(x).values()} != {0}))
    }
