"""Flax msgpack and safetensors: the readers against files the real libraries wrote
(tests/golden/foreign/make_small.py), the streaming safetensors writer, and crafted bad input."""

from __future__ import annotations

import json
import math
import os
import struct
import tracemalloc
from pathlib import Path

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxckpt._errors import (
    CheckpointCorruptedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    JaxckptError,
    MismatchError,
    UnsupportedValueError,
)
from jaxckpt.format.records import NUMPY, NUMPY_SCALAR, ArrayLeaf, ValueLeaf
from jaxckpt.interop import flax_msgpack as fm
from jaxckpt.interop import safetensors as sf
from jaxckpt.interop.formats import ForeignCheckpoint

GOLDEN = Path(__file__).parent / "golden" / "foreign"
MSGPACK = GOLDEN / "msgpack"
SAFETENSORS = GOLDEN / "safetensors"


def load(path: Path, module) -> ForeignCheckpoint:
    return ForeignCheckpoint(module.open(str(path)))


def bits(x: np.ndarray) -> np.ndarray:
    """What expected.npz holds for ``x``: bfloat16 as its uint16 bits."""
    return x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x


def check_against(ckpt: ForeignCheckpoint, expected: dict, npz, prefix: str) -> None:
    assert sorted(ckpt.index.leaves) == sorted(expected)
    for key, want in expected.items():
        leaf = ckpt.index.leaves[key]
        if "value" in want:
            assert isinstance(leaf, ValueLeaf)
            assert (leaf.type, leaf.value) == (want["type"], want["value"])
            assert type(leaf.value).__name__ == want["type"]
            continue
        assert isinstance(leaf, ArrayLeaf) and leaf.container == NUMPY
        assert (str(leaf.dtype), list(leaf.shape)) == (want["dtype"], want["shape"])
        got = ckpt.read(key)
        assert (str(got.dtype), list(got.shape)) == (want["dtype"], want["shape"])
        ref = npz[f"{prefix}:{key}"]
        assert bits(got).dtype == ref.dtype and bits(got).tobytes() == ref.tobytes(), key


# --- Flax msgpack: golden files -------------------------------------------------------------------


def test_msgpack_golden_to_bytes():
    expected = json.loads((MSGPACK / "expected.json").read_text())
    with np.load(MSGPACK / "expected.npz", allow_pickle=False) as npz:
        ckpt = load(MSGPACK / "params.msgpack", fm)
        assert ckpt.name == "Flax msgpack"
        check_against(ckpt, expected["params.msgpack"], npz, "params.msgpack")
    # flax's state dict turned the list into a map keyed "0", "1": those names are kept
    assert ckpt.index.nodes["layers"].keys == ("0", "1")
    assert {str(ckpt.index.leaves[k].dtype) for k in ckpt.index.leaves if k.startswith("layers")} == {
        "bfloat16",
        "int32",
    }


def test_msgpack_golden_legacy_folder():
    folder = MSGPACK / "legacy"
    expected = json.loads((MSGPACK / "expected.json").read_text())
    assert fm.manages(str(folder))
    assert fm.latest(str(folder)) == str(folder / "checkpoint_20")
    assert not sf.manages(str(folder))
    with np.load(MSGPACK / "expected.npz", allow_pickle=False) as npz:
        for step in (10, 20):
            name = f"legacy/checkpoint_{step}"
            assert fm.detect(str(folder / f"checkpoint_{step}"))
            check_against(load(folder / f"checkpoint_{step}", fm), expected[name], npz, name)


def test_detect():
    st_file, mp_file = str(SAFETENSORS / "model.safetensors"), str(MSGPACK / "params.msgpack")
    assert fm.detect(mp_file) and not sf.detect(mp_file)
    assert sf.detect(st_file) and not fm.detect(st_file)
    for folder in (MSGPACK, MSGPACK / "legacy", SAFETENSORS):
        assert not fm.detect(str(folder)) and not sf.detect(str(folder))
    assert not fm.detect(str(MSGPACK / "expected.json")) and not sf.detect(str(MSGPACK / "expected.json"))
    assert not fm.detect(str(MSGPACK / "absent.msgpack")) and not sf.detect(str(SAFETENSORS / "absent.safetensors"))
    assert not fm.manages(str(SAFETENSORS)) and fm.latest(str(SAFETENSORS)) is None


