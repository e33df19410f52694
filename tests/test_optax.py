"""Optax states and Flax NNX optimizers round-trip with exact types and bit-identical values.

Each optimizer takes a few update steps first, so that every slot and count holds a value that a
fresh state does not; the restore goes into a freshly initialized state, as after a restart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxckpt

Params = dict[str, Any]


def make_params() -> Params:
    """A linen-style params dict: the keys of its slots read like ``mu/params/dense/kernel``."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "params": {
            "dense": {"kernel": jax.random.normal(k1, (3, 4)), "bias": jax.random.normal(k2, (4,))},
            "out": {"kernel": jax.random.normal(k3, (4, 2))},
        }
    }


def grads_at(params: Params, step: int) -> Params:
    # Different gradients at every step, so the moments do not settle into one simple value.
    return jax.tree.map(lambda p: jnp.sin(p * (step + 1)) + 0.1 * step, params)


def train(tx: optax.GradientTransformation, params: Params, steps: int = 3) -> Any:
    state = tx.init(params)
    for step in range(steps):
        updates, state = tx.update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return state


def one_level(x: Any) -> list[Any] | None:
    """The children of a pytree node, or None for a leaf."""
    children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return None
    return children


def bits(x: Any) -> np.ndarray:
    """The raw bytes of an array, so that NaN payloads and -0.0 count as different values."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def assert_identical(a: Any, b: Any, path: str = "root") -> None:
    """Same node types all the way down (a tuple stays a tuple), same dtypes, shapes and bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    kids_a, kids_b = one_level(a), one_level(b)
    if kids_a is None or kids_b is None:
        assert kids_a is None and kids_b is None, path
        if isinstance(a, (jax.Array, np.ndarray, np.generic)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
            assert np.array_equal(bits(a), bits(b)), f"{path}: values differ"
            if isinstance(a, jax.Array):
                assert a.sharding == b.sharding, f"{path}: {a.sharding} != {b.sharding}"
        else:
            assert a == b, path
        return
    assert jax.tree_util.tree_structure(a, is_leaf=lambda y: y is not a) == jax.tree_util.tree_structure(
        b, is_leaf=lambda y: y is not b
    ), path
    assert len(kids_a) == len(kids_b), path
    for i, (x, y) in enumerate(zip(kids_a, kids_b)):
        assert_identical(x, y, f"{path}/{i}")


def _masked() -> optax.GradientTransformation:
    mask = {"params": {"dense": {"kernel": True, "bias": False}, "out": {"kernel": True}}}
    return optax.masked(optax.adam(0.1), mask)


def _multi_transform() -> optax.GradientTransformation:
    labels = {"params": {"dense": {"kernel": "adam", "bias": "sgd"}, "out": {"kernel": "adam"}}}
    return optax.multi_transform({"adam": optax.adam(0.1), "sgd": optax.sgd(0.1, momentum=0.9)}, labels)


OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(0.1),
    "adamw": lambda: optax.adamw(0.1, weight_decay=0.01),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "chain_clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
    "multi_transform": _multi_transform,
    "masked": _masked,
    "adam_schedule": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(0.1), every_k_schedule=2),
}


@pytest.fixture(params=list(OPTIMIZERS))
def trained(request) -> tuple[Any, Any]:
    """A state after a few steps, and a fresh state of the same optimizer to restore into."""
    tx = OPTIMIZERS[request.param]()
    params = make_params()
    state = train(tx, params)
    if request.param == "inject_hyperparams":
        state.hyperparams["learning_rate"] = jnp.asarray(0.05)  # as a user's schedule would set it
    return state, tx.init(params)


def test_save_restore_like_fresh_state(tmp_path, trained):
    state, fresh = trained
    path = jaxckpt.save(tmp_path / "opt", state)
    assert_identical(jaxckpt.restore(path, like=fresh), state)


def test_checkpoint_child(tmp_path, trained, small_packs):
    # small_packs: every leaf its own zarr3 array, the other storage path of the round trip.
    state, fresh = trained
    path = jaxckpt.Checkpoint(optimizer=state, step=3).save(tmp_path / "ckpt")
    ckpt = jaxckpt.Checkpoint(optimizer=fresh, step=0)
    ckpt.restore(path).assert_consumed()
    assert_identical(ckpt.optimizer, state)
    assert ckpt.step == 3


def test_restored_chain_trains_on_bitwise(tmp_path):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1))
    params = make_params()
    state = train(tx, params)
    path = jaxckpt.save(tmp_path / "opt", state)
    restored = jaxckpt.restore(path, like=tx.init(params))
    want, _ = tx.update(grads_at(params, 3), state, params)
    got, _ = tx.update(grads_at(params, 3), restored, params)
    assert_identical(got, want)


def test_keys_read_naturally(tmp_path):
    params = make_params()
    state = train(optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam()), params)
    path = jaxckpt.Checkpoint(optimizer={"opt_state": state}).save(tmp_path / "ckpt")
    keys = [k for k, _ in jaxckpt.list_variables(path)]
    assert keys == [
        "optimizer/opt_state/1/count",
        "optimizer/opt_state/1/mu/params/dense/bias",
        "optimizer/opt_state/1/mu/params/dense/kernel",
        "optimizer/opt_state/1/mu/params/out/kernel",
        "optimizer/opt_state/1/nu/params/dense/bias",
        "optimizer/opt_state/1/nu/params/dense/kernel",
        "optimizer/opt_state/1/nu/params/out/kernel",
        "save_counter",
    ]
    mu = jaxckpt.load_variable(path, "optimizer/opt_state/1/mu/params/dense/kernel")
    assert np.array_equal(bits(mu), bits(state[1].mu["params"]["dense"]["kernel"]))


