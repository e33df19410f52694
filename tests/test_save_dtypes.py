"""``save_dtypes=``: the saved copy of float arrays in another dtype (Orbax's ``SaveArgs(dtype=...)``).

Written as an Orbax user moving a project over writes it: bfloat16 weights saved from a Flax
``TrainState``'s float32 parameters, an Orbax ``save_args`` tree, an NNX model under a manager, and a
restore into the float32 template that casts back; sharded, asynchronous and incremental saves; and
the errors a wrong ``save_dtypes`` gets, each naming its key, with nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def stored(path: str | Path) -> dict[str, str]:
    """The dtype the index records for each array leaf."""
    leaves = json.loads(Path(path, "index.json").read_text())["leaves"]
    return {k: v["dtype"] for k, v in leaves.items() if "dtype" in v}


def as_bf16(x: Any) -> np.ndarray:
    """What a float32 array comes back as after a save in bfloat16."""
    return np.asarray(x).astype(jnp.bfloat16).astype(np.float32)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def train_state() -> TrainState:
    params = MLP().init(jax.random.key(0), jnp.ones((1, 5)))
    params = jax.tree.map(lambda p: p + 1 / 3, params)  # values bfloat16 cannot hold exactly
    return TrainState.create(apply_fn=MLP().apply, params=params, tx=optax.adam(1e-3))


def test_bfloat16_params_of_a_train_state_restore_into_the_float32_template(tmp_path):
    state = train_state()
    before = jax.tree.map(np.asarray, state.params)
    path = jaxckpt.save(tmp_path / "bf16", state, save_dtypes={"params": jnp.bfloat16})
    dtypes = stored(path)
    assert {k: d for k, d in dtypes.items() if k.startswith("params/")} == dict.fromkeys(
        [
            "params/params/Dense_0/bias",
            "params/params/Dense_0/kernel",
            "params/params/Dense_1/bias",
            "params/params/Dense_1/kernel",
        ],
        "bfloat16",
    )
    assert dtypes["opt_state/0/mu/params/Dense_0/kernel"] == "float32"  # outside the prefix: as it is
    assert "step" not in dtypes  # a Python int, stored as JSON
    # The caller's arrays are untouched.
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.params, before)
    assert all(x.dtype == jnp.float32 and not x.is_deleted() for x in jax.tree.leaves(state.params))

    restored = jaxckpt.restore(path, like=state)  # StandardCheckpointer().restore(path, abstract_state)
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(before), strict=True):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), as_bf16(want))
    for got, want in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # float32, exactly
    as_saved = jaxckpt.restore(path)  # no template: the stored dtype
    assert as_saved["params"]["params"]["Dense_0"]["kernel"].dtype == jnp.bfloat16


@dataclasses.dataclass
class SaveArgs:
    """The fields of ``orbax.checkpoint.SaveArgs`` that a save_args tree carries (Orbax is no test dependency)."""

    aggregate: bool = False
    dtype: Any = None


def test_an_orbax_save_args_tree_and_a_callable(tmp_path):
    state = train_state()
    # Orbax: save_args = jax.tree.map(lambda x: ocp.SaveArgs(dtype=...), state); ckptr.save(path, state, save_args=...)
    save_args = jax.tree.map(lambda x: SaveArgs(dtype=jnp.bfloat16 if np.ndim(x) == 2 else None), state)
    path = jaxckpt.save(tmp_path / "args", state, save_dtypes=save_args)
    dtypes = stored(path)
    assert dtypes["params/params/Dense_1/kernel"] == dtypes["opt_state/0/nu/params/Dense_1/kernel"] == "bfloat16"
    assert dtypes["params/params/Dense_1/bias"] == "float32"

    def kernels_in_half(key, leaf):
        return jnp.float16 if key.endswith("/kernel") and leaf.dtype == jnp.float32 else None

    path = jaxckpt.save(tmp_path / "fn", state, save_dtypes=kernels_in_half)
    dtypes = stored(path)
    assert dtypes["params/params/Dense_0/kernel"] == dtypes["opt_state/0/mu/params/Dense_0/kernel"] == "float16"
    assert dtypes["params/params/Dense_0/bias"] == "float32" and dtypes["opt_state/0/count"] == "int32"
    restored = jaxckpt.restore(path, like=state)
    np.testing.assert_array_equal(
        restored.params["params"]["Dense_0"]["kernel"],
        np.asarray(state.params["params"]["Dense_0"]["kernel"]).astype(np.float16).astype(np.float32),
    )


def test_one_dtype_casts_every_float_array_and_leaves_the_rest(tmp_path):
    tree = {
        "w": np.linspace(0, 1, 7, dtype=np.float32),
        "n": np.arange(3, dtype=np.int32),
        "key": jax.random.key(1),
        "lr": 0.5,
    }
    tree["s"] = np.float32(1 / 3)
    path = jaxckpt.save(tmp_path / "all", tree, save_dtypes="bfloat16")
    assert stored(path) == {"w": "bfloat16", "s": "bfloat16", "n": "int32", "key": "uint32"}
    restored = jaxckpt.restore(path, like=tree)
    np.testing.assert_array_equal(restored["w"], as_bf16(tree["w"]))
    assert (
        restored["lr"] == 0.5
        and jax.random.key_data(restored["key"]).tolist() == jax.random.key_data(tree["key"]).tolist()
    )
    assert tree["w"].dtype == np.float32  # the numpy array too is the caller's, unchanged


def test_a_sharded_async_save_casts_on_the_devices_in_the_sharding(tmp_path):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    kernel = jax.device_put(jnp.arange(1024 * 1024, dtype=jnp.float32).reshape(1024, 1024) / 3, sharding)  # 4 MiB
    path = jaxckpt.save(tmp_path / "sharded", {"kernel": kernel}, blocking=False, save_dtypes=jnp.bfloat16)
    jaxckpt.wait_until_finished()
    record = json.loads(Path(path, "index.json").read_text())["leaves"]["kernel"]
    assert record["dtype"] == record["at"]["stored"] == "bfloat16"
    # In the float32 array's sharding, written in its shards.
    assert record["sharding"] == "NamedSharding(mesh={'data': 4, 'model': 2}, spec=('data', 'model'))"
    assert record["at"]["chunks"] == [256, 512]
    other = NamedSharding(jax.make_mesh((2, 4), ("data", "model")), P(None, "model"))
    restored = jaxckpt.restore(path, like={"kernel": jax.ShapeDtypeStruct(kernel.shape, jnp.float32, sharding=other)})
    assert restored["kernel"].sharding == other and restored["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(restored["kernel"], as_bf16(kernel))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 6, rngs=rngs)
        self.out = nnx.Linear(6, 2, rngs=rngs)


def test_a_manager_saves_an_nnx_model_in_bfloat16_and_restores_into_an_abstract_one(tmp_path):
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    ckpt = jaxckpt.Checkpoint(model=model, optimizer=optimizer)
    kernel = np.asarray(model.linear.kernel[...])
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "run", save_dtypes={"model": jnp.bfloat16}) as mngr:
        mngr.save(1)
        mngr.save(2, save_dtypes=None)  # the manager's
        mngr.save(3, save_dtypes={"model": {"linear": jnp.float16}})  # this save's own
        mngr.wait_until_finished()
        paths = dict(zip(mngr.all_steps(), mngr.checkpoints))
    assert stored(paths[1])["model/linear/kernel"] == stored(paths[2])["model/out/bias"] == "bfloat16"
    assert stored(paths[1])["optimizer/opt_state/0/mu/linear/kernel"] == "float32"
    assert stored(paths[3])["model/linear/kernel"] == "float16" and stored(paths[3])["model/out/kernel"] == "float32"

    abstract_model = nnx.eval_shape(lambda: Model(nnx.Rngs(7)))
    abstract_optimizer = nnx.eval_shape(lambda: nnx.Optimizer(abstract_model, optax.adamw(1e-2), wrt=nnx.Param))
    fresh = jaxckpt.Checkpoint(model=abstract_model, optimizer=abstract_optimizer)
    with jaxckpt.CheckpointManager(fresh, tmp_path / "run") as mngr:
        mngr.restore(1).assert_consumed()
    assert abstract_model.linear.kernel[...].dtype == jnp.float32
    np.testing.assert_array_equal(abstract_model.linear.kernel[...], as_bf16(kernel))


def test_a_cast_copy_is_never_linked_to_the_float32_files_and_back(tmp_path):
    """Incremental saves link an unchanged array's files by identity (jax.Array) or content (numpy): a
    cast copy is another array, so neither the bfloat16 copy nor, later, the float32 original is linked
    to the other's files."""
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    frozen = jax.device_put(jnp.arange(1024 * 1024, dtype=jnp.float32).reshape(1024, 1024) / 3, sharding)  # 4 MiB
    host = np.arange(1024 * 1024, dtype=np.float32) / 7
    ckpt = jaxckpt.Checkpoint(frozen=frozen, host=host)
    half = {"frozen": jnp.bfloat16, "host": jnp.bfloat16}
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts") as mngr:
        first = mngr.save(1)
        plain = mngr.save(2)
        cast = mngr.save(3, save_dtypes=half)
        cast_again = mngr.save(4, save_dtypes=half)
        plain_again = mngr.save(5)
        mngr.wait_until_finished()

    def inodes(path, key):
        array = json.loads(Path(path, "index.json").read_text())["leaves"][key]["at"]["array"]
        folder = Path(path, "data", array, "c")
        return {p.stat().st_ino for p in folder.rglob("*") if p.is_file()}

    assert inodes(plain, "frozen") == inodes(first, "frozen") and inodes(plain, "host") == inodes(first, "host")
    for key in ("frozen", "host"):
        assert not inodes(cast, key) & inodes(plain, key), key  # the copy is written, not linked to float32
        assert not inodes(plain_again, key) & inodes(cast_again, key), key  # and float32 again is float32's
        assert stored(cast)[key] == stored(cast_again)[key] == "bfloat16"
        assert stored(plain_again)[key] == "float32"
    assert not inodes(cast_again, "frozen") & inodes(cast, "frozen")  # a new copy at each save: written again
    assert inodes(cast_again, "host") == inodes(cast, "host")  # the same bfloat16 bytes: content decides
    for path, want in (
        (plain, np.float32),
        (cast, jnp.bfloat16),
        (cast_again, jnp.bfloat16),
        (plain_again, np.float32),
    ):
        restored = jaxckpt.restore(path)
        assert restored["frozen"].dtype == restored["host"].dtype == want
        np.testing.assert_array_equal(restored["frozen"], np.asarray(frozen).astype(want))
        np.testing.assert_array_equal(restored["host"], host.astype(want))