def test_detect_by_first_bytes(tmp_path):
    a, b = tmp_path / "weights.bin", tmp_path / "params.bin"
    a.write_bytes((SAFETENSORS / "model.safetensors").read_bytes())
    b.write_bytes((MSGPACK / "params.msgpack").read_bytes())
    assert sf.detect(str(a)) and not fm.detect(str(a))
    assert fm.detect(str(b)) and not sf.detect(str(b))
    c = tmp_path / "notes.txt"
    c.write_text("hello")
    assert not sf.detect(str(c)) and not fm.detect(str(c))
    d = tmp_path / "blob.bin"  # a map byte, then a str header, then bytes that are not text
    d.write_bytes(b"\x83\xa4\x00\x01\x02\x03")
    assert not fm.detect(str(d))
    for name in ("x.msgpack", "x.safetensors"):  # folders are never one of these files
        (tmp_path / name).mkdir()
        assert not fm.detect(str(tmp_path / name)) and not sf.detect(str(tmp_path / name))


def test_legacy_folder_ignores_temp_files_and_orbax_folders(tmp_path):
    good = (MSGPACK / "params.msgpack").read_bytes()
    (tmp_path / "checkpoint_tmp").write_bytes(good)  # flax's temp file, renamed when complete
    (tmp_path / "checkpoint_50").mkdir()  # an Orbax-backed flax checkpoint is a folder
    (tmp_path / "checkpoint_40_gda").mkdir()
    (tmp_path / "checkpoint_60").write_text("not msgpack")
    assert not fm.manages(str(tmp_path)) and fm.latest(str(tmp_path)) is None
    (tmp_path / "checkpoint_3").write_bytes(good)
    (tmp_path / "checkpoint_12").write_bytes(good)  # newest by step, not by name
    assert fm.manages(str(tmp_path))
    assert fm.latest(str(tmp_path)) == str(tmp_path / "checkpoint_12")


# --- Flax msgpack: forms flax writes --------------------------------------------------------------


def ext_array(x: np.ndarray, code: int = fm.EXT_NDARRAY) -> msgpack.ExtType:
    payload = msgpack.packb((x.shape, x.dtype.name, x.tobytes("C")), use_bin_type=True)
    return msgpack.ExtType(code, payload)


def write_msgpack(path: Path, obj) -> str:
    path.write_bytes(msgpack.packb(obj, use_bin_type=True))
    return str(path)


def test_msgpack_values_of_every_kind(tmp_path):
    f16 = np.array([1.5, -2.0], np.float16)
    tree = {
        "arr": ext_array(f16),
        "npscalar": ext_array(np.array(7, np.int64), fm.EXT_NPSCALAR),
        "complex": msgpack.ExtType(fm.EXT_COMPLEX, msgpack.packb((1.0, -2.5))),
        "none": None,
        "flag": True,
        "name": "adam",
        "big": 2**63 + 5,
        "list": [1, ext_array(np.arange(3, dtype=np.uint8))],  # msgpack_serialize keeps lists
        7: 0.5,  # int keys read as their str, as flax's state dicts write them
        "raw": b"\x00\x01",
        "unknown": msgpack.ExtType(42, b"xyz"),
        "when": msgpack.Timestamp(5),
        "a/b": 1,  # a "/" in a name is one edge, escaped in the key
    }
    ckpt = load(Path(write_msgpack(tmp_path / "x.msgpack", tree)), fm)
    leaves = ckpt.index.leaves
    assert ckpt.read("arr").tobytes() == f16.tobytes() and ckpt.read("arr").dtype == np.float16
    assert leaves["npscalar"].container == NUMPY_SCALAR and ckpt.read("npscalar") == 7
    assert leaves["complex"].dtype == np.complex128 and ckpt.read("complex") == complex(1.0, -2.5)
    assert leaves["none"] == ValueLeaf("none", None)
    assert leaves["flag"] == ValueLeaf("bool", True)
    assert leaves["name"] == ValueLeaf("str", "adam")
    assert leaves["big"] == ValueLeaf("int", 2**63 + 5)
    assert leaves["list/0"] == ValueLeaf("int", 1)
    assert ckpt.read("list/1").tolist() == [0, 1, 2]
    assert leaves["7"] == ValueLeaf("float", 0.5)
    assert leaves["a~1b"] == ValueLeaf("int", 1)
    assert set(ckpt.skipped) == {"raw", "unknown", "when"}
    assert ckpt.skipped["raw"].note.startswith("bytes") and "42" in ckpt.skipped["unknown"].note


