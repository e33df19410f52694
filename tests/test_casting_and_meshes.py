"""Restoring into what Orbax users hold: templates of another dtype (cast as Orbax casts), and abstract
templates whose shardings name an ``AbstractMesh`` (``jax.eval_shape`` / ``nnx.eval_shape`` under
``jax.set_mesh``), placed on the concrete mesh in context."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxckpt


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


# --- casting -------------------------------------------------------------------------------------


@pytest.mark.parametrize("small", [False, True], ids=["own-array", "packed"])
@pytest.mark.parametrize(
    "saved, target",
    [
        (np.float32, jnp.bfloat16),
        (jnp.bfloat16, np.float32),
        (np.float32, np.float16),
        (np.float64, np.float32),
        (np.float32, ml_dtypes.float8_e4m3fn),
        (np.float16, np.float64),
    ],
)
def test_float_to_float_casts_to_the_templates_dtype(tmp_path, saved, target, small):
    n = 64 if small else 600_000  # over the 1 MiB packing limit: its own zarr3 array
    values = (np.linspace(-3, 3, n) ** 3).astype(saved)
    path = jaxckpt.save(tmp_path / "c", {"w": values})
    expected = values.astype(target)  # round to nearest, as numpy / ml_dtypes convert
    likes = [np.zeros(n, target)]
    if np.dtype(target).itemsize < 8:  # jax holds no float64 without jax_enable_x64
        likes += [jnp.zeros(n, target), jax.ShapeDtypeStruct((n,), target)]
    for like in likes:
        restored = jaxckpt.restore(path, like={"w": like})["w"]
        assert restored.dtype == np.dtype(target)
        assert isinstance(restored, np.ndarray if isinstance(like, np.ndarray) else jax.Array)
        assert np.asarray(restored).tobytes() == expected.tobytes()


def test_a_float32_checkpoint_restores_into_a_bfloat16_model(tmp_path):
    """`jaxckpt.restore(path, like=bf16_model)` from the issue: an NNX module in bfloat16."""
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    path = jaxckpt.save(tmp_path / "c", model)
    bf16 = nnx.Linear(4, 3, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16)
    jaxckpt.restore(path, like=bf16)
    assert bf16.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(bf16.kernel[...], model.kernel[...].astype(jnp.bfloat16))


@pytest.mark.parametrize(
    "saved, target",
    [(np.int32, np.int8), (np.int64, np.int16), (np.uint8, np.int64), (np.int8, np.uint32), (np.int32, ml_dtypes.int4)],
)
def test_int_to_int_casts_exactly_when_the_values_fit(tmp_path, saved, target):
    values = np.array([0, 1, 2, 7], saved)
    path = jaxckpt.save(tmp_path / "c", {"i": values})
    restored = jaxckpt.restore(path, like={"i": np.zeros(4, target)})["i"]
    assert restored.dtype == np.dtype(target) and restored.astype(np.int64).tolist() == [0, 1, 2, 7]


def test_int_values_that_do_not_fit_are_refused_not_wrapped(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"i": np.array([1, 300, -5], np.int32)})
    with pytest.raises(jaxckpt.MismatchError, match=r"'i' as int8.*from -5 to 300.*\[-128, 127\]"):
        jaxckpt.restore(path, like={"i": jnp.zeros(3, jnp.int8)})
    with pytest.raises(jaxckpt.MismatchError, match=r"'i' as uint16.*from -5 to 300"):
        jaxckpt.restore(path, like={"i": np.zeros(3, np.uint16)})


@pytest.mark.parametrize(
    "saved, target",
    [
        (np.float32, np.int32),
        (np.int32, np.float32),
        (np.bool_, np.int8),
        (np.int8, np.bool_),
        (np.complex64, np.float32),
    ],
)
def test_no_cast_across_kinds(tmp_path, saved, target):
    # 1.5: float to int is refused where a value is not whole (whole ones cast: test_orbax_migration).
    path = jaxckpt.save(tmp_path / "c", {"x": np.full(3, 1.5).astype(saved)})
    with pytest.raises(jaxckpt.MismatchError, match=r"'x'"):
        jaxckpt.restore(path, like={"x": np.zeros(3, target)})


def test_a_cast_lands_on_the_templates_sharding(tmp_path):
    mesh = _mesh()
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    x = jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32), sharding)
    path = jaxckpt.save(tmp_path / "c", {"x": x})
    like = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("model")))
    restored = jaxckpt.restore(path, like={"x": like})["x"]
    assert restored.dtype == jnp.bfloat16 and restored.sharding == like.sharding
    np.testing.assert_array_equal(restored, x.astype(jnp.bfloat16))


# --- abstract meshes ------------------------------------------------------------------------------


def test_abstract_mesh_template_lands_on_the_mesh_in_context(tmp_path):
    mesh = _mesh()
    x = jax.device_put(jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6), NamedSharding(mesh, PartitionSpec("data")))
    path = jaxckpt.save(tmp_path / "c", {"x": x, "step": 3})
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(
            lambda: {"x": jax.sharding.reshard(jnp.zeros((8, 6)), PartitionSpec("data", "model")), "step": 0}
        )
        assert isinstance(abstract["x"].sharding.mesh, jax.sharding.AbstractMesh)
        restored = jaxckpt.restore(path, like=abstract)
    assert restored["step"] == 3
    assert restored["x"].sharding == NamedSharding(mesh, PartitionSpec("data", "model"))
    np.testing.assert_array_equal(restored["x"], x)


def test_abstract_mesh_template_without_a_mesh_in_context_says_what_to_do(tmp_path):
    mesh = _mesh()
    path = jaxckpt.save(tmp_path / "c", {"x": jnp.ones((8, 6))})
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(lambda: {"x": jax.sharding.reshard(jnp.zeros((8, 6)), PartitionSpec("data"))})
    with pytest.raises(jaxckpt.MismatchError, match=r"'x'.*abstract mesh.*no mesh is in context.*jax.set_mesh"):
        jaxckpt.restore(path, like=abstract)
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        with pytest.raises(jaxckpt.MismatchError, match=r"'x'.*the mesh in context is"):
            jaxckpt.restore(path, like=abstract)


class _Sharded(nnx.Module):
    """The Flax "Scale up on multiple devices" guide's model, small."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model"))
        self.dot1 = nnx.Linear(8, 16, kernel_init=init, use_bias=False, rngs=rngs)
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (16, 8)), out_sharding=("model", "data"))


def _make_sharded() -> _Sharded:
    model = _Sharded(rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model


def test_nnx_eval_shape_under_set_mesh_restores_onto_the_mesh(tmp_path):
    mesh = _mesh()
    with jax.set_mesh(mesh):
        model = nnx.jit(_make_sharded)()
    path = jaxckpt.save(tmp_path / "c", model)
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(_make_sharded)
        jaxckpt.restore(path, like=abstract)
    assert isinstance(abstract.dot1.kernel[...], jax.Array)
    assert abstract.dot1.kernel[...].sharding.spec == PartitionSpec("data", "model")
    np.testing.assert_array_equal(abstract.dot1.kernel[...], model.dot1.kernel[...])
    np.testing.assert_array_equal(abstract.w2[...], model.w2[...])
