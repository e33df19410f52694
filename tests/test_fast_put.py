"""jaxckpt.reading.fast_put: many host arrays placed as jax.device_put places them, through jax's private
C++ call where that agrees with jax.device_put, and through jax.device_put where not."""

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import jaxckpt
from jaxckpt.reading import fast_put


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))


def _cases() -> tuple[list[np.ndarray], list[jax.sharding.Sharding]]:
    one = SingleDeviceSharding(jax.devices()[0])
    other = SingleDeviceSharding(jax.devices()[3])
    mesh = _mesh()
    values = [
        np.arange(16, dtype=np.float32),
        np.arange(16, dtype=np.float32) + 1,
        np.array(3, np.float32),
        np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
        np.array([True, False]),
        np.arange(5, dtype=np.int64),  # x64 is off: jax.device_put makes it int32, so put_many leaves it to jax
        np.arange(64, dtype=np.float32).reshape(8, 8),
        np.arange(64, dtype=np.int8).reshape(8, 8),
        np.arange(128, dtype=np.complex64).reshape(16, 8)[::2],  # not contiguous
    ]
    shardings = [
        one,
        one,
        other,
        one,
        one,
        one,
        NamedSharding(mesh, PartitionSpec("x", "y")),
        NamedSharding(mesh, PartitionSpec()),  # replicated on 8 devices
        NamedSharding(mesh, PartitionSpec(None, "y")),
    ]
    return values, shardings


def _same(ours: list[jax.Array], theirs: list[jax.Array]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert type(a) is type(b)
        assert a.aval == b.aval and a.dtype == b.dtype and a.weak_type == b.weak_type
        assert a.sharding == b.sharding and a.committed == b.committed
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for sa, sb in zip(a.addressable_shards, b.addressable_shards):
            assert sa.device == sb.device and sa.index == sb.index
            np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))


def test_the_private_path_is_taken_and_agrees_with_device_put(monkeypatch):
    assert fast_put._agrees(), "jax's private batched_device_put no longer agrees: restores of many leaves slow down"
    calls = []
    real = fast_put._batched
    monkeypatch.setattr(fast_put, "_batched", lambda *a: calls.append(a) or real(*a))
    values, shardings = _cases()
    _same(fast_put.put_many(values, shardings), jax.device_put(values, shardings))
    assert len(calls) == len(values) - 1  # all but the int64 one, which jax would change


def test_without_the_private_call_device_put_places_everything(monkeypatch):
    monkeypatch.setattr(fast_put, "_batched", None)
    values, shardings = _cases()
    _same(fast_put.put_many(values, shardings), jax.device_put(values, shardings))


def test_a_private_call_that_disagrees_is_not_used(monkeypatch):
    def wrong(aval, sharding, shards, devices, committed):
        return jax.device_put(np.asarray(shards[0]) + 1, sharding)

    monkeypatch.setattr(fast_put, "_batched", wrong)
    fast_put._agrees.cache_clear()
    try:
        assert not fast_put._agrees()
        values, shardings = _cases()
        _same(fast_put.put_many(values, shardings), jax.device_put(values, shardings))
    finally:
        fast_put._agrees.cache_clear()


def test_a_shape_the_sharding_cannot_divide_fails_as_device_put_does():
    sharding = NamedSharding(_mesh(), PartitionSpec("x"))
    with pytest.raises(ValueError) as theirs:
        jax.device_put([np.zeros(6, np.float32)], sharding)
    with pytest.raises(ValueError) as ours:
        fast_put.put_many([np.zeros(6, np.float32)], [sharding])
    assert type(ours.value) is type(theirs.value)


def test_under_a_trace_device_put_is_used():
    values, shardings = _cases()

    @jax.jit
    def f(x):
        placed = fast_put.put_many([values[0]], [shardings[0]])
        return x + placed[0]

    np.testing.assert_array_equal(np.asarray(f(np.ones(16, np.float32))), values[0] + 1)


def test_many_small_leaves_restore_through_it_and_alias_nothing_a_later_save_changes(tmp_path):
    tree = {f"b{i}": {"w": np.full(16, i, np.float32), "s": np.float32(i)} for i in range(300)}
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
    jaxckpt.save(tmp_path / "a", tree)
    out = jaxckpt.restore(tmp_path / "a", like=like)
    jaxckpt.save(tmp_path / "b", jax.tree.map(lambda x: x + 1, tree))  # no buffer of `out` is reused
    for i in range(300):
        assert isinstance(out[f"b{i}"]["w"], jax.Array) and out[f"b{i}"]["w"].committed
        np.testing.assert_array_equal(np.asarray(out[f"b{i}"]["w"]), np.full(16, i, np.float32))
        assert float(out[f"b{i}"]["s"]) == i