def test_msgpack_chunked_array_from_flax(tmp_path, monkeypatch):
    serialization = pytest.importorskip("flax.serialization")
    # flax splits arrays over MAX_CHUNK_SIZE (1 GiB) into 1-D chunks; a small limit gives that form here.
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 40)
    big = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    bf = np.linspace(-1, 1, 33).astype(ml_dtypes.bfloat16)
    data = serialization.msgpack_serialize({"emb": big, "inner": {"bf": bf}, "small": np.ones(2, np.int8)})
    assert b"__msgpack_chunked_array__" in data
    path = tmp_path / "chunked.msgpack"
    path.write_bytes(data)
    ckpt = load(path, fm)
    assert list(ckpt.index.leaves) == ["emb", "inner/bf", "small"]
    assert ckpt.index.leaves["emb"].shape == (3, 4, 5)
    assert np.array_equal(ckpt.read("emb"), big) and ckpt.read("emb").dtype == np.float32
    assert (
        ckpt.read("inner/bf").dtype == ml_dtypes.bfloat16
        and bits(ckpt.read("inner/bf")).tobytes() == bits(bf).tobytes()
    )
    # and what flax reads back is the same
    assert np.array_equal(serialization.msgpack_restore(data)["emb"], ckpt.read("emb"))


# --- Flax msgpack: bad input ----------------------------------------------------------------------


def test_msgpack_truncated(tmp_path):
    data = (MSGPACK / "params.msgpack").read_bytes()
    for cut in (1, 20, len(data) // 2, len(data) - 1):
        path = tmp_path / "cut.msgpack"
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointCorruptedError, match="truncated") as e:
            fm.open(str(path))
        assert "cut.msgpack" in str(e.value)


def test_msgpack_huge_array_claim_is_refused_without_allocation(tmp_path):
    payload = msgpack.packb(([2**20, 2**20], "float32", b"\x00" * 16), use_bin_type=True)
    path = write_msgpack(tmp_path / "huge.msgpack", {"params": {"w": msgpack.ExtType(1, payload)}})
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError, match=r"params/w.*needs 4,398,046,511,104 bytes, found 16"):
            fm.open(path)
        assert tracemalloc.get_traced_memory()[1] < 10 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (([2], "object", b"0123456789abcdef"), "dtype name"),
        (([1], "<U4", b"abcd"), "dtype name"),
        (([3], "float32", b"\x00" * 8), "needs 12 bytes, found 8"),
        (([-1], "float32", b""), "non-negative"),
        (([2.0], "float32", b"\x00" * 8), "non-negative"),
        (([2], "float32"), r"\(shape, dtype, bytes\)"),
        (([1] * 65, "float32", b"\x00" * 4), "does not decode"),
    ],
)
def test_msgpack_bad_ndarray_ext(tmp_path, payload, match):
    ext = msgpack.ExtType(1, msgpack.packb(payload, use_bin_type=True))
    path = write_msgpack(tmp_path / "bad.msgpack", {"opt": {"mu": ext}})
    with pytest.raises(CheckpointFormatError, match=match) as e:
        fm.open(path)
    assert "'opt/mu'" in str(e.value) and "bad.msgpack" in str(e.value)


