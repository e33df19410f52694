"""Where a template's keys meet what another library stored otherwise than jaxckpt would.

Two cases, both from Orbax (the reader says so, see ``ForeignCheckpoint``), both decided by what the
checkpoint says and what the template holds together, never by a key's name alone:

- Orbax stores ``None`` and every pytree node without leaves (optax's ``EmptyState()``, an empty
  tuple) alike, as a ``None`` value. Such a value restores into a template's leafless node there:
  the template keeps its own node (an ``EmptyState()`` stays one).
- Orbax stores a Flax NNX Variable as JAX flattens it, its value under the edge ``value``
  (``linear/kernel/value``), where jaxckpt keys it as the Variable itself (``linear/kernel``). A
  template key below an NNX object (a module, its ``nnx.State``) that the checkpoint lacks takes the
  value of the checkpoint's node of that key, if that node holds exactly one value, under ``value``.
  A user's own key named ``value`` is matched as it is, as every key is.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from jaxckpt.format.keys import NNX, NodeInfo, child_keys
from jaxckpt.reading.reader import Opened
from jaxckpt.tree.objects import Flat


def foreign_matches(opened: Opened, flat: Flat, missing: list[str]) -> tuple[dict[str, str], list[str]]:
    """What the template ``flat`` takes of ``opened`` beyond its own keys: ``{template key: checkpoint
    key}`` of the NNX Variables among ``missing`` (template leaves the checkpoint lacks), and the
    checkpoint keys of Orbax's ``None`` values that stand for the template's leafless nodes."""
    renamed = variable_values(missing, flat.nodes, opened.variable_nodes) if missing else {}
    empties = [k for k in opened.empty_or_none if k not in flat.leaves and leafless(k, flat.nodes, flat.leaves)]
    return renamed, empties


def variable_values(
    missing: list[str], nodes: Mapping[str, NodeInfo], variable_nodes: Mapping[str, str]
) -> dict[str, str]:
    """``{template key: checkpoint key}`` for the keys of ``missing`` (template leaves the checkpoint
    lacks) that are NNX Variables whose value the checkpoint stores below them (``variable_nodes``:
    its nodes with one value under ``value``). ``nodes``: the template's."""
    if not variable_nodes:
        return {}
    nnx_nodes = {key for key, info in nodes.items() if info.kind == NNX}
    out: dict[str, str] = {}
    for key in missing:
        stored = variable_nodes.get(key)
        if stored is not None and _below_any(key, nnx_nodes):
            out[key] = stored
    return out


def _below_any(key: str, node_keys: AbstractSet[str]) -> bool:
    parent = key
    while parent:
        parent = parent.rpartition("/")[0]
        if parent in node_keys:
            return True
    return False


def leafless(key: str, nodes: Mapping[str, NodeInfo], leaves: Mapping[str, Any]) -> bool:
    """Whether the template has a node at ``key`` with no leaf below it (``EmptyState()``, ``()``, ``{}``)."""
    info = nodes.get(key)
    if info is None:
        return False
    return all(child not in leaves and leafless(child, nodes, leaves) for child in child_keys(key, info))
