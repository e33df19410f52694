"""The object graph: objects become named edges, and keys become objects again.

A *key* is the ``/``-joined path of *edges* from the root to a node or leaf, for example
``optimizer/opt_state/0/mu/l1/kernel``. This module turns any supported object into two flat tables
(``nodes``: key -> :class:`NodeInfo`, ``leaves``: key -> leaf object) and rebuilds objects from
restored leaf values, either following a template (what the user holds now) or, with no template,
from the recorded node kinds alone.

Edges are escaped so that every dict key round-trips: ``~`` -> ``~0``, ``/`` -> ``~1``, the empty
string -> ``~e``; an int dict key whose text equals a sibling str key (``{0: a, "0": b}``) gets the edge
``~i0``. The node table records each node's original keys (JSON keeps int and str apart), so the
escaping is only for readability and uniqueness, never the source of truth.

This is the only module that knows about Flax NNX: an NNX graph node (``nnx.Module``,
``nnx.Optimizer``) is one node whose children are its ``nnx.state(...)`` as a pure dict, so an NNX
Variable is a leaf (``net/l1/kernel``), and restoring it updates the module in place.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxckpt._errors import UnsupportedValueError

# Node kinds as written in the index.
DICT = "dict"
LIST = "list"
TUPLE = "tuple"
NAMEDTUPLE = "namedtuple"
NODE = "node"  # any other registered pytree node: dataclass, flax.struct, optax state, FrozenDict...
NNX = "nnx"
CHECKPOINT = "checkpoint"
NODE_KINDS = frozenset({DICT, LIST, TUPLE, NAMEDTUPLE, NODE, NNX, CHECKPOINT})


class NodeInfo(NamedTuple):
    """A container in the graph: its kind, class name (informational) and child keys in order."""

    kind: str
    cls: str
    keys: tuple[str | int, ...]


class _Node(NamedTuple):
    """One level of a container: its info, children in key order, and how to rebuild it."""

    info: NodeInfo
    children: list[Any]
    rebuild: Callable[[list[Any]], Any]


# --- edges and keys --------------------------------------------------------------------------


def escape_edge(name: str) -> str:
    if name == "":
        return "~e"
    return name.replace("~", "~0").replace("/", "~1")


def edges_for(keys: Sequence[str | int]) -> list[str]:
    """The edge names of a node's children, given their original keys."""
    strs = {k for k in keys if isinstance(k, str)}
    edges = []
    for k in keys:
        if isinstance(k, str):
            edges.append(escape_edge(k))
        else:
            text = str(k)
            edges.append("~i" + text if text in strs else text)
    return edges


def join(prefix: str, edge: str) -> str:
    return f"{prefix}/{edge}" if prefix else edge


def child_keys(prefix: str, info: NodeInfo) -> list[str]:
    return [join(prefix, e) for e in edges_for(info.keys)]


def describe(key: str) -> str:
    """How a key reads in messages: the root is named as such."""
    return repr(key) if key else "the root"


# --- what is a leaf ----------------------------------------------------------------------------


def is_state_object(x: Any) -> bool:
    """Objects saved through ``get_state()`` / ``set_state(state)`` (JSON-able state)."""
    return callable(getattr(type(x), "get_state", None)) and callable(getattr(type(x), "set_state", None))


def _nnx():
    """The ``flax.nnx`` module if it has been imported; an NNX object cannot exist otherwise."""
    return sys.modules.get("flax.nnx")