def test_msgpack_bad_structure(tmp_path):
    cases = {
        "nested": {"a": None},
        "bytes_key": {b"k": 1},
        "float_key": {1.5: 1},
        "colliding": {1: 1, "1": 2},
        "root_value": 3,
        "root_array": ext_array(np.ones(2)),
        "root_chunked": {fm.CHUNKED: True, "shape": {"0": 2}, "chunks": {"0": ext_array(np.ones(2))}},
        "bad_scalar": {"s": ext_array(np.ones(2), fm.EXT_NPSCALAR)},
        "bad_complex": {"c": msgpack.ExtType(fm.EXT_COMPLEX, msgpack.packb(("a", 1)))},
        "bad_chunks": {"c": {fm.CHUNKED: True, "shape": {"0": 5}, "chunks": {"0": ext_array(np.ones(3))}}},
    }
    deep: dict = {"leaf": 1}
    for _ in range(300):  # deeper than jaxckpt's MAX_DEPTH, within msgpack's own limit
        deep = {"d": deep}
    cases["nested"] = deep
    for name, obj in cases.items():
        path = write_msgpack(tmp_path / f"{name}.msgpack", obj)
        with pytest.raises(CheckpointFormatError) as e:
            fm.open(path)
        assert f"{name}.msgpack" in str(e.value), name
    # deeper than msgpack decodes at all
    path = tmp_path / "deeper.msgpack"
    path.write_bytes(b"\x81\xa1d" * 5000 + b"\xc0")
    with pytest.raises(CheckpointFormatError, match="nested"):
        fm.open(str(path))


