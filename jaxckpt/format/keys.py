"""Keys: the ``/``-joined paths of escaped edges that name every node and leaf of a checkpoint
(``optimizer/opt_state/0/mu/l1/kernel``), and the node records the index keeps for containers.

Edges are escaped so that every dict key round-trips: ``~`` -> ``~0``, ``/`` -> ``~1``, the empty
string -> ``~e``; an int dict key whose text equals a sibling str key (``{0: a, "0": b}``) gets the edge
``~i0``. The node table records each node's original keys (JSON keeps int and str apart), so the
escaping is only for readability and uniqueness, never the source of truth. :mod:`jaxckpt.tree`
makes keys from objects; the index (:mod:`jaxckpt.format.index_json`) records them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, NamedTuple, TypeGuard

# Node kinds as written in the index.
NodeKind = Literal["dict", "list", "tuple", "namedtuple", "node", "nnx", "checkpoint"]
DICT: Final = "dict"
LIST: Final = "list"
TUPLE: Final = "tuple"
NAMEDTUPLE: Final = "namedtuple"
NODE: Final = "node"  # any other registered pytree node: dataclass, flax.struct, optax state, FrozenDict...
NNX: Final = "nnx"
CHECKPOINT: Final = "checkpoint"
NODE_KINDS: frozenset[str] = frozenset({DICT, LIST, TUPLE, NAMEDTUPLE, NODE, NNX, CHECKPOINT})


def is_node_kind(text: str) -> TypeGuard[NodeKind]:
    return text in NODE_KINDS


class NodeInfo(NamedTuple):
    """A container in the graph: its kind, class name (informational) and child keys in order."""

    kind: NodeKind
    cls: str
    keys: tuple[str | int, ...]


def escape_edge(name: str) -> str:
    if name == "":
        return "~e"
    return name.replace("~", "~0").replace("/", "~1")


def unescape_edge(edge: str) -> str:
    """The name an escaped edge stands for (the inverse of :func:`escape_edge`)."""
    if edge == "~e":
        return ""
    return edge.replace("~1", "/").replace("~0", "~")


def edges_for(keys: Sequence[str | int]) -> list[str]:
    """The edge names of a node's children, given their original keys."""
    strs = None
    edges = []
    for k in keys:
        if isinstance(k, str):
            edges.append(k if k and "~" not in k and "/" not in k else escape_edge(k))
        else:
            if strs is None:
                strs = {k for k in keys if isinstance(k, str)}
            text = str(k)
            edges.append("~i" + text if text in strs else text)
    return edges


def join(prefix: str, edge: str) -> str:
    return f"{prefix}/{edge}" if prefix else edge


def child_keys(prefix: str, info: NodeInfo) -> list[str]:
    prefix = prefix + "/" if prefix else ""
    return [prefix + e for e in edges_for(info.keys)]


def describe(key: str) -> str:
    """How a key reads in messages: the root is named as such."""
    return repr(key) if key else "the root"
