"""The index as JSON, parsed: :func:`decode_index` (:mod:`jaxckpt.format.index_encode` writes it, canonical
and checksummed). docs/format.md is the specification. Parsing is defensive: a crafted index
can only produce a :class:`CheckpointFormatError`, never a path outside the checkpoint, an object
dtype, or an allocation that its own data does not back.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from jaxckpt._errors import (
    CheckpointCorruptedError,
    CheckpointFormatError,
    UnsupportedVersionError,
)
from jaxckpt._gc_pause import gc_paused
from jaxckpt.format import records
from jaxckpt.format.checked_json import check_checksum
from jaxckpt.format.keys import CHECKPOINT as CHECKPOINT_KIND
from jaxckpt.format.keys import NodeInfo, child_keys, describe, is_node_kind
from jaxckpt.format.records import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    MAX_DEPTH,
    MAX_DEVICES,
    MAX_MESHES,
    MAX_PROCESS,
    MAX_PROCESS_STATES,
    MAX_RANK,
    SCALAR_TYPES,
    STATE_TYPES,
    ArrayLeaf,
    InArray,
    Index,
    InPack,
    Layout,
    Leaf,
    MeshRecord,
    Pack,
    ValueLeaf,
    is_container,
    is_scalar_type,
    prng_key_data_shape,
)

# What a store, an array and a pack may be named in an index: nothing else gets near a path.
_STORE = re.compile(r"^data(\.p[1-9][0-9]{0,5})?$")
_ARRAY_PATH = re.compile(r"^a/[0-9]{1,9}$")
_PACK_PATH = re.compile(r"^p/[0-9]{1,9}$")
SAVE_ID = re.compile(r"^[0-9a-f]{1,64}$")  # the id of a save (version 5)


# --- parsing -----------------------------------------------------------------------------------


def _fail(where: object, msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"Invalid checkpoint index {where}: {msg}")


_ABSENT = object()


def _get(obj: Any, name: str, types: type | tuple[type, ...], where: object) -> Any:
    value = obj.get(name, _ABSENT) if type(obj) is dict else _ABSENT
    if type(value) is types:  # the common case, ten times a leaf: exactly the one type asked for
        return value
    if not isinstance(obj, dict):
        raise _fail(where, f"expected a JSON object, found {type(obj).__name__}")
    if name not in obj:
        raise _fail(where, f"missing field {name!r}")
    value = obj[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise _fail(where, f"field {name!r} has type {type(value).__name__}")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _nonneg_int(obj: Any, name: str, where: object) -> int:
    value = _get(obj, name, int, where)
    if value < 0:
        raise _fail(where, f"field {name!r} is negative")
    return value


@gc_paused
def decode_index(data: bytes, where: str) -> Index:
    """Parse and validate an index; ``where`` names the file in messages."""
    try:
        body = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, or an integer of over 4300 digits
        raise CheckpointCorruptedError(f"The checkpoint index {where} is not valid JSON ({e}); it is damaged.") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise CheckpointFormatError(f'{where} is not a jaxckpt index (no "format": "jaxckpt" field).')
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise _fail(where, "field 'version' is not an integer")
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"{where} has format version {version}; this jaxckpt reads versions up to {FORMAT_VERSION}. "
            "Upgrade jaxckpt to read it."
        )
    if version < 1:
        raise _fail(where, f"unknown format version {version}")
    check_checksum(data, body, f"The checkpoint index {where}")
    save = None
    if version >= 5:
        save = _get(body, "save", str, where)
        if not SAVE_ID.fullmatch(save):
            raise _fail(where, f"field 'save' is {save[:80]!r}, not 1 to 64 lowercase hexadecimal digits")
    nodes = _parse_nodes(_get(body, "nodes", dict, where), where)
    packs = [_parse_pack(p, version, f"{where} packs[{i}]") for i, p in enumerate(_get(body, "packs", list, where))]
    meshes = _parse_meshes(body, where) if version >= 3 else []
    full = lambda key, raw: _parse_leaf(raw, packs, meshes, version, _LeafWhere(where, key))  # noqa: E731
    leaves = parse_leaves(_get(body, "leaves", dict, where), packs, version, full)
    _check_graph(nodes, leaves, where)
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _fail(where, "field 'metadata' is not an object")
    aliases = _parse_aliases(body.get("aliases"), nodes, where)
    return Index(nodes, leaves, packs, metadata, version, meshes, aliases, save, refs=version >= 6)


class _LeafWhere:
    """Where a leaf is, for messages: formatted only if one is raised (10,000 leaves, most never named)."""

    __slots__ = ("key", "where")

    def __init__(self, where: str, key: str) -> None:
        self.where, self.key = where, key

    def __str__(self) -> str:
        return f"{self.where} leaf {describe(self.key)}"


def _parse_aliases(raw: Any, nodes: Mapping[str, NodeInfo], where: str) -> dict[str, str]:
    """Optional (readers before it see empty checkpoint nodes): each alias is an empty checkpoint
    node naming a checkpoint node that is not itself an alias."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise _fail(where, "field 'aliases' is not an object of strings")
    for key, target in raw.items():
        alias, stored = nodes.get(key), nodes.get(target)
        if alias is None or alias.kind != CHECKPOINT_KIND or alias.keys:
            raise _fail(where, f"alias {describe(key)} is not an empty checkpoint node")
        if stored is None or stored.kind != CHECKPOINT_KIND or target in raw:
            raise _fail(where, f"alias {describe(key)} names {describe(target)}, which is not a stored checkpoint node")
    return dict(raw)