def test_msgpack_bad_bytes(tmp_path):
    good = (MSGPACK / "params.msgpack").read_bytes()
    cases = {
        "trailing": good + b"\x00",
        "not_utf8": b"\x81\xa2\xff\xfe\x01",
        "huge_map": b"\xdf\xff\xff\xff\xff",  # a map claiming 2**32 - 1 entries in a 5-byte file
        "huge_bin": b"\x81\xa1a\xc6\x7f\xff\xff\xff",
        "reserved": b"\x81\xa1a\xc1",
        "empty": b"",
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.msgpack"
        path.write_bytes(data)
        with pytest.raises(CheckpointFormatError) as e:
            fm.open(str(path))
        assert f"{name}.msgpack" in str(e.value), name
    with pytest.raises(CheckpointFormatError, match="regular file"):
        fm.open(str(tmp_path))
    with pytest.raises(CheckpointFormatError, match="regular file"):
        sf.open(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError):
        fm.open(str(tmp_path / "absent.msgpack"))
    with pytest.raises(CheckpointNotFoundError):
        sf.open(str(tmp_path / "absent.safetensors"))


# --- safetensors: golden file ---------------------------------------------------------------------


def test_safetensors_golden():
    expected = json.loads((SAFETENSORS / "expected.json").read_text())["model.safetensors"]
    reader = sf.open(str(SAFETENSORS / "model.safetensors"))
    assert reader.metadata == expected["metadata"]
    ckpt = ForeignCheckpoint(reader)
    assert ckpt.name == "safetensors"
    # one edge per tensor name, dots and all
    assert set(ckpt.index.nodes[""].keys) == set(expected["tensors"])
    with np.load(SAFETENSORS / "expected.npz", allow_pickle=False) as npz:
        check_against(ckpt, {k: expected["tensors"][k] for k in ckpt.index.leaves}, npz, "model.safetensors")


# --- safetensors: the writer ----------------------------------------------------------------------

TENSORS = {
    "model.layers.0.self_attn.q_proj.weight": np.linspace(-2, 2, 12).astype(ml_dtypes.bfloat16).reshape(3, 4),
    "half": np.array([0.5, -1.25, 65504], np.float16),
    "mask": np.array([[True, False]]),
    "ids": np.arange(5, dtype=np.int64),
    "scalar": np.array(2.5, np.float32),
    "empty": np.zeros((0, 3), np.float32),
    "nested/name": np.arange(4, dtype=np.uint8),
    "f8": np.arange(4).astype(ml_dtypes.float8_e4m3fn),
}


def specs(tensors: dict[str, np.ndarray]) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    return [(k, v.dtype, v.shape) for k, v in tensors.items()]


def test_writer_round_trip(tmp_path):
    path = tmp_path / "out.safetensors"
    calls: list[str] = []

    def produce(name: str) -> np.ndarray:
        calls.append(name)
        return TENSORS[name]

    sf.write(path, specs(TENSORS), produce, {"format": "np", "note": "ünïcode"})
    assert sorted(calls) == sorted(TENSORS) and os.listdir(tmp_path) == ["out.safetensors"]
    # largest itemsize first, so every offset is aligned; produce follows that order
    assert [TENSORS[n].dtype.itemsize for n in calls] == sorted(
        (v.dtype.itemsize for v in TENSORS.values()), reverse=True
    )
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    assert n % 8 == 0 and data[8 + n - 1 : 8 + n] in (b" ", b"}")
    header = json.loads(data[8 : 8 + n])
    for name, info in header.items():
        if name != "__metadata__":  # each tensor aligned to its itemsize
            assert info["data_offsets"][0] % TENSORS[name].dtype.itemsize == 0
    assert sf.detect(str(path))
    reader = sf.open(str(path))
    assert reader.metadata == {"format": "np", "note": "ünïcode"}
    ckpt = ForeignCheckpoint(reader)
    assert {k for k in ckpt.index.leaves} == {k.replace("/", "~1") for k in TENSORS}
    for name, want in TENSORS.items():
        got = ckpt.read(name.replace("/", "~1"))
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def test_writer_streams_into_a_temp_file_beside_the_destination(tmp_path):
    from jaxckpt.storage.locations import temp_file_pattern

    path = tmp_path / "model.safetensors"
    seen: list[list[str]] = []

    def produce(name: str) -> np.ndarray:
        seen.append(os.listdir(tmp_path))  # while writing: only the temp file, no destination yet
        return np.full(3, len(seen), np.int32)

    sf.write(path, [("a", np.dtype(np.int32), (3,)), ("b", np.dtype(np.int32), (3,))], produce)
    assert len(seen) == 2 and seen[0] == seen[1] and len(seen[0]) == 1
    assert temp_file_pattern("model.safetensors").fullmatch(seen[0][0])
    ckpt = ForeignCheckpoint(sf.open(str(path)))
    assert ckpt.read("a").tolist() == [1, 1, 1] and ckpt.read("b").tolist() == [2, 2, 2]


def test_writer_replaces_existing_file_and_accepts_jax_arrays(tmp_path):
    import jax.numpy as jnp

    path = tmp_path / "out.safetensors"
    path.write_bytes(b"old")
    x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    sf.write(path, [("x", np.dtype(ml_dtypes.bfloat16), (2, 3))], lambda name: x)
    assert ForeignCheckpoint(sf.open(str(path))).read("x").tobytes() == np.asarray(x).tobytes()


@pytest.mark.parametrize(
    ("produce", "error", "match"),
    [
        (
            lambda name: np.zeros((4, 3), np.float32),
            MismatchError,
            r"returned float32 \(4, 3\), expected float32 \(3, 4\)",
        ),
        (lambda name: np.zeros((3, 4), np.float64), MismatchError, "returned float64"),
        (lambda name: 1 / 0, ZeroDivisionError, "division"),
    ],
)
def test_writer_failure_leaves_destination_untouched(tmp_path, produce, error, match):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"previous contents")
    good = np.ones(5, np.float32)
    with pytest.raises(error, match=match):
        sf.write(path, [("a", good.dtype, (5,)), ("w", np.dtype(np.float32), (3, 4))],
                 lambda name: good if name == "a" else produce(name))  # fmt: skip
    assert path.read_bytes() == b"previous contents"
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temp file left


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (("c", np.dtype(np.complex128), (2,)), "complex128, which safetensors cannot hold"),
        (("s", np.dtype("U3"), (2,)), "cannot hold"),
        (("i4", np.dtype(ml_dtypes.int4), (2,)), "cannot hold"),
        (("__metadata__", np.dtype(np.float32), (2,)), "metadata entry"),
        (("bad\ud800", np.dtype(np.float32), (2,)), "UTF-8"),
        (("neg", np.dtype(np.float32), (-1,)), "non-negative"),
    ],
)
def test_writer_refuses_before_writing(tmp_path, spec, match):
    path = tmp_path / "out.safetensors"

    def produce(name):
        raise AssertionError("not reached")

    with pytest.raises(UnsupportedValueError, match=match):
        sf.write(path, [spec], produce)
    with pytest.raises(UnsupportedValueError, match="twice"):
        sf.write(path, [("a", np.dtype("f4"), (1,))] * 2, produce)
    with pytest.raises(UnsupportedValueError, match="metadata"):
        sf.write(path, [], produce, {"a": 1})  # type: ignore[dict-item]
    assert os.listdir(tmp_path) == []


