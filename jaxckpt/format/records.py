"""The index's records: what a checkpoint holds (nodes, leaves and where each is stored), the
format's constants and dtypes, and where the regions of a sharded array are.

docs/format.md is the specification; :mod:`jaxckpt.format.index_json` writes and parses the
index as JSON.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from typing import Any, Final, Literal, TypeGuard

import jax
import ml_dtypes
import numpy as np

from jaxckpt.format.keys import NodeInfo, child_keys

FORMAT_NAME = "jaxckpt"
# Version 2: every chunk is stored (a missing chunk is damage, never a fill value), and the index
# records chunk shapes, so that an array's zarr.json is checked against what the index implies.
# Version 3: a multi-process save records each array's sharding (a mesh of the checkpoint's device
# table and a partition spec) instead of every region of every process, so that the index of a save
# by N processes does not grow with N.
# Version 4: a data store is a plain folder of zarr3 arrays with the ``sharding_indexed`` codec, one
# file per shard, every inner chunk with its CRC-32C (jaxckpt.arrays.zarr_local), instead of an OCDBT
# database; an array's ``chunks`` are its shard shape. Packs are such arrays too.
# Version 5: every data store holds the CRC-32C of each inner chunk of its shards, in order, in
# CHECKSUMS_FILE, which names the save that wrote it (the index's ``save``): a chunk or shard moved,
# swapped or copied from another checkpoint with its own checksum is damage, not another place's
# values (a chunk's own checksum proves its bytes intact, not where they belong).
# Version 6: a data store may store arrays by reference to a sibling checkpoint of the same folder
# (a manager's incremental saves on buckets; REFS_FILE, see jaxckpt.incremental.refs). Only a checkpoint that
# holds references is written as version 6; every other one stays version 5 (PLAIN_VERSION), which
# readers of version 5 open.
#: The newest format version that this jaxckpt writes; it reads every version up to it (1 to 6).
FORMAT_VERSION = 6
PLAIN_VERSION = 5  # what a checkpoint without references is written as
INDEX_FILE = "index.json"
CHECKSUMS_FILE = "checksums.json"  # in each data store, from version 5 (jaxckpt.arrays.checksums)
DATA_DIR = "data"  # the data store of process 0 (an OCDBT database up to version 3)


def data_store(process: int) -> str:
    """The data store (a folder of zarr3 arrays) that process ``process`` writes."""
    return DATA_DIR if process == 0 else f"{DATA_DIR}.p{process}"


MAX_PROCESS = 999_999  # data.p<n> has at most six digits
# Devices in a checkpoint's device table, and in any one mesh: far above any pod, and a bound on the
# work a crafted table can ask of the parser.
MAX_DEVICES = 1 << 20
MAX_MESHES = 4096


MAX_RANK = 64
# The product of an array's nonzero dimensions times its itemsize is below this: numpy can make no
# larger array, not even an empty one, and the geometry derived from a shape stays within uint64.
MAX_ARRAY_SPAN = 1 << 63
# A chunk is read into memory whole: a crafted chunk shape must not ask for more than this.
MAX_CHUNK_BYTES = 256 << 20
# Shards of one array (format version 4): a save writes at most one per device. A read plans each
# shard it touches before opening a file, so a crafted shard shape must not imply millions.
MAX_SHARDS = MAX_DEVICES
# Packs are cut into inner chunks of 4 MiB (PACK_CHUNK_BYTES), or one of the whole pack, and always
# were; a read plans each chunk it touches, so a crafted pack must not be cut into bytes.
MIN_PACK_CHUNK_BYTES = 64 << 10
# Nesting depth of the node graph. Restores rebuild trees recursively, about two Python frames a
# level, so a deeper graph would exhaust the interpreter's stack; no real model comes near it.
MAX_DEPTH = 256
# The grid that the distinct boundaries of an array's listed regions cut it into has at most this
# many cells: a save lists one region per shard of a sharding, which form a grid of at most one cell
# per device. A bound on the work and memory of checking that they tile the array.
MAX_REGION_CELLS = 1 << 22

# Container of an array leaf: how it comes back without a template.
Container = Literal["jax", "numpy", "numpy_scalar"]
JAX: Final = "jax"
NUMPY: Final = "numpy"
NUMPY_SCALAR: Final = "numpy_scalar"
CONTAINERS: frozenset[str] = frozenset({JAX, NUMPY, NUMPY_SCALAR})

# What a value leaf holds: a Python scalar or str, None, or an object's state: JSON ("state"), or
# bytes ("state_bytes", base64 in the index), as grain's DataLoader iterator's get_state() returns.
# In a multi-process run whose processes' states of one key differ (each its own data iterator), the
# leaf is "state_per_process": a tuple of "state" / "state_bytes" leaves, one per process in process
# order; each process restores its own, and another process count is refused (as grain reads only the
# restoring process's own state file). A jaxckpt older than either refuses it as an unknown leaf type, by name.
ScalarType = Literal["int", "float", "bool", "str"]
ValueType = Literal["int", "float", "bool", "str", "none", "state", "state_bytes", "state_per_process"]
STATE_TYPES: frozenset[str] = frozenset({"state", "state_bytes"})  # one process's state
MAX_PROCESS_STATES = 1 << 16  # processes of a run whose states an index lists: a crafted list is refused
SCALAR_TYPES: dict[ScalarType, type] = {"int": int, "float": float, "bool": bool, "str": str}


def is_container(text: str) -> TypeGuard[Container]:
    return text in CONTAINERS


def is_scalar_type(text: str) -> TypeGuard[ScalarType]:
    return text in SCALAR_TYPES


def scalar_type(value: Any) -> ScalarType | None:
    """The value type of a Python scalar or str (exactly: a subclass is not one), or None."""
    return next((name for name, t in SCALAR_TYPES.items() if type(value) is t), None)


@functools.lru_cache(maxsize=16)
def prng_key_data_shape(impl: str) -> tuple[int, ...] | None:
    """The key data shape of one key of a PRNG implementation registered with JAX under that name,
    or None. A PRNG key array is stored as its key data: the key array's shape, then this.

    Resolved by name in JAX's registry of implementations (nothing is imported) and only traced.
    """
    try:
        return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)
    except (ValueError, TypeError):
        return None


def _dtype_table() -> dict[str, np.dtype]:
    names = ["bool"]
    names += [f"{p}int{b}" for p in ("", "u") for b in (8, 16, 32, 64)]
    names += ["float16", "float32", "float64", "complex64", "complex128"]
    table = {n: np.dtype(n) for n in names}
    for n in (
        "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
        "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
        "int2", "int4", "uint2", "uint4",
    ):  # fmt: skip
        if hasattr(ml_dtypes, n):
            table[n] = np.dtype(getattr(ml_dtypes, n))
    return table


DTYPES: dict[str, np.dtype] = _dtype_table()


_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str | None:
    """The index name of a dtype, or None if jaxckpt cannot store it."""
    return _NAMES.get(np.dtype(dtype))


# --- records -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class MeshRecord:
    """A device mesh that arrays of the checkpoint were sharded over: axis names and sizes, and for
    each position (C order) the device id and the process that held it. Compared by identity."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    devices: tuple[int, ...]
    processes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an array was sharded: ``spec[d]`` names the mesh axes that split dimension ``d`` (major
    first; empty: not split), as a ``PartitionSpec`` does. Every shard has the same shape (each split
    dimension divides evenly), and a shard is written by the process of the first mesh position (C
    order) that holds it."""

    mesh: MeshRecord
    spec: tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class InArray:
    """The leaf is its own zarr3 array at ``path``, stored as ``stored`` dtype.

    With ``regions`` and ``layout`` None, the whole array is in the data store of process 0
    (``data``). A save by several processes writes each region (shard) into the data store of the
    process that owns it: ``layout`` (version 3) says which by the array's sharding; otherwise
    ``regions`` maps each store to its regions, each a list of ``(start, stop)`` per dimension (every
    multi-process save of versions 1 and 2; in version 3, shardings that a layout cannot describe).
    ``chunks`` is the zarr3 chunk shape (None in version 1 indexes, which did not record it).
    """

    path: str
    stored: str
    regions: dict[str, list[list[tuple[int, int]]]] | None = None
    chunks: tuple[int, ...] | None = None
    layout: Layout | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class InPack:
    """The leaf is ``nbytes`` little-endian C-order bytes at ``offset`` in pack ``pack``, with their
    ``checksum``: CRC-32C from format version 4 (as every chunk of an array), zlib's CRC-32 before."""

    pack: int
    offset: int
    nbytes: int
    checksum: int


