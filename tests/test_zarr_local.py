"""Format version 4's data files, as jaxckpt writes and reads them itself on a local disk.

Each array with storage of its own is a zarr3 array in ``data/a/<n>/`` (``zarr.json``, one file per
shard at ``c/<i>/<j>...``), its shards cut into inner chunks of at most 8 MiB by the
``sharding_indexed`` codec: each inner chunk is its bytes then their CRC-32C, and the shard file ends
with an index of (offset, size) per inner chunk and its CRC-32C. Damage to any of it is a
CheckpointCorruptedError naming the key, never other values; what jaxckpt writes TensorStore alone
reads bit for bit, and what TensorStore writes (``s3://``) jaxckpt's own reader reads.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.arrays import store_write, zarr_local, zarr_meta
from jaxckpt.storage import locations
from jaxckpt.tools import verify

_ENTRY = 16  # (offset, size), uint64 little-endian
_CRC = 4


def _index(path: Path) -> dict:
    return json.loads((Path(path) / "index.json").read_text())


def _folder(path: Path, key: str) -> Path:
    """The folder of the zarr3 array holding ``key`` (its own array, or its pack)."""
    index = _index(path)
    at = index["leaves"][key]["at"]
    return Path(path) / "data" / (at["array"] if "array" in at else index["packs"][at["pack"]]["path"])


def _shards(folder: Path) -> list[Path]:
    return sorted(p for p in (folder / "c").rglob("*") if p.is_file())


def _chunks_per_shard(folder: Path) -> int:
    meta = json.loads((folder / "zarr.json").read_bytes())
    shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
    inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    return math.prod(s // c for s, c in zip(shard, inner))


def _entries(file: Path, chunks: int) -> np.ndarray:
    raw = file.read_bytes()
    index = raw[-(chunks * _ENTRY + _CRC) : -_CRC]
    assert zarr_local.crc_bytes(memoryview(index)) == raw[-_CRC:], "the shard index fails its checksum"
    return np.frombuffer(index, "<u8").reshape(chunks, 2).copy()


def _write_entries(file: Path, entries: np.ndarray) -> None:
    """Replace the shard's index, with a valid checksum (as a crafted file would have)."""
    raw = file.read_bytes()
    index = entries.astype("<u8").tobytes()
    file.write_bytes(raw[: -(len(index) + _CRC)] + index + zarr_local.crc_bytes(memoryview(index)))


def _ts_read(folder: Path) -> np.ndarray:
    """The array, read by TensorStore alone (no jaxckpt code on the read path)."""
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{folder}/"}}).result()
    return store.read().result()


def _same_bits(a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def _saved(tmp_path: Path) -> tuple[Path, dict]:
    """A checkpoint of an own array 'w' (one shard of 4 inner chunks of 1 KiB), another own array 'v'
    and a packed leaf 'small'; and 200 one-byte leaves, packed 64 bytes apart, so that the data store
    holds 12 KiB more than its values and the store-size check before reading (which a lost shard
    of 'w' would fail) leaves the damage to the reader of 'w'."""
    rng = np.random.default_rng(0)
    tree = {
        "w": rng.standard_normal((32, 32)).astype(np.float32),
        "v": rng.standard_normal(2000).astype(np.float32),
        "small": np.arange(5, dtype=np.int32),
    }
    padding = {f"pad{i}": np.full(1, i, np.uint8) for i in range(200)}
    path = Path(jaxckpt.save(tmp_path / "c", {**tree, **padding}))
    assert _chunks_per_shard(_folder(path, "w")) == 4
    assert "pack" in _index(path)["leaves"]["small"]["at"]
    return path, tree


def _refused(path: Path, tree: dict, key: str, match: str) -> None:
    """Every way of reading ``key`` refuses, naming it; the other values still read."""
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=rf"'{key}'.*{match}"):
        jaxckpt.restore(path)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=rf"'{key}'.*{match}"):
        jaxckpt.restore(path, like={k: np.zeros_like(v) for k, v in tree.items()}, partial=True)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=rf"'{key}'.*{match}"):
        jaxckpt.load_variable(path, key)
    result = verify.verify(str(path))
    assert [k for k, _ in result.damaged] == [key] and not result.ok
    for other in tree:
        if other != key:
            _same_bits(jaxckpt.load_variable(path, other), tree[other])


# --- damaged shard files ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["index byte", "index checksum"])
def test_a_shard_whose_index_checksum_fails_is_refused(tmp_path, small_inner_chunks, where):
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    raw = bytearray(shard.read_bytes())
    raw[-3 if where == "index checksum" else -(4 * _ENTRY + _CRC) + 9] ^= 0x10
    shard.write_bytes(bytes(raw))
    _refused(path, tree, "w", "index .*fails its checksum")


_OUTSIDE = "outside the file or of the wrong size"
_MISPLACED = "not the data the index records"  # format 5: each chunk intact, in another's place


