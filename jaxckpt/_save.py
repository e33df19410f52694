"""Saving: leaves become index records and array data, written into a staging folder and published."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import jax
import numpy as np

from jaxckpt import _arrayio, _storage
from jaxckpt._errors import UnsupportedValueError
from jaxckpt._format import (
    DATA_DIR,
    INDEX_FILE,
    JAX,
    NUMPY,
    NUMPY_SCALAR,
    ArrayLeaf,
    InArray,
    Index,
    InPack,
    Leaf,
    Pack,
    ValueLeaf,
    dtype_name,
    encode_index,
)
from jaxckpt._tree import Flat, describe, flatten, is_state_object
from jaxckpt._version import __version__


def describe_sharding(x: jax.Array) -> str | None:
    sharding = x.sharding
    if len(sharding.device_set) <= 1:
        return None
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"NamedSharding(mesh={dict(sharding.mesh.shape)}, spec={tuple(sharding.spec)})"
    return f"{type(sharding).__name__}({len(sharding.device_set)} devices)"


def _unsupported(key: str, x: Any, hint: str = "") -> UnsupportedValueError:
    t = type(x)
    return UnsupportedValueError(
        f"Cannot save {describe(key)}: values of type {t.__module__}.{t.__qualname__} are not supported. "
        + (hint or "Save arrays, Python scalars, str, None, pytrees of them, or objects with get_state()/set_state().")
    )


def _array_leaf(key: str, x: Any) -> tuple[ArrayLeaf, Any]:
    """The record of an array leaf (its location filled in later) and the data to store."""
    impl = None
    sharding = None
    if isinstance(x, jax.Array):
        container = JAX
        sharding = describe_sharding(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
    elif isinstance(x, np.generic):
        container, x = NUMPY_SCALAR, np.asarray(x)
    else:
        container = NUMPY
    dtype = np.dtype(x.dtype)
    if dtype_name(dtype) is None:
        raise _unsupported(key, x, f"Its dtype {dtype} cannot be stored; convert it to a numeric dtype.")
    return ArrayLeaf(dtype, tuple(x.shape), container, InArray("", ""), impl, sharding), x


def _value_leaf(key: str, x: Any) -> ValueLeaf | None:
    if x is None:
        return ValueLeaf("none", None)
    if isinstance(x, bool):
        return ValueLeaf("bool", x)
    if isinstance(x, int):
        return ValueLeaf("int", int(x))
    if isinstance(x, float):
        return ValueLeaf("float", float(x))
    if isinstance(x, str):
        return ValueLeaf("str", str(x))
    if is_state_object(x):
        state = x.get_state()
        try:
            json.dumps(state, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise UnsupportedValueError(
                f"Cannot save {describe(key)}: {type(x).__name__}.get_state() returned a value that is not JSON ({e}). "
                "Return dicts, lists, str, int, finite floats, bool and None."
            ) from e
        return ValueLeaf("state", state)
    return None


class _Packer:
    """Lays small leaves end to end into packs of about PACK_TARGET_BYTES each."""

    def __init__(self) -> None:
        self.packs: list[list[tuple[int, np.ndarray]]] = []
        self.sizes: list[int] = []

    def add(self, data: np.ndarray) -> InPack:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if not self.packs or self.sizes[-1] + raw.size > _arrayio.PACK_TARGET_BYTES:
            self.packs.append([])
            self.sizes.append(0)
        offset = -(-self.sizes[-1] // _arrayio.PACK_ALIGN) * _arrayio.PACK_ALIGN
        self.packs[-1].append((offset, raw))
        self.sizes[-1] = offset + raw.size
        return InPack(len(self.packs) - 1, offset, raw.size, zlib.crc32(raw))

    def buffers(self) -> list[np.ndarray]:
        out = []
        for parts, size in zip(self.packs, self.sizes):
            buffer = np.zeros(size, np.uint8)
            for offset, raw in parts:
                buffer[offset : offset + raw.size] = raw
            out.append(buffer)
        return out


def plan(flat: Flat, writer: _arrayio.Writer) -> Index:
    """The index of ``flat``, with its array data handed to ``writer``."""
    leaves: dict[str, Leaf] = {}
    packer = _Packer()
    arrays = 0
    for key, x in flat.leaves.items():
        value = _value_leaf(key, x)
        if value is not None:
            leaves[key] = value
            continue
        if isinstance(x, jax.ShapeDtypeStruct):
            raise _unsupported(key, x, "A ShapeDtypeStruct is a restore template with no data; save a concrete array.")
        if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
            raise _unsupported(key, x)
        record, data = _array_leaf(key, x)
        if record.nbytes <= _arrayio.PACK_LEAF_LIMIT:
            at: InArray | InPack = packer.add(np.asarray(data))
        else:
            at = InArray(f"a/{arrays}", _arrayio.stored_dtype(record.dtype))
            arrays += 1
            writer.add_array(at.path, data, record.dtype, record.shape)
        leaves[key] = ArrayLeaf(record.dtype, record.shape, record.container, at, record.prng_impl, record.sharding)
    packs = []
    for i, buffer in enumerate(packer.buffers()):
        packs.append(Pack(f"p/{i}", buffer.size))
        writer.add_pack(packs[-1].path, buffer)
    return Index(flat.nodes, leaves, packs, {"writer": f"jaxckpt {__version__}"})


def write(path: str | os.PathLike[str], root: Any, *, overwrite: bool = False) -> str:
    """Saves ``root`` as a new checkpoint at ``path``; returns ``path``."""
    dest = _storage.local_path(path)
    _storage.check_writable(dest, overwrite)
    flat = flatten(root)
    staging = _storage.staging_folder(dest)
    try:
        writer = _arrayio.Writer(str(staging / DATA_DIR))
        index = plan(flat, writer)
        writer.commit()
        _storage.write_durable(staging / INDEX_FILE, encode_index(index))
        _storage.publish(staging, dest, overwrite)
    except BaseException:
        _storage.discard(staging)
        raise
    return os.fspath(path)
