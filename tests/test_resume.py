"""Exact resumption: a run restarted from a checkpoint computes the same losses, bit for bit.

Each test trains once without interruption, saving along the way, then builds a fresh set of objects
(initialized from another seed, so that nothing is right by accident), restores a middle checkpoint
and trains to the end. Losses are compared as float bits with ``np.array_equal``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen, nnx
from flax.training import train_state
from guide_model import ToyIterator, make_checkpoint, toy_dataset, train_and_checkpoint

import jaxckpt


def assert_same_bits(restarted: dict[int, np.ndarray], uninterrupted: dict[int, np.ndarray]) -> None:
    assert restarted, "the restarted run trained no step"
    for step, loss in restarted.items():
        want = uninterrupted[step]
        assert loss.dtype == want.dtype and np.array_equal(loss.view(np.uint32), want.view(np.uint32)), (
            f"step {step}: {loss!r} != {want!r}"
        )


# --- (a) the guide's example: NNX net, Adam, a data iterator with a saved position ------------------


def test_guide_example_resumes_exactly(tmp_path: Path):
    ckpt = make_checkpoint(seed=0)
    ckpt.restore(None)  # nothing to restore yet: start from scratch (as the guide does)
    uninterrupted = train_and_checkpoint(ckpt, tmp_path / "run" / "ckpt", until=50)
    assert sorted(uninterrupted) == list(range(1, 51))
    assert uninterrupted[50] < uninterrupted[10] / 2  # it learns (steps 10 and 50 see the same batch)

    restarted_ckpt = make_checkpoint(seed=1)
    restarted_ckpt.restore(tmp_path / "run" / "ckpt-3").assert_consumed()  # saved at step 30
    assert restarted_ckpt.step == 30 and restarted_ckpt.iterator.position == 30
    assert restarted_ckpt.save_counter == 3  # so the next save of the restarted run is ckpt-4
    restarted = train_and_checkpoint(restarted_ckpt, tmp_path / "restarted" / "ckpt", until=50)
    assert sorted(restarted) == list(range(31, 51))
    assert_same_bits(restarted, uninterrupted)

    # The final checkpoints of both runs hold the same bits too, key by key.
    ours, theirs = tmp_path / "restarted" / "ckpt-5", tmp_path / "run" / "ckpt-5"
    keys = [k for k, _ in jaxckpt.list_variables(theirs)]
    assert keys == [k for k, _ in jaxckpt.list_variables(ours)]
    for key in keys:
        a, b = jaxckpt.load_variable(ours, key), jaxckpt.load_variable(theirs, key)
        assert np.array_equal(np.asarray(a), np.asarray(b)), key


def test_guide_example_resumes_from_latest(tmp_path: Path):
    # A run that stopped at step 37 (after the step-30 save) restarts from its latest checkpoint.
    uninterrupted = train_and_checkpoint(make_checkpoint(seed=0), tmp_path / "full" / "ckpt", until=50)
    crashed = make_checkpoint(seed=0)
    train_and_checkpoint(crashed, tmp_path / "run" / "ckpt", until=37)
    latest = tmp_path / "run" / f"ckpt-{crashed.save_counter}"
    assert latest.name == "ckpt-3"

    restarted_ckpt = make_checkpoint(seed=2)
    restarted_ckpt.restore(latest).assert_consumed()
    assert restarted_ckpt.step == 30
    restarted = train_and_checkpoint(restarted_ckpt, tmp_path / "restarted" / "ckpt", until=50)
    assert_same_bits(restarted, uninterrupted)


# --- (b) a Flax linen model in a TrainState ------------------------------------------------------


class LinenNet(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(5, name="l1")(x)


@jax.jit
def linen_step(state: train_state.TrainState, x: jax.Array, y: jax.Array) -> tuple[train_state.TrainState, jax.Array]:
    def loss_fn(params) -> jax.Array:
        return jnp.mean(jnp.abs(state.apply_fn(params, x) - y))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def fresh_train_state(seed: int) -> train_state.TrainState:
    model = LinenNet()
    params = model.init(jax.random.key(seed), jnp.zeros((1, 1)))
    tx = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(0.1))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def run_linen(state: train_state.TrainState, until: int, save_to: Path) -> dict[int, np.ndarray]:
    """Train to step ``until``; the data position is the step itself, so the state is all there is."""
    inputs, labels = toy_dataset()
    losses = {}
    while int(state.step) < until:
        start = (int(state.step) % 5) * 2
        state, loss = linen_step(state, inputs[start : start + 2], labels[start : start + 2])
        losses[int(state.step)] = np.asarray(loss)
        if int(state.step) % 10 == 0:
            jaxckpt.save(save_to / f"state-{int(state.step)}", state)
    return losses


def test_linen_train_state_resumes_exactly(tmp_path: Path):
    uninterrupted = run_linen(fresh_train_state(0), 50, tmp_path / "run")
    fresh = fresh_train_state(1)
    state = jaxckpt.restore(tmp_path / "run" / "state-30", like=fresh)
    assert type(state) is train_state.TrainState and state.tx is fresh.tx
    assert int(state.step) == 30
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(fresh.opt_state)
    restarted = run_linen(state, 50, tmp_path / "restarted")
    assert sorted(restarted) == list(range(31, 51))
    assert_same_bits(restarted, uninterrupted)


# --- (c) dropout: the RNG state resumes too -------------------------------------------------------


class DropoutNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(1, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def dropout_checkpoint(params_seed: int, dropout_seed: int) -> jaxckpt.Checkpoint:
    net = DropoutNet(nnx.Rngs(params=params_seed, dropout=dropout_seed))
    optimizer = nnx.Optimizer(net, optax.adam(0.01), wrt=nnx.Param)
    return jaxckpt.Checkpoint(step=0, optimizer=optimizer, net=net, iterator=ToyIterator())


def test_dropout_rng_resumes_exactly(tmp_path: Path):
    uninterrupted = train_and_checkpoint(dropout_checkpoint(0, 10), tmp_path / "run" / "ckpt", until=30)
    # The dropout masks matter: another dropout seed gives other losses from the first step on.
    other_seed = train_and_checkpoint(dropout_checkpoint(0, 11), tmp_path / "other" / "ckpt", until=10)
    assert not np.array_equal(other_seed[10], uninterrupted[10])

    restarted_ckpt = dropout_checkpoint(5, 99)  # other params and another dropout stream, until restored
    status = restarted_ckpt.restore(tmp_path / "run" / "ckpt-2").assert_consumed()
    assert "net/drop/rngs/key" in status.matched_keys and "net/drop/rngs/count" in status.matched_keys
    assert int(restarted_ckpt.net.drop.rngs.count[...]) == 20  # one dropout draw per step
    restarted = train_and_checkpoint(restarted_ckpt, tmp_path / "restarted" / "ckpt", until=30)
    assert sorted(restarted) == list(range(21, 31))
    assert_same_bits(restarted, uninterrupted)