def _swap(e, i, j):
    e[[i, j]] = e[[j, i]]


@pytest.mark.parametrize(
    "entry",
    [
        ("offset past the end", lambda e, size: e[3].__setitem__(0, size), _OUTSIDE),
        ("offset into the index", lambda e, size: e[3].__setitem__(0, size - 4 * _ENTRY - _CRC - 8), _OUTSIDE),
        ("offset of 2**63", lambda e, size: e[1].__setitem__(0, 2**63), _OUTSIDE),
        ("size too large", lambda e, size: e[0].__setitem__(1, e[0][1] + 4), _OUTSIDE),
        ("size of 2**64 - 2", lambda e, size: e[0].__setitem__(1, 2**64 - 2), _OUTSIDE),
        ("size too small", lambda e, size: e[2].__setitem__(1, 4), _OUTSIDE),
        ("marked absent", lambda e, size: e.__setitem__(2, [2**64 - 1, 2**64 - 1]), "missing"),
        ("two swapped", lambda e, size: _swap(e, 1, 3), _MISPLACED),
        ("two naming the same bytes", lambda e, size: e.__setitem__(3, e[1]), "overlap"),
    ],
    ids=lambda e: e[0],
)
def test_a_crafted_shard_index_is_refused(tmp_path, small_inner_chunks, entry):
    """Entries outside the file, absent (an absent chunk is missing data, never zeros), or naming
    chunks in other places (each chunk's own checksum holds): all refused, naming the value."""
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    entries = _entries(shard, 4)
    entry[1](entries, shard.stat().st_size)
    _write_entries(shard, entries)
    _refused(path, tree, "w", entry[2])


@pytest.mark.parametrize("keep", [0, 1, 100, "all but the last byte", "all but the index"])
def test_a_truncated_shard_is_refused(tmp_path, small_inner_chunks, keep):
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    raw = shard.read_bytes()
    keep = {"all but the last byte": len(raw) - 1, "all but the index": len(raw) - 4 * _ENTRY - _CRC}.get(keep, keep)
    shard.write_bytes(raw[:keep])
    _refused(path, tree, "w", "damaged")


def test_a_shard_with_bytes_appended_is_refused(tmp_path, small_inner_chunks):
    """The index is read from the file's end: a longer file moves it, and its checksum fails."""
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    shard.write_bytes(shard.read_bytes() + bytes(16))
    _refused(path, tree, "w", "damaged")


def test_a_missing_shard_file_is_refused(tmp_path, small_inner_chunks):
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    shard.unlink()
    _refused(path, tree, "w", "missing")


def test_a_missing_zarr_json_is_refused(tmp_path, small_inner_chunks):
    path, tree = _saved(tmp_path)
    (_folder(path, "w") / "zarr.json").unlink()
    _refused(path, tree, "w", "missing")


@pytest.mark.parametrize("chunk", [0, 3], ids=["first inner chunk", "last inner chunk"])
@pytest.mark.parametrize("at", ["data", "its checksum"])
def test_an_inner_chunk_with_a_flipped_byte_is_refused(tmp_path, small_inner_chunks, chunk, at):
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    offset, size = _entries(shard, 4)[chunk]
    raw = bytearray(shard.read_bytes())
    raw[int(offset) + (int(size) - 2 if at == "its checksum" else 100)] ^= 0x01
    shard.write_bytes(bytes(raw))
    _refused(path, tree, "w", "fails its checksum")
    with pytest.raises(ValueError):  # TensorStore alone refuses it too
        _ts_read(_folder(path, "w"))
    # A region that does not touch the damaged chunk still reads (each inner chunk has its own checksum).
    rows = slice(24, 32) if chunk == 0 else slice(0, 8)
    from jaxckpt.reading.reader import Opened

    got = Opened(locations.location(path)).read_regions({"w": [(rows, slice(0, 32))]})["w"][0]
    _same_bits(got, tree["w"][rows])


def test_a_flipped_byte_in_a_packed_leaf_names_that_leaf(tmp_path, small_inner_chunks):
    """A pack's inner chunks carry no CRC-32C: each leaf's own CRC-32 in the index catches it."""
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "small"))
    at = _index(path)["leaves"]["small"]["at"]
    raw = bytearray(shard.read_bytes())
    raw[at["offset"] + 5] ^= 0x02
    shard.write_bytes(bytes(raw))
    _refused(path, tree, "small", "checksum")


# --- inner chunks read and checksummed in pieces --------------------------------------------------


@pytest.fixture
def small_read_pieces(monkeypatch):
    """Inner chunks read and checksummed 100 bytes at a time: a 1 KiB chunk is 10 pieces and a short
    one, none of them aligned to its elements."""
    monkeypatch.setattr(zarr_local, "READ_PIECE", 100)