# --- safetensors: bad input -----------------------------------------------------------------------


def craft(path: Path, header, data: bytes = b"", raw: bytes | None = None) -> str:
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return str(path)


def tensor(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    ("header", "data", "error", "match"),
    [
        ({"w.weight": tensor(offsets=(0, 8))}, b"\x00" * 5, CheckpointCorruptedError, r"'w.weight'.*truncated"),
        ({"w.weight": tensor(offsets=(100, 108))}, b"\x00" * 8, CheckpointCorruptedError, r"'w.weight'.*\[100, 108\)"),
        ({"e": tensor(shape=(0,), offsets=(9, 9))}, b"\x00" * 8, CheckpointCorruptedError, r"'e'.*\[9, 9\)"),
        ({"a": tensor(), "b": tensor(offsets=(4, 12))}, b"\x00" * 12, CheckpointFormatError, r"'a'.*'b'.*overlap"),
        ({"w.weight": tensor(dtype="F128")}, b"\x00" * 8, CheckpointFormatError, r"'w.weight'.*dtype.*'F128'"),
        ({"w.weight": tensor(dtype=3)}, b"\x00" * 8, CheckpointFormatError, r"'w.weight'.*dtype"),
        ({"w.weight": tensor(shape=(3,))}, b"\x00" * 12, CheckpointFormatError, r"'w.weight'.*needs 12 bytes.*span 8"),
        ({"w": tensor(shape=(2**40, 2**40))}, b"", CheckpointFormatError, r"'w'.*needs"),
        ({"w": tensor(shape=(-2,))}, b"", CheckpointFormatError, r"'w'.*non-negative"),
        ({"w": tensor(shape=(True,))}, b"", CheckpointFormatError, r"'w'.*non-negative"),
        ({"w": tensor(shape=[1] * 65, offsets=(0, 4))}, b"\x00" * 4, CheckpointFormatError, r"'w'.*at most 64"),
        ({"w": tensor(offsets=(8, 0))}, b"\x00" * 8, CheckpointFormatError, r"'w'.*begin <= end"),
        ({"w": tensor(offsets=(0, 8.0))}, b"\x00" * 8, CheckpointFormatError, r"'w'.*data_offsets"),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\x00" * 8, CheckpointFormatError, r"'w'.*data_offsets"),
        ({"w": [1, 2]}, b"", CheckpointFormatError, r"'w'.*expected an object"),
        ({"__metadata__": {"a": 1}}, b"", CheckpointFormatError, "__metadata__"),
        ([1, 2], b"", CheckpointFormatError, "expected the header to be a JSON object, found a list"),
    ],
)
def test_safetensors_bad_header(tmp_path, header, data, error, match):
    path = craft(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(error, match=match) as e:
        sf.open(path)
    assert "bad.safetensors" in str(e.value)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"w": ' + b"\xff\xfe" + b"}", r"not UTF-8 \(byte 6 of the header is 0xff\)"),
        (b'{"a.b": {"dtype": "F\xff32"}}', r"not UTF-8 \(byte 20 .*in or after the entry of tensor 'a.b'"),
        (b'{"w": 1', "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        (b'{"w": NaN}', "not JSON"),
        (b'{"a": {}, "a": {}}', "names 'a' twice"),
    ],
)
def test_safetensors_bad_header_bytes(tmp_path, raw, match):
    with pytest.raises(CheckpointFormatError, match=match):
        sf.open(craft(tmp_path / "bad.safetensors", None, raw=raw))