@pytest.mark.parametrize(
    ("save_dtypes", "message"),
    [
        ({"parms": jnp.bfloat16}, r"names 'parms', which the saved tree does not have .*\['name', 'params', 'step'\]"),
        ({"params": {"dense": {"kernal": jnp.bfloat16}}}, r"names 'params/dense/kernal'"),
        ({"step": jnp.bfloat16}, r"gives bfloat16 for 'step', which is an array of int32: only floating-point"),
        ({"params": jnp.int8}, r"the value at 'params' is int8, which is not a floating-point dtype"),
        ({"params": "half-ish"}, r"the value at 'params' is 'half-ish', which is not a dtype"),
        (jnp.complex64, r"the value at the root is complex64, which is not a floating-point"),
        (lambda key, leaf: jnp.int32, r"the dtype returned for 'params/dense/kernel' is int32"),
        (lambda key, leaf: jnp.bfloat16, r"gives bfloat16 for 'step', which is an array of int32"),
        ({"params": {"dense": {"kernel": jnp.float64}}}, r"gives float64 for 'params/dense/kernel', which jax cannot"),
        ({"name": jnp.bfloat16}, r"gives bfloat16 for 'name', which is a str, not an array"),
    ],
)
def test_a_bad_save_dtypes_names_its_key_and_writes_nothing(tmp_path, save_dtypes, message):
    tree = {
        "params": {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}},
        "step": jnp.int32(3),
        "name": "run",
    }
    with pytest.raises(ValueError, match=message):
        jaxckpt.save(tmp_path / "bad", tree, save_dtypes=save_dtypes)
    assert os.listdir(tmp_path) == []