def _chunk_file(tmp_path: Path, data: bytes, stored: bytes | None = None) -> int:
    """A file of 7 bytes, then ``data`` and its CRC-32C (or ``stored``), opened for reading."""
    file = tmp_path / "chunk"
    file.write_bytes(b"x" * 7 + data + (zarr_local.crc_bytes(memoryview(data)) if stored is None else stored))
    return os.open(file, os.O_RDONLY)


@pytest.mark.parametrize("piece", [1, 7, 100, 1024, 1027, 1 << 20])
@pytest.mark.parametrize("size", [0, 1, 1024, 1027])
def test_a_chunk_read_in_pieces_has_the_crc_of_the_whole(tmp_path, monkeypatch, piece, size):
    monkeypatch.setattr(zarr_local, "READ_PIECE", piece)
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    fd = _chunk_file(tmp_path, data)
    into = np.full(size, 0xAA, np.uint8)
    try:
        crc = zarr_local._read_chunk(fd, memoryview(into), 7, True)
    finally:
        os.close(fd)
    assert crc == zarr_local.crc32c_of(data) and into.tobytes() == data


@pytest.mark.parametrize("where", [0, 99, 100, 550, 1000, 1023, "checksum"])
def test_a_flipped_byte_in_any_piece_of_a_chunk_fails_its_checksum(tmp_path, small_read_pieces, where):
    data = bytearray(np.random.default_rng(3).integers(0, 256, 1024, np.uint8).tobytes())
    stored = bytearray(zarr_local.crc_bytes(memoryview(bytes(data))))
    if where == "checksum":
        stored[3] ^= 0x40
    else:
        data[where] ^= 0x01
    fd = _chunk_file(tmp_path, bytes(data), bytes(stored))
    try:
        assert zarr_local._read_chunk(fd, memoryview(bytearray(1024)), 7, True) is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("keep", [7, 8, 7 + 100, 7 + 550, 7 + 1023, 7 + 1024, 7 + 1027])
def test_a_chunk_cut_short_in_any_piece_is_not_read(tmp_path, small_read_pieces, keep):
    """A file that ends inside the chunk or its checksum (shrunk after its index was checked)."""
    data = np.random.default_rng(4).integers(0, 256, 1024, np.uint8).tobytes()
    fd = _chunk_file(tmp_path, data)
    os.truncate(tmp_path / "chunk", keep)
    try:
        assert zarr_local._read_chunk(fd, memoryview(bytearray(1024)), 7, True) is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("shape", [(32, 32), (1009, 8), (7, 1013)])
def test_arrays_read_in_pieces_of_odd_sizes(tmp_path, small_packs, small_inner_chunks, small_read_pieces, shape):
    values = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    path = Path(jaxckpt.save(tmp_path / "c", {"w": values}))
    _same_bits(jaxckpt.restore(path)["w"], values)
    assert verify.verify(str(path)).ok


@pytest.mark.parametrize("at", [0, 150, 1020, "its checksum"])
def test_damage_in_a_middle_piece_of_an_inner_chunk_is_refused(tmp_path, small_inner_chunks, small_read_pieces, at):
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    offset, size = _entries(shard, 4)[2]
    raw = bytearray(shard.read_bytes())
    raw[int(offset) + (int(size) - 1 if at == "its checksum" else at)] ^= 0x10
    shard.write_bytes(bytes(raw))
    _refused(path, tree, "w", "fails its checksum")


def test_a_shard_of_several_chunks_is_read_with_sequential_read_ahead(tmp_path, monkeypatch, small_inner_chunks):
    """Each shard file read is marked sequential (the kernel then reads ahead twice its device's
    read-ahead), and nothing asks POSIX_FADV_WILLNEED, of which Linux reads only one read-ahead."""
    path, tree = _saved(tmp_path)
    advice = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *args: advice.append(args) or real(fd, *args))
    _same_bits(jaxckpt.restore(path)["w"], tree["w"])
    assert (0, 0, os.POSIX_FADV_SEQUENTIAL) in advice
    assert not [a for a in advice if a[-1] == os.POSIX_FADV_WILLNEED]


# --- what TensorStore alone reads ------------------------------------------------------------------


