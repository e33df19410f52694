"""Restoring optimizer slots into a changed optimizer: matched by slot name and parameter path.

An optax state keys its slots by the transform's position in the chain
(``opt_state/1/0/mu/params/dense/kernel``), so adding ``clip_by_global_norm`` in front of ``adam``
moves every slot, and an exact restore no longer fits. :func:`restore_slots` matches each slot by its
*canonical name* instead: its key below ``prefix`` without the leading edges that only say where the
transform sits, which leaves ``<slot name>/<parameter path>`` (``mu/params/dense/kernel``).

The leading edges removed are, from the top, as long as they are one of:

- an int edge: a position in a chain's tuple (or in the dict that NNX makes of it);
- a wrapper's field: ``opt_state`` (an ``nnx.Optimizer``, a ``TrainState``), ``inner_state``
  (``masked``, ``inject_hyperparams``...), ``inner_opt_state`` (``MultiSteps``);
- ``inner_states`` and the label below it (``multi_transform``).

A name that is unique on both sides is a match. Where a name is not unique (the ``count`` of
``scale_by_adam`` and of ``scale_by_schedule``), the class of the state that holds the slot breaks the
tie (``ScaleByAdamState``); where a side does not know that class (an ``nnx.Optimizer`` keeps its
state as plain dicts), the fields of the state that holds the slot do (``count``, ``mu``, ``nu`` for
adam's ``count``; ``count`` alone for a schedule's); then the exact key below ``prefix``. What is still
ambiguous keeps its fresh value. A match restores only if the shapes and dtypes agree; otherwise it is reported, not raised.
Everything not restored keeps the value it has in the fresh state, and the :class:`SlotReport` says
which slot went where.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

from jaxckpt._errors import MismatchError, MissingKeyError, UnsupportedValueError
from jaxckpt.format.keys import DICT, LIST, NNX, TUPLE, NodeInfo, describe, edges_for, join
from jaxckpt.reading.open import open_checkpoint
from jaxckpt.reading.templates import check, expected_text, held_text
from jaxckpt.storage import locations
from jaxckpt.tree.objects import flatten, rebuild

T = TypeVar("T")

# Fields of optax states (and of the objects that hold them) that wrap the actual transform state.
WRAPPER_FIELDS = frozenset({"opt_state", "inner_state", "inner_opt_state"})
# Fields whose children are labels of partitions, each wrapping a transform state (multi_transform).
LABELED_WRAPPER_FIELDS = frozenset({"inner_states"})
# Node kinds whose class says nothing about which transform a slot belongs to.
_ANONYMOUS_KINDS = frozenset({DICT, LIST, TUPLE, NNX})


class _Slot(NamedTuple):
    key: str  # full key (checkpoint key, or the fresh state's key as if saved at the same prefix)
    relative: str  # the key below the prefix
    name: str  # canonical name: <slot name>/<parameter path>
    owner: str | None  # class of the state holding the slot, when it has a meaningful one
    fields: tuple[str, ...]  # the fields of the state holding the slot, sorted


def _slots(nodes: Mapping[str, NodeInfo], leaves: Mapping[str, Any], prefix: str) -> list[_Slot]:
    """The leaves at or below ``prefix``, each with its canonical name, in graph order."""
    out: list[_Slot] = []
    start = len(prefix) + 1 if prefix else 0

    def walk(key: str, leading: bool, name: list[str], owner: str | None, fields: tuple[str, ...], skip: bool) -> None:
        info = nodes.get(key)
        if info is None:
            if key in leaves:
                relative = key[start:]
                # A leaf reached through position edges alone has no name; it matches only in place.
                out.append(_Slot(key, relative, "/".join(name) or relative, owner, fields))
            return
        for edge, original in zip(edges_for(info.keys), info.keys):
            child = join(key, edge)
            if skip:  # the label of a multi_transform partition
                walk(child, True, name, owner, fields, False)
            elif leading and (isinstance(original, int) or original in WRAPPER_FIELDS):
                walk(child, True, name, owner, fields, False)
            elif leading and original in LABELED_WRAPPER_FIELDS:
                walk(child, True, name, owner, fields, True)
            elif leading:  # the first edge of the canonical name: the slot's field
                cls = None if info.kind in _ANONYMOUS_KINDS else info.cls
                walk(child, False, [edge], cls, tuple(sorted(map(str, info.keys))), False)
            else:
                walk(child, False, [*name, edge], owner, fields, False)

    walk(prefix, True, [], None, (), False)
    return out


@dataclasses.dataclass(frozen=True)
class SlotReport:
    """What :func:`restore_slots` restored, and what it did not.

    Keys are checkpoint keys; the fresh state's keys are written as if it were saved at ``prefix``,
    so that ``new <- old`` pairs read side by side.

    Attributes:
        path: the checkpoint read.
        prefix: the key of the optimizer state in the checkpoint.
        matched: new key -> old key, for every slot restored.
        unmatched: new key -> why it kept its fresh value, for every slot not restored.
        mismatched: new key -> old key, for the unmatched slots whose counterpart has another shape or
            dtype (a subset of ``unmatched``).
        unused: checkpoint keys below ``prefix`` that restored nothing.
    """

    path: str
    prefix: str
    matched: dict[str, str]
    unmatched: dict[str, str]
    mismatched: dict[str, str]
    unused: list[str]

    def __str__(self) -> str:
        where = f" (prefix {self.prefix!r})" if self.prefix else ""
        lines = [
            f"Slot restore from {self.path!r}{where}: {len(self.matched)} restored, "
            f"{len(self.unmatched)} kept fresh, {len(self.unused)} unused in the checkpoint."
        ]
        if self.matched:
            lines.append("  restored (new <- checkpoint):")
            lines += [f"    {new} <- {old}" for new, old in self.matched.items()]
        if self.unmatched:
            lines.append("  kept fresh:")
            lines += [f"    {new}: {why}" for new, why in self.unmatched.items()]
        if self.unused:
            lines.append("  unused in the checkpoint:")
            lines += [f"    {old}" for old in self.unused]
        return "\n".join(lines)


def _pair(old: list[_Slot], new: list[_Slot]) -> tuple[dict[str, _Slot], dict[str, str]]:
    """Pairs of new key -> old slot, and new key -> why a slot found no partner."""
    pairs: dict[str, _Slot] = {}
    why: dict[str, str] = {}
    # Each tier pairs what is unique on both sides by its label, and hands the rest to the next.
    tiers = (
        lambda s: s.name,
        lambda s: (s.owner, s.name) if s.owner else None,
        lambda s: (s.fields, s.name),
        lambda s: (s.relative, s.name),
    )
    old_left, new_left = list(old), list(new)
    for label in tiers:
        olds, news = defaultdict(list), defaultdict(list)
        for s in old_left:
            olds[label(s)].append(s)
        for s in new_left:
            news[label(s)].append(s)
        for tag, group in news.items():
            if tag is not None and len(group) == 1 and len(olds.get(tag, ())) == 1:
                pairs[group[0].key] = olds[tag][0]
        taken = {s.key for s in pairs.values()}
        old_left = [s for s in old_left if s.key not in taken]
        new_left = [s for s in new_left if s.key not in pairs]
    left_by_name: dict[str, list[str]] = defaultdict(list)
    for s in old_left:
        left_by_name[s.name].append(s.key)
    known = {s.name for s in old}
    new_count: dict[str, int] = defaultdict(int)
    for s in new:
        new_count[s.name] += 1
    for s in new_left:
        if s.name not in known:
            why[s.key] = f"no slot {s.name!r} in the checkpoint"
        elif left_by_name[s.name]:
            where = ", ".join(map(repr, left_by_name[s.name]))
            why[s.key] = (
                f"ambiguous: {new_count[s.name]} slot(s) {s.name!r} here and {len(left_by_name[s.name])} left "
                f"in the checkpoint ({where}), with nothing to tell them apart"
            )
        else:
            why[s.key] = f"every slot {s.name!r} of the checkpoint went to another slot of that name"
    return pairs, why


def restore_slots(path: str | os.PathLike[str], target: T, *, prefix: str = "") -> tuple[T, SlotReport]:
    """Restore the optimizer slots that still correspond into a freshly initialized optimizer state.

    Use it when the optimizer or the model changed since the checkpoint was saved: a transform was
    added to or removed from the chain (``adam`` -> ``chain(clip_by_global_norm(1.0), adam)``), or
    the model gained a layer. Slots are matched by name and parameter path (``mu/params/dense/kernel``)
    wherever their transform sits; slots with no counterpart, or one of another shape or dtype, keep
    their fresh values. The report says which is which::

        opt_state = tx.init(params)
        opt_state, report = jaxckpt.restore_slots(path, opt_state, prefix="opt_state")
        print(report)

    Args:
        path: a checkpoint.
        target: a fresh optax state (a pytree), returned as a new pytree of the same types; or an
            ``nnx.Optimizer``, updated in place (its ``step`` is restored too) and returned.
        prefix: the key of the optimizer state in the checkpoint (``""``: the checkpoint's root, as
            written by ``jaxckpt.save(path, opt_state)``).

    Returns:
        ``(restored, report)``, the target with the matched slots restored and a :class:`SlotReport`.
    """
    opened = open_checkpoint(locations.location(path))
    index = opened.index
    if prefix not in index.nodes and prefix not in index.leaves:
        top = sorted({k.split("/", 1)[0] for k in index.leaves})
        raise MissingKeyError(
            f"The checkpoint {str(opened.path)!r} has no optimizer state at {describe(prefix)}; its top-level "
            f"keys are {', '.join(map(repr, top[:10]))}. Pass the key of the optimizer state as prefix=."
        )
    # The fresh state takes the checkpoint's prefix, so both sides' keys read alike in the report.
    flat = flatten(target, prefix)
    old = _slots(index.nodes, index.leaves, prefix)
    new = _slots(flat.nodes, flat.leaves, prefix)
    pairs, unmatched = _pair(old, new)

    wanted: dict[str, Any] = {}  # old key -> template (the fresh value, for its shape, dtype, sharding)
    mismatched: dict[str, str] = {}
    for new_key, slot in pairs.items():
        template = flat.leaves[new_key]
        leaf = index.leaves[slot.key]
        try:
            check(new_key, leaf, template)
        except MismatchError:
            mismatched[new_key] = slot.key
            unmatched[new_key] = (
                f"mismatch: the checkpoint's {slot.key!r} holds {held_text(leaf)}, the fresh state {expected_text(template)}"
            )
            continue
        except UnsupportedValueError:  # a leaf that holds nothing restorable (an object, a function)
            unmatched[new_key] = f"not restored: the fresh state holds a {type(template).__name__} there"
            continue
        wanted[slot.key] = template
    loaded = opened.load(wanted)
    opened.close()  # read: nothing of it is held open
    values = {new_key: loaded[slot.key] for new_key, slot in pairs.items() if slot.key in loaded}
    restored = rebuild(target, values, prefix)

    order = {s.key: i for i, s in enumerate(new)}
    report = SlotReport(
        path=str(opened.path),
        prefix=prefix,
        matched={new_key: pairs[new_key].key for new_key in sorted(values, key=order.__getitem__)},
        unmatched=dict(sorted(unmatched.items(), key=lambda kv: order[kv[0]])),
        mismatched=dict(sorted(mismatched.items(), key=lambda kv: order[kv[0]])),
        unused=[s.key for s in old if s.key not in wanted],
    )
    return restored, report