@dataclasses.dataclass(frozen=True)
class InForeign:
    """The leaf is in a checkpoint that another library wrote (``jaxckpt.interop.formats``); ``ref`` is
    what that format's reader needs to find it. Never in an index that jaxckpt writes."""

    ref: Any


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayLeaf:
    dtype: np.dtype
    shape: tuple[int, ...]
    container: Container
    at: InArray | InPack | InForeign
    prng_impl: str | None = None  # typed PRNG keys: dtype/shape are those of the key data
    sharding: str | None = None  # how it was sharded when saved (informational)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def value_shape(self) -> tuple[int, ...]:
        """The shape of the value saved: for a PRNG key array, its key shape (without the key data's
        trailing dimensions, see :func:`prng_key_data_shape`)."""
        if not self.prng_impl:
            return self.shape
        # An implementation not registered here: one trailing dimension, as every one JAX has.
        key_data = prng_key_data_shape(self.prng_impl) or (0,)
        return self.shape[: len(self.shape) - len(key_data)]


@dataclasses.dataclass(frozen=True, slots=True)
class ValueLeaf:
    """A Python scalar, str or None (``type`` in SCALAR_TYPES or "none"), or an object's ``state``
    (JSON) or ``state_bytes`` (bytes), or ``state_per_process``: a tuple of those two, one per process."""

    type: ValueType
    value: Any


