"""Reading TensorFlow checkpoints (``tf.train.Checkpoint`` and TF1 ``Saver``), without TensorFlow.

A checkpoint is a prefix: ``prefix.index``, a table of every value's metadata, and the data shards
``prefix.data-00000-of-0000N`` that hold the bytes. The index's bytes (its table format, protobuf
messages and slice keys) are decoded by :mod:`.tf_index`; this module reads the files, checks what
the index claims against them, and presents the values as jaxckpt keys.

Keys: TensorFlow names split on ``/``. For ``tf.train.Checkpoint`` names the trailing
``/.ATTRIBUTES/VARIABLE_VALUE`` is dropped (``net/l1/kernel``), other attributes lose the
``.ATTRIBUTES`` edge (``iterator/ITERATOR_STATE``), and ``_CHECKPOINTABLE_OBJECT_GRAPH`` is not a
value: it is read for :attr:`Reader.objects`. A slot variable
(``net/l1/kernel/.OPTIMIZER_SLOT/optimizer/m/...``) cannot sit below its variable, which is itself
a value: it goes below its optimizer and slot name, then the variable's path
(``optimizer/m/net/l1/kernel``), as optax keeps ``mu`` and ``nu``. TF1 names stay as written (``dense/kernel``).
Partitioned TF1 variables are read whole, assembled from the slices that TensorFlow stores under
keys made by ``EncodeTensorNameSlice``; those slice entries are not listed.
"""

from __future__ import annotations

import builtins
import functools
import math
import os
import re
import sys

import crc32c as crc32c_package
import ml_dtypes
import numpy as np

from jaxckpt._errors import CheckpointCorruptedError, CheckpointFormatError, StorageError, UnsupportedVersionError
from jaxckpt.format.records import NUMPY, ArrayLeaf, InForeign
from jaxckpt.interop.common import Entry
from jaxckpt.interop.tf_index import (
    BundleEntry,
    BundleHeader,
    Malformed,
    as_bytes,
    as_int,
    as_text,
    crc32c,
    encode_tensor_name_slice,
    fields,
    mask_crc,
    slice_key_name,
    table,
    varint,
)

NAME = "TensorFlow"

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_ATTRIBUTES = ".ATTRIBUTES"
_VARIABLE_VALUE = "VARIABLE_VALUE"
_OPTIMIZER_SLOT = ".OPTIMIZER_SLOT"

_MAX_INDEX_BYTES = 1 << 30  # an index is metadata: a gigabyte of it is no checkpoint we can hold
_MAX_ENTRIES = 10_000_000
_MAX_SHARDS = 1 << 20
_MAX_VALUE_BYTES = 1 << 62  # beyond any file, and keeps offset + size inside int64
_MAX_STATE_FILE = 1 << 20  # the manager's text `checkpoint` file
_MAX_OBJECTS = 1_000_000

# DataType enum (tensorflow/core/framework/types.proto) -> numpy dtype; little-endian on disk.
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("float32"),
    2: np.dtype("float64"),
    3: np.dtype("int32"),
    4: np.dtype("uint8"),
    5: np.dtype("int16"),
    6: np.dtype("int8"),
    8: np.dtype("complex64"),
    9: np.dtype("int64"),
    10: np.dtype("bool"),
    14: np.dtype(ml_dtypes.bfloat16),
    17: np.dtype("uint16"),
    18: np.dtype("complex128"),
    19: np.dtype("float16"),
    22: np.dtype("uint32"),
    23: np.dtype("uint64"),
}
_DT_STRING = 7
# Values with no numpy form: listed as skipped, under these names.
_DTYPE_NAMES = {
    7: "DT_STRING",
    11: "DT_QINT8",
    12: "DT_QUINT8",
    13: "DT_QINT32",
    15: "DT_QINT16",
    16: "DT_QUINT16",
    20: "DT_RESOURCE",
    21: "DT_VARIANT",
}


# --- keys -------------------------------------------------------------------------------------


