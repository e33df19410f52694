"""The index as JSON, written: :func:`encode_index` (:mod:`jaxckpt.format.index_json` parses it).

The file is canonical compact JSON (keys sorted, ``,`` and ``:``, UTF-8) with its CRC-32 in front
(:mod:`jaxckpt.format.checked_json`); docs/format.md is the specification. Most leaves of a many-leaf
checkpoint are small arrays in packs, whose records differ only in their numbers: each is written
here as one string from a template, byte for byte what ``json.dumps`` writes for its record (the
tests compare the two), without making the record's three dicts and a list first. For 10,000 leaves
that halves the index's cost; for a million it spares about 700 MB of short-lived objects.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from json.encoder import encode_basestring
from typing import Any

from jaxckpt._errors import UnsupportedValueError
from jaxckpt._gc_pause import gc_paused
from jaxckpt.format.checked_json import CHECKSUM_SLOT, canonical_text, fill_checksum
from jaxckpt.format.index_json import deepest
from jaxckpt.format.keys import describe
from jaxckpt.format.records import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_DEPTH,
    PLAIN_VERSION,
    ArrayLeaf,
    InArray,
    Index,
    InPack,
    Leaf,
    ValueLeaf,
    dtype_name,
)


def _float_to_json(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)  # "nan", "inf", "-inf"


def leaf_to_json(leaf: Leaf, meshes: Mapping[int, int]) -> dict[str, Any]:
    """A leaf's record as the index holds it (``meshes``: each mesh's number, by the mesh's id)."""
    if isinstance(leaf, ValueLeaf):
        value = _float_to_json(leaf.value) if leaf.type == "float" else leaf.value
        if leaf.type == "state_bytes":
            value = base64.b64encode(leaf.value).decode("ascii")
        elif leaf.type == "state_per_process":  # each process's state, in process order
            value = [leaf_to_json(state, meshes) for state in leaf.value]
        return {"type": leaf.type, "value": value}
    out: dict[str, Any] = {
        "type": "prng_key" if leaf.prng_impl else "array",
        "dtype": dtype_name(leaf.dtype),
        "shape": list(leaf.shape),
        "container": leaf.container,
    }
    if leaf.prng_impl:
        out["impl"] = leaf.prng_impl
    if leaf.sharding:
        out["sharding"] = leaf.sharding
    at = leaf.at
    if isinstance(at, InArray):
        out["at"] = {"array": at.path, "stored": at.stored}
        if at.chunks is not None:
            out["at"]["chunks"] = list(at.chunks)
        if at.layout is not None:
            out["at"]["mesh"] = meshes[id(at.layout.mesh)]
            out["at"]["spec"] = [list(axes) or None for axes in at.layout.spec]
        if at.regions is not None:
            out["at"]["regions"] = {
                store: [[list(r) for r in region] for region in regions] for store, regions in at.regions.items()
            }
    elif isinstance(at, InPack):
        out["at"] = {"pack": at.pack, "offset": at.offset, "nbytes": at.nbytes, "crc32c": at.checksum}
    else:
        raise TypeError(f"{leaf!r} is in another library's checkpoint; a jaxckpt index cannot refer to it")
    return out


class _PackedLeaves:
    """Records of packed array leaves as text: the part after each leaf's numbers, by the leaf's
    dtype, shape, container and sharding (a model has few of those), is made once by ``json.dumps``."""

    def __init__(self) -> None:
        self._tails: dict[tuple[Any, ...], str] = {}

    def text(self, leaf: ArrayLeaf, at: InPack) -> str:
        # The record's keys sorted: at (crc32c, nbytes, offset, pack), container, dtype, shape,
        # sharding, type. Its numbers are Python ints (json.dumps writes int.__repr__; bool is refused).
        crc, nbytes, offset, pack = numbers = (at.checksum, at.nbytes, at.offset, at.pack)
        kind = (leaf.dtype, leaf.shape, leaf.container, leaf.sharding)
        tail = self._tails.get(kind)
        if tail is None and all(type(n) is int for n in leaf.shape):
            record = canonical_text({k: v for k, v in leaf_to_json(leaf, {}).items() if k != "at"})
            tail = self._tails[kind] = "}," + record[1:]
        if tail is None or not all(type(n) is int for n in numbers):  # as json.dumps writes (or refuses) it
            return canonical_text(leaf_to_json(leaf, {}))
        return f'{{"at":{{"crc32c":{crc},"nbytes":{nbytes},"offset":{offset},"pack":{pack}{tail}'