def test_keys_of_adamw_chain(tmp_path):
    # adamw is itself a chain: (scale_by_adam, add_decayed_weights, scale), hence the 1/0.
    path = jaxckpt.save(tmp_path / "opt", {"opt_state": train(OPTIMIZERS["chain_clip_adamw"](), make_params())})
    assert dict(jaxckpt.list_variables(path)) == {
        "opt_state/1/0/count": (),
        "opt_state/1/0/mu/params/dense/bias": (4,),
        "opt_state/1/0/mu/params/dense/kernel": (3, 4),
        "opt_state/1/0/mu/params/out/kernel": (4, 2),
        "opt_state/1/0/nu/params/dense/bias": (4,),
        "opt_state/1/0/nu/params/dense/kernel": (3, 4),
        "opt_state/1/0/nu/params/out/kernel": (4, 2),
    }


def test_restore_without_template_keeps_namedtuples_and_tuples(tmp_path):
    state = train(optax.adam(0.1), make_params())
    restored = jaxckpt.restore(jaxckpt.save(tmp_path / "opt", state))
    assert type(restored) is tuple
    assert type(restored[0]).__name__ == "ScaleByAdamState" and restored[0]._fields == ("count", "mu", "nu")
    assert np.array_equal(restored[0].mu["params"]["out"]["kernel"], state[0].mu["params"]["out"]["kernel"])


def test_sharded_state_keeps_fresh_shardings(tmp_path):
    mesh = jax.make_mesh((8,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    params = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)}
    tx = optax.adam(0.1)
    state = train(tx, params)
    path = jaxckpt.save(tmp_path / "opt", state)
    fresh = tx.init(params)
    restored = jaxckpt.restore(path, like=fresh)
    assert restored[0].mu["w"].sharding == fresh[0].mu["w"].sharding
    assert np.array_equal(bits(restored[0].mu["w"]), bits(state[0].mu["w"]))


def test_train_state(tmp_path):
    params = make_params()
    tx = OPTIMIZERS["chain_clip_adamw"]()
    state = train_state.TrainState.create(apply_fn=lambda p, x: x, params=params, tx=tx)
    for step in range(3):
        state = state.apply_gradients(grads=grads_at(state.params, step))
    path = jaxckpt.save(tmp_path / "state", state)
    fresh = train_state.TrainState.create(apply_fn=lambda p, x: x, params=make_params(), tx=tx)
    restored = jaxckpt.restore(path, like=fresh)
    assert restored.apply_fn is fresh.apply_fn and restored.tx is fresh.tx  # static fields stay the fresh ones
    assert_identical(restored.replace(apply_fn=None, tx=None), state.replace(apply_fn=None, tx=None))


# --- Flax NNX ------------------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(1, 5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l1(x)


def _nnx_trained(tx: optax.GradientTransformation, seed: int = 0, steps: int = 3) -> tuple[Net, nnx.Optimizer]:
    net = Net(nnx.Rngs(seed))
    opt = nnx.Optimizer(net, tx, wrt=nnx.Param)
    x = jnp.arange(4.0).reshape(4, 1)
    for _ in range(steps):
        grads = nnx.grad(lambda n: jnp.mean(jnp.abs(n(x) - 1.0)))(net)
        opt.update(net, grads)
    return net, opt


def test_nnx_optimizer_keys_and_round_trip(tmp_path):
    net, opt = _nnx_trained(optax.adam(0.1))
    path = jaxckpt.Checkpoint(optimizer=opt, net=net).save(tmp_path / "ckpt")
    assert dict(jaxckpt.list_variables(path)) == {
        "net/l1/bias": (5,),
        "net/l1/kernel": (1, 5),
        "optimizer/opt_state/0/count": (),
        "optimizer/opt_state/0/mu/l1/bias": (5,),
        "optimizer/opt_state/0/mu/l1/kernel": (1, 5),
        "optimizer/opt_state/0/nu/l1/bias": (5,),
        "optimizer/opt_state/0/nu/l1/kernel": (1, 5),
        "optimizer/step": (),
        "save_counter": (),
    }
    net2, opt2 = _nnx_trained(optax.adam(0.1), seed=1, steps=0)
    ckpt = jaxckpt.Checkpoint(optimizer=opt2, net=net2)
    ckpt.restore(path).assert_consumed()
    assert ckpt.optimizer is opt2 and ckpt.net is net2  # NNX objects are restored in place
    # The optimizer's own state tree (OptVariables inside optax NamedTuples) keeps its types.
    assert jax.tree_util.tree_structure(opt2.opt_state) == jax.tree_util.tree_structure(opt.opt_state)
    assert_identical(nnx.to_pure_dict(nnx.state(opt2)), nnx.to_pure_dict(nnx.state(opt)))
    assert_identical(nnx.to_pure_dict(nnx.state(net2)), nnx.to_pure_dict(nnx.state(net)))


def test_nnx_optimizer_chain_restore_like(tmp_path):
    tx = OPTIMIZERS["chain_clip_adamw"]
    _, opt = _nnx_trained(tx())
    path = jaxckpt.save(tmp_path / "opt", opt)
    assert "opt_state/1/0/mu/l1/kernel" in dict(jaxckpt.list_variables(path))
    _, fresh = _nnx_trained(tx(), seed=1, steps=0)
    assert jaxckpt.restore(path, like=fresh) is fresh
    assert_identical(nnx.to_pure_dict(nnx.state(fresh)), nnx.to_pure_dict(nnx.state(opt)))