def edges_of(name: str) -> tuple[str, ...]:
    """The edges of a TensorFlow name: split on ``/``, object-based attribute suffixes dropped."""
    edges = name.split("/")
    if _OPTIMIZER_SLOT in edges[1:]:
        # `var/.OPTIMIZER_SLOT/opt/m/...`: the variable `var` is itself a value, so its slots cannot
        # be below it. They go below the optimizer and the slot name, then the variable's path
        # (`opt/m/var`), as optax keeps its slots (`opt_state/mu/<param path>`).
        i = edges.index(_OPTIMIZER_SLOT, 1)
        slot = edges[i + 1 :]
        attributes = slot[-2:] if len(slot) >= 2 and slot[-2] == _ATTRIBUTES else []
        slot = slot[: len(slot) - len(attributes)]
        edges = [*slot, *edges[:i], *attributes]
    if len(edges) >= 3 and edges[-2] == _ATTRIBUTES and edges[-1] == _VARIABLE_VALUE:
        return tuple(edges[:-2])
    if len(edges) >= 3 and edges[-2] == _ATTRIBUTES:
        return (*edges[:-2], edges[-1])
    return tuple(edges)


# --- the reader -------------------------------------------------------------------------------


def _shard_path(prefix: str, shard: int, num_shards: int) -> str:
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