_BATCH = 4096  # records joined and encoded at a time: a few hundred kB, still in cache


def _add_leaves(out: bytearray, leaves: Mapping[str, Leaf], meshes: Mapping[int, int]) -> None:
    """The ``leaves`` object as canonical JSON, encoded onto ``out``: what ``canonical_text`` makes of
    each leaf's record, joined and encoded a batch at a time rather than as one string copied whole."""
    packed = _PackedLeaves()
    out += b"{"
    start = len(out)
    batch: list[str] = []
    for key in sorted(leaves):  # json.dumps sorts the items: the keys differ, so by key alone
        leaf = leaves[key]
        at = getattr(leaf, "at", None)
        if type(at) is InPack and type(leaf) is ArrayLeaf and not leaf.prng_impl:
            record = packed.text(leaf, at)
        else:
            record = canonical_text(leaf_to_json(leaf, meshes))
        batch.append(f"{encode_basestring(key)}:{record}")
        if len(batch) == _BATCH:
            _join_onto(out, start, batch)
    _join_onto(out, start, batch)
    out += b"}"


def _join_onto(out: bytearray, start: int, records: list[str]) -> None:
    """Append ``records`` to ``out``, after a comma unless they are the first (at ``start``); empty it."""
    if records:
        out += b"," if len(out) > start else b""
        out += ",".join(records).encode()
        records.clear()


@gc_paused
def encode_index(index: Index) -> bytearray:
    """The index file: compact canonical JSON with a crc32 of itself (without the checksum field)."""
    too_deep = deepest(index.nodes)
    if too_deep is not None:
        raise UnsupportedValueError(
            f"Cannot save the values below {describe(too_deep)[:80]}...: they are nested more than {MAX_DEPTH} levels "
            f"deep, and jaxckpt restores trees of at most {MAX_DEPTH} levels. Flatten the structure."
        )
    meshes = {id(m): i for i, m in enumerate(index.meshes)}
    body: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION if index.refs else PLAIN_VERSION,
        "metadata": index.metadata,
        "nodes": {k: {"kind": n.kind, "class": n.cls, "keys": list(n.keys)} for k, n in index.nodes.items()},
        "packs": [{"path": p.path, "nbytes": p.nbytes, "chunk": p.chunk} for p in index.packs],
    }
    if index.meshes:  # the device table once, then each mesh by device ids
        table = dict(sorted({d: p for m in index.meshes for d, p in zip(m.devices, m.processes)}.items()))
        body["devices"] = {"id": list(table), "process": list(table.values())}
        body["meshes"] = [
            {"axes": list(m.axes), "shape": list(m.shape), "devices": list(m.devices)} for m in index.meshes
        ]
    if index.aliases:
        body["aliases"] = dict(index.aliases)
    if index.save is not None:
        body["save"] = index.save
    # The body's fields in key order, "leaves" among them: as json.dumps(sort_keys=True) puts them.
    # Encoded straight after the checksum's slot, so that the file is made in one buffer.
    out = bytearray(CHECKSUM_SLOT)
    for i, key in enumerate(sorted([*body, "leaves"])):
        out += f"{',' if i else ''}{encode_basestring(key)}:".encode()
        if key == "leaves":
            _add_leaves(out, index.leaves, meshes)
        else:
            out += canonical_text(body[key]).encode()
    out += b"}"
    return fill_checksum(out)
