"""Every kind of leaf round-trips with its type, dtype and value, packed or as its own array."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxckpt
from jaxckpt.storage import locations

DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3,
    ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e4m3b11fnuz,
    ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2,
]  # fmt: skip


def _values(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2, size=shape) if np.dtype(dtype) == np.bool_ else rng.integers(0, 3, size=shape)
    return raw.astype(dtype)


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(params=["packed", "own-array"])
def layout(request):
    if request.param == "own-array":
        request.getfixturevalue("small_packs")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_dtypes_round_trip(tmp_path, layout, dtype):
    tree = {"x": _values(dtype, (3, 4)), "scalar": _values(dtype, ()), "empty": _values(dtype, (0, 5))}
    path = jaxckpt.save(tmp_path / "c", tree)
    for restored in (jaxckpt.restore(path), jaxckpt.restore(path, like=tree)):
        for k in tree:
            assert type(restored[k]) is np.ndarray
            assert _same_bits(restored[k], tree[k]), k


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint32, jnp.float16, jnp.bool_])
def test_jax_arrays_keep_dtype_and_come_back_as_jax(tmp_path, layout, dtype):
    tree = {"w": jnp.asarray(_values(dtype, (5, 3))), "s": jnp.asarray(_values(dtype, ()))}
    path = jaxckpt.save(tmp_path / "c", tree)
    restored = jaxckpt.restore(path, like=jax.tree.map(jnp.zeros_like, tree))
    for k in tree:
        assert isinstance(restored[k], jax.Array)
        assert _same_bits(restored[k], tree[k])
    assert all(type(v) is np.ndarray for v in jaxckpt.restore(path).values())  # no template: numpy


def test_large_values_survive_both_layouts(tmp_path, layout):
    x = np.random.default_rng(1).standard_normal((700, 500)).astype(np.float32)  # 1.4 MB > pack limit
    path = jaxckpt.save(tmp_path / "c", {"x": x})
    assert _same_bits(jaxckpt.restore(path)["x"], x)


def test_python_values_restore_as_the_same_python_types(tmp_path):
    tree = {
        "i": 3, "big": 2**80, "f": 0.1, "nan": float("nan"), "inf": float("-inf"), "negzero": -0.0,
        "b": True, "s": "héllo/wörld", "none": None, "np_scalar": np.float32(2.5),
    }  # fmt: skip
    path = jaxckpt.save(tmp_path / "c", tree)
    for restored in (jaxckpt.restore(path), jaxckpt.restore(path, like=tree)):
        for k, v in tree.items():
            assert type(restored[k]) is type(v), k
        assert restored["big"] == 2**80 and restored["f"] == 0.1 and restored["s"] == "héllo/wörld"
        assert np.isnan(restored["nan"]) and restored["inf"] == float("-inf")
        assert str(restored["negzero"]) == "-0.0"
        assert restored["b"] is True and restored["none"] is None


def test_typed_prng_keys_restore_as_typed_keys(tmp_path, layout):
    tree = {"k": jax.random.key(42), "ks": jax.random.split(jax.random.key(1), 4), "rbg": jax.random.key(3, impl="rbg")}
    path = jaxckpt.save(tmp_path / "c", tree)
    template = {
        "k": jax.random.key(0),
        "ks": jax.random.split(jax.random.key(0), 4),
        "rbg": jax.random.key(0, impl="rbg"),
    }
    for restored in (jaxckpt.restore(path, like=template), jaxckpt.restore(path)):
        for k in tree:
            assert jax.dtypes.issubdtype(restored[k].dtype, jax.dtypes.prng_key)
            assert jax.random.key_impl(restored[k]) == jax.random.key_impl(tree[k])
            assert _same_bits(jax.random.key_data(restored[k]), jax.random.key_data(tree[k]))
    assert dict(jaxckpt.list_variables(path))["ks"] == (4,)


def test_abstract_prng_key_templates(tmp_path):
    keys = {"k": jax.random.key(1), "rbg": jax.random.split(jax.random.key(2, impl="rbg"), 3)}
    path = jaxckpt.save(tmp_path / "c", keys)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in keys.items()}
    restored = jaxckpt.restore(path, like=like)
    for k in keys:
        assert _same_bits(jax.random.key_data(restored[k]), jax.random.key_data(keys[k]))
    wrong = {**like, "k": jax.ShapeDtypeStruct((), jax.random.key(0, impl="rbg").dtype)}
    with pytest.raises(jaxckpt.MismatchError, match=r"'k'.*threefry2x32.*expects a PRNG key array \(rbg\)"):
        jaxckpt.restore(path, like=wrong)


def test_shape_dtype_struct_template_becomes_a_concrete_array(tmp_path):
    tree = {"w": jnp.arange(12.0).reshape(3, 4)}
    path = jaxckpt.save(tmp_path / "c", tree)
    restored = jaxckpt.restore(path, like={"w": jax.ShapeDtypeStruct((3, 4), jnp.float32)})
    assert isinstance(restored["w"], jax.Array)
    assert _same_bits(restored["w"], tree["w"])


def test_state_objects_save_their_json_state(tmp_path):
    class Iterator:
        def __init__(self):
            self.position = 0

        def get_state(self):
            return {"position": self.position, "order": [3, 1, 2]}

        def set_state(self, state):
            self.position = state["position"]

    it = Iterator()
    it.position = 17
    path = jaxckpt.save(tmp_path / "c", {"it": it})
    fresh = Iterator()
    restored = jaxckpt.restore(path, like={"it": fresh})
    assert restored["it"] is fresh and fresh.position == 17
    assert jaxckpt.restore(path)["it"] == {"position": 17, "order": [3, 1, 2]}
    assert jaxckpt.load_variable(path, "it") == {"position": 17, "order": [3, 1, 2]}


def test_scalar_and_zero_d_array_convert_both_ways(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"step": jnp.int32(7), "lr": 0.5})
    restored = jaxckpt.restore(path, like={"step": 0, "lr": jnp.zeros((), jnp.float32)})
    assert type(restored["step"]) is int and restored["step"] == 7
    assert isinstance(restored["lr"], jax.Array) and float(restored["lr"]) == 0.5


def test_the_per_leaf_work_runs_with_the_garbage_collector_paused(tmp_path):
    """Many leaves make many objects; collections triggered meanwhile scan ever more of them (a save
    of 100,000 leaves took 16x as long as one of 10,000). Save's snapshot and restore pause it, and
    leave it as they found it."""
    import gc

    from jaxckpt.saving import pipeline

    tree = {f"k{i}": np.full(3, i, np.float32) for i in range(3000)}
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    path = tmp_path / "c"
    threshold = gc.get_threshold()
    gc.set_threshold(10)  # a collection every few allocations, were it running
    gc.callbacks.append(count)
    try:
        # Running, it would collect hundreds of times here; calling in may still trigger one or two.
        prepared = pipeline.prepare(locations.location(path), tree)
        assert len(collections) <= 2, len(collections)
        pipeline.write_and_publish(prepared)
        collections.clear()
        restored = jaxckpt.restore(path, like=tree)
        assert len(collections) <= 2, len(collections)
        gc.disable()
        jaxckpt.restore(tmp_path / "c")
        assert not gc.isenabled()  # a caller's own pause is left alone
    finally:
        gc.enable()
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    assert gc.isenabled()
    np.testing.assert_array_equal(restored["k2999"], tree["k2999"])


def test_a_numpy_float64_scalar_comes_back_as_one(tmp_path):
    """np.float64 subclasses Python's float, but it is a NumPy scalar like np.float32: it is saved as
    one and restores as one, with or without a template (it was saved as a Python float, and a
    template of np.float64 then refused it)."""
    tree = {"x": np.float64(32.0), "y": np.float32(2.0), "z": 1.5}
    path = jaxckpt.save(tmp_path / "c", tree)
    for restored in (jaxckpt.restore(path), jaxckpt.restore(path, like=tree)):
        assert type(restored["x"]) is np.float64 and restored["x"] == 32.0
        assert type(restored["y"]) is np.float32 and type(restored["z"]) is float