def _int_list(obj: Any, name: str, where: object, lo: int, hi: int, limit: int) -> list[int]:
    values = _get(obj, name, list, where)
    if len(values) > limit or not all(type(v) is int and lo <= v <= hi for v in values):
        raise _fail(where, f"field {name!r} is not a list of at most {limit} integers from {lo} to {hi}")
    return values


def _parse_meshes(body: dict[str, Any], where: str) -> list[MeshRecord]:
    """The device table (device id -> process) and the meshes over it (version 3, multi-process saves)."""
    if "meshes" not in body and "devices" not in body:
        return []
    table = _get(body, "devices", dict, where)
    ids = _int_list(table, "id", f"{where} devices", 0, 2**62, MAX_DEVICES)
    processes = _int_list(table, "process", f"{where} devices", 0, MAX_PROCESS, MAX_DEVICES)
    process_of = dict(zip(ids, processes))
    if len(ids) != len(processes) or len(process_of) != len(ids):
        raise _fail(where, "its device table has duplicate ids, or not one process per device")
    raw = _get(body, "meshes", list, where)
    if len(raw) > MAX_MESHES:
        raise _fail(where, f"it has over {MAX_MESHES} meshes")
    out = []
    for i, mesh in enumerate(raw):
        w = f"{where} meshes[{i}]"
        axes = _get(mesh, "axes", list, w)
        if len(axes) > MAX_RANK or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
            raise _fail(w, f"axes {axes!r} are not distinct names")
        shape = _int_list(mesh, "shape", w, 1, MAX_DEVICES, MAX_RANK)
        devices = _int_list(mesh, "devices", w, 0, 2**62, MAX_DEVICES)
        if len(shape) != len(axes) or math.prod(shape) != len(devices) or len(set(devices)) != len(devices):
            raise _fail(w, f"its {len(devices)} distinct devices do not fill shape {shape!r} of axes {axes!r}")
        try:
            owners = tuple(process_of[d] for d in devices)
        except KeyError as e:
            raise _fail(w, f"device {e.args[0]} is not in the device table") from None
        out.append(MeshRecord(tuple(axes), tuple(shape), tuple(devices), owners))
    return out


def _parse_layout(at: dict[str, Any], shape: list[int], meshes: list[MeshRecord], where: object) -> Layout:
    number = _get(at, "mesh", int, where)
    if not 0 <= number < len(meshes):
        raise _fail(where, f"mesh {number} is not one of the {len(meshes)} meshes of the checkpoint")
    mesh = meshes[number]
    raw = _get(at, "spec", list, where)
    if len(raw) != len(shape):
        raise _fail(where, f"spec {raw!r} does not have one entry per dimension of shape {tuple(shape)}")
    spec, used = [], []
    for axes, n in zip(raw, shape):
        axes = [] if axes is None else axes
        if not isinstance(axes, list) or not all(isinstance(a, str) and a in mesh.axes for a in axes):
            raise _fail(where, f"spec {raw!r} names axes that mesh {number} {mesh.axes!r} lacks")
        split = math.prod(mesh.shape[mesh.axes.index(a)] for a in axes)
        if n % split:
            raise _fail(where, f"spec {raw!r} splits a dimension of {n} into {split} uneven shards")
        spec.append(tuple(axes))
        used += axes
    if len(set(used)) != len(used):
        raise _fail(where, f"spec {raw!r} uses a mesh axis twice")
    return Layout(mesh, tuple(spec))


