"""safetensors files (Hugging Face): a reader, and :func:`write`, a streaming writer.

The format: an 8-byte little-endian unsigned header length N, N bytes of UTF-8 JSON

    {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
     "__metadata__": {"<str>": "<str>"}}

then the data section: each tensor's C-order little-endian bytes at ``[begin, end)`` of the data
section. Tensor names are kept as written, one edge each (``model.layers.0.q_proj.weight`` is one
key, dots and all).

The format has no checksums: damage is detected only where it breaks the header (its JSON, types,
sizes and offsets) or shortens the file (a truncated file is a
:class:`~jaxckpt.CheckpointCorruptedError` naming the first tensor cut off). A flipped bit in the
data comes back as a different value.

Every field of the header is checked before anything is allocated from it: the header length
against the file and a 100 MB bound (the reference implementation's), each dtype against an
allow-list, each shape (non-negative ints, rank at most 64), each tensor's size against its
offsets, and the offsets against the data section and each other (no overlaps).
"""

from __future__ import annotations

import builtins
import itertools
import json
import math
import os
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from jaxckpt._errors import (
    CheckpointCorruptedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    MismatchError,
    StorageError,
    UnsupportedValueError,
)
from jaxckpt.format.records import MAX_RANK, NUMPY, ArrayLeaf, InForeign
from jaxckpt.interop.common import Entry, open_regular, read_head

NAME = "safetensors"
SUFFIX = ".safetensors"
MAX_HEADER = 100_000_000  # the reference implementation refuses larger headers
METADATA_KEY = "__metadata__"

# safetensors dtype name -> numpy dtype (little-endian, as the format stores). F8 names follow the
# reference implementation (and torch): F8_E4M3 is float8_e4m3fn.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "C64": np.dtype("<c8"),  # safetensors >= 0.6
}
_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def _st_name(dtype: np.dtype) -> str | None:
    """The safetensors name of a numpy dtype (either byte order), or None if it has none."""
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    return _NAMES.get(dtype)


# --- detection ------------------------------------------------------------------------------------


def detect(path: str) -> bool:
    """A regular file named ``*.safetensors``, or one whose first bytes are a plausible header
    length followed by ``{"``."""
    head = read_head(path, 10)
    if head is None:
        return False
    if path.endswith(SUFFIX):
        return True
    if len(head) < 10:
        return False
    n = int.from_bytes(head[:8], "little")
    # The reference writer starts the JSON right after the length; ``{}`` alone is 2 bytes.
    return 2 <= n <= MAX_HEADER and head[8:10] in (b'{"', b"{}")


def manages(directory: str) -> bool:
    """safetensors has no manager: a folder of them is a model's shards, not a checkpoint history."""
    return False


def latest(directory: str) -> str | None:
    return None


# --- reading --------------------------------------------------------------------------------------