def is_nnx_node(x: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and nnx.graph.is_graph_node(x)


def _class_name(x: Any) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def _check_dict_keys(keys: Sequence[Any], prefix: str) -> None:
    for k in keys:
        if isinstance(k, bool) or not isinstance(k, (str, int)):
            raise UnsupportedValueError(
                f"The dict at {describe(prefix)} has the key {k!r} of type {type(k).__name__}; "
                "jaxckpt supports str and int dict keys. Convert the keys to str before saving."
            )


def decompose(x: Any, prefix: str = "") -> _Node | None:
    """One level of ``x`` as a node, or None if ``x`` is a leaf."""
    if x is None or isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return None
    children_of = getattr(type(x), "_jaxckpt_children", None)
    if children_of is not None:  # a jaxckpt.Checkpoint, known here only through this protocol
        kids = x._jaxckpt_children()
        names = list(kids)

        def rebuild_checkpoint(values: list[Any]) -> Any:
            for name, value in zip(names, values):
                x._jaxckpt_set(name, value)
            return x

        return _Node(NodeInfo(CHECKPOINT, _class_name(x), tuple(names)), list(kids.values()), rebuild_checkpoint)
    if is_nnx_node(x):
        return _decompose_nnx(x, prefix)
    if is_state_object(x):
        return None
    t = type(x)
    if t is dict:
        keys = list(x)
        _check_dict_keys(keys, prefix)
        return _Node(NodeInfo(DICT, "dict", tuple(keys)), list(x.values()), lambda v: dict(zip(keys, v)))
    if t is list:
        return _Node(NodeInfo(LIST, "list", tuple(range(len(x)))), list(x), list)
    if t is tuple:
        return _Node(NodeInfo(TUPLE, "tuple", tuple(range(len(x)))), list(x), tuple)
    return _decompose_registered(x, prefix)


def _decompose_registered(x: Any, prefix: str) -> _Node | None:
    """Any other pytree node registered with JAX (namedtuples, dataclasses, optax states...)."""
    try:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    except TypeError as e:  # e.g. a dict subclass whose keys cannot be sorted
        raise UnsupportedValueError(f"Cannot flatten the {type(x).__name__} at {describe(prefix)}: {e}") from e
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return None  # JAX sees a leaf
    keys: list[str | int] = []
    for path, _ in pairs:
        (entry,) = path
        if isinstance(entry, jax.tree_util.DictKey):
            keys.append(entry.key)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            keys.append(entry.idx)
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            keys.append(entry.name)
        else:  # FlattenedIndexKey and custom key types
            keys.append(getattr(entry, "key", str(entry)))
    _check_dict_keys(keys, prefix)
    kind = NAMEDTUPLE if isinstance(x, tuple) and hasattr(x, "_fields") else NODE
    cls = type(x).__qualname__ if kind == NAMEDTUPLE else _class_name(x)
    return _Node(NodeInfo(kind, cls, tuple(keys)), [v for _, v in pairs], treedef.unflatten)


def _decompose_nnx(x: Any, prefix: str) -> _Node:
    nnx = _nnx()
    pure = nnx.to_pure_dict(nnx.state(x))
    keys = list(pure)
    _check_dict_keys(keys, prefix)

    def update_in_place(values: list[Any]) -> Any:
        state = nnx.state(x)
        nnx.replace_by_pure_dict(state, dict(zip(keys, values)))
        nnx.update(x, state)
        return x

    return _Node(NodeInfo(NNX, _class_name(x), tuple(keys)), list(pure.values()), update_in_place)


# --- flatten and rebuild -----------------------------------------------------------------------


@dataclasses.dataclass
class Flat:
    nodes: dict[str, NodeInfo]
    leaves: dict[str, Any]


def flatten(root: Any, prefix: str = "") -> Flat:
    """Every node and leaf under ``root``, keyed by their paths below ``prefix``."""
    flat = Flat({}, {})

    def walk(x: Any, key: str) -> None:
        node = decompose(x, key)
        if node is None:
            flat.leaves[key] = x
            return
        flat.nodes[key] = node.info
        for child_key, child in zip(child_keys(key, node.info), node.children):
            walk(child, child_key)

    walk(root, prefix)
    return flat


def rebuild(template: Any, values: Mapping[str, Any], prefix: str = "") -> Any:
    """``template`` with every leaf whose key is in ``values`` replaced by that value.

    Containers keep their types (a tuple stays a tuple, an optax state stays one); NNX nodes and
    state objects are updated in place; leaves missing from ``values`` keep the template's value.
    """
    node = decompose(template, prefix)
    if node is None:
        return values.get(prefix, template)
    new = [rebuild(c, values, k) for c, k in zip(node.children, child_keys(prefix, node.info))]
    return node.rebuild(new)


def build(nodes: Mapping[str, NodeInfo], values: Mapping[str, Any], key: str = "") -> Any:
    """An object rebuilt from the recorded node kinds alone, without a template.

    dicts, lists and tuples come back as such, namedtuples as namedtuples of the same name and
    fields (made here: no class is imported from a checkpoint), every other node as a dict.
    """
    info = nodes.get(key)
    if info is None:
        return values[key]
    children = [build(nodes, values, k) for k in child_keys(key, info)]
    if info.kind == LIST:
        return children
    if info.kind == TUPLE:
        return tuple(children)
    if info.kind == NAMEDTUPLE:
        return _namedtuple(info.cls, info.keys)(*children)
    return dict(zip(info.keys, children))


def _namedtuple(name: str, fields: tuple[str | int, ...]) -> type:
    import collections

    name = name.rsplit(".", 1)[-1]
    try:
        return collections.namedtuple(name if name.isidentifier() else "Record", [str(f) for f in fields])
    except ValueError:  # field names that are not identifiers
        return collections.namedtuple("Record", [str(f) for f in fields], rename=True)