class Reader:
    """An opened TensorFlow checkpoint: its index parsed, values read on demand."""

    checksums = True  # every value read is checked against its CRC-32C (jaxckpt verify says so)

    def __init__(self, prefix: str) -> None:
        self.path = prefix
        self.index_path = prefix + ".index"
        self._entries: dict[str, BundleEntry] = {}  # TF name -> entry, in key order, slices excluded
        self._slices: dict[bytes, BundleEntry] = {}  # EncodeTensorNameSlice key -> the slice's entry
        self.num_shards = 0
        self._parse()
        self.name = (
            "TensorFlow (tf.train.Checkpoint)" if OBJECT_GRAPH_KEY in self._entries else "TensorFlow (tf1 Saver)"
        )

    def _fail(self, message: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.index_path!r}: {message}")

    def _parse(self) -> None:
        try:
            with builtins.open(self.index_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > _MAX_INDEX_BYTES:
                    raise self._fail(f"the index is {size} bytes, more than the {_MAX_INDEX_BYTES} read")
                data = f.read(size + 1)
        except FileNotFoundError:
            raise CheckpointFormatError(f"{self.index_path!r}: no such file; not a TensorFlow checkpoint") from None
        except OSError as e:  # permission denied, a directory: not damage, the storage said no
            raise StorageError(f"Cannot read {self.index_path!r}: {e.strerror or e}", e.errno) from None
        header: BundleHeader | None = None
        previous: bytes | None = None
        try:
            for key, value in table(data):
                if previous is not None and key <= previous:
                    raise Malformed(f"keys are out of order ({previous!r} then {key!r})")
                previous = key
                if len(self._entries) + len(self._slices) >= _MAX_ENTRIES:
                    raise Malformed(f"more than {_MAX_ENTRIES} entries")
                if key == b"":
                    header = BundleHeader(bytes(value))
                    continue
                if header is None:
                    raise Malformed("the first key is not the header's empty key")
                entry = BundleEntry(bytes(value))
                if key[0] == 0:  # a slice of a partitioned variable (EncodeTensorNameSlice)
                    self._slices[key] = entry
                    continue
                try:
                    name = key.decode("utf-8")
                except UnicodeDecodeError:
                    raise Malformed(f"the name {key!r} is not UTF-8") from None
                self._entries[name] = entry
        except Malformed as e:
            raise self._fail(f"malformed TensorFlow checkpoint index: {e}") from None
        if header is None:
            raise self._fail("the index has no header (its empty key); not a TensorFlow checkpoint index")
        if header.endianness != 0:
            raise self._fail(
                "this checkpoint was written big-endian; only little-endian TensorFlow checkpoints are read"
            )
        if header.min_consumer > 1:
            raise UnsupportedVersionError(
                f"{self.index_path!r}: this bundle needs a reader of version {header.min_consumer}; this one reads version 1"
            )
        if not 0 <= header.num_shards <= _MAX_SHARDS:
            raise self._fail(f"the header claims {header.num_shards} data shards")
        self.num_shards = header.num_shards
        for name, entry in [*self._entries.items(), *((slice_key_name(k), e) for k, e in self._slices.items())]:
            if entry.dtype in _DTYPES and not entry.slices:
                self._check_sizes(name, entry)
        for name, entry in self._entries.items():
            if entry.slices:
                self._check_slices(name, entry)

    def _check_sizes(self, name: str, entry: BundleEntry) -> None:
        """A value's claims, checked against each other before anything is read or allocated."""
        nbytes = math.prod(entry.shape) * _DTYPES[entry.dtype].itemsize
        if nbytes > _MAX_VALUE_BYTES:
            raise self._fail(f"{name!r} has shape {entry.shape}: {nbytes} bytes, more than any file holds")
        if entry.size != nbytes:
            raise self._fail(
                f"{name!r} is {_DTYPES[entry.dtype]} of shape {entry.shape}, {nbytes} bytes, "
                f"but its entry says {entry.size} bytes"
            )
        if entry.shard_id >= self.num_shards:
            raise self._fail(f"{name!r} is in data shard {entry.shard_id}, but the checkpoint has {self.num_shards}")

    def _check_slices(self, name: str, entry: BundleEntry) -> None:
        if entry.dtype not in _DTYPES:
            raise self._fail(f"{name!r} is partitioned, but its dtype {entry.dtype} has no numpy form")
        total = math.prod(entry.shape)
        covered = 0
        for extents in entry.slices:
            if len(extents) != len(entry.shape):
                raise self._fail(f"{name!r} has shape {entry.shape}, but a slice of it has {len(extents)} dimensions")
            for (start, length), dim in zip(extents, entry.shape):
                if start + max(length, 0) > dim or (length < 0 and start != 0):
                    raise self._fail(f"{name!r} has shape {entry.shape}; its slice {extents} is outside it")
            piece = self._slices.get(encode_tensor_name_slice(name, extents))
            shape = _slice_shape(extents, entry.shape)
            if piece is None:
                raise self._fail(f"{name!r} is partitioned, but its slice {extents} is not in the index")
            if piece.dtype != entry.dtype or piece.shape != shape:
                raise self._fail(
                    f"{name!r}: its slice {extents} should be dtype {entry.dtype} of shape {shape}, "
                    f"the index has dtype {piece.dtype} of shape {piece.shape}"
                )
            covered += math.prod(shape)
        if covered != total:  # overlaps are checked as the slices are placed
            raise self._fail(f"{name!r} has {total} elements, but its slices hold {covered}")

    def entries(self) -> list[Entry]:
        out = []
        for name, entry in self._entries.items():
            if name == OBJECT_GRAPH_KEY:
                continue
            edges = edges_of(name)
            dtype = _DTYPES.get(entry.dtype)
            if dtype is None:
                note = _DTYPE_NAMES.get(entry.dtype, f"DataType {entry.dtype}")
                out.append(Entry(edges, None, note=note, shape=entry.shape))
            else:
                out.append(Entry(edges, ArrayLeaf(dtype, entry.shape, NUMPY, InForeign(name))))
        return out

    def read(self, key: str, leaf: ArrayLeaf) -> np.ndarray:
        name = leaf.at.ref if isinstance(leaf.at, InForeign) else None
        entry = self._entries.get(name) if isinstance(name, str) else None
        if not isinstance(name, str) or entry is None or entry.dtype not in _DTYPES:
            raise CheckpointFormatError(f"{self.path!r}: {key!r} is not a value of this TensorFlow checkpoint")
        if entry.slices:
            pieces = [self._slices[encode_tensor_name_slice(name, extents)] for extents in entry.slices]
            for piece in pieces:  # every slice's shard holds it, before the whole is allocated
                _, fd = self._open_shard(key, piece)
                os.close(fd)
            out = np.empty(entry.shape, _DTYPES[entry.dtype])
            filled = np.zeros(entry.shape, bool)  # slices sum to the whole (checked at open): none overlap
            for extents, piece in zip(entry.slices, pieces):
                where = tuple(slice(start, start + length) if length >= 0 else slice(None) for start, length in extents)
                if filled[where].any():
                    raise CheckpointFormatError(f"{self.path!r}: {key!r} has overlapping slices")
                out[where] = self._read_entry(key, piece)
                filled[where] = True
            return out
        return self._read_entry(key, entry)

    def _open_shard(self, key: str, entry: BundleEntry) -> tuple[str, int]:
        """The data shard that holds ``entry`` (its path, an open descriptor), checked to be long
        enough to hold it: a truncated shard is refused before any memory is allocated."""
        shard = _shard_path(self.path, entry.shard_id, self.num_shards)
        try:
            fd = os.open(shard, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointCorruptedError(
                f"{self.path!r}: {key!r} is in the data shard {shard!r}, which is missing"
            ) from None
        except OSError as e:
            raise StorageError(f"Cannot read {shard!r} (for {key!r}): {e.strerror or e}", e.errno) from None
        available = os.fstat(fd).st_size
        if entry.offset > available or entry.size > available - entry.offset:
            os.close(fd)
            raise CheckpointCorruptedError(
                f"{self.path!r}: {key!r} is {entry.size} bytes at offset {entry.offset} of {shard!r}, "
                f"which is only {available} bytes (truncated?)"
            )
        return shard, fd

    def _read_entry(self, key: str, entry: BundleEntry) -> np.ndarray:
        """The bytes of one stored value, its size checked against its shard before they are read."""
        dtype = _DTYPES[entry.dtype]
        shard, fd = self._open_shard(key, entry)
        try:
            buf = bytearray(entry.size)
            view, done = memoryview(buf), 0
            while done < entry.size:
                n = os.preadv(fd, [view[done:]], entry.offset + done)
                if n <= 0:
                    raise CheckpointCorruptedError(
                        f"{self.path!r}: {key!r}: {shard!r} ended after {entry.offset + done} bytes while reading it"
                    )
                done += n
        finally:
            os.close(fd)
        actual = mask_crc(crc32c(view))
        if actual != entry.crc32c:
            raise CheckpointCorruptedError(
                f"{self.path!r}: {key!r} fails its checksum in {shard!r} "
                f"(stored {entry.crc32c:#010x}, computed {actual:#010x}): the data is damaged"
            )
        array = np.frombuffer(buf, dtype).reshape(entry.shape)
        return array.byteswap() if sys.byteorder == "big" else array

    @functools.cached_property
    def objects(self) -> list[str]:
        """The paths of the objects a tf.train.Checkpoint tracked (``net``, ``net/l1``,
        ``optimizer``, its variables too), breadth first from its object graph; [] for TF1.
        Read when first asked for, so that listing a checkpoint with a damaged shard still works."""
        entry = self._entries.get(OBJECT_GRAPH_KEY)
        if entry is None:
            return []
        if entry.dtype != _DT_STRING or entry.shape != ():
            raise self._fail(f"{OBJECT_GRAPH_KEY} is not a scalar string (dtype {entry.dtype}, shape {entry.shape})")
        if entry.shard_id >= self.num_shards:
            raise self._fail(f"{OBJECT_GRAPH_KEY} is in data shard {entry.shard_id} of {self.num_shards}")
        raw = self._read_string(OBJECT_GRAPH_KEY, entry)
        try:
            nodes = []
            for number, wire, value in fields(raw):
                if number == 1:
                    children = []
                    for n, w, v in fields(as_bytes(wire, value, "node")):
                        if n == 1:  # ObjectReference: node_id 1, local_name 2
                            node_id, local = 0, ""
                            for n2, w2, v2 in fields(as_bytes(w, v, "child")):
                                if n2 == 1:
                                    node_id = as_int(w2, v2, "node_id")
                                elif n2 == 2:
                                    local = as_text(w2, v2, "local_name")
                            children.append((node_id, local))
                    nodes.append(children)
                    if len(nodes) > _MAX_OBJECTS:
                        raise Malformed(f"more than {_MAX_OBJECTS} objects")
        except Malformed as e:
            raise self._fail(f"malformed {OBJECT_GRAPH_KEY}: {e}") from None
        # Breadth first from the root, as TensorFlow names objects: each by its shortest path.
        paths: dict[int, str] = {0: ""}
        queue = [0]
        for node in queue:
            if not 0 <= node < len(nodes):
                raise self._fail(f"{OBJECT_GRAPH_KEY} refers to object {node}, but has {len(nodes)}")
            for child, local in nodes[node]:
                if child not in paths:
                    paths[child] = f"{paths[node]}/{local}" if paths[node] else local
                    queue.append(child)
        return [paths[n] for n in queue[1:]]

    def _read_string(self, key: str, entry: BundleEntry) -> bytes:
        """A scalar DT_STRING: [varint64 length][masked CRC-32C of the length][bytes]; the entry's
        CRC covers the length (as 4 bytes), that masked CRC, then the bytes."""
        shard, fd = self._open_shard(key, entry)
        with builtins.open(fd, "rb") as f:
            f.seek(entry.offset)
            data = f.read(entry.size)
        if len(data) != entry.size:
            raise CheckpointCorruptedError(f"{self.path!r}: {key!r}: {shard!r} ended while reading it")
        try:
            length, pos = varint(data, 0, len(data))
        except Malformed as e:
            raise CheckpointCorruptedError(f"{self.path!r}: {key!r}: {e}") from None
        if pos + 4 + length != len(data):
            raise CheckpointCorruptedError(
                f"{self.path!r}: {key!r} is a {length}-byte string, but its entry holds {len(data)} bytes"
            )
        # TensorFlow checksums each length as the low 4 bytes of the number (what its writer's
        # Extend over `sizeof(uint32)` of a little-endian uint64 covers), not as the varint.
        crc = crc32c_package.crc32c((length & 0xFFFFFFFF).to_bytes(4, "little"))
        if mask_crc(crc) != int.from_bytes(data[pos : pos + 4], "little"):
            raise CheckpointCorruptedError(f"{self.path!r}: {key!r}: the checksum of its length fails in {shard!r}")
        crc = crc32c_package.crc32c(data[pos : pos + 4], crc)
        crc = crc32c_package.crc32c(data[pos + 4 :], crc)
        if mask_crc(crc) != entry.crc32c:
            raise CheckpointCorruptedError(f"{self.path!r}: {key!r} fails its checksum in {shard!r}")
        return data[pos + 4 :]


def _slice_shape(extents: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(length if length >= 0 else dim for (_, length), dim in zip(extents, shape))


# --- the module's surface ---------------------------------------------------------------------


def detect(path: str) -> bool:
    """A TensorFlow checkpoint is named by its prefix: ``path.index`` is a file."""
    return os.path.isfile(path + ".index")


def open(path: str) -> Reader:  # the name every format module uses, shadowing the builtin here
    return Reader(os.fspath(path))


_STATE_LINE = re.compile(rb'^\s*model_checkpoint_path\s*:\s*"((?:[^"\\]|\\.)*)"\s*$', re.MULTILINE)
_ESCAPES = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b'"': b'"', b"'": b"'", b"\\": b"\\", b"a": b"\a", b"b": b"\b"}
_ESCAPES |= {b"f": b"\f", b"v": b"\v", b"?": b"?"}


def _c_unescape(text: bytes) -> bytes:
    """A text-format string's C escapes (\\n, \\", octal \\123, hex \\x41) undone."""

    def one(match: re.Match[bytes]) -> bytes:
        body = match.group(1)
        if body[:1] in (b"x", b"X"):
            return bytes([int(body[1:], 16) & 0xFF])
        if body[:1].isdigit():
            return bytes([int(body, 8) & 0xFF])
        return _ESCAPES.get(body, body)

    return re.sub(rb"\\([0-7]{1,3}|[xX][0-9a-fA-F]{1,2}|.)", one, text, flags=re.DOTALL)


def _state(directory: str) -> str | None:
    """The newest checkpoint that the ``checkpoint`` state file names, as written, or None."""
    try:
        with builtins.open(os.path.join(directory, "checkpoint"), "rb") as f:
            data = f.read(_MAX_STATE_FILE)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    match = _STATE_LINE.search(data)
    if match is None:
        return None
    try:
        return _c_unescape(match.group(1)).decode("utf-8")
    except UnicodeDecodeError:
        return None


def manages(directory: str) -> bool:
    """A folder that tf.train.CheckpointManager (or a Saver) keeps: a text ``checkpoint`` file
    naming the newest checkpoint."""
    return os.path.isfile(os.path.join(directory, "checkpoint")) and _state(directory) is not None


def latest(directory: str) -> str | None:
    """The prefix of the newest checkpoint, as tf.train.latest_checkpoint gives it: relative
    names are relative to ``directory``; None when its index is gone."""
    name = _state(directory)
    if not name:
        return None
    prefix = name if os.path.isabs(name) else os.path.join(directory, name)
    return prefix if detect(prefix) else None