def _prime_above(n: int) -> int:
    while any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def test_an_array_of_prime_size_is_padded_to_whole_inner_chunks(tmp_path, small_packs):
    """Over 8 MiB and prime: the shard is padded to a multiple of 8 MiB inner chunks, not one chunk of
    any size; jaxckpt and TensorStore alone read back exactly the array."""
    n = _prime_above((8 << 20) // 4 + 1)  # 2,097,169 float32: just over 8 MiB
    values = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    path = Path(jaxckpt.save(tmp_path / "c", {"w": values}))
    at = _index(path)["leaves"]["w"]["at"]
    assert at["chunks"] == [2 * (2 << 20)]  # two inner chunks of 2**21 elements
    folder = _folder(path, "w")
    assert _chunks_per_shard(folder) == 2
    (shard,) = _shards(folder)
    assert shard.stat().st_size == 2 * ((8 << 20) + _CRC) + 2 * _ENTRY + _CRC
    _same_bits(jaxckpt.restore(path)["w"], values)
    _same_bits(_ts_read(folder), values)
    _same_bits(jaxckpt.load_variable(path, "w")[n - 7 :], values[n - 7 :])
    assert verify.verify(str(path)).ok


@pytest.mark.parametrize("shape", [(1009, 8), (8, 1009), (1031, 3, 5), (7, 1013)])
def test_arrays_of_prime_sizes_with_small_inner_chunks(tmp_path, small_packs, small_inner_chunks, shape):
    values = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    path = Path(jaxckpt.save(tmp_path / "c", {"w": values}))
    at = _index(path)["leaves"]["w"]["at"]
    assert at["chunks"] == list(zarr_meta.shard_shape(shape, shape, 4))
    assert all(c >= n for c, n in zip(at["chunks"], shape))
    folder = _folder(path, "w")
    _same_bits(_ts_read(folder), values)
    _same_bits(jaxckpt.restore(path)["w"], values)
    from jaxckpt.reading.reader import Opened

    rows = slice(shape[0] - 3, shape[0])  # the rows in the padded inner chunk
    got = Opened(locations.location(path)).read_regions({"w": [(rows, *[slice(None)] * (len(shape) - 1))]})["w"][0]
    _same_bits(got, values[rows])
    assert verify.verify(str(path)).ok


def _int4(values):
    return np.asarray(values, np.int8).astype(ml_dtypes.int4)


OWN_ARRAYS = {
    "rank 0": lambda: np.float32(3.25),
    "rank 0 array": lambda: np.array(-7, np.int64),
    "zero size": lambda: np.zeros((0, 3), np.float32),
    "zero size, last dim": lambda: np.zeros((4, 0), np.int16),
    "bfloat16": lambda: np.random.default_rng(3).standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
    "int4": lambda: _int4(np.arange(-8, 8).reshape(4, 4)),
    "bool": lambda: np.random.default_rng(4).random((3, 11)) < 0.5,
    "complex64": lambda: (np.arange(12) + 1j * np.arange(12)[::-1]).astype(np.complex64).reshape(3, 4),
    "float8_e4m3fn": lambda: np.arange(9).astype(ml_dtypes.float8_e4m3fn),
}


@pytest.mark.parametrize("name", list(OWN_ARRAYS))
def test_own_arrays_are_read_by_tensorstore_alone_bit_for_bit(tmp_path, small_packs, name):
    value = OWN_ARRAYS[name]()
    path = Path(jaxckpt.save(tmp_path / "c", {"x": value}))
    at = _index(path)["leaves"]["x"]["at"]
    assert "array" in at, at
    folder = _folder(path, "x")
    meta = json.loads((folder / "zarr.json").read_bytes())
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    assert meta["codecs"][0]["configuration"]["codecs"][-1] == {"name": "crc32c"}
    got = _ts_read(folder)
    assert got.shape == np.shape(value)
    if np.asarray(value).dtype.name in meta["data_type"]:
        _same_bits(got, np.asarray(value))
    else:  # stored as raw bits of the same width
        _same_bits(got, np.asarray(value).view(got.dtype))
    restored = jaxckpt.restore(path)["x"]
    _same_bits(restored, value)
    assert type(restored) is type(value)
    assert verify.verify(str(path)).ok


def test_a_pack_is_read_by_tensorstore_alone(tmp_path):
    """A pack: a 1-D uint8 zarr3 array, inner chunks without CRC-32C, the index with one."""
    tree = {"a": np.arange(5, dtype=np.int32), "b": np.ones((2, 3), ml_dtypes.bfloat16), "c": np.array([2.5, -1])}
    path = Path(jaxckpt.save(tmp_path / "c", tree))
    index = _index(path)
    folder = _folder(path, "a")
    meta = json.loads((folder / "zarr.json").read_bytes())
    config = meta["codecs"][0]["configuration"]
    assert meta["data_type"] == "uint8" and {"name": "crc32c"} not in config["codecs"]
    assert config["index_codecs"][-1] == {"name": "crc32c"}
    raw = _ts_read(folder)
    for key, value in tree.items():
        at = index["leaves"][key]["at"]
        _same_bits(
            raw[at["offset"] : at["offset"] + at["nbytes"]].view(np.asarray(value).dtype).reshape(np.shape(value)),
            value,
        )


# --- regions onto another mesh ---------------------------------------------------------------------


def _mesh(shape, names, devices=None):
    devices = jax.devices()[: math.prod(shape)] if devices is None else devices
    return jax.sharding.Mesh(np.array(devices).reshape(shape), names)


@pytest.mark.parametrize(
    "target",
    [
        lambda: NamedSharding(_mesh((6,), ("d",)), P("d")),
        lambda: NamedSharding(_mesh((8,), ("d",)), P(None, "d")),
        lambda: NamedSharding(_mesh((2, 4), ("x", "y")), P("x", "y")),
        lambda: NamedSharding(_mesh((2, 2), ("x", "y"), jax.devices()[4:]), P(None, ("x", "y"))),
    ],
    ids=["6-rows", "8-columns", "(2,4)", "other-4-devices"],
)
def test_a_region_restore_onto_another_mesh_reads_partial_inner_chunks(tmp_path, monkeypatch, small_packs, target):
    """Saved over a (4, 2) mesh: shards of (24, 16), inner chunks of (12, 16) (768 bytes at most).
    The target's regions start and end inside inner chunks: each is read whole, checked, and cut."""
    monkeypatch.setattr(zarr_meta, "INNER_CHUNK_LIMIT", 768)
    values = np.random.default_rng(5).standard_normal((96, 32)).astype(np.float32)
    saved = jax.device_put(values, NamedSharding(_mesh((4, 2), ("x", "y")), P("x", "y")))
    path = Path(jaxckpt.save(tmp_path / "c", {"w": saved}))
    folder = _folder(path, "w")
    assert _index(path)["leaves"]["w"]["at"]["chunks"] == [24, 16]
    assert json.loads((folder / "zarr.json").read_bytes())["codecs"][0]["configuration"]["chunk_shape"] == [12, 16]
    assert len(_shards(folder)) == 8
    sharding = target()
    partial = []
    real = zarr_local.LocalReader._read_part

    def recording(self, array, plan):
        partial.append(any(not piece.direct for piece in plan.pieces))
        return real(self, array, plan)

    monkeypatch.setattr(zarr_local.LocalReader, "_read_part", recording)
    restored = jaxckpt.restore(path, like={"w": jax.ShapeDtypeStruct((96, 32), np.float32, sharding=sharding)})
    assert restored["w"].sharding == sharding
    _same_bits(np.asarray(restored["w"]), values)
    for shard in restored["w"].addressable_shards:
        _same_bits(np.asarray(shard.data), values[shard.index])
    assert any(partial), "no region read part of an inner chunk"


def test_damage_in_an_inner_chunk_read_in_part_is_refused(tmp_path, monkeypatch, small_packs):
    """A region that wants a few rows of a damaged inner chunk reads it whole, and checks it."""
    monkeypatch.setattr(zarr_meta, "INNER_CHUNK_LIMIT", 768)
    values = np.random.default_rng(6).standard_normal((96, 32)).astype(np.float32)
    path = Path(jaxckpt.save(tmp_path / "c", {"w": values}))
    folder = _folder(path, "w")
    (shard,) = _shards(folder)
    meta = json.loads((folder / "zarr.json").read_bytes())
    assert meta["codecs"][0]["configuration"]["chunk_shape"] == [6, 32]  # 768 bytes: 6 rows of 128
    offset, _ = _entries(shard, 16)[2]  # rows 12..18
    raw = bytearray(shard.read_bytes())
    raw[int(offset) + 32 * 4 * 5 + 3] ^= 0x80  # in row 17, which the region below does not want
    shard.write_bytes(bytes(raw))
    from jaxckpt.reading.reader import Opened

    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'.*fails its checksum"):
        Opened(locations.location(path)).read_regions({"w": [(slice(13, 15), slice(3, 9))]})["w"][0]
    sharding = NamedSharding(_mesh((8,), ("d",)), P("d"))  # rows of 12: device 1 reads rows 12..24
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="'w'"):
        jaxckpt.restore(path, like={"w": jax.ShapeDtypeStruct((96, 32), np.float32, sharding=sharding)})
    got = Opened(locations.location(path)).read_regions({"w": [(slice(24, 40), slice(0, 32))]})["w"][0]
    _same_bits(got, values[24:40])