Leaf = ArrayLeaf | ValueLeaf


@dataclasses.dataclass(frozen=True)
class Pack:
    path: str
    nbytes: int
    chunk: int | None = None  # bytes per zarr3 chunk (None in version 1 indexes)


@dataclasses.dataclass
class Index:
    nodes: dict[str, NodeInfo]
    leaves: dict[str, Leaf]
    packs: list[Pack]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = FORMAT_VERSION
    meshes: list[MeshRecord] = dataclasses.field(default_factory=list)  # those that layouts refer to
    # key of an empty checkpoint node -> key where that same Checkpoint object is stored (a graph, not
    # only a tree: an object reached by two paths, or around a cycle, is stored once)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    # The id of the save that wrote it (version 5): every data store's CHECKSUMS_FILE names it.
    save: str | None = None
    refs: bool = False  # a data store holds references (jaxckpt.incremental.refs): written as version 6

    def keys_under(self, prefix: str) -> list[str]:
        """Leaf keys at or below ``prefix``, in graph order."""
        out: list[str] = []

        def walk(key: str) -> None:
            info = self.nodes.get(key)
            if info is None:
                if key in self.leaves:
                    out.append(key)
                return
            for k in child_keys(key, info):
                walk(k)

        walk(prefix)
        return out


# --- where the regions of an array are -------------------------------------------------------------

Box = list[tuple[int, int]]  # (start, stop) per dimension


