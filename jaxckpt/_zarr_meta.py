"""The geometry and metadata of format version 4's zarr3 arrays (see :mod:`jaxckpt._zarr_local`):
how a shard is cut into inner chunks, how large a shard is, and the ``zarr.json`` that says so.
Part of the format: readers derive the inner chunks from the shard shape the index records."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

# Inner chunks hold at most this many bytes: the unit checked by one checksum, and read whole when
# a read wants only part of it.
INNER_CHUNK_LIMIT = 8 << 20
# A split dimension whose best divisor gives chunks this many times smaller than the limit is not
# split that way (see :func:`inner_chunk_shape`).
_TOO_FINE = 8
_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CODECS = [_BYTES, {"name": "crc32c"}]


def _largest_divisor(n: int, at_most: int) -> int:
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if best < c <= at_most:
                    best = c
    return best


def _cut(shard: Sequence[int], itemsize: int) -> tuple[int, int] | None:
    """Where a shard is cut into inner chunks: the first dimension one step along which (a *row*) is
    at most INNER_CHUNK_LIMIT bytes (the dimensions before it are cut into 1s), and how many rows of
    it a chunk may hold; None for rank 0."""
    for i in range(len(shard)):
        row = math.prod(shard[i + 1 :]) * itemsize
        if row <= INNER_CHUNK_LIMIT:
            return i, INNER_CHUNK_LIMIT // row
    return None


def inner_chunk_shape(shard: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The inner chunks of a shard: it is cut along its leading dimensions only, so that each inner
    chunk is contiguous in a C-order shard, into pieces of at most INNER_CHUNK_LIMIT bytes. Along the
    dimension cut, the largest divisor of its size that fits; if that divisor is more than
    ``_TOO_FINE`` times too small (a prime size), the rest of the shard is one chunk instead.
    Part of the format: readers derive the chunks from the shard shape the index records."""
    chunk = [max(1, n) for n in shard]
    cut = _cut(chunk, itemsize)
    if cut is not None:
        i, rows = cut
        chunk[:i] = [1] * i
        if chunk[i] > rows:
            divisor = _largest_divisor(chunk[i], rows)
            if divisor * _TOO_FINE >= rows:
                chunk[i] = divisor
    return tuple(chunk)


def shard_shape(shape: Sequence[int], region: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The outer chunk (shard) of an array of ``shape`` whose regions are ``region`` in size. An array
    stored whole (one region) may have a shard larger than itself: where its size along the dimension
    cut is prime, the shard is padded to a multiple of a good chunk instead of being one chunk of any
    size."""
    shard = [max(1, n) for n in region]
    cut = _cut(shard, itemsize) if shard == [max(1, n) for n in shape] else None
    if cut is not None:
        i, rows = cut
        if shard[i] > rows and _largest_divisor(shard[i], rows) * _TOO_FINE < rows:
            shard[i] = -(-shard[i] // rows) * rows
    return tuple(shard)
    for i in range(len(shard)):
        row = math.prod(shard[i + 1 :]) * itemsize
        if shard[i] * row <= INNER_CHUNK_LIMIT or row > INNER_CHUNK_LIMIT:
            if shard[i] * row <= INNER_CHUNK_LIMIT:
                break
            continue
        want = INNER_CHUNK_LIMIT // row
        if _largest_divisor(shard[i], want) * _TOO_FINE < want:
            shard[i] = -(-shard[i] // want) * want
        break
    return tuple(shard)


def numpy_dtype(stored: str) -> np.dtype:
    """The numpy dtype of a zarr3 data type name (ml_dtypes' for ``bfloat16``, ``float8_*``, ``int4``...)."""
    try:
        return np.dtype(getattr(ml_dtypes, stored)) if hasattr(ml_dtypes, stored) else np.dtype(stored)
    except TypeError:
        raise ValueError(f"unknown data type {stored!r}") from None


def _fill_value(stored: str) -> Any:
    """Zero, as zarr3 writes it for the data type: ``false``, ``[0.0, 0.0]``, ``0`` or ``0.0``."""
    if stored == "bool":
        return False
    if stored.startswith("complex"):
        return [0.0, 0.0]
    return 0 if stored.startswith(("int", "uint")) else 0.0


def pack_shard(nbytes: int, chunk: int) -> int:
    """The one shard of a pack of ``nbytes`` bytes in inner chunks of ``chunk`` bytes."""
    return -(-nbytes // chunk) * chunk if nbytes else chunk


def pack_metadata(nbytes: int, chunk: int) -> dict[str, Any]:
    """The zarr3 metadata of a pack: one shard, inner chunks of the index's ``chunk`` bytes, which
    carry no checksum: each leaf in it has its own CRC-32C in the index, so that damage costs only
    the leaves it hits."""
    return metadata([nbytes], "uint8", [pack_shard(nbytes, chunk)], 1, inner=[chunk], checksum=False)


def metadata(
    shape: Sequence[int],
    stored: str,
    shard: Sequence[int],
    itemsize: int,
    *,
    inner: Sequence[int] | None = None,
    checksum: bool = True,
) -> dict[str, Any]:
    """The zarr3 metadata (``zarr.json``) of an array in format version 4 (``inner``: the inner chunk
    shape, if not :func:`inner_chunk_shape`'s)."""
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": stored,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard)}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": _fill_value(stored),
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner_chunk_shape(shard, itemsize) if inner is None else inner),
                    "codecs": _CODECS if checksum else [_BYTES],
                    "index_codecs": _CODECS,
                },
            }
        ],
    }


def _as_written(sharding: dict[str, Any], one_byte: bool) -> dict[str, Any]:
    """A ``sharding_indexed`` codec as jaxckpt writes it, where another writer left out defaults: the
    index at the end, and (TensorStore, for 1-byte types) the endianness of ``bytes``."""
    config = sharding.get("configuration")
    if not isinstance(config, dict) or config.get("index_location", "end") != "end":
        return sharding
    config = {k: v for k, v in config.items() if k != "index_location"}
    if one_byte and isinstance(config.get("codecs"), list):
        config["codecs"] = [_BYTES if c == {"name": "bytes"} else c for c in config["codecs"]]
    return {**sharding, "configuration": config}


def metadata_problem(found: Any, expected: dict[str, Any]) -> str | None:
    """What in a ``zarr.json`` differs from the metadata the index implies (None: nothing). Fields
    that do not change which bytes are read (attributes, dimension names) may differ."""
    if not isinstance(found, dict):
        return "it is not a JSON object"
    one_byte = numpy_dtype(expected["data_type"]).itemsize == 1
    for field, value in expected.items():
        have = found.get(field)
        if field == "codecs" and isinstance(have, list) and len(have) == 1 and isinstance(have[0], dict):
            have = [_as_written(have[0], one_byte)]
        if field == "fill_value":
            if not (have == value and type(have) is not str):
                return f"its fill value is {have!r}, not {value!r}"
        elif have != value:
            return f"its {field!r} is {json.dumps(have)[:200]}, where the index implies {json.dumps(value)}"
    extra = set(found) - set(expected) - {"attributes", "dimension_names"}
    return f"it has unexpected fields {sorted(extra)}" if extra else None


def chunk_key(position: Sequence[int]) -> str:
    """The key of the shard at grid ``position`` (zarr3's default key encoding)."""
    return "/".join(["c", *map(str, position)])