# --- TensorStore writes the same layout elsewhere ---------------------------------------------------


def _copy_down(source: str, target: Path) -> list[str]:
    """Copy every object under ``source`` (a kvstore folder) to the local folder ``target``."""
    kv = ts.KvStore.open(locations.location(source).spec(), context=store_write._context()).result()
    keys = sorted(k.decode() for k in kv.list().result())
    for key in keys:
        (target / key).parent.mkdir(parents=True, exist_ok=True)
        (target / key).write_bytes(kv.read(key).result().value)
    return keys


def _tree_for_layout(packed: bool):
    rng = np.random.default_rng(7)
    mesh = _mesh((4, 2), ("x", "y"))
    tree = {
        "sharded": jax.device_put(rng.standard_normal((64, 32)).astype(np.float32), NamedSharding(mesh, P("x", "y"))),
        "big": rng.standard_normal((3000, 1000)).astype(np.float32),  # 12 MB: two inner chunks
        "prime": rng.standard_normal(2_097_169).astype(np.float32),  # padded shard
        "bf16": rng.standard_normal((40, 40)).astype(ml_dtypes.bfloat16),
        "small": np.arange(7, dtype=np.int16),
        "scalar": np.float32(1.5),
    }
    if packed:  # a pack (a 1-D uint8 zarr3 array), and an own array of a 1-byte type
        tree["bools"] = rng.random(5000) < 0.5
    return tree


