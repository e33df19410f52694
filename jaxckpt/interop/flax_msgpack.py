"""Flax msgpack checkpoints: ``flax.serialization.to_bytes`` / ``msgpack_serialize`` files, and the
legacy ``flax.training.checkpoints`` files (``checkpoint_<step>``) written without Orbax.

The file is one msgpack object, decoded here with the ``msgpack`` package (never with flax):

- maps are nodes, each key one edge. Flax's state dicts turn lists and tuples into maps keyed
  ``"0"``, ``"1"``...: those names are kept. A msgpack array (``msgpack_serialize`` of a list) is a
  node with edges ``"0"``, ``"1"``... too. Integer map keys become their decimal str (``str(k)``, as
  flax's state dicts do); any other key type (bytes, float, bool, None, tuple) is refused, as are
  two keys of one map with the same str.
- ext type 1 is an ndarray: a nested msgpack ``(shape, dtype name, C-order bytes)``; ext type 3 a
  numpy scalar in the same form (restored as a numpy scalar); ext type 2 a Python complex, a packed
  ``(real, imag)`` (restored as a numpy complex128 scalar: jaxckpt's Python values do not include
  complex). Other ext types and msgpack bin (bytes) values are listed as skipped.
- a map with ``"__msgpack_chunked_array__"`` is one array that flax split into 1-D chunks (arrays
  over 1 GiB): ``{"shape": {"0": d0, ...}, "chunks": {"0": ndarray, ...}}``.
- int, float, bool, str and nil are Python values.

The whole file is read (as flax does) and the arrays' bytes are kept in memory until the reader is
dropped. Input is untrusted: the file must be a regular file, msgpack's own length limits are set
from its size, every dtype name is checked against an allow-list, and each array's byte count
against its shape and dtype before an array is made (a crafted ext claiming 2**40 elements costs
nothing). Nesting is bounded by jaxckpt's ``MAX_DEPTH``.

msgpack has no checksums: damage is detected only where it breaks the structure (truncation, a
malformed object) or the sizes; a flipped bit inside an array's bytes comes back as a different
value.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Literal

import msgpack
import numpy as np

from jaxckpt._errors import (
    CheckpointCorruptedError,
    CheckpointFormatError,
    JaxckptError,
)
from jaxckpt.format.records import DTYPES, MAX_DEPTH, MAX_RANK, NUMPY, NUMPY_SCALAR, ArrayLeaf, InForeign
from jaxckpt.interop.common import EMPTY_DICT, Entry, open_regular, read_head, value_leaf

NAME = "Flax msgpack"
SUFFIX = ".msgpack"
CHUNKED = "__msgpack_chunked_array__"
EXT_NDARRAY, EXT_COMPLEX, EXT_NPSCALAR = 1, 2, 3  # flax.serialization._MsgpackExtType
# flax.training.checkpoints' default prefix; its temp file is "<prefix>tmp", which does not match.
_LEGACY = re.compile(r"^checkpoint_([0-9]{1,18})$")
# A str value larger than this is not a checkpoint value anyone meant (array bytes are bin or ext).
MAX_STR = 64 << 20


# --- detection ------------------------------------------------------------------------------------


def _looks_like_state_dict(head: bytes) -> bool:
    """A msgpack map whose first key is a printable str: how every flax state dict begins.

    Only a heuristic for files not named ``*.msgpack``; the stricter it is, the fewer other binary
    files (which may begin with any byte) are taken for msgpack.
    """
    if not head:
        return False
    b = head[0]
    if 0x81 <= b <= 0x8F:
        rest = head[1:]
    elif b in (0xDE, 0xDF):
        rest = head[3:] if b == 0xDE else head[5:]
    else:
        return head == b"\x80"  # an empty state dict
    if not rest:
        return False
    if 0xA0 <= rest[0] <= 0xBF:
        length, key = rest[0] & 0x1F, rest[1:]
    elif rest[0] == 0xD9 and len(rest) > 1:
        length, key = rest[1], rest[2:]
    else:
        return False
    key = key[:length]
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError as e:  # a key cut by the end of ``head`` is fine
        if e.reason != "unexpected end of data":
            return False
        text = key[: e.start].decode("utf-8")
    return text.isprintable()


def detect(path: str) -> bool:
    """A regular file named ``*.msgpack``, or one whose bytes begin as a flax state dict does."""
    head = read_head(path, 40)
    if head is None:
        return False
    return path.endswith(SUFFIX) or _looks_like_state_dict(head)


def _legacy_steps(directory: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in names:
        m = _LEGACY.match(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        # Orbax-backed flax checkpoints are folders with these names: not ours.
        head = read_head(path, 40)
        if head is not None and _looks_like_state_dict(head):
            out.append((int(m.group(1)), path))
    return sorted(out)


def manages(directory: str) -> bool:
    """A folder of legacy ``flax.training.checkpoints`` files (``checkpoint_<step>``, msgpack)."""
    return bool(_legacy_steps(directory))


def latest(directory: str) -> str | None:
    """The ``checkpoint_<step>`` file with the highest step. Flax writes ``checkpoint_tmp`` and
    renames it, so every file with a step is complete."""
    steps = _legacy_steps(directory)
    return steps[-1][1] if steps else None


# --- decoding -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Array:
    """A decoded ndarray ext: checked, not yet an array."""

    dtype: np.dtype
    shape: tuple[int, ...]
    data: bytes
    scalar: bool = False


@dataclasses.dataclass(frozen=True)
class _Bad:
    """An ext that does not decode; the walk raises with the key (the ext hook does not know it)."""

    why: str


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """A chunked array: its dtype and shape, and the 1-D pieces that hold it, in order."""

    dtype: np.dtype
    shape: tuple[int, ...]
    pieces: tuple[_Array, ...]
    scalar: bool = False


def _ndarray(data: bytes, scalar: bool) -> _Array | _Bad:
    try:
        # The payload is small apart from its bin: ranks beyond MAX_RANK, maps and exts are refused.
        obj = msgpack.unpackb(
            data,
            raw=True,
            max_array_len=MAX_RANK,
            max_map_len=0,
            max_ext_len=0,
            max_str_len=64,
            max_bin_len=len(data),
        )
    except Exception as e:
        return _Bad(f"its ndarray payload does not decode ({e})")
    if not isinstance(obj, (list, tuple)) or len(obj) != 3:
        return _Bad(f"expected an ndarray payload (shape, dtype, bytes), found {obj!r:.100}")
    shape, name, buf = obj
    if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
        return _Bad(f"expected a shape of non-negative integers, found {shape!r:.100}")
    if not isinstance(name, bytes) or name.decode("latin-1") not in DTYPES:
        return _Bad(f"expected a numeric dtype name (float32, bfloat16, int8, ...), found {name!r:.100}")
    if not isinstance(buf, bytes):
        return _Bad(f"expected the array's bytes, found a {type(buf).__name__}")
    dtype = DTYPES[name.decode("latin-1")]
    expected = math.prod(shape) * dtype.itemsize
    if len(buf) != expected:
        return _Bad(f"shape {list(shape)} of {dtype} needs {expected:,} bytes, found {len(buf):,}")
    if scalar and shape:
        return _Bad(f"expected a numpy scalar (shape ()), found shape {list(shape)}")
    return _Array(dtype, tuple(shape), buf, scalar)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_NDARRAY:
        return _ndarray(data, scalar=False)
    if code == EXT_NPSCALAR:
        return _ndarray(data, scalar=True)
    if code == EXT_COMPLEX:
        try:
            pair = msgpack.unpackb(data, max_array_len=2, max_map_len=0, max_ext_len=0, max_str_len=0, max_bin_len=0)
        except Exception as e:
            return _Bad(f"its complex payload does not decode ({e})")
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair)
        ):
            return _Bad(f"expected a complex (real, imag), found {pair!r:.100}")
        value = np.complex128(complex(pair[0], pair[1]))
        return _Array(value.dtype, (), value.tobytes(), scalar=True)
    return msgpack.ExtType(code, b"")  # listed as skipped; its bytes are not kept


class MsgpackReader:
    """An opened Flax msgpack file: decoded whole; arrays are made on demand from their bytes."""

    name = NAME

    def __init__(self, path: str) -> None:
        self.path = path
        self._entries: list[Entry] = []
        self._values: dict[int, _Array | _Chunks] = {}
        root = self._decode(_read_whole(path))
        if not isinstance(root, (dict, list)) or (isinstance(root, dict) and CHUNKED in root):
            what = "array" if isinstance(root, (dict, _Array)) else type(root).__name__
            raise CheckpointFormatError(
                f"{path!r}: expected a map of values (a flax state dict), found a single {what} at the "
                "root; jaxckpt reads trees of named values."
            )
        self._walk(root, ())

    def _decode(self, data: bytes) -> Any:
        n = len(data)
        try:
            return msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=False,
                ext_hook=_ext_hook,
                # Each element takes at least one byte: no header asks for much more than the file
                # holds (a list is allocated at its header's length). The floor keeps a header of a
                # truncated small file a truncation, not a limit.
                max_array_len=max(n, 1024),
                max_map_len=max(n // 2, 1024),
                max_str_len=min(n, MAX_STR),
                max_bin_len=n,
                max_ext_len=n,
            )
        except JaxckptError:
            raise
        except msgpack.ExtraData:
            raise CheckpointFormatError(
                f"{self.path!r}: expected one msgpack object, found bytes after it; it is not a Flax msgpack file."
            ) from None
        except UnicodeDecodeError as e:
            raise CheckpointFormatError(f"{self.path!r}: a str in this msgpack file is not UTF-8 ({e}).") from None
        except msgpack.StackError:
            raise CheckpointFormatError(
                f"{self.path!r}: its maps are nested deeper than msgpack decodes; it is not a flax checkpoint."
            ) from None
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            if "incomplete input" in str(e):
                raise CheckpointCorruptedError(
                    f"{self.path!r}: the msgpack data ends in the middle of a value ({n:,} bytes); the file is "
                    "truncated."
                ) from None
            raise CheckpointFormatError(f"{self.path!r}: not valid msgpack ({e}).") from None

    def _error(self, edges: tuple[str, ...], what: str) -> CheckpointFormatError:
        key = "/".join(edges) or "the root"
        return CheckpointFormatError(f"{self.path!r}: {key!r}: {what}.")

    def _edges(self, node: Any, edges: tuple[str, ...]) -> list[tuple[str, Any]]:
        if isinstance(node, list):
            return [(str(i), v) for i, v in enumerate(node)]
        out: dict[str, Any] = {}
        for k, v in node.items():
            if isinstance(k, str):
                edge = k
            elif isinstance(k, int) and not isinstance(k, bool):
                edge = str(k)
            else:
                raise self._error(edges, f"expected str or int map keys, found the {type(k).__name__} key {k!r:.100}")
            if edge in out:
                raise self._error(edges, f"two keys read as {edge!r}")
            out[edge] = v
        return list(out.items())

    def _walk(self, node: Any, edges: tuple[str, ...]) -> None:
        if len(edges) > MAX_DEPTH:
            raise self._error(edges[:8] + ("...",), f"nested deeper than {MAX_DEPTH} levels")
        for edge, value in self._edges(node, edges):
            here = (*edges, edge)
            if isinstance(value, dict) and CHUNKED in value:
                value = self._chunks(value, here)
            if isinstance(value, (dict, list)) and not value:  # an empty state dict ({} in flax's optax states)
                self._entries.append(Entry(here, None, note=EMPTY_DICT))
            elif isinstance(value, (dict, list)):  # msgpack gives lists, never tuples (ExtType is one)
                self._walk(value, here)
            else:
                self._entries.append(self._leaf(value, here))

    def _chunks(self, d: dict[Any, Any], edges: tuple[str, ...]) -> _Chunks:
        # flax: {"__msgpack_chunked_array__": True, "shape": {"0": d0, ...}, "chunks": {"0": arr, ...}}
        shape_d, chunks_d = d.get("shape"), d.get("chunks")
        if not isinstance(shape_d, dict) or not isinstance(chunks_d, dict) or len(shape_d) > MAX_RANK:
            raise self._error(edges, "expected a chunked array with 'shape' and 'chunks' maps")
        try:
            shape = tuple(shape_d[str(i)] for i in range(len(shape_d)))
            pieces = tuple(chunks_d[str(i)] for i in range(len(chunks_d)))
        except KeyError as e:
            raise self._error(edges, f"a chunked array lacks entry {e.args[0]!r}") from None
        if not all(type(x) is int and x >= 0 for x in shape):
            raise self._error(edges, f"expected a chunked array shape of non-negative integers, found {shape!r:.100}")
        for i, p in enumerate(pieces):
            if isinstance(p, _Bad):
                raise self._error(edges, f"chunk {i}: {p.why}")
            if not isinstance(p, _Array) or len(p.shape) != 1 or p.dtype != pieces[0].dtype:
                raise self._error(edges, f"chunk {i} is not a 1-D array of the dtype of chunk 0")
        if not pieces:
            raise self._error(edges, "a chunked array has no chunks")
        total = sum(p.shape[0] for p in pieces)
        if total != math.prod(shape):
            raise self._error(
                edges, f"shape {list(shape)} needs {math.prod(shape):,} elements, the chunks hold {total:,}"
            )
        return _Chunks(pieces[0].dtype, shape, pieces)

    def _leaf(self, value: Any, edges: tuple[str, ...]) -> Entry:
        if isinstance(value, _Bad):
            raise self._error(edges, value.why)
        if isinstance(value, (_Array, _Chunks)):
            ref = len(self._values)
            self._values[ref] = value
            container: Literal["numpy", "numpy_scalar"] = NUMPY_SCALAR if value.scalar else NUMPY
            return Entry(edges, ArrayLeaf(value.dtype, value.shape, container, InForeign(ref)))
        leaf = value_leaf(value)
        if leaf is not None:
            return Entry(edges, leaf)
        if isinstance(value, bytes):
            return Entry(edges, None, note=f"bytes ({len(value):,})")
        if isinstance(value, msgpack.ExtType):
            return Entry(edges, None, note=f"msgpack ext type {value.code}")
        if isinstance(value, msgpack.Timestamp):  # ext type -1, which msgpack decodes itself
            return Entry(edges, None, note="msgpack timestamp")
        raise self._error(edges, f"a value of type {type(value).__name__}")  # not reached: msgpack's types

    def entries(self) -> list[Entry]:
        return list(self._entries)

    def read(self, key: str, leaf: ArrayLeaf) -> np.ndarray:
        ref = leaf.at.ref if isinstance(leaf.at, InForeign) else None
        value = self._values.get(ref) if isinstance(ref, int) else None
        if value is None:
            raise CheckpointFormatError(f"{self.path!r}: no array {key!r} in this {NAME} file")
        if isinstance(value, _Array):
            # A copy: writable, aligned, and not tied to the bytes this reader keeps.
            return np.frombuffer(value.data, value.dtype).reshape(value.shape).copy()
        out = np.empty(leaf.shape, leaf.dtype)
        flat, at = out.reshape(-1), 0
        for p in value.pieces:
            n = len(p.data) // p.dtype.itemsize
            flat[at : at + n] = np.frombuffer(p.data, p.dtype)
            at += n
        return out


def open(path: str) -> MsgpackReader:
    return MsgpackReader(os.fspath(path))


def _read_whole(path: str) -> bytes:
    """The file's bytes: a regular file, read to the size fstat gave (nothing unbounded)."""
    fd = open_regular(path, NAME)
    info = os.fstat(fd)
    with os.fdopen(fd, "rb") as f:
        data = f.read(info.st_size)
    if len(data) < info.st_size:
        raise CheckpointCorruptedError(f"{path!r}: the file shrank while it was read; read it again once it is whole.")
    return data
