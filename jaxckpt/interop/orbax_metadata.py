"""Orbax's metadata files, read and checked before anything else is: JSON files read whole with a
size limit (``_METADATA``, ``_CHECKPOINT_METADATA``, JSON items, ``_strings.json``, ``_sharding``),
and the zarr metadata of each array (``.zarray`` for zarr v2, ``zarr.json`` for zarr3) checked to
use only what Orbax writes, so that TensorStore is handed metadata whose every field was looked at.
:mod:`.orbax` builds the tree and reads arrays with these; see its docstring for what is checked.
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import json
import math
import os
import stat
from typing import Any

import numpy as np

from jaxckpt._errors import CheckpointFormatError, StorageError
from jaxckpt.format.records import DTYPES, MAX_RANK, ArrayLeaf, prng_key_data_shape

# Size limits of the JSON files read whole: far above what real checkpoints hold (_METADATA takes
# about 300 bytes a leaf), low enough that a crafted file cannot exhaust memory.
METADATA_LIMIT = 256 << 20
ZARR_METADATA_LIMIT = 1 << 20
MAX_ARRAY_BYTES = 1 << 40

_ZARR2_COMPRESSORS = frozenset({"zstd", "gzip", "zlib", "blosc"})
_ZARR3_CODECS = frozenset({"bytes", "zstd", "gzip", "blosc", "crc32c"})
_ZARR2_FIELDS = frozenset(
    {"zarr_format", "shape", "chunks", "dtype", "compressor", "fill_value", "order", "filters", "dimension_separator"}
)
_ZARR3_FIELDS = frozenset(
    {"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs", "fill_value"}
    | {"attributes", "dimension_names", "storage_transformers"}
)


def read_json(file: str, limit: int, what: str) -> Any:
    """The JSON in ``file`` (at most ``limit`` bytes), or None if there is no such file."""
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):  # a FIFO would block, a device never end
            raise CheckpointFormatError(f"{what} ({file!r}) is not a regular file: it is damaged or crafted.")
        with builtins.open(file, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageError(f"Cannot read {what} ({file!r}): {e}", e.errno) from e
    if len(data) > limit:
        raise CheckpointFormatError(f"{what} ({file!r}) is larger than {limit} bytes: it is damaged or crafted.")
    return parse_json(data, f"{what} ({file!r})")


def parse_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointFormatError(f"{what} is not valid JSON: {e}") from e


def malformed(what: str, expected: str, found: Any) -> CheckpointFormatError:
    return CheckpointFormatError(f"{what}: expected {expected}, found {str(found)[:200]!r}. It is damaged or crafted.")


def int_tuple(value: Any, what: str, field: str, minimum: int = 0) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_RANK
        or not all(type(v) is int and v >= minimum for v in value)  # bool is not a size
    ):
        raise malformed(what, f"{field} as a list of at most {MAX_RANK} integers >= {minimum}", value)
    return tuple(value)


def _dtype(name: Any, what: str, zarr3: bool) -> np.dtype:
    """The numpy dtype of a zarr ``dtype`` (v2: ``<f4``, ``|b1``, or TensorStore's ``bfloat16``...)
    or ``data_type`` (v3: ``float32``, ``bfloat16``)."""
    if isinstance(name, str) and name in DTYPES and (zarr3 or DTYPES[name].kind == "V"):  # ml_dtypes: kind V
        return DTYPES[name]
    if isinstance(name, str) and not zarr3 and len(name) >= 3 and name[0] in "<|" and name[1] in "biufc":
        try:
            dtype = np.dtype(name)
        except TypeError:
            dtype = None
        if dtype is not None and dtype in DTYPES.values() and dtype.byteorder in "=|":
            return dtype
    raise malformed(what, "a numeric dtype (little-endian) that jaxckpt knows", name)


def _check_size(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    if len(chunks) != len(shape) or any(c > max(1, n) for c, n in zip(chunks, shape)):
        raise malformed(what, f"chunks of rank {len(shape)}, each at most the shape {shape}", chunks)
    if math.prod(shape) * dtype.itemsize > MAX_ARRAY_BYTES:
        raise CheckpointFormatError(
            f"{what}: the array of shape {shape} and dtype {dtype.name} would take more than {MAX_ARRAY_BYTES} "
            "bytes. It is damaged or crafted."
        )


def zarr2_array(meta: Any, what: str) -> tuple[np.dtype, tuple[int, ...]]:
    if not isinstance(meta, dict) or meta.get("zarr_format") != 2:
        raise malformed(what, "zarr v2 metadata (a JSON object with zarr_format 2)", meta)
    unknown = set(meta) - _ZARR2_FIELDS
    if unknown:
        raise malformed(what, f"only the fields {sorted(_ZARR2_FIELDS)}", sorted(unknown))
    shape = int_tuple(meta.get("shape"), what, "shape")
    chunks = int_tuple(meta.get("chunks"), what, "chunks", minimum=1)
    dtype = _dtype(meta.get("dtype"), what, zarr3=False)
    compressor = meta.get("compressor")
    if compressor is not None and (not isinstance(compressor, dict) or compressor.get("id") not in _ZARR2_COMPRESSORS):
        raise malformed(what, f"no compressor or one of {sorted(_ZARR2_COMPRESSORS)}", compressor)
    if meta.get("filters") not in (None, []):
        raise malformed(what, "no filters", meta.get("filters"))
    if meta.get("order", "C") != "C":
        raise malformed(what, "order 'C'", meta.get("order"))
    if meta.get("dimension_separator", ".") not in (".", "/"):
        raise malformed(what, "dimension_separator '.' or '/'", meta.get("dimension_separator"))
    _check_size(shape, chunks, dtype, what)
    return dtype, shape


def _codecs(codecs: Any, what: str, shape: tuple[int, ...], chunks: tuple[int, ...], nested: bool) -> None:
    if not isinstance(codecs, list) or not codecs or len(codecs) > 8:
        raise malformed(what, "a list of codecs", codecs)
    for codec in codecs:
        name = codec.get("name") if isinstance(codec, dict) else None
        if name == "sharding_indexed" and not nested:
            config = codec.get("configuration")
            if not isinstance(config, dict):
                raise malformed(what, "a configuration of the sharding_indexed codec", codec)
            inner = int_tuple(config.get("chunk_shape"), what, "the sharded chunk_shape", minimum=1)
            _check_size(chunks, inner, np.dtype("uint8"), what)
            _codecs(config.get("codecs"), what, shape, inner, nested=True)
            _codecs(config.get("index_codecs"), what, shape, inner, nested=True)
        elif name not in _ZARR3_CODECS:
            raise malformed(what, f"codecs among {sorted(_ZARR3_CODECS | {'sharding_indexed'})}", codec)


def zarr3_array(meta: Any, what: str) -> tuple[np.dtype, tuple[int, ...]]:
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type", "array") != "array":
        raise malformed(what, "zarr3 array metadata (a JSON object with zarr_format 3)", meta)
    unknown = set(meta) - _ZARR3_FIELDS
    if unknown:
        raise malformed(what, f"only the fields {sorted(_ZARR3_FIELDS)}", sorted(unknown))
    shape = int_tuple(meta.get("shape"), what, "shape")
    dtype = _dtype(meta.get("data_type"), what, zarr3=True)
    grid = meta.get("chunk_grid")
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(grid.get("configuration"), dict):
        raise malformed(what, "a regular chunk_grid", grid)
    chunks = int_tuple(grid["configuration"].get("chunk_shape"), what, "chunk_shape", minimum=1)
    encoding = meta.get("chunk_key_encoding")
    if not isinstance(encoding, dict) or encoding.get("name") not in ("default", "v2"):
        raise malformed(what, "the chunk_key_encoding 'default' or 'v2'", encoding)
    if meta.get("storage_transformers") not in (None, []):
        raise malformed(what, "no storage_transformers", meta.get("storage_transformers"))
    _check_size(shape, chunks, dtype, what)
    _codecs(meta.get("codecs"), what, shape, chunks, nested=False)
    return dtype, shape


def sharding_table(folder: str) -> dict[str, str]:
    """How each array was sharded when saved, by Orbax name, as jaxckpt describes it
    (``NamedSharding(mesh={'data': 4}, spec=('data', None))``), from the item's ``_sharding`` file.
    Informational only (reading never depends on it), so a file that does not parse is ignored."""
    try:
        table = read_json(os.path.join(folder, "_sharding"), METADATA_LIMIT, "Orbax's sharding table")
    except CheckpointFormatError:
        return {}
    out: dict[str, str] = {}
    for encoded, text in table.items() if isinstance(table, dict) else ():
        try:
            name = base64.b64decode(encoded, validate=True).decode("utf-8")
            record = json.loads(text)
            if record.get("sharding_type") != "NamedSharding":
                continue
            mesh = dict(zip(record["axis_names"], record["shape"], strict=True))
            if math.prod(mesh.values()) > 1 and all(isinstance(n, str) and type(k) is int for n, k in mesh.items()):
                spec = tuple(tuple(p) if isinstance(p, list) else p for p in record["partition_spec"])
                out[name] = f"NamedSharding(mesh={mesh}, spec={spec})"[:1000]
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            continue
    return out


def leaf_name(edges: list[str], what: str) -> str:
    """The Orbax name of a leaf, which is also its folder (or key prefix) in the item: kept inside it."""
    name = ".".join(edges)
    parts = name.split("/")
    if not name or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise malformed(what, "a leaf name that stays inside the checkpoint's folder", name)
    return name


ARRAY_METADATAS = "array_metadatas"  # per process: each array's write shape and ext_metadata
_MAX_PROCESS_FILES = 4096


def prng_impls(folder: str) -> dict[str, str]:
    """The PRNG implementation of each typed key array of an item, by Orbax name: Orbax stores a key
    array as its raw key data (uint32) and names the implementation in the ``ext_metadata``
    (``{"random_key_impl": "threefry2x32"}``) of its entry in ``array_metadatas/process_<i>``.
    Absent files (older Orbax, which did not save typed keys) give no keys."""
    where = os.path.join(folder, ARRAY_METADATAS)
    try:
        names = sorted(n for n in os.listdir(where) if n.startswith("process_"))[:_MAX_PROCESS_FILES]
    except OSError:
        return {}
    out: dict[str, str] = {}
    for name in names:
        file = os.path.join(where, name)
        listing = read_json(file, METADATA_LIMIT, "Orbax's array metadata")
        records = listing.get("array_metadatas") if isinstance(listing, dict) else None
        if not isinstance(records, list):
            raise malformed(repr(file), "a JSON object with the list 'array_metadatas'", listing)
        for record in records:
            meta = record.get("array_metadata") if isinstance(record, dict) else None
            if not isinstance(meta, dict):
                continue
            ext = meta.get("ext_metadata")
            if not isinstance(ext, dict) or "random_key_impl" not in ext:
                continue
            param, impl = meta.get("param_name"), ext["random_key_impl"]
            if not isinstance(param, str) or not isinstance(impl, str) or len(impl) > 100:
                raise malformed(repr(file), "a param_name and a random_key_impl as strings", record)
            out[param] = impl
    return out


def prng_leaf(leaf: ArrayLeaf, impl: str, what: str) -> ArrayLeaf:
    """``leaf``, an array of raw key data, as a typed PRNG key array of ``impl``; its data must have
    the shape and dtype that implementation's keys have (JAX's registry of implementations knows)."""
    data_shape = prng_key_data_shape(impl)
    if data_shape is None:
        raise CheckpointFormatError(
            f"{what}: Orbax recorded it as a PRNG key array of the implementation {impl!r}, which is not registered "
            "with JAX here; register it (jax.extend.random) before restoring."
        )
    if leaf.dtype != np.uint32 or leaf.shape[len(leaf.shape) - len(data_shape) :] != data_shape:
        raise CheckpointFormatError(
            f"{what}: Orbax recorded it as a PRNG key array of {impl!r}, whose key data is uint32 of trailing shape "
            f"{data_shape}, but its array is {leaf.dtype.name} of shape {leaf.shape}. It is damaged or crafted."
        )
    return dataclasses.replace(leaf, prng_impl=impl)