LAYOUTS = [
    pytest.param(True, id="with a pack and a 1-byte array"),
    pytest.param(False, id="own arrays of wider types only"),
]


@pytest.mark.parametrize("packed", LAYOUTS)
def test_s3_writes_the_layout_the_local_reader_reads(tmp_path, monkeypatch, s3, local_packing, packed):
    if not packed:
        monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", -1)
        monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", -1)
    tree = _tree_for_layout(packed)
    local = Path(jaxckpt.save(tmp_path / "local", tree))
    remote = jaxckpt.save(f"{s3}/c", tree)
    down = tmp_path / "down"
    keys = _copy_down(remote, down)
    expected = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert keys == expected
    assert _index(down)["leaves"] == _index(local)["leaves"] and _index(down)["packs"] == _index(local)["packs"]
    for key in ("big", "prime", "bf16"):  # TensorStore alone reads both the same
        _same_bits(_ts_read(_folder(down, key)), _ts_read(_folder(local, key)))
    restored = jaxckpt.restore(down)  # jaxckpt's own reader, on files TensorStore wrote
    for key, value in tree.items():
        _same_bits(restored[key], np.asarray(value))
    assert verify.verify(str(down)).ok
    # Damage in what TensorStore wrote is found by jaxckpt's reader too.
    (shard,) = _shards(_folder(down, "big"))
    raw = bytearray(shard.read_bytes())
    raw[12345] ^= 0x04
    shard.write_bytes(bytes(raw))
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'big'.*fails its checksum"):
        jaxckpt.load_variable(down, "big")


def test_what_jaxckpt_writes_locally_reads_on_s3(tmp_path, s3):
    """The other way: local files, uploaded as they are, read by TensorStore through jaxckpt."""
    tree = _tree_for_layout(packed=True)
    local = Path(jaxckpt.save(tmp_path / "local", tree))
    target = locations.location(f"{s3}/up")
    kv = ts.KvStore.open(target.spec()).result()
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        kv.write(str(file.relative_to(local)), file.read_bytes()).result()
    restored = jaxckpt.restore(f"{s3}/up")
    for key, value in tree.items():
        _same_bits(restored[key], np.asarray(value))


@pytest.mark.parametrize("packed", LAYOUTS)
def test_memory_store_writes_the_same_layout(tmp_path, monkeypatch, local_packing, packed):
    if not packed:
        monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", -1)
        monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", -1)
    tree = {"w": np.random.default_rng(8).standard_normal((50, 70)).astype(np.float32), "s": np.arange(3.0)}
    if packed:
        tree["b"] = np.array([True, False])
    remote = jaxckpt.save(f"memory://zarr-local-layout/{tmp_path.name}", tree)
    local = Path(jaxckpt.save(tmp_path / "local", tree))
    down = tmp_path / "down"
    keys = _copy_down(remote, down)
    assert keys == sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    restored = jaxckpt.restore(down)
    for key, value in tree.items():
        _same_bits(restored[key], value)


@pytest.mark.parametrize("name", ["bool", "int8", "float8_e4m3fn", "int4"])
def test_one_byte_arrays_written_by_tensorstore_read_locally(tmp_path, small_packs, name):
    value = {
        "bool": np.arange(20) % 3 == 0,
        "int8": np.arange(-10, 10, dtype=np.int8),
        "float8_e4m3fn": np.arange(9).astype(ml_dtypes.float8_e4m3fn),
        "int4": _int4(np.arange(-8, 8)),
    }[name]
    remote = jaxckpt.save(f"memory://zarr-local-one-byte/{tmp_path.name}", {"x": value})
    _copy_down(remote, tmp_path / "down")
    _same_bits(jaxckpt.restore(tmp_path / "down")["x"], value)


def test_a_local_save_writes_packs_and_arrays_from_the_leaves_own_buffers(tmp_path):
    """No copy of the packed bytes (nor of an array's shard) is made: CPU jax arrays are written
    straight from their buffers. numpy reports its allocations to tracemalloc."""
    import tracemalloc

    import jax.numpy as jnp

    tree = {f"w{i}": jnp.full((128, 1024), i, jnp.float32) for i in range(40)}  # 512 KiB each: packed
    tree["big"] = jnp.ones((2048, 1024), jnp.float32)  # 8 MiB: its own array
    jaxckpt.save(tmp_path / "warm", tree)
    tracemalloc.start()
    try:
        jaxckpt.save(tmp_path / "c", tree)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"a save of 28 MiB allocated {peak / 2**20:.1f} MiB"
    restored = jaxckpt.restore(tmp_path / "c")
    assert float(restored["w39"][5, 5]) == 39 and float(restored["big"].sum()) == 2048 * 1024


