"""An index's leaf records parsed, the record of a small packed array in short.

With many leaves, most records are small arrays in packs that differ only in where their bytes are
(``{"type": "array", "dtype", "shape", "container", "at": {"pack", "offset", "nbytes", "crc32c"}}``).
The dtype, shape and container of such a record are validated in full once per kind (by the full
parser, ``full``), and each further record of that kind has only its place checked here: its four
integers, its bytes within its pack, and its size that of its shape. Every other record, and any
record that fails these checks (so that the full parser names what is wrong), goes through ``full``.
Records of one kind share their shape tuple, which a million leaves otherwise each hold a copy of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxckpt._format import ArrayLeaf, InPack, Leaf, Pack


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
