"""How keys and records read to people: key patterns (``jaxckpt ls PATH PATTERN``), the key tree
that ``ls`` and the notebook view draw, and each leaf's type, shape and JSON form. Shared by
:mod:`jaxckpt.tools.inspect`, the CLI and ``diff``.

Patterns: ``*`` matches within one edge, ``**`` any number of edges (none included), ``?`` one
character of an edge; a pattern selects the keys it matches and everything below them, so a plain
key (``optimizer``) selects its subtree.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jaxckpt.format.keys import CHECKPOINT, NodeInfo, child_keys, edges_for, join
from jaxckpt.format.records import ArrayLeaf, Index, Leaf, ValueLeaf
from jaxckpt.tree.objects import build

# Python values longer than this are cut in the tree; `jaxckpt show` prints them whole.
VALUE_WIDTH = 40


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """``a/**/b`` -> a regex where ``**`` spans edges (none included) and ``*``, ``?`` stay in one."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")  # zero or more whole edges
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append("(?:/.*)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def key_matcher(patterns: Iterable[str]) -> Callable[[str], bool] | None:
    """A test of whether a key matches any of ``patterns`` (leading and trailing ``/`` ignored).

    None when there are no patterns: everything matches.
    """
    regexes = [_pattern_regex(p.strip("/")) for p in patterns]
    if not regexes:
        return None
    return lambda key: any(r.fullmatch(key) for r in regexes)


@dataclasses.dataclass
class KeyTree:
    """A node or leaf as displayed: chains of single-child nodes are merged into one row."""

    key: str
    label: str  # the edge(s) this row stands for
    info: NodeInfo | None  # for nodes
    leaf: Leaf | None  # for leaves
    children: list[KeyTree]
    count: int  # values at or below
    nbytes: int  # array bytes at or below


def leaf_nbytes(leaf: Leaf) -> int:
    return leaf.nbytes if isinstance(leaf, ArrayLeaf) else 0


def build_tree(index: Index, match: Callable[[str], bool] | None) -> KeyTree | None:
    def walk(key: str, label: str, chosen: bool) -> KeyTree | None:
        chosen = chosen or match is None or match(key)
        info = index.nodes.get(key)
        if info is None:
            leaf = index.leaves[key]
            return KeyTree(key, label, None, leaf, [], 1, leaf_nbytes(leaf)) if chosen else None
        kids = [kid for e in edges_for(info.keys) if (kid := walk(join(key, e), e, chosen)) is not None]
        if not kids and not chosen:
            return None
        if key and len(kids) == 1 and kids[0].info is not None:  # "opt_state" + "0" -> "opt_state/0"
            only = kids[0]
            return dataclasses.replace(only, label=f"{label}/{only.label}")
        return KeyTree(key, label, info, None, kids, sum(k.count for k in kids), sum(k.nbytes for k in kids))

    return walk("", "", False)


def selected(key: str, match: Callable[[str], bool]) -> bool:
    """A key is selected if it, one of its ancestors, or the root matches."""
    parts = key.split("/") if key else []
    return any(match("/".join(parts[:i])) for i in range(len(parts) + 1))


def printable(text: str) -> str:
    """Control characters in a key would break the tree's lines; show them escaped."""
    return text if text.isprintable() else repr(text)[1:-1]


def short_value(leaf: ValueLeaf, width: int = VALUE_WIDTH) -> str:
    text = "None" if leaf.type == "none" else json.dumps(json_value(leaf.value), ensure_ascii=False)
    text = printable(text)
    return text if len(text) <= width else text[: width - 3] + "..."


def leaf_type(leaf: Leaf) -> str:
    """What a leaf is, in a word: its dtype, ``key<impl>`` for PRNG keys, or the Python type."""
    if isinstance(leaf, ValueLeaf):
        return leaf.type
    if leaf.prng_impl:
        return f"key<{leaf.prng_impl}>"
    return leaf.dtype.name


def leaf_shape(leaf: ArrayLeaf) -> tuple[int, ...]:
    """The shape a user sees: for PRNG keys the key array's shape, without the key data's last axis."""
    return leaf.value_shape


def json_value(value: Any) -> Any:
    """A Python value as strict JSON can hold it (non-finite floats as "nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_value(v) for v in value]
    if isinstance(value, bytes):  # a state_bytes leaf: as the index holds it
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, tuple):  # a state_per_process leaf: each process's state, as the index holds them
        return [{"type": state.type, "value": json_value(state.value)} for state in value]
    return value


def leaf_json(key: str, leaf: Leaf) -> dict[str, Any]:
    """One value as ``jaxckpt ls --json`` lists it."""
    if isinstance(leaf, ValueLeaf):
        return {"key": key, "type": leaf.type, "value": json_value(leaf.value)}
    out: dict[str, Any] = {
        "key": key,
        "type": "prng_key" if leaf.prng_impl else "array",
        "dtype": leaf.dtype.name,
        "shape": list(leaf_shape(leaf)),
        "nbytes": leaf.nbytes,
        "container": leaf.container,
        "sharding": leaf.sharding,
    }
    if leaf.prng_impl:
        out["impl"] = leaf.prng_impl
    return out


def node_type(info: NodeInfo) -> str:
    if info.kind == CHECKPOINT:
        return "Checkpoint"
    return info.cls.rsplit(".", 1)[-1]


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def pruned(nodes: Mapping[str, NodeInfo], values: Mapping[str, Any]) -> Any:
    """Like :func:`build`, for some of the leaves: a container keeps only the children with selected
    values below them, and one that lost children comes back as a dict of the kept ones by their
    original keys (so a list's indexes stay meaningful)."""
    wanted = set(values)
    for key in values:  # and every ancestor (a "/" inside an edge is escaped)
        parts = key.split("/")
        wanted.update("/".join(parts[:i]) for i in range(len(parts)))

    @functools.cache
    def complete(key: str) -> bool:  # every value below ``key`` is selected
        info = nodes.get(key)
        return key in values if info is None else all(complete(ck) for ck in child_keys(key, info))

    def visit(key: str) -> Any:
        if complete(key):
            return build(nodes, values, key)
        info = nodes[key]
        return {k: visit(ck) for k, ck in zip(info.keys, child_keys(key, info)) if ck in wanted}

    return visit("") if values else {}