@pytest.mark.parametrize("what", ["shard", "zarr.json"])
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "folder"])
def test_a_shard_or_zarr_json_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, what, kind):
    """A crafted checkpoint may put a FIFO (whose open would wait for a writer forever), a device or a
    folder where a file belongs: refused as damage, naming the value."""
    path = Path(jaxckpt.save(tmp_path / "c", {"w": np.ones((600, 600), np.float32), "small": np.arange(3)}))
    folder = _folder(path, "w")
    target = _shards(folder)[0] if what == "shard" else folder / "zarr.json"
    target.unlink()
    (path / "data" / "spare").write_bytes(bytes(2 << 20))  # the store-size check before reading passes
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    else:
        target.symlink_to("/dev/zero")
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'.*not a regular file"):
        jaxckpt.restore(path)
    np.testing.assert_array_equal(jaxckpt.load_variable(path, "small"), np.arange(3))


def test_a_chunk_that_several_regions_want_part_of_is_read_once(tmp_path, monkeypatch):
    """Saved sharded by rows and restored sharded by columns, every inner chunk is wanted in part by
    several devices' regions: it is read and checked once for all of them, and let go after."""
    values = np.random.default_rng(7).standard_normal((1024, 1024)).astype(np.float32)  # over the pack limit
    saved = jax.device_put(values, NamedSharding(_mesh((8,), ("d",)), P("d")))
    path = Path(jaxckpt.save(tmp_path / "c", {"w": saved}))
    read = []
    real = zarr_local._read_chunk

    def counting(fd, into, offset, checksum):
        read.append(len(into))
        return real(fd, into, offset, checksum)

    monkeypatch.setattr(zarr_local, "_read_chunk", counting)
    sharding = NamedSharding(_mesh((8,), ("d",)), P(None, "d"))
    restored = jaxckpt.restore(path, like={"w": jax.ShapeDtypeStruct((1024, 1024), np.float32, sharding=sharding)})
    _same_bits(np.asarray(restored["w"]), values)
    assert sum(read) == values.nbytes, f"read {sum(read)} bytes of chunks for {values.nbytes} bytes"
    from jaxckpt.reading.reader import Opened

    opened = Opened(locations.location(path))
    opened.read_regions({"w": [(slice(0, 1024), slice(128 * i, 128 * i + 128)) for i in range(8)]})
    assert all(not r._local._partial for r in opened._readers.values() if r._local is not None)


# --- zarr v3 data type names -----------------------------------------------------------------------

# Every dtype jaxckpt stores has a registered zarr v3 name (the core types, and zarr-extensions'
# data-types/), but float8_e4m3fn (OCP FP8 E4M3, no infinities), which has only TensorStore's name:
# zarr's float8_e4m3 is the IEEE-like type with infinities, another type.
DTYPE_VALUES = {
    "float32": lambda: np.linspace(-1, 1, 40, dtype=np.float32),  # core types, for comparison
    "bool": lambda: np.arange(10) % 3 == 0,
    "bfloat16": lambda: np.linspace(-3, 3, 40).astype(ml_dtypes.bfloat16),
    "float8_e4m3fn": lambda: np.linspace(-448, 448, 40).astype(ml_dtypes.float8_e4m3fn),
    "float8_e4m3": lambda: np.array([-np.inf, np.inf, np.nan, 1.5, -240.0], np.float32).astype(ml_dtypes.float8_e4m3),
    "float8_e5m2": lambda: np.linspace(-5e4, 5e4, 40).astype(ml_dtypes.float8_e5m2),
    "float8_e8m0fnu": lambda: np.array([2.0**-10, 1.0, 2.0**20], np.float32).astype(ml_dtypes.float8_e8m0fnu),
    "float4_e2m1fn": lambda: np.linspace(-6, 6, 25).astype(ml_dtypes.float4_e2m1fn),
    "float6_e2m3fn": lambda: np.linspace(-7.5, 7.5, 31).astype(ml_dtypes.float6_e2m3fn),
    "float6_e3m2fn": lambda: np.linspace(-28, 28, 31).astype(ml_dtypes.float6_e3m2fn),
    "int4": lambda: _int4(np.arange(-8, 8).reshape(4, 4)),
    "uint4": lambda: np.arange(16).astype(ml_dtypes.uint4),
    "int2": lambda: np.array([-2, -1, 0, 1] * 3, np.int8).astype(ml_dtypes.int2),
    "uint2": lambda: np.array([0, 1, 2, 3] * 3, np.uint8).astype(ml_dtypes.uint2),
}
DTYPE_VALUES = {n: f for n, f in DTYPE_VALUES.items() if hasattr(ml_dtypes, n) or hasattr(np, n)}
# What TensorStore's zarr3 driver (0.1.86) cannot open: registered names it does not know yet.
TENSORSTORE_LACKS = {"float8_e4m3", "float6_e2m3fn", "float6_e3m2fn", "uint2", "uint4"}