def _parse_nodes(raw: dict[str, Any], where: str) -> dict[str, NodeInfo]:
    nodes = {}
    for key, node in raw.items():
        w = f"{where} node {describe(key)}"
        kind = _get(node, "kind", str, w)
        if not is_node_kind(kind):
            raise _fail(w, f"unknown node kind {kind!r}")
        keys = _get(node, "keys", list, w)
        for k in keys:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise _fail(w, f"child key {k!r} is neither a string nor an integer")
        if len(set(map(repr, keys))) != len(keys):
            raise _fail(w, "duplicate child keys")
        nodes[key] = NodeInfo(kind, _get(node, "class", str, w), tuple(keys))
    return nodes


def _parse_pack(raw: Any, version: int, where: str) -> Pack:
    path = _get(raw, "path", str, where)
    if not _PACK_PATH.match(path):
        raise _fail(where, f"pack path {path!r} is not of the form 'p/<n>'")
    nbytes = _nonneg_int(raw, "nbytes", where)
    if version < 2:
        return Pack(path, nbytes)
    chunk = _nonneg_int(raw, "chunk", where)
    low, high = max(1, min(nbytes, records.MIN_PACK_CHUNK_BYTES)), max(1, min(nbytes, MAX_CHUNK_BYTES))
    if not low <= chunk <= high:  # jaxckpt cuts packs into chunks of 4 MiB, or one of the whole pack
        raise _fail(where, f"chunk of {chunk} bytes does not fit a pack of {nbytes} bytes ({low:,} to {high:,})")
    return Pack(path, nbytes, chunk)