@functools.lru_cache(maxsize=256)
def _offsets(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """Per dimension, per shard number along it: what it adds to the C-order position in the mesh of
    the first device holding the shard (axes that split no dimension are at 0 there)."""
    mesh = layout.mesh
    strides = [math.prod(mesh.shape[i + 1 :]) for i in range(len(mesh.shape))]
    at = {a: i for i, a in enumerate(mesh.axes)}
    out = []
    for axes in layout.spec:
        offsets = [0]
        for a in axes:  # major first: each axis refines the split of the ones before
            i = at[a]
            offsets = [o + j * strides[i] for o in offsets for j in range(mesh.shape[i])]
        out.append(tuple(offsets))
    return tuple(out)


def shard_shape(layout: Layout, shape: tuple[int, ...]) -> list[int]:
    """The size of a shard along each dimension."""
    return [n // len(o) for n, o in zip(shape, _offsets(layout))]


def _layout_pieces(layout: Layout, shape: tuple[int, ...], want: Box) -> list[tuple[str, Box]]:
    offsets, sizes = _offsets(layout), shard_shape(layout, shape)
    if 0 in sizes or any(lo >= hi for lo, hi in want):
        return []
    ranges = [range(lo // b, (hi - 1) // b + 1) for (lo, hi), b in zip(want, sizes)]
    processes = layout.mesh.processes
    out = []
    for shard in itertools.product(*ranges):
        owner = processes[sum(o[c] for o, c in zip(offsets, shard))]
        box = [(max(lo, c * b), min(hi, (c + 1) * b)) for (lo, hi), c, b in zip(want, shard, sizes)]
        out.append((data_store(owner), box))
    return out


def pieces(at: InArray, shape: tuple[int, ...], want: Box) -> list[tuple[str, Box]]:
    """The parts of the box ``want`` of an array: (data store, the part of ``want`` it holds)."""
    if at.layout is not None:
        return _layout_pieces(at.layout, shape, want)
    if at.regions is None:
        return [(DATA_DIR, list(want))]
    out: list[tuple[str, Box]] = []
    for store, regions in at.regions.items():
        for region in regions:
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, region)]
            if all(lo < hi for lo, hi in overlap) or (not overlap and not out):
                out.append((store, overlap))
    return out


def tiling_problem(boxes: list[Box], shape: tuple[int, ...] | list[int]) -> str | None:
    """What keeps ``boxes`` (each within ``shape``) from covering every element of it exactly once,
    or None. Overlapping boxes whose volumes add up can hide a gap, and a gap is read from memory
    that nothing wrote. Checked on the grid of the boxes' distinct boundaries (one cell per box for
    the regions of a sharding), in time and memory bounded by :data:`MAX_REGION_CELLS`."""
    boxes = [box for box in boxes if all(lo < hi for lo, hi in box)]  # an empty box covers nothing
    edges = [sorted({0, n, *(box[d][0] for box in boxes), *(box[d][1] for box in boxes)}) for d, n in enumerate(shape)]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_REGION_CELLS:
        return (
            f"its {len(boxes)} regions cut it into a grid of {cells:,} cells, more than the {MAX_REGION_CELLS:,} "
            "that the regions of any sharding make"
        )
    spans = [
        [(bisect.bisect_left(e, lo), bisect.bisect_left(e, hi)) for e, (lo, hi) in zip(edges, box)] for box in boxes
    ]
    covered = sum(math.prod(b - a for a, b in span) for span in spans)
    if covered != cells:  # then some cell is covered twice, or some never
        return f"its regions {'overlap' if covered > cells else 'leave part of it uncovered'}"
    cut = [d for d, e in enumerate(edges) if len(e) > 2]  # dimensions of one cell do not matter
    grid = np.zeros([len(edges[d]) - 1 for d in cut], np.uint8)
    for span in spans:  # as many cells painted as there are: a count that wraps still leaves a 0
        grid[tuple(slice(*span[d]) for d in cut)] += 1
    if (grid != 1).any():
        return "its regions overlap and leave part of it uncovered"
    return None


def grid_cells(boxes: list[Box], step: tuple[int, ...]) -> int:
    """How many cells of the regular grid of ``step`` the union of ``boxes`` touches: exactly when
    the boxes cut it into few pieces, else at least (the most that one box touches)."""
    cells = {
        tuple((lo // s, -(-hi // s)) for (lo, hi), s in zip(box, step))
        for box in boxes
        if all(lo < hi for lo, hi in box)
    }
    if len(cells) <= 1:
        return math.prod(b - a for a, b in next(iter(cells))) if cells else 0
    edges = [sorted({e for box in cells for e in box[d]}) for d in range(len(step))]
    cut = [d for d, e in enumerate(edges) if len(e) > 2]
    if math.prod(len(edges[d]) - 1 for d in cut) > _UNION_PIECES:
        return max(math.prod(b - a for a, b in box) for box in cells)
    covered = np.zeros([len(edges[d]) - 1 for d in cut], bool)
    for box in cells:
        covered[
            tuple(slice(bisect.bisect_left(edges[d], box[d][0]), bisect.bisect_left(edges[d], box[d][1])) for d in cut)
        ] = True
    whole = math.prod(e[1] - e[0] for d, e in enumerate(edges) if d not in cut)
    return whole * sum(
        math.prod(edges[d][i + 1] - edges[d][i] for d, i in zip(cut, piece)) for piece in np.argwhere(covered).tolist()
    )


# Pieces of the union of boxes that :func:`grid_cells` counts one by one.
_UNION_PIECES = 1 << 16


def regions(at: InArray, shape: tuple[int, ...]) -> dict[str, list[Box]]:
    """Every region of an array, by the data store that holds it."""
    out: dict[str, list[Box]] = {}
    for store, box in pieces(at, shape, [(0, n) for n in shape]):
        out.setdefault(store, []).append(box)
    return out


@functools.lru_cache(maxsize=256)
def _owned(layout: Layout) -> dict[int, int]:
    """How many shards of an array of this layout each process writes."""
    counts: dict[int, int] = {}
    processes = layout.mesh.processes
    for shard in itertools.product(*_offsets(layout)):
        owner = processes[sum(shard)]
        counts[owner] = counts.get(owner, 0) + 1
    return counts


def store_bytes(at: InArray, shape: tuple[int, ...], itemsize: int, store: str) -> int:
    """The bytes of values of this array that the data store ``store`` holds."""
    if at.layout is not None:
        process = 0 if store == DATA_DIR else int(store[len(DATA_DIR) + 2 :])
        return _owned(at.layout).get(process, 0) * math.prod(shard_shape(at.layout, shape)) * itemsize
    if at.regions is None:
        return math.prod(shape) * itemsize if store == DATA_DIR else 0
    return sum(math.prod(b - a for a, b in r) for r in at.regions.get(store, ())) * itemsize


def stores_of(at: InArray) -> list[str]:
    """Every data store that holds part of the array."""
    if at.layout is not None:
        return [data_store(p) for p in sorted(_owned(at.layout))]
    return list(at.regions or (DATA_DIR,))