def test_a_manager_refuses_a_bad_save_dtypes_before_touching_its_directory(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with pytest.raises(ValueError, match=r"the value at 'w' is int8"):
        jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts", save_dtypes={"w": jnp.int8})
    assert not (tmp_path / "ckpts").exists()
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts", async_save=False) as mngr:
        with pytest.raises(ValueError, match=r"names 'v', which the saved tree does not have"):
            mngr.save(1, save_dtypes={"v": jnp.bfloat16})
        assert mngr.all_steps() == [] and mngr.checkpoint.save_counter == 0
        assert mngr.save(1, save_dtypes={"w": jnp.bfloat16}) is not None  # the next save works
        assert stored(mngr.latest_checkpoint)["w"] == "bfloat16"


def test_checkpoint_save_and_write_take_save_dtypes(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=jnp.full(4, 1 / 3), step=3)
    path = ckpt.save(tmp_path / "ckpt", save_dtypes={"w": jnp.float16})
    assert stored(path)["w"] == "float16" and jaxckpt.latest_checkpoint(tmp_path) == path
    written = ckpt.write(tmp_path / "written", save_dtypes=jnp.bfloat16, blocking=False)
    ckpt.wait_until_finished()
    assert stored(written)["w"] == "bfloat16"
    fresh = jaxckpt.Checkpoint(w=jnp.zeros(4), step=0)
    fresh.restore(path).assert_consumed()
    assert fresh.w.dtype == jnp.float32 and fresh.step == 3
    np.testing.assert_array_equal(fresh.w, np.full(4, 1 / 3, np.float32).astype(np.float16).astype(np.float32))
