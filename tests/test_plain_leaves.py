"""Restores take plain leaves (an array template of the stored shape and dtype) by a short path
(``jaxckpt.reading.templates.check_all``): the same checks, values, dtypes and shardings as the full one,
which every other leaf still takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.format.records import ArrayLeaf, InPack
from jaxckpt.reading.templates import check_all, target_sharding


def _tree():
    return {
        "plain": {f"w{i}": jnp.arange(16, dtype=jnp.float32) + i for i in range(20)},
        "ints": jnp.arange(6, dtype=jnp.int32).reshape(2, 3),
        "to_half": jnp.linspace(0, 1, 8, dtype=jnp.float32),
        "key": jax.random.key(3),
        "step": 7,
        "none": None,
    }


def _like(tree, device):
    one = jax.sharding.SingleDeviceSharding(device)
    arrays = {"plain": tree["plain"], "ints": tree["ints"]}
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    like["plain"]["w0"] = jax.ShapeDtypeStruct((16,), jnp.float32, sharding=one)
    like["plain"]["w1"] = jnp.zeros(16, jnp.float32, device=device)  # an array template: its sharding
    like["to_half"] = jax.ShapeDtypeStruct((8,), jnp.float16)  # cast on restore: not plain
    like["key"] = jax.eval_shape(lambda: jax.random.key(0))
    like["step"], like["none"] = 0, None
    return like


def test_mixed_tree_restores_as_before(tmp_path):
    tree = _tree()
    jaxckpt.save(tmp_path / "c", tree)
    device = jax.devices()[-1]
    out = jaxckpt.restore(tmp_path / "c", like=_like(tree, device))

    for i in range(20):
        got = out["plain"][f"w{i}"]
        assert isinstance(got, jax.Array) and got.dtype == jnp.float32
        np.testing.assert_array_equal(got, np.arange(16, dtype=np.float32) + i)
    # A template without a sharding: the default device; with one, that one.
    assert out["plain"]["w2"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert out["plain"]["w0"].sharding == jax.sharding.SingleDeviceSharding(device)
    assert out["plain"]["w1"].sharding == jax.sharding.SingleDeviceSharding(device)
    np.testing.assert_array_equal(out["ints"], np.arange(6).reshape(2, 3))
    assert out["to_half"].dtype == jnp.float16
    np.testing.assert_allclose(out["to_half"], np.linspace(0, 1, 8), atol=1e-3)
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))
    assert out["step"] == 7 and out["none"] is None


@pytest.mark.parametrize(
    "template, message",
    [
        (jax.ShapeDtypeStruct((17,), jnp.float32), "shape"),
        (jax.ShapeDtypeStruct((16,), jnp.bool_), "bool"),
        (jax.eval_shape(lambda: jax.random.key(0)), "key"),
    ],
)
def test_a_mismatch_among_plain_leaves_names_its_key(tmp_path, template, message):
    tree = _tree()
    jaxckpt.save(tmp_path / "c", tree)
    like = _like(tree, jax.devices()[0])
    like["plain"]["w13"] = template
    with pytest.raises(jaxckpt.MismatchError, match=r"plain/w13") as e:
        jaxckpt.restore(tmp_path / "c", like=like)
    assert message in str(e.value)


def test_check_all_marks_plain_leaves_only():
    f32 = ArrayLeaf(np.dtype(np.float32), (4,), "jax", InPack(0, 0, 16, 0), None, None)
    key_leaf = ArrayLeaf(np.dtype(np.uint32), (2,), "jax", InPack(0, 64, 8, 0), "threefry2x32", None)
    sds = jax.ShapeDtypeStruct((4,), jnp.float32)
    wanted = {
        "a": sds,
        "b": jnp.zeros(4, jnp.float32),
        "c": jax.ShapeDtypeStruct((4,), jnp.float16),  # a cast
        "d": np.zeros(4, np.float32),  # a numpy template stays numpy: not placed here
        "e": jax.eval_shape(lambda: jax.random.key(0)),
    }
    targets = check_all(wanted, [f32, f32, f32, f32, key_leaf])
    assert targets[0] is target_sharding(sds)  # one default sharding object for every such leaf
    assert targets[1] == wanted["b"].sharding
    assert targets[2:] == [None, None, None]


def _packed_tree():
    return {f"w{i:02d}": np.arange(100 * i, 100 * i + 50, dtype=np.float32) for i in range(30)}


@pytest.fixture
def one_span_per_leaf(monkeypatch):
    """Packs read in spans: with no gap allowed, every leaf of a pack is its own span."""
    import jaxckpt.reading.read_plan

    monkeypatch.setattr(jaxckpt.reading.read_plan, "SPAN_GAP", 0)


def test_packed_leaves_read_from_many_spans(tmp_path, one_span_per_leaf):
    tree = _packed_tree()
    jaxckpt.save(tmp_path / "c", tree)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}
    out = jaxckpt.restore(tmp_path / "c", like=like)
    for k, v in tree.items():
        np.testing.assert_array_equal(out[k], v)
    some = {k: like[k] for k in ("w03", "w17", "w29")}
    out = jaxckpt.restore(tmp_path / "c", like=some, partial=True)
    assert sorted(out) == sorted(some)
    for k in some:
        np.testing.assert_array_equal(out[k], tree[k])


def test_damage_in_a_later_span_names_its_leaf(tmp_path, one_span_per_leaf):
    tree = _packed_tree()
    jaxckpt.save(tmp_path / "c", tree)
    packs = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and tree["w21"].tobytes() in p.read_bytes()]
    assert len(packs) == 1
    data = bytearray(packs[0].read_bytes())
    data[data.index(tree["w21"].tobytes()) + 7] ^= 0xFF
    packs[0].write_bytes(bytes(data))
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="w21"):
        jaxckpt.restore(tmp_path / "c", like=like)
    out = jaxckpt.restore(tmp_path / "c", like={"w20": like["w20"], "w22": like["w22"]}, partial=True)
    np.testing.assert_array_equal(out["w22"], tree["w22"])