class _Tensor(NamedTuple):
    """Where a tensor's bytes are, its header entry checked."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # in the file: past the 8-byte length and the header
    nbytes: int


class SafetensorsReader:
    """An opened safetensors file: the header parsed and checked; values are read on demand."""

    name = NAME

    def __init__(self, path: str) -> None:
        self.path = path
        self.metadata: dict[str, str] = {}
        # name -> (dtype, shape, absolute begin, nbytes); in the header's own order
        self._tensors: dict[str, _Tensor] = {}
        self._parse()

    def _error(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.path!r}: {what}; it is not a valid safetensors file.")

    def _parse(self) -> None:
        fd = open_regular(self.path, NAME)
        try:
            size = os.fstat(fd).st_size
            prefix = _pread_exact(fd, 8, 0)
            if len(prefix) < 8:
                raise CheckpointCorruptedError(
                    f"{self.path!r}: expected an 8-byte header length, found a file of {size} bytes; "
                    "it is truncated or not a safetensors file."
                )
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER:
                raise self._error(f"the header length is {n:,} bytes, over the limit of {MAX_HEADER:,}")
            if n > size - 8:
                raise CheckpointCorruptedError(
                    f"{self.path!r}: the header length is {n:,} bytes but only {size - 8:,} bytes follow "
                    "the length; the file is truncated or not a safetensors file."
                )
            raw = _pread_exact(fd, n, 8)
        finally:
            os.close(fd)
        if len(raw) < n:
            raise CheckpointCorruptedError(f"{self.path!r}: the file shrank while its header was read")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._error(
                f"the header is not UTF-8 (byte {e.start} of the header is {raw[e.start]:#04x}{_near(raw, e.start)})"
            ) from None
        try:
            header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        except _Duplicate as e:
            raise self._error(f"the header names {e.args[0]!r} twice") from None
        except (ValueError, RecursionError) as e:
            raise self._error(f"the header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._error(f"expected the header to be a JSON object, found a {type(header).__name__}")
        data_start, data_len = 8 + n, size - 8 - n
        spans: list[tuple[int, int, str]] = []
        every: list[tuple[int, int, str]] = []  # empty tensors too
        for name, info in header.items():
            if name == METADATA_KEY:
                self.metadata = self._metadata(info)
                continue
            dtype, shape, begin, end = self._tensor(name, info)
            if end > begin:
                spans.append((begin, end, name))
            every.append((begin, end, name))
            self._tensors[name] = _Tensor(dtype, shape, data_start + begin, end - begin)
        spans.sort()
        for (b0, e0, n0), (b1, _, n1) in itertools.pairwise(spans):  # sorted by begin: adjacent pairs suffice
            if b1 < e0:
                raise self._error(f"the bytes of tensor {n0!r} [{b0}, {e0}) and of tensor {n1!r} [{b1}, ...) overlap")
        # Offsets that are consistent with each other but run past the end: the file was cut. (Empty
        # tensors count too: their offsets must also lie within the data section.)
        beyond = sorted(t for t in every if t[1] > data_len)
        if beyond:
            cut = beyond[0]
            raise CheckpointCorruptedError(
                f"{self.path!r}: tensor {cut[2]!r} needs bytes [{cut[0]}, {cut[1]}) of the data section, "
                f"which holds only {data_len:,} bytes; the file is truncated."
            )

    def _metadata(self, info: Any) -> dict[str, str]:
        if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
            raise self._error(f"expected {METADATA_KEY!r} to be an object of strings, found {info!r:.200}")
        return info

    def _tensor(self, name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
        def bad(what: str) -> CheckpointFormatError:
            return self._error(f"tensor {name!r}: {what}")

        if not isinstance(info, dict):
            raise bad(f"expected an object with dtype, shape and data_offsets, found {info!r:.200}")
        missing = {"dtype", "shape", "data_offsets"} - info.keys()
        if missing:
            raise bad(f"expected the fields dtype, shape and data_offsets, {sorted(missing)} missing")
        code = info["dtype"]
        if not isinstance(code, str) or code not in DTYPES:
            raise bad(f"expected a dtype among {', '.join(DTYPES)}, found {code!r:.100}")
        dtype = DTYPES[code]
        shape = info["shape"]
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"expected a shape of at most {MAX_RANK} non-negative integers, found {shape!r:.200}")
        offsets = info["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[1] < offsets[0]
        ):
            raise bad(f"expected data_offsets [begin, end] with 0 <= begin <= end, found {offsets!r:.200}")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise bad(
                f"shape {shape} of {code} needs {nbytes:,} bytes, but data_offsets [{begin}, {end}) "
                f"span {end - begin:,} bytes"
            )
        return dtype, tuple(shape), begin, end

    def entries(self) -> list[Entry]:
        return [
            Entry((name,), ArrayLeaf(dtype, shape, NUMPY, InForeign(name)))
            for name, (dtype, shape, _, _) in self._tensors.items()
        ]

    def read(self, key: str, leaf: ArrayLeaf) -> np.ndarray:
        name = leaf.at.ref if isinstance(leaf.at, InForeign) else None
        if name not in self._tensors:
            raise CheckpointFormatError(f"{self.path!r}: no tensor {key!r} in this safetensors file")
        dtype, shape, begin, nbytes = self._tensors[name]
        # np.empty is aligned for every dtype here; bytes land in it directly, with no other copy.
        buf = np.empty(nbytes, np.uint8)
        fd = open_regular(self.path, NAME)
        try:
            got = _readinto(fd, buf.data, begin)  # .data: the array's memoryview
        finally:
            os.close(fd)
        if got < nbytes:
            raise CheckpointCorruptedError(
                f"{self.path!r}: tensor {name!r} needs {nbytes:,} bytes at offset {begin:,}, found only "
                f"{got:,}; the file is truncated."
            )
        out = buf.view(dtype).reshape(shape)
        return out if out.dtype.isnative else out.astype(out.dtype.newbyteorder("="))


def open(path: str) -> SafetensorsReader:
    return SafetensorsReader(os.fspath(path))


def _near(raw: bytes, at: int) -> str:
    """Which entry of the header byte ``at`` is in: the last ``"name": {`` before it, if any."""
    before = raw[:at].decode("utf-8", "replace")
    names = re.findall(r'"((?:[^"\\]|\\.)*)"\s*:\s*\{', before)
    return f", in or after the entry of tensor {names[-1]!r}" if names else ""


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _readinto(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; the count read (less only at the end of the file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)  # Linux caps one call near 2 GiB
        if n == 0:
            break
        done += n
    return done


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    buf = bytearray(n)
    got = _readinto(fd, memoryview(buf), offset)
    return bytes(buf[:got])


# --- writing --------------------------------------------------------------------------------------


def write(
    path: str | os.PathLike[str],
    specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
    produce: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file at ``path`` holding the tensors of ``specs`` (name, dtype, shape).

    The header comes first, from the specs alone; then ``produce(name)`` is called once per tensor
    and its bytes written at once, so memory holds one tensor at a time. Tensors are laid out
    largest itemsize first (each offset aligned to its itemsize, as the reference writer does);
    ``produce`` is called in that order. The file is written beside ``path`` under a temp name,
    made durable, then renamed over ``path``: a failure (a ``produce`` that raises or returns the
    wrong dtype or shape, a full disk) leaves ``path`` as it was and no temp file.
    """
    target = os.fspath(path)
    header, order = _header(target, specs, metadata)
    folder, base = os.path.split(os.path.abspath(target))
    # The temp name follows jaxckpt's rule for atomic writes (_storage.temp_file_pattern).
    tmp = os.path.join(folder, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with builtins.open(tmp, "xb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for name, dtype, shape in order:
                _write_tensor(f, target, name, dtype, shape, produce(name))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and not isinstance(e, (StorageError, CheckpointNotFoundError)):
            raise StorageError(f"Cannot write {target!r}: {e.strerror or e}.", e.errno) from e
        raise
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself must survive a power cut
    finally:
        os.close(fd)


def _header(
    target: str,
    specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
    metadata: dict[str, str] | None,
) -> tuple[bytes, list[tuple[str, np.dtype, tuple[int, ...]]]]:
    seen: set[str] = set()
    checked: list[tuple[str, np.dtype, tuple[int, ...], str]] = []
    for name, dtype, shape in specs:
        if not isinstance(name, str):
            raise UnsupportedValueError(f"Cannot write {target!r}: expected tensor names of type str, found {name!r}.")
        if name == METADATA_KEY or name in seen:
            why = "is the header's metadata entry" if name == METADATA_KEY else "is given twice"
            raise UnsupportedValueError(f"Cannot write {target!r}: the tensor name {name!r} {why}.")
        _check_utf8(target, name, "tensor name")
        seen.add(name)
        code = _st_name(dtype)
        if code is None:
            raise UnsupportedValueError(
                f"Cannot write {target!r}: tensor {name!r} has dtype {np.dtype(dtype)}, which safetensors "
                f"cannot hold (it holds {', '.join(str(d) for d in DTYPES.values())}). Cast it first."
            )
        shape = tuple(shape)
        if len(shape) > MAX_RANK or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise UnsupportedValueError(
                f"Cannot write {target!r}: tensor {name!r} has shape {shape}; expected at most {MAX_RANK} "
                "non-negative integers."
            )
        checked.append((name, np.dtype(dtype), tuple(int(d) for d in shape), code))
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise UnsupportedValueError(f"Cannot write {target!r}: metadata must be a dict of str to str.")
        for k, v in metadata.items():
            _check_utf8(target, k, "metadata key")
            _check_utf8(target, v, f"metadata value of {k!r}")
    # Largest itemsize first (stable): every tensor then starts at a multiple of its itemsize.
    checked.sort(key=lambda t: -t[1].itemsize)
    obj: dict[str, Any] = {}
    if metadata:
        obj[METADATA_KEY] = dict(metadata)
    offset = 0
    for name, dtype, shape, code in checked:
        end = offset + math.prod(shape) * dtype.itemsize
        obj[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    header += b" " * (-len(header) % 8)  # as the reference writer: the data section starts 8-aligned
    if len(header) > MAX_HEADER:
        raise UnsupportedValueError(
            f"Cannot write {target!r}: its header would be {len(header):,} bytes, over the {MAX_HEADER:,} "
            "that safetensors readers accept."
        )
    return header, [(n, d, s) for n, d, s, _ in checked]


def _check_utf8(target: str, text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedValueError(
            f"Cannot write {target!r}: the {what} {text!r} is not valid UTF-8 ({e.reason})."
        ) from None


def _write_tensor(f: Any, target: str, name: str, dtype: np.dtype, shape: tuple[int, ...], value: Any) -> None:
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)  # a jax.Array, or anything else with __array__
        except Exception as e:
            raise MismatchError(
                f"Cannot write {target!r}: produce({name!r}) returned a {type(value).__name__}, expected an array "
                f"of {dtype} {shape} ({e})."
            ) from None
    if value.dtype != dtype or value.shape != shape:
        raise MismatchError(
            f"Cannot write {target!r}: produce({name!r}) returned {value.dtype} {value.shape}, expected "
            f"{dtype} {shape} as its spec says."
        )
    if value.dtype.byteorder == ">" or (value.dtype.byteorder == "=" and not np.little_endian):
        value = value.astype(value.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    f.write(flat.data)