def _parse_chunks(raw: Any, shape: list[int], itemsize: int, version: int, where: object) -> tuple[int, ...]:
    """A chunk shape: one positive size per dimension, none larger than the array, within MAX_CHUNK_BYTES.
    From version 4 it is the shard shape: read in inner chunks (at most 8 MiB, or checked against the
    file's size before they are read), and padded up to less than twice the array where it is cut."""
    ok = isinstance(raw, list) and len(raw) == len(shape)
    if version >= 4:
        ok = ok and all(type(c) is int and 1 <= c <= 2 * max(1, n) for c, n in zip(raw, shape))
        shards = math.prod(-(-max(1, n) // c) for c, n in zip(raw, shape)) if ok else 0
        if ok and shards <= records.MAX_SHARDS:  # a save writes one shard per device at most
            return tuple(raw)
        raise _fail(where, f"shard shape {raw!r} does not fit shape {tuple(shape)} in {records.MAX_SHARDS:,} shards")
    ok = ok and all(type(c) is int and 1 <= c <= max(1, n) for c, n in zip(raw, shape))
    if not ok or math.prod(raw) * itemsize > MAX_CHUNK_BYTES:
        raise _fail(
            where, f"chunk shape {raw!r} does not fit shape {tuple(shape)} (or exceeds {MAX_CHUNK_BYTES} bytes)"
        )
    return tuple(raw)


def _depth(key: str) -> int:
    return key.count("/") + 1 if key else 0  # a "/" inside an edge is escaped, so each one separates two


def deepest(nodes: Mapping[str, NodeInfo]) -> str | None:
    """A node deeper than MAX_DEPTH (its children would be deeper still), or None."""
    return next((k for k in nodes if _depth(k) >= MAX_DEPTH), None)


def _parse_leaf(raw: Any, packs: list[Pack], meshes: list[MeshRecord], version: int, where: object) -> Leaf:
    kind = _get(raw, "type", str, where)
    if kind == "none":
        return ValueLeaf("none", None)
    if kind == "state":
        return ValueLeaf("state", _get(raw, "value", (dict, list, str, int, float, bool, type(None)), where))
    if kind == "state_bytes":
        try:
            return ValueLeaf("state_bytes", base64.b64decode(_get(raw, "value", str, where), validate=True))
        except (binascii.Error, ValueError):
            raise _fail(where, "state_bytes value is not base64 text") from None
    if kind == "state_per_process":
        states = _get(raw, "value", list, where)
        if not 1 <= len(states) <= MAX_PROCESS_STATES:
            raise _fail(where, f"state_per_process lists {len(states)} states, not 1 to {MAX_PROCESS_STATES}")
        parsed = []
        for state in states:  # one process's state each: never nested, never an array
            if _get(state, "type", str, where) not in STATE_TYPES:
                raise _fail(where, f"state_per_process lists a {state['type']!r} leaf, not a state")
            parsed.append(_parse_leaf(state, packs, meshes, version, where))
        return ValueLeaf("state_per_process", tuple(parsed))
    if is_scalar_type(kind):
        if kind == "float":
            value = _get(raw, "value", (int, float, str), where)
            if isinstance(value, str):
                if value not in ("nan", "inf", "-inf"):
                    raise _fail(where, f"float value {value!r}")
                value = float(value)
            try:
                return ValueLeaf(kind, float(value))
            except OverflowError:  # an integer beyond float's range
                raise _fail(where, f"float value of {len(str(value))} digits is out of range") from None
        return ValueLeaf(kind, _get(raw, "value", SCALAR_TYPES[kind], where))
    if kind not in ("array", "prng_key"):
        raise _fail(where, f"unknown leaf type {kind!r}")
    name = _get(raw, "dtype", str, where)
    if name not in DTYPES:
        raise _fail(where, f"unsupported dtype {name!r}")
    dtype = DTYPES[name]
    shape = _get(raw, "shape", list, where)
    if len(shape) > MAX_RANK or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _fail(where, f"shape {shape!r} is not a list of non-negative integers")
    if math.prod(d for d in shape if d) * dtype.itemsize >= records.MAX_ARRAY_SPAN:  # numpy's own limit, even if empty
        raise _fail(where, f"shape {tuple(shape)} of {name} is larger than any array can be (2**63 bytes)")
    container = _get(raw, "container", str, where)
    if not is_container(container):
        raise _fail(where, f"unknown container {container!r}")
    impl = _get(raw, "impl", str, where) if kind == "prng_key" else None
    if impl is not None:  # restores wrap the data as keys of this implementation: check it fits
        key_shape = prng_key_data_shape(impl)
        if key_shape is None:
            raise _fail(where, f"unknown PRNG implementation {impl!r}")
        if name != "uint32" or len(shape) < len(key_shape) or tuple(shape[len(shape) - len(key_shape) :]) != key_shape:
            raise _fail(where, f"{impl} key data must be uint32 of shape (..., {', '.join(map(str, key_shape))})")
    sharding = raw.get("sharding")
    if sharding is not None and not isinstance(sharding, str):
        raise _fail(where, "field 'sharding' is not a string")
    at_raw = _get(raw, "at", dict, where)
    nbytes = math.prod(shape) * dtype.itemsize
    at: InArray | InPack
    if "array" in at_raw:
        path = _get(at_raw, "array", str, where)
        if not _ARRAY_PATH.match(path):
            raise _fail(where, f"array path {path!r} is not of the form 'a/<n>'")
        stored = _get(at_raw, "stored", str, where)
        if stored not in DTYPES or DTYPES[stored].itemsize != dtype.itemsize:
            raise _fail(where, f"stored dtype {stored!r} does not fit dtype {name!r}")
        chunks = None if version < 2 else _parse_chunks(at_raw.get("chunks"), shape, dtype.itemsize, version, where)
        layout = None
        if version >= 3 and ("mesh" in at_raw or "spec" in at_raw):
            if "regions" in at_raw:
                raise _fail(where, "it has both a sharding layout and explicit regions")
            layout = _parse_layout(at_raw, shape, meshes, where)
        at = InArray(path, stored, _parse_regions(at_raw.get("regions"), shape, where), chunks, layout)
    else:
        pack = _nonneg_int(at_raw, "pack", where)
        offset = _nonneg_int(at_raw, "offset", where)
        size = _nonneg_int(at_raw, "nbytes", where)
        if pack >= len(packs) or offset + size > packs[pack].nbytes:
            raise _fail(where, f"bytes {offset}..{offset + size} lie outside pack {pack}")
        if size != nbytes:
            raise _fail(where, f"{size} stored bytes cannot hold shape {tuple(shape)} of {name}")
        at = InPack(pack, offset, size, _nonneg_int(at_raw, "crc32c" if version >= 4 else "crc32", where))
    return ArrayLeaf(dtype, tuple(shape), container, at, impl, sharding)


def _parse_regions(raw: Any, shape: list[int], where: object) -> dict[str, list[list[tuple[int, int]]]] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _fail(where, "field 'regions' is not an object")
    out: dict[str, list[list[tuple[int, int]]]] = {}
    for store, regions in raw.items():
        if not _STORE.match(store):
            raise _fail(where, f"data store {store!r} is not of the form 'data' or 'data.p<n>'")
        if not isinstance(regions, list):
            raise _fail(where, f"regions of {store!r} are not a list")
        parsed = []
        for region in regions:
            ok = isinstance(region, list) and len(region) == len(shape)
            ok = ok and all(
                isinstance(r, list) and len(r) == 2 and all(type(v) is int for v in r) and 0 <= r[0] <= r[1] <= n
                for r, n in zip(region, shape)
            )
            if not ok:
                raise _fail(where, f"region {region!r} of {store!r} does not lie within shape {tuple(shape)}")
            parsed.append([(a, b) for a, b in region])
        out[store] = parsed
    if problem := records.tiling_problem([box for boxes in out.values() for box in boxes], shape):
        raise _fail(where, f"{problem}: they must hold every element of shape {tuple(shape)} exactly once")
    return out


def _check_graph(nodes: dict[str, NodeInfo], leaves: dict[str, Leaf], where: str) -> None:
    """Every node and leaf is reachable from the root exactly once, and nothing is both."""
    if "" not in nodes and "" not in leaves:
        raise _fail(where, "it has no root")
    both = nodes.keys() & leaves.keys()
    if both:
        raise _fail(where, f"{describe(min(both))} is both a node and a leaf")
    seen_nodes, seen_leaves = 0, 0
    stack = [""]
    while stack:
        key = stack.pop()
        info = nodes.get(key)
        if info is None:
            if key not in leaves:
                raise _fail(where, f"{describe(key)} is listed as a child but has no entry")
            seen_leaves += 1
            continue
        seen_nodes += 1
        if seen_nodes > len(nodes):
            raise _fail(where, "the node graph has a cycle")
        stack.extend(child_keys(key, info))
    if seen_nodes != len(nodes) or seen_leaves != len(leaves):
        raise _fail(where, "it has entries that are not reachable from the root")
    too_deep = deepest(nodes)
    if too_deep is not None:
        raise _fail(where, f"its nodes are nested more than {MAX_DEPTH} levels deep ({describe(too_deep)[:100]}...)")


def parse_leaves(
    records: dict[str, Any], packs: list[Pack], version: int, full: Callable[[str, Any], Leaf]
) -> dict[str, Leaf]:
    """``{key: leaf}`` of an index's ``"leaves"`` object; ``full(key, record)`` parses one in full."""
    crc = "crc32c" if version >= 4 else "crc32"
    # A kind -> (dtype, shape, container, bytes) of its leaves, or None where they are not packed arrays.
    kinds: dict[tuple[Any, ...], tuple[Any, tuple[int, ...], Any, int] | None] = {}
    leaves: dict[str, Leaf] = {}
    for key, raw in records.items():
        kind = _kind(raw)
        if kind is not None:
            like = kinds.get(kind)
            if like is not None:
                at = raw["at"]
                pack, offset, size, checksum = at.get("pack"), at.get("offset"), at.get("nbytes"), at.get(crc)
                if (
                    type(pack) is int
                    and type(offset) is int
                    and type(size) is int
                    and type(checksum) is int
                    and 0 <= pack < len(packs)
                    and offset >= 0
                    and checksum >= 0
                    and size == like[3]
                    and offset + size <= packs[pack].nbytes
                ):
                    leaves[key] = ArrayLeaf(like[0], like[1], like[2], InPack(pack, offset, size, checksum))
                    continue
        leaf = leaves[key] = full(key, raw)
        if kind is not None and kind not in kinds:
            kinds[kind] = None
            if isinstance(leaf, ArrayLeaf) and isinstance(leaf.at, InPack) and not leaf.prng_impl and not leaf.sharding:
                kinds[kind] = (leaf.dtype, leaf.shape, leaf.container, leaf.nbytes)
    return leaves


def _kind(raw: Any) -> tuple[Any, ...] | None:
    """A packed array record's dtype, container and shape, or None for any other record."""
    if type(raw) is not dict or len(raw) != 5 or raw.get("type") != "array":
        return None
    at, shape, dtype, container = raw.get("at"), raw.get("shape"), raw.get("dtype"), raw.get("container")
    if type(at) is not dict or len(at) != 4 or "array" in at or type(shape) is not list:
        return None
    if type(dtype) is not str or type(container) is not str or not all(type(d) is int for d in shape):
        return None
    return (dtype, container, *shape)
