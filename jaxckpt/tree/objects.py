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

This module knows about Flax NNX, with :mod:`jaxckpt.tree.nnx_state` (which spares a training loop's
saves Flax's graph traversal). A module, its ``nnx.State`` and its pure dict
(``nnx.to_pure_dict``) give the same keys (``net/l1/kernel``), so a checkpoint written from any one
restores into any other:

- an NNX graph node (``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``) is one node whose children are
  its ``nnx.state(...)`` as a pure dict; restoring into it updates it in place;
- an ``nnx.State`` is one node whose children are its mapping; restoring into it gives a new State;
- an ``nnx.Variable`` anywhere is transparent: it saves as its value (an array leaf, or the node of a
  pytree value) under its own key, never ``.../value``. Restoring into one gives a new Variable of
  the template's type and metadata holding the restored value. Metadata is not saved.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxckpt._errors import MismatchError, MissingKeyError, UnsupportedValueError
from jaxckpt.format.keys import (
    CHECKPOINT,
    DICT,
    LIST,
    NAMEDTUPLE,
    NNX,
    NODE,
    TUPLE,
    NodeInfo,
    NodeKind,
    child_keys,
    describe,
    edges_for,
)
from jaxckpt.tree.nnx_state import pure_state


class _Node(NamedTuple):
    """One level of a container: its info, children in key order, and how to rebuild it."""

    info: NodeInfo
    children: list[Any]
    rebuild: Callable[[list[Any]], Any]


# --- what is a leaf ----------------------------------------------------------------------------


def is_state_object(x: Any) -> bool:
    """Objects saved through ``get_state()`` / ``set_state(state)`` (JSON-able state)."""
    return callable(getattr(type(x), "get_state", None)) and callable(getattr(type(x), "set_state", None))


def _nnx() -> types.ModuleType | None:
    """The ``flax.nnx`` module if it has been imported; an NNX object cannot exist otherwise."""
    return sys.modules.get("flax.nnx")


def is_nnx_node(x: Any) -> bool:
    """An NNX graph node other than a Variable (a module, an optimizer, Rngs)."""
    nnx = _nnx()
    # A Variable is a graph node too, but nnx.state() of a lone Variable fails inside Flax.
    return nnx is not None and not isinstance(x, nnx.Variable) and nnx.graph.is_graph_node(x)


def is_variable(x: Any) -> bool:
    nnx = _nnx()
    # isinstance, not type(): Flax's hijax Variables pass isinstance without subclassing Variable.
    return nnx is not None and isinstance(x, nnx.Variable)


def _flax_failure(e: Exception) -> str:
    return f"Flax raised {type(e).__name__}: {e}"


def variable_value(x: Any, key: str) -> Any:
    """What ``x`` saves and restores as: a Variable's value (as ``nnx.to_pure_dict`` reads it), else ``x``."""
    if not is_variable(x):
        return x
    try:
        return x.get_value()
    except Exception as e:
        raise UnsupportedValueError(
            f"Cannot read the value of the {_class_name(x)} at {describe(key)}: {_flax_failure(e)}. "
            "jaxckpt saves what Variable.get_value() returns; make it return the arrays to save."
        ) from e


def _rewrap(template: Any, value: Any, key: str) -> Any:
    """A new Variable of the template's type and metadata (sharding annotations...) holding ``value``."""
    try:
        return template.replace(value)  # what nnx.replace_by_pure_dict does with each Variable
    except Exception as e:
        raise MismatchError(
            f"Cannot put the restored value of {describe(key)} into a {_class_name(template)} like the "
            f"template's: {_flax_failure(e)}. Check that the template's Variable accepts a value like the saved one."
        ) from e


def _class_name(x: Any) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def not_utf8(text: str) -> str | None:
    """Why ``text`` cannot be written as UTF-8 (a lone surrogate, where it is), or None if it can.

    The index is UTF-8 JSON: a str that fails here would fail only when the index is written, for an
    async save in the background, long after the call that gave it.
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{e.reason} at position {e.start}: {text[e.start : e.end]!r}"
    return None


def _check_dict_keys(keys: Sequence[Any], prefix: str) -> None:
    for k in keys:
        if type(k) is str and k.isascii():
            continue
        if isinstance(k, bool) or not isinstance(k, (str, int)):
            raise UnsupportedValueError(
                f"The dict at {describe(prefix)} has the key {k!r} of type {type(k).__name__}; "
                "jaxckpt supports str and int dict keys. Convert the keys to str before saving."
            )
        if isinstance(k, str) and not_utf8(k) is not None:
            raise UnsupportedValueError(
                f"The dict at {describe(prefix)} has the key {k!r}, which is not valid Unicode (a lone "
                "surrogate) and cannot be written as UTF-8. Rename the key."
            )


def _decompose_dict(x: dict[Any, Any], prefix: str) -> _Node:
    keys = list(x)
    _check_dict_keys(keys, prefix)
    return _Node(NodeInfo(DICT, "dict", tuple(keys)), list(x.values()), lambda v: dict(zip(keys, v)))


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
    if is_nnx_state(x):
        return _decompose_nnx_state(x, prefix)
    if is_state_object(x):
        return None
    t = type(x)
    if t is dict:
        return _decompose_dict(x, prefix)
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
    # jax's PyTreeDef is an alias of jaxlib's extension type, which has no stubs: mypy sees no attributes.
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # type: ignore[attr-defined]
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
    kind: NodeKind = NAMEDTUPLE if isinstance(x, tuple) and hasattr(x, "_fields") else NODE
    cls = type(x).__qualname__ if kind == NAMEDTUPLE else _class_name(x)
    return _Node(NodeInfo(kind, cls, tuple(keys)), [v for _, v in pairs], treedef.unflatten)  # type: ignore[attr-defined]


def _decompose_nnx(x: Any, prefix: str) -> _Node:
    nnx = _nnx()
    assert nnx is not None  # x is an NNX node, so flax.nnx is imported
    try:
        pure = pure_state(nnx, x)
    except Exception as e:
        raise UnsupportedValueError(
            f"Cannot read the state of the Flax NNX {_class_name(x)} at {describe(prefix)}: {_flax_failure(e)}. "
            "jaxckpt saves what nnx.to_pure_dict(nnx.state(obj)) returns; check that this call works on it."
        ) from e
    keys = list(pure)
    _check_dict_keys(keys, prefix)

    def update_in_place(values: list[Any]) -> Any:
        try:
            state = nnx.state(x)
            nnx.replace_by_pure_dict(state, dict(zip(keys, values)))
            nnx.update(x, state)
        except Exception as e:
            raise MismatchError(
                f"Cannot update the Flax NNX {_class_name(x)} at {describe(prefix)} in place with the restored "
                f"values: {_flax_failure(e)}. Check that it has the structure of the object that was saved."
            ) from e
        return x

    return _Node(NodeInfo(NNX, _class_name(x), tuple(keys)), list(pure.values()), update_in_place)


def is_nnx_state(x: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.State)


def _decompose_nnx_state(x: Any, prefix: str) -> _Node:
    """An ``nnx.State``: a node whose children are its mapping's, so that its keys are its module's.

    JAX flattens a State as a pytree, which would work too, but the node is recorded as NNX (like
    its module), not as a class of its own: which of a module, its State or its pure dict was saved
    must not matter to what restores from it (see _slots' anonymous kinds).
    """
    mapping = x.raw_mapping  # nested levels are plain dicts there, as in the module's pure dict
    keys = list(mapping)
    _check_dict_keys(keys, prefix)
    cls = type(x)

    def new_state(values: list[Any]) -> Any:
        return cls(dict(zip(keys, values)))

    return _Node(NodeInfo(NNX, _class_name(x), tuple(keys)), list(mapping.values()), new_state)


# --- flatten and rebuild -----------------------------------------------------------------------


@dataclasses.dataclass
class Flat:
    nodes: dict[str, NodeInfo]
    leaves: dict[str, Any]
    # A Checkpoint reached again (by a second path, or around a cycle) is an empty node here that
    # aliases the key where it was first met: an object graph, each object stored once.
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    _first: dict[int, str] = dataclasses.field(default_factory=dict, repr=False)
    # A dict's keys -> its node's info and edges: the dicts of a model's layers share them, made once.
    _dicts: dict[tuple[Any, ...], tuple[NodeInfo, list[str]]] = dataclasses.field(default_factory=dict, repr=False)
    # Keys of the leaves that are not jax's ArrayImpl, where known (jaxckpt.tree.structure): the rest are arrays.
    not_arrays: list[str] | None = None


def flatten(root: Any, prefix: str = "") -> Flat:
    """Every node and leaf under ``root``, keyed by their paths below ``prefix``."""
    flat = Flat({}, {})
    # Ids of the containers from the root to here: a container met again on its own path is a cycle,
    # which would otherwise recurse until RecursionError. (rebuild follows templates that were
    # flattened first, so this check covers restores as well.)
    _walk(root, prefix, flat, set())
    flat._first.clear()  # ids only mean something while the objects are known alive
    flat._dicts.clear()
    return flat


# Types whose objects are leaves as they are (flatten and rebuild file them at once, not through decompose);
# jax's array type is added when met. A ShapeDtypeStruct is a restore's template.
PLAIN_LEAVES: set[type] = {np.ndarray, type(None), bool, int, float, str, jax.ShapeDtypeStruct}


def _walk(x: Any, key: str, flat: Flat, path: set[int]) -> None:
    # A module-level function, not a closure: a nested function that calls itself is a reference
    # cycle (function -> cell -> function) holding ``flat``, so every leaf would outlive the save
    # until the garbage collector ran.
    t = type(x)
    if t in PLAIN_LEAVES:
        flat.leaves[key] = x
        return
    if t is dict:  # as decompose makes it, without what only rebuild needs (the cost of many nodes)
        keys = tuple(x)
        known = flat._dicts.get(keys)
        if known is None:
            _check_dict_keys(keys, key)
            known = (NodeInfo(DICT, "dict", keys), edges_for(keys))
            if all(type(k) is str for k in keys):  # not numbers: 1 == 1.0 == True, and only int is a key
                flat._dicts[keys] = known
        (info, edges), children = known, x.values()
        prefix = key + "/" if key else ""
        child_keys_ = [prefix + e for e in edges]
    else:
        x = variable_value(x, key)  # a Variable is transparent: its value saves under its key
        node = decompose(x, key)
        if node is None:
            flat.leaves[key] = x
            if type(x) is t and isinstance(x, jax.Array) and t.__module__.partition(".")[0] in ("jax", "jaxlib"):
                PLAIN_LEAVES.add(t)
            return
        info, children = node.info, node.children
        child_keys_ = child_keys(key, info)
        if info.kind == CHECKPOINT:
            first = flat._first.get(id(x))
            if first is not None:
                flat.nodes[key], flat.aliases[key] = NodeInfo(CHECKPOINT, info.cls, ()), first
                return
            flat._first[id(x)] = key
    if id(x) in path:
        raise UnsupportedValueError(
            f"Cannot use {describe(key)}: the {type(x).__name__} there contains itself (a reference cycle); "
            "jaxckpt stores trees. Break the cycle."
        )
    path.add(id(x))
    flat.nodes[key] = info
    for child_key, child in zip(child_keys_, children):
        if type(child) in PLAIN_LEAVES:
            flat.leaves[child_key] = child
        else:
            _walk(child, child_key, flat, path)
    path.discard(id(x))


def rebuild(
    template: Any,
    values: Mapping[str, Any],
    prefix: str = "",
    *,
    _placeholders: list[str] | None = None,
    _seen: set[int] | None = None,
) -> Any:
    """``template`` with every leaf whose key is in ``values`` replaced by that value.

    Containers keep their types (a tuple stays a tuple, an optax state stays one, an nnx.State a new
    State, an nnx.Variable a new Variable with the template's metadata); NNX nodes and state objects
    are updated in place; leaves missing from ``values`` keep the template's value. A
    ``jax.ShapeDtypeStruct`` (an abstract placeholder) is never left behind: if any is missing from
    ``values``, :class:`MissingKeyError` names them all, and nothing is updated in place.
    """
    if _placeholders is None:  # the root call
        placeholders: list[str] = []
        out = rebuild(template, values, prefix, _placeholders=placeholders, _seen=set())
        if placeholders:
            raise MissingKeyError(placeholders_message(placeholders))
        return out
    if type(template) is dict:  # the common node: neither a Variable nor a Checkpoint (decompose's first checks)
        if not template and prefix in values:  # an empty dict given a whole value (a JSON child restored as saved)
            return values[prefix]
        node: _Node | None = _decompose_dict(template, prefix)
    elif is_variable(template):
        value = rebuild(variable_value(template, prefix), values, prefix, _placeholders=_placeholders, _seen=_seen)
        return template if _placeholders else _rewrap(template, value, prefix)
    else:
        node = decompose(template, prefix)
    if node is not None and node.info.kind == CHECKPOINT and _seen is not None:
        if id(template) in _seen:  # a Checkpoint met again (shared, or a cycle): restored where first met
            return template
        _seen.add(id(template))
    if node is None:
        if prefix not in values and isinstance(template, jax.ShapeDtypeStruct):
            _placeholders.append(prefix)
        return values.get(prefix, template)
    new = []
    for c, k in zip(node.children, child_keys(prefix, node.info)):
        t = type(c)
        if t in PLAIN_LEAVES:  # a leaf, as the call below finds (10,000 calls less)
            if t is jax.ShapeDtypeStruct and k not in values:
                _placeholders.append(k)
            new.append(values.get(k, c))
        else:
            new.append(rebuild(c, values, k, _placeholders=_placeholders, _seen=_seen))
    # Once a placeholder is found the restore fails: update no module in place on the way out.
    return template if _placeholders else node.rebuild(new)


def placeholders_message(keys: list[str]) -> str:
    shown = ", ".join(map(describe, keys[:10])) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
    return (
        f"{len(keys)} value(s) of the template have no value in the checkpoint: {shown}. The template holds only "
        "a jax.ShapeDtypeStruct there (an abstract placeholder, as from nnx.eval_shape), which restoring would "
        "leave behind; nothing was updated. Restore into a concrete template (a freshly initialized model) to "
        "keep its values where the checkpoint has none, or from a checkpoint that has these keys."
    )


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