def test_safetensors_header_length_beyond_file(tmp_path):
    good = (SAFETENSORS / "model.safetensors").read_bytes()
    path = tmp_path / "cut.safetensors"
    for data, error, match in [
        (struct.pack("<Q", 2**63) + good[8:], CheckpointFormatError, "over the limit"),
        (struct.pack("<Q", 1000) + good[8:100], CheckpointCorruptedError, "only 92 bytes follow"),
        (good[:5], CheckpointCorruptedError, "8-byte header length"),
    ]:
        path.write_bytes(data)
        with pytest.raises(error, match=match):
            sf.open(str(path))


def test_safetensors_truncated_golden_names_the_tensor(tmp_path):
    good = (SAFETENSORS / "model.safetensors").read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(good[:-3])
    with pytest.raises(CheckpointCorruptedError, match=r"'model.layers.0.self_attn.q_proj.weight'.*truncated"):
        sf.open(str(path))
    # cut after open: read finds it, naming the tensor
    path.write_bytes(good)
    ckpt = ForeignCheckpoint(sf.open(str(path)))
    path.write_bytes(good[:-3])
    with pytest.raises(CheckpointCorruptedError, match=r"'model.layers.0.self_attn.q_proj.weight'.*truncated"):
        ckpt.read("model.layers.0.self_attn.q_proj.weight")


def _mutate(good: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    data = bytearray(good)
    n = struct.unpack("<Q", good[:8])[0]
    for pos, value in edits:
        data[pos % (8 + n)] = value  # the length and the header: where parsing decides
    return bytes(data[:cut] if cut is not None else data)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.none() | st.integers(0, 700),
    field=st.none()
    | st.tuples(
        st.sampled_from(["dtype", "shape", "data_offsets"]),
        st.none()
        | st.booleans()
        | st.integers(-1, 2**65)
        | st.floats()
        | st.sampled_from(["F32", "BF16", "I8", "C64", "X"])
        | st.lists(st.integers(-2, 2**64) | st.booleans() | st.floats(), max_size=3),
    ),
)
def test_safetensors_fuzz_raises_only_jaxckpt_errors(tmp_path, edits, cut, field):
    good = (SAFETENSORS / "model.safetensors").read_bytes()
    if field is not None:  # a well-formed header with one field replaced
        n = struct.unpack("<Q", good[:8])[0]
        header = json.loads(good[8 : 8 + n])
        header["model.embed_tokens.weight"][field[0]] = field[1]
        body = json.dumps(header).encode()
        data = struct.pack("<Q", len(body)) + body + good[8 + n :]
    else:
        data = _mutate(good, edits, cut)
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(data)
    try:
        ckpt = ForeignCheckpoint(sf.open(str(path)))
        for key, leaf in ckpt.index.leaves.items():
            got = ckpt.read(key)
            assert got.shape == leaf.shape and got.dtype == leaf.dtype
            assert got.nbytes == math.prod(leaf.shape) * leaf.dtype.itemsize
    except JaxckptError:
        pass
