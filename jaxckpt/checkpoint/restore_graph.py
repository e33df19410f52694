"""One ``Checkpoint.restore`` into a graph of :class:`~jaxckpt.Checkpoint` objects, as TensorFlow's.

Children are matched by edge name; a Checkpoint reached by several paths is restored once per saved
object it stands for: once if the paths lead to one saved object (saved once, an alias at the
others, or a cycle), from each if they lead to several (two saved objects loaded into one shared
Checkpoint, TF's testObjectsCombined), and a child is missing only if none of them has it. One saved
object restored into two different Checkpoints is reported (TF's testAmbiguousLoad). Values whose
edge has no child yet wait in the Checkpoint's ``_pending`` until the child is assigned.

Checkpoint is known here only as a :class:`Node` (and by the ``_jaxckpt_children`` protocol, as in
:mod:`jaxckpt.tree.objects`), so that :mod:`jaxckpt.checkpoint.checkpoint`, which uses this module,
is not imported here.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Protocol

import jax

from jaxckpt._errors import CheckpointNotFoundError, JaxckptError, MissingKeyError
from jaxckpt.checkpoint.foreign_keys import foreign_matches
from jaxckpt.checkpoint.restore import SAVE_COUNTER, RestoreStatus, json_children
from jaxckpt.format.keys import CHECKPOINT, describe, escape_edge, join
from jaxckpt.format.records import ValueLeaf
from jaxckpt.reading.reader import Opened
from jaxckpt.reading.templates import NO_TEMPLATE
from jaxckpt.tree.objects import build, flatten, placeholders_message, rebuild


class Checkpoint(Protocol):
    """What a restore reads and changes of a :class:`jaxckpt.Checkpoint`: its children by edge name,
    its save counter, and the values waiting for a child not assigned yet."""

    _children: dict[str, Any]
    _pending: dict[str, list[tuple[Restore, str]]]
    _restored_by: dict[str, int]  # by child: the restore that set it
    save_counter: int

    def _jaxckpt_set(self, name: str, value: Any) -> None: ...


_RESTORE_IDS = itertools.count(1)


def _is_checkpoint(x: object) -> bool:
    return getattr(type(x), "_jaxckpt_children", None) is not None


def object_leaves(obj: Any, key: str) -> list[str]:
    """Leaf keys of ``obj`` at ``key``, without the save counters of nested Checkpoints."""
    flat = flatten(obj, key)
    counters = {join(k, SAVE_COUNTER) for k, info in flat.nodes.items() if info.kind == CHECKPOINT}
    return [k for k in flat.leaves if k not in counters]


class Restore:
    """One restore of a checkpoint into a graph of Checkpoint objects."""

    def __init__(self, opened: Opened, status: RestoreStatus) -> None:
        self.opened = opened
        self.status = status
        # Restores are ordered by their restore() call: where two give a value to the same child, the
        # later call's value wins, whatever the order in which children are assigned (as in TF).
        self.uid = next(_RESTORE_IDS)
        self.jobs: list[tuple[Checkpoint, str, Any, str]] = []  # (owner, name, value, key)
        # Edges whose values wait for an assignment. Weak: the Checkpoint holds this restore in its
        # _pending, and a strong reference back would be a cycle keeping its children alive until GC.
        self.waiting: list[tuple[weakref.ref[Checkpoint], str]] = []
        # The object graph: each Checkpoint gathered with the saved objects (keys) it is restored from,
        # and the object each saved Checkpoint went into. Weak, for the same reason as ``waiting``.
        self.gathered: weakref.WeakKeyDictionary[Checkpoint, set[str]] = weakref.WeakKeyDictionary()
        self.restored_into: dict[str, weakref.ref[Checkpoint]] = {}
        # A child that a saved object lacks, by (id of its Checkpoint, edge): (child, key) until another
        # saved object restored into the same Checkpoint has it (None), settled before values are read.
        self.absent: dict[tuple[int, str], tuple[Any, str] | None] = {}

    def gather(self, ckpt: Checkpoint, key: str) -> None:
        """Plan the restore of ``ckpt`` (at ``key``): its children now, its absent edges later."""
        key = self.opened.index.aliases.get(key, key)  # the saved object stored once, where first met
        keys = self.gathered.setdefault(ckpt, set())
        if key in keys:
            return  # the same saved object reached again by another path (or around a cycle): once
        earlier = self.restored_into.get(key)
        if earlier is not None and earlier() is not None and earlier() is not ckpt:
            self.status._loaded_twice.add(key)
        keys.add(key)
        self.restored_into[key] = weakref.ref(ckpt)
        info = self.opened.index.nodes.get(key)
        saved = set(info.keys) if info is not None else set()
        for name, child in ckpt._children.items():
            child_key = join(key, escape_edge(name))
            if name not in saved:
                self.absent.setdefault((id(ckpt), name), (child, child_key))
                continue
            self.absent[(id(ckpt), name)] = None  # found: another saved object that lacks it is fine
            if _is_checkpoint(child):
                self.gather(child, child_key)
            else:
                self.jobs.append((ckpt, name, child, child_key))
        if SAVE_COUNTER in saved and isinstance(self.opened.index.leaves.get(join(key, SAVE_COUNTER)), ValueLeaf):
            self.jobs.append((ckpt, SAVE_COUNTER, ckpt.save_counter, join(key, SAVE_COUNTER)))
        for edge in saved - set(ckpt._children) - {SAVE_COUNTER}:
            if isinstance(edge, str):
                ckpt._pending.setdefault(edge, []).append((self, join(key, escape_edge(edge))))
                self.waiting.append((weakref.ref(ckpt), edge))

    def _settle_absent(self) -> None:
        """The children that no saved object restored into their Checkpoint has are missing."""
        absent = [entry for entry in self.absent.values() if entry is not None]
        self.absent.clear()
        for child, child_key in absent:
            leaves = flatten(child, child_key).leaves
            abstract = [k for k, v in leaves.items() if isinstance(v, jax.ShapeDtypeStruct)]
            if abstract:  # it would keep its placeholders: never leave them behind
                raise MissingKeyError(placeholders_message(abstract))
            self.status._missing.update(object_leaves(child, child_key))

    def abandon(self) -> None:
        """A restore that failed leaves no values waiting, and no warning about unused ones."""
        self.status._partial_ok = self.status._settled = True
        self.absent.clear()
        for ref, name in self.waiting:
            ckpt = ref()
            if ckpt is not None and name in ckpt._pending:
                left = [(r, k) for r, k in ckpt._pending[name] if r is not self]
                if left:
                    ckpt._pending[name] = left
                else:
                    del ckpt._pending[name]

    def run(self) -> None:
        self._settle_absent()
        leaves = self.opened.index.leaves
        wanted: dict[str, Any] = {}  # by checkpoint key
        renamed: dict[str, str] = {}  # template key -> checkpoint key, and Orbax's Nones taken (see foreign_keys)
        empties: list[str] = []
        json_nodes: list[str] = []
        foreign = bool(self.opened.empty_or_none or self.opened.variable_nodes)
        for _, _, value, key in self.jobs:
            flat = flatten(value, key)
            missing = []
            for k, template in flat.leaves.items():
                if k in leaves:
                    wanted[k] = template
                else:
                    missing.append(k)
            for node, keys in json_children(self.opened.index, flat).items():
                wanted.update(dict.fromkeys(keys, NO_TEMPLATE))
                json_nodes.append(node)
            if foreign:
                more, taken = foreign_matches(self.opened, flat, missing)
                wanted.update((stored, flat.leaves[k]) for k, stored in more.items())
                missing = [k for k in missing if k not in more]
                renamed.update(more)
                empties += taken
            self.status._missing.update(missing)
        values = self.opened.load(wanted)
        for k, stored in renamed.items():
            values[k] = values.pop(stored)
        for node in json_nodes:
            values[node] = build(self.opened.index.nodes, values, node)
        for owner, name, value, key in self.jobs:
            if owner._restored_by.get(name, 0) > self.uid:
                continue  # a later restore() call already gave it its value; this one's counts as used
            owner._jaxckpt_set(name, rebuild(value, values, key))
            owner._restored_by[name] = self.uid
        self.status._used.update(wanted)
        self.status._used.update(empties)
        self.jobs.clear()

    def deferred(self, ckpt: Checkpoint, name: str, value: Any, key: str) -> Any:
        """Restore a child assigned after ``restore()``; returns what to store.

        If it fails, the child keeps the value assigned (so the next save includes it), and no job is
        left behind for a later assignment to run again.
        """
        try:
            if _is_checkpoint(value):
                self.gather(value, key)
                self.run()
                return value
            self.jobs.append((ckpt, name, value, key))
            self.run()
        except JaxckptError as e:
            self.jobs.clear()
            if self.opened.exists():
                raise
            raise CheckpointNotFoundError(
                f"Cannot restore {describe(key)}, assigned after restore(): its checkpoint {str(self.opened.path)!r} "
                "has been deleted since (a manager's retention?). The child keeps the value you assigned. Assign "
                "children before the next save, or restore them from a newer checkpoint."
            ) from e
        return ckpt._children[name]
