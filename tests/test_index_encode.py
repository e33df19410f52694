"""jaxckpt.format.index_encode: the index written from templates is byte for byte the canonical JSON that
``json.dumps(sort_keys=True)`` makes of its records, for every kind of leaf and key."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.format import checked_json, index_encode, index_json
from jaxckpt.format.keys import NodeInfo
from jaxckpt.format.records import ArrayLeaf, Index, InPack, Pack, ValueLeaf


def _canonical(data: bytes) -> bytes:
    """What json.dumps makes of the file's own body: the definition of the format's bytes."""
    body = json.loads(data)
    del body["checksum"]
    return checked_json.checksummed_json(body)


def _record_by_record(index: Index, monkeypatch) -> bytes:
    """encode_index with every leaf's record made by json.dumps (no template)."""
    with monkeypatch.context() as m:
        m.setattr(
            index_encode._PackedLeaves,
            "text",
            lambda self, leaf, at: checked_json.canonical_text(index_encode.leaf_to_json(leaf, {})),
        )
        return index_encode.encode_index(index)


KEYS = ["b10", "b2", "B", "a/b", 'quote"d', "back\\slash", "new\nline", "tab\t", "é", "日本", "\x7f", "z" * 40, "", "0"]


def _tree():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    tree = {key: jnp.full((3, 2), i, jnp.float32) for i, key in enumerate(KEYS)}
    tree["kinds"] = {
        "bf16": jnp.ones((4,), jnp.bfloat16),
        "int8": np.arange(5, dtype=np.int8),
        "bool": jnp.array([True, False]),
        "scalar": jnp.float32(2.5),
        "np_scalar": np.float64(1.25),
        "uint64": np.array([2**64 - 1], np.uint64),
        "fp8": np.zeros(3, ml_dtypes.float8_e4m3fn),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(1),
        "big": jnp.zeros((512, 512), jnp.float32),  # its own array, not in a pack
        "sharded": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x", "y"))),
        "replicated": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P())),
        "values": [1, 2.5, float("nan"), float("inf"), 'text "é"', None, True, 2**62],
        "empty": np.zeros((0, 3), np.float32),
    }
    tree["layers"] = [{"w": jnp.full((2, 2), i, jnp.float32), "b": jnp.zeros(2)} for i in range(30)]
    return tree


def test_a_saved_index_is_the_canonical_json_of_its_body(tmp_path):
    jaxckpt.save(tmp_path / "c", _tree())
    data = (tmp_path / "c" / "index.json").read_bytes()
    assert data == _canonical(data)
    assert b'"b10":' in data and data.index(b'"b10":') < data.index(b'"b2":')  # sorted as str


def test_templates_write_what_json_dumps_writes_record_by_record(tmp_path, monkeypatch):
    jaxckpt.save(tmp_path / "c", _tree())
    data = (tmp_path / "c" / "index.json").read_bytes()
    index = index_json.decode_index(data, "index")
    assert index_encode.encode_index(index) == data == _record_by_record(index, monkeypatch)


def _index(leaves: dict) -> Index:
    return Index(nodes={"": NodeInfo("dict", "dict", tuple(leaves))}, leaves=leaves, packs=[Pack("p/0", 4096, 4096)])


@pytest.mark.parametrize(
    "leaf",
    [
        ArrayLeaf(np.dtype("float32"), (4,), "jax", InPack(True, 0, 16, 5)),  # bool is not int: json writes true
        ArrayLeaf(np.dtype("float32"), (np.int64(4),), "jax", InPack(0, 0, 16, 5)),  # not json: refused alike
        ArrayLeaf(np.dtype("int8"), (2, 3), "numpy", InPack(0, 64, 6, 2**32 - 1), sharding='Single "device"\n'),
        ArrayLeaf(np.dtype("float32"), (), "numpy_scalar", InPack(0, 128, 4, 0)),
        ValueLeaf("float", float("-inf")),
    ],
    ids=repr,
)
def test_odd_records_are_written_as_json_dumps_writes_them(leaf, monkeypatch):
    # "0" first: its kind is new (an equal shape of numpy ints met later would use the template of ints).
    index = _index({"0": leaf, "a": ArrayLeaf(np.dtype("float32"), (4,), "jax", InPack(0, 0, 16, 7))})
    try:
        expected = _record_by_record(index, monkeypatch)
    except TypeError:
        with pytest.raises(TypeError):
            index_encode.encode_index(index)
        return
    assert index_encode.encode_index(index) == expected
    assert _canonical(expected) == expected


def test_equal_kinds_share_one_template_and_keep_their_own_numbers():
    leaves = {
        f"w{i}": ArrayLeaf(np.dtype("float32"), (4,), "jax", InPack(i % 3, 16 * i, 16, 1000 + i)) for i in range(50)
    }
    records = json.loads(index_encode.encode_index(_index(leaves)))["leaves"]
    assert [records[f"w{i}"]["at"] for i in range(50)] == [
        {"pack": i % 3, "offset": 16 * i, "nbytes": 16, "crc32c": 1000 + i} for i in range(50)
    ]


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 5, 6, 7])
def test_records_encoded_in_batches_join_as_one_text(count, monkeypatch):
    # Batches of 3: none, one short, one full, a full one and a short one, two full ones...
    monkeypatch.setattr(index_encode, "_BATCH", 3)
    leaves = {f"k{i}": ArrayLeaf(np.dtype("float32"), (4,), "jax", InPack(0, 16 * i, 16, i)) for i in range(count)}
    leaves.update({"é": ValueLeaf("int", count)} if count % 2 else {})
    data = index_encode.encode_index(_index(leaves))
    assert data == _canonical(data)
    body = json.loads(data)
    del body["checksum"]
    assert data == checked_json.with_checksum(checked_json.canonical_json(body))
    assert sorted(body["leaves"]) == sorted(leaves)