def _opens_with_tensorstore(folder: Path) -> bool:
    try:
        _ts_read(folder)
    except ValueError as e:
        assert "data_type" in str(e), e
        return False
    return True


@pytest.mark.parametrize("name", list(DTYPE_VALUES))
def test_local_arrays_are_stored_by_their_zarr_names(tmp_path, small_packs, name):
    """On a local disk jaxckpt's writer stores each dtype by its own name: the registered zarr v3
    name, or TensorStore's for float8_e4m3fn. TensorStore alone reads what it knows, bit for bit."""
    value = DTYPE_VALUES[name]()
    path = Path(jaxckpt.save(tmp_path / "c", {"x": value}))
    assert _index(path)["leaves"]["x"]["at"]["stored"] == name
    folder = _folder(path, "x")
    assert json.loads((folder / "zarr.json").read_bytes())["data_type"] == name
    restored = jaxckpt.restore(path)["x"]
    _same_bits(restored, value)
    if _opens_with_tensorstore(folder):  # a TensorStore that knows the name (0.1.86 lacks five)
        _same_bits(_ts_read(folder), value)
    else:
        assert name in TENSORSTORE_LACKS
    assert verify.verify(str(path)).ok


@pytest.mark.parametrize("name", list(DTYPE_VALUES))
def test_tensorstore_writes_the_names_it_knows_and_raw_bits_otherwise(name, small_packs):
    """Where TensorStore writes (object stores, memory://), a dtype it has no name for is stored as
    the unsigned integer of its width (its raw bits), as before; both read back."""
    value = DTYPE_VALUES[name]()
    path = jaxckpt.save(f"memory://dtype-names/{name}", {"x": value})
    at = json.loads(locations.read_index_bytes(locations.location(path)))["leaves"]["x"]["at"]
    assert at["stored"] == ("uint8" if name in TENSORSTORE_LACKS else name)
    _same_bits(jaxckpt.restore(path)["x"], value)


def test_registered_names_read_where_tensorstore_reads(tmp_path, small_packs):
    """A local checkpoint with names TensorStore does not know, copied as it is to where TensorStore
    reads it (a tier's upload, jaxckpt.copy): jaxckpt reads those arrays as their raw bits, as the
    index says; their zarr.json is not read there (format 5, see Reader.open_arrays)."""
    tree = {n: f() for n, f in DTYPE_VALUES.items()}
    tree["wide"] = np.arange(3000).astype(ml_dtypes.uint4).reshape(30, 100)  # several regions below
    local = Path(jaxckpt.save(tmp_path / "local", tree))
    target = locations.location("memory://registered-up/c")
    kv = ts.KvStore.open(target.spec(), context=store_write._context()).result()
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        kv.write(str(file.relative_to(local)), file.read_bytes()).result()
    restored = jaxckpt.restore(target.text)
    for key, value in tree.items():
        _same_bits(restored[key], value)
    part = jaxckpt.load_variable(target.text, "wide")[7:9, 10:20]
    _same_bits(part, tree["wide"][7:9, 10:20])
    assert verify.verify(target.text).ok
    # Its zarr.json is not read there: the index (checksummed) decides how the bytes are read, and the
    # bytes are checked against the data store's checksums, so one that names another type changes
    # no value (one request less per array on a bucket; a local disk still checks it).
    meta = json.loads((_folder(local, "uint4") / "zarr.json").read_bytes())
    array = _index(local)["leaves"]["uint4"]["at"]["array"]
    kv.write(f"data/{array}/zarr.json", json.dumps({**meta, "data_type": "int4"}).encode()).result()
    _same_bits(jaxckpt.load_variable(target.text, "uint4"), tree["uint4"])


@pytest.mark.parametrize("name", list(DTYPE_VALUES))
def test_zarr_python_reads_what_it_knows(tmp_path, small_packs, name):
    """zarr-python (when installed) reads the registered names it supports, bit for bit."""
    zarr = pytest.importorskip("zarr")
    value = DTYPE_VALUES[name]()
    path = Path(jaxckpt.save(tmp_path / "c", {"x": value}))
    try:
        array = zarr.open_array(_folder(path, "x"), mode="r")
    except Exception as e:  # a data type this zarr-python does not know
        pytest.skip(f"zarr {zarr.__version__} cannot open {name}: {e}")
    got = np.asarray(array[...])
    assert (
        got.tobytes() == np.asarray(value).tobytes()
        or got.view(np.uint8).tobytes() == np.asarray(value).view(np.uint8).tobytes()
    ), (got, value)
