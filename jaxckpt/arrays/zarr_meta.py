"""The geometry and metadata of format version 4's zarr3 arrays (see :mod:`jaxckpt.arrays.zarr_local`):
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


# Candidate divisors tried at once (see :func:`_divisor`).
_BLOCK = 1 << 16


def _remainders(n: int, candidates: np.ndarray) -> np.ndarray:
    """``n`` modulo each of ``candidates`` (uint64, each below 2**25), for any ``n``: beyond uint64
    (never from a parsed index), taken 32 bits at a time, so that no intermediate value leaves it."""
    if n < 1 << 64:
        return np.uint64(n) % candidates
    r = np.zeros_like(candidates)
    for shift in range(32 * ((n.bit_length() - 1) // 32), -1, -32):
        r = ((r << np.uint64(32)) | np.uint64((n >> shift) & 0xFFFFFFFF)) % candidates
    return r


def _divisor(n: int, rows: int) -> int | None:
    """The largest divisor of ``n`` from ``rows / _TOO_FINE`` to ``rows`` (None: there is none): the
    rows along the cut dimension an inner chunk holds. Searched among these candidates, largest
    first, or among their cofactors ``n / d``, smallest first, whichever are fewer (at most 7/8 of
    ``rows``, which is at most 2**23), a block at a time: a crafted dimension of 2**62 costs at most
    tens of milliseconds, not the 2**31 steps of a search up to its square root."""
    lo, hi = -(-rows // _TOO_FINE), min(rows, n)
    if lo > hi:
        return None
    co_lo, co_hi = -(-n // hi), n // lo  # the cofactors of divisors from lo to hi
    if min(hi - lo, co_hi - co_lo) < _BLOCK >> 8:  # too few for numpy's overhead to pay
        if hi - lo <= co_hi - co_lo:
            return next((d for d in range(hi, lo - 1, -1) if n % d == 0), None)
        return next((n // e for e in range(co_lo, co_hi + 1) if n % e == 0), None)
    if hi - lo <= co_hi - co_lo:
        for top in range(hi, lo - 1, -_BLOCK):
            candidates = np.arange(max(lo, top - _BLOCK + 1), top + 1, dtype=np.uint64)
            hits = np.flatnonzero(_remainders(n, candidates) == 0)
            if hits.size:
                return int(candidates[hits[-1]])
    else:  # fewer cofactors than candidates: then co_hi < 8/3 (co_hi - co_lo + 1), below 2**25
        for start in range(co_lo, co_hi + 1, _BLOCK):
            candidates = np.arange(start, min(co_hi, start + _BLOCK - 1) + 1, dtype=np.uint64)
            hits = np.flatnonzero(_remainders(n, candidates) == 0)
            if hits.size:
                return n // int(candidates[hits[0]])
    return None


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
            divisor = _divisor(chunk[i], rows)
            if divisor is not None:
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
        if shard[i] > rows and _divisor(shard[i], rows) is None:
            shard[i] = -(-shard[i] // rows) * rows
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


def shard_number(position: Sequence[int], shape: Sequence[int], shard: Sequence[int]) -> int:
    """The number of the shard at grid ``position`` of an array of ``shape`` in shards of ``shard``:
    C order over the grid of ``ceil(shape / shard)`` shards (how format 5's checksums name shards)."""
    grid = [-(-n // s) for n, s in zip(shape, shard)]
    return int(np.ravel_multi_index(position, grid)) if len(position) else 0


def chunk_key(position: Sequence[int]) -> str:
    """The key of the shard at grid ``position`` (zarr3's default key encoding)."""
    return "/".join(["c", *map(str, position)])
