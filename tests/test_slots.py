"""``restore_slots``: optimizer slots restored into a changed optimizer, matched by name and path."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxckpt


def make_params(extra_layer: bool = False, dense_out: int = 4) -> dict[str, Any]:
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    layers = {
        "dense": {"kernel": jax.random.normal(k1, (3, dense_out)), "bias": jax.random.normal(k2, (dense_out,))},
        "out": {"kernel": jax.random.normal(k3, (4, 2))},
    }
    if extra_layer:
        layers["extra"] = {"kernel": jax.random.normal(k4, (2, 2))}
    return {"params": layers}


def train(tx: optax.GradientTransformation, params: dict[str, Any], steps: int = 3) -> Any:
    state = tx.init(params)
    for step in range(steps):
        grads = jax.tree.map(lambda p, s=step: jnp.sin(p * (s + 1)) + 0.1 * s, params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return state


def same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def saved(tmp_path, state: Any) -> str:
    """The checkpoint of a training script that kept its optimizer state under ``opt_state``."""
    return jaxckpt.Checkpoint(opt_state=state, step=3).save(tmp_path / "ckpt")


def test_adam_to_clip_then_adam(tmp_path):
    params = make_params()
    old = train(optax.adam(0.1), params)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    fresh = tx.init(params)

    new, report = jaxckpt.restore_slots(saved(tmp_path, old), fresh, prefix="opt_state")

    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(fresh)  # types kept
    adam_old, adam_new = old[0], new[1][0]
    for slot in ("mu", "nu"):
        for a, b in zip(jax.tree.leaves(getattr(adam_new, slot)), jax.tree.leaves(getattr(adam_old, slot))):
            assert same_bits(a, b)
    assert same_bits(adam_new.count, adam_old.count) and int(adam_new.count) == 3
    assert report.matched["opt_state/1/0/mu/params/dense/kernel"] == "opt_state/0/mu/params/dense/kernel"
    assert report.matched["opt_state/1/0/count"] == "opt_state/0/count"
    assert len(report.matched) == 7 and report.unmatched == {} and report.unused == [] and report.mismatched == {}
    # The restored state trains on: the next update equals the old optimizer's, clipped or not.
    grads = jax.tree.map(lambda p: 1e-3 * p, params)
    want, _ = optax.adam(0.1).update(grads, old, params)
    got, _ = tx.update(grads, new, params)
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def test_clip_then_adam_to_adam(tmp_path):
    params = make_params()
    old = train(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)), params)
    new, report = jaxckpt.restore_slots(saved(tmp_path, old), optax.adam(0.1).init(params), prefix="opt_state")
    assert type(new[0]) is optax.ScaleByAdamState
    for a, b in zip(jax.tree.leaves(new[0]), jax.tree.leaves(old[1][0])):
        assert same_bits(a, b)
    assert report.matched["opt_state/0/nu/params/out/kernel"] == "opt_state/1/0/nu/params/out/kernel"
    assert report.unmatched == {} and report.unused == []


def test_model_gained_a_layer(tmp_path):
    old = train(optax.adam(0.1), make_params())
    params = make_params(extra_layer=True)
    fresh = optax.adam(0.1).init(params)
    new, report = jaxckpt.restore_slots(saved(tmp_path, old), fresh, prefix="opt_state")

    for slot in ("mu", "nu"):
        restored, before = getattr(new[0], slot)["params"], getattr(old[0], slot)["params"]
        for layer in ("dense", "out"):
            for a, b in zip(jax.tree.leaves(restored[layer]), jax.tree.leaves(before[layer])):
                assert same_bits(a, b)
        assert same_bits(restored["extra"]["kernel"], getattr(fresh[0], slot)["params"]["extra"]["kernel"])
    assert report.unmatched == {
        "opt_state/0/mu/params/extra/kernel": "no slot 'mu/params/extra/kernel' in the checkpoint",
        "opt_state/0/nu/params/extra/kernel": "no slot 'nu/params/extra/kernel' in the checkpoint",
    }
    assert report.unused == []


def test_model_lost_a_layer(tmp_path):
    old = train(optax.adam(0.1), make_params(extra_layer=True))
    _, report = jaxckpt.restore_slots(saved(tmp_path, old), optax.adam(0.1).init(make_params()), prefix="opt_state")
    assert report.unused == ["opt_state/0/mu/params/extra/kernel", "opt_state/0/nu/params/extra/kernel"]
    assert report.unmatched == {}


def test_sgd_momentum_trace(tmp_path):
    params = make_params()
    old = train(optax.sgd(0.1, momentum=0.9), params)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    new, report = jaxckpt.restore_slots(saved(tmp_path, old), tx.init(params), prefix="opt_state")
    assert type(new[1][0]) is optax.TraceState
    for a, b in zip(jax.tree.leaves(new[1][0].trace), jax.tree.leaves(old[0].trace)):
        assert same_bits(a, b)
    assert report.matched["opt_state/1/0/trace/params/dense/bias"] == "opt_state/0/trace/params/dense/bias"
    assert len(report.matched) == 3 and report.unmatched == {} and report.unused == []


def test_other_slots_never_match(tmp_path):
    # adam's moments are not sgd's trace: nothing of one goes into the other.
    params = make_params()
    fresh = optax.sgd(0.1, momentum=0.9).init(params)
    new, report = jaxckpt.restore_slots(saved(tmp_path, train(optax.adam(0.1), params)), fresh, prefix="opt_state")
    assert report.matched == {}
    assert set(report.unmatched) == {
        f"opt_state/0/trace/params/{k}" for k in ("dense/bias", "dense/kernel", "out/kernel")
    }
    assert len(report.unused) == 7  # count, and mu and nu of three parameters
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(fresh)))


def test_shape_mismatch_is_reported_not_raised(tmp_path):
    old = train(optax.adam(0.1), make_params())
    fresh = optax.adam(0.1).init(make_params(dense_out=5))
    new, report = jaxckpt.restore_slots(saved(tmp_path, old), fresh, prefix="opt_state")
    key = "opt_state/0/mu/params/dense/kernel"
    assert report.mismatched[key] == key
    assert report.unmatched[key] == (
        f"mismatch: the checkpoint's {key!r} holds a float32 array of shape (3, 4), "
        "the fresh state a float32 array of shape (3, 5)"
    )
    assert key in report.unused and key not in report.matched
    assert same_bits(new[0].mu["params"]["dense"]["kernel"], fresh[0].mu["params"]["dense"]["kernel"])
    assert same_bits(new[0].mu["params"]["out"]["kernel"], old[0].mu["params"]["out"]["kernel"])
    assert len(report.mismatched) == 4  # mu and nu of the dense kernel and bias


def test_counts_of_two_transforms_match_by_state_class(tmp_path):
    # scale_by_adam and scale_by_schedule both count steps: the state's class tells them apart.
    params = make_params()
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    old = train(optax.adam(schedule), params, steps=2)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    new, report = jaxckpt.restore_slots(saved(tmp_path, old), tx.init(params), prefix="opt_state")
    assert report.matched["opt_state/1/0/count"] == "opt_state/0/count"
    assert report.matched["opt_state/1/1/count"] == "opt_state/1/count"
    assert int(new[1][1].count) == 2 and report.unmatched == {} and report.unused == []


def test_ambiguous_count_keeps_fresh(tmp_path):
    # Two adams under multi_transform have a count each; one adam cannot tell which one is its own.
    params = make_params()
    labels = {"params": {"dense": {"kernel": "a", "bias": "b"}, "out": {"kernel": "a"}}}
    old = train(optax.multi_transform({"a": optax.adam(0.1), "b": optax.adam(0.01)}, labels), params)
    new, report = jaxckpt.restore_slots(saved(tmp_path, old), optax.adam(0.1).init(params), prefix="opt_state")
    assert report.unmatched["opt_state/0/count"] == (
        "ambiguous: 1 slot(s) 'count' here and 2 left in the checkpoint "
        "('opt_state/inner_states/a/inner_state/0/count', 'opt_state/inner_states/b/inner_state/0/count'), "
        "with nothing to tell them apart"
    )
    assert int(new[0].count) == 0
    # Each parameter's moments live in exactly one partition, so they match by name and path.
    mu_old = old.inner_states["b"].inner_state[0].mu["params"]["dense"]["bias"]
    assert same_bits(new[0].mu["params"]["dense"]["bias"], mu_old)
    assert len(report.matched) == 6
    assert set(report.unused) == {
        "opt_state/inner_states/a/inner_state/0/count",
        "opt_state/inner_states/b/inner_state/0/count",
    }


def test_adam_into_masked_and_inject_hyperparams(tmp_path):
    params = make_params()
    old = train(optax.adam(0.1), params)
    path = saved(tmp_path, old)
    mask = {"params": {"dense": {"kernel": True, "bias": False}, "out": {"kernel": True}}}
    new, report = jaxckpt.restore_slots(path, optax.masked(optax.adam(0.1), mask).init(params), prefix="opt_state")
    assert report.matched["opt_state/inner_state/0/mu/params/dense/kernel"] == "opt_state/0/mu/params/dense/kernel"
    assert "opt_state/0/mu/params/dense/bias" in report.unused  # masked out: it has no slot now
    assert type(new.inner_state[0].mu["params"]["dense"]["bias"]) is optax.MaskedNode

    fresh = optax.inject_hyperparams(optax.adam)(learning_rate=0.1).init(params)
    new, report = jaxckpt.restore_slots(path, fresh, prefix="opt_state")
    assert same_bits(new.inner_state[0].nu["params"]["out"]["kernel"], old[0].nu["params"]["out"]["kernel"])
    # inject_hyperparams' own count and its hyperparams have no counterpart in a plain adam.
    assert set(report.unmatched) == {"opt_state/count", *(f"opt_state/hyperparams/{h}" for h in fresh.hyperparams)}


def test_root_prefix_and_missing_prefix(tmp_path):
    params = make_params()
    path = jaxckpt.save(tmp_path / "opt", train(optax.adam(0.1), params))
    _, report = jaxckpt.restore_slots(path, optax.adam(0.1).init(params))
    assert report.matched["0/mu/params/out/kernel"] == "0/mu/params/out/kernel" and not report.unmatched
    with pytest.raises(jaxckpt.MissingKeyError, match="no optimizer state at 'opt_state'"):
        jaxckpt.restore_slots(path, optax.adam(0.1).init(params), prefix="opt_state")


def test_report_reads_well(tmp_path):
    old = train(optax.adam(0.1), make_params())
    fresh = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)).init(make_params(extra_layer=True))
    _, report = jaxckpt.restore_slots(saved(tmp_path, old), fresh, prefix="opt_state")
    text = str(report)
    assert text.startswith(
        f"Slot restore from {report.path!r} (prefix 'opt_state'): 7 restored, 2 kept fresh, 0 unused"
    )
    assert "    opt_state/1/0/mu/params/dense/kernel <- opt_state/0/mu/params/dense/kernel\n" in text
    assert "  kept fresh:\n    opt_state/1/0/mu/params/extra/kernel: no slot 'mu/params/extra/kernel'" in text


# --- Flax NNX ------------------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, extra_layer: bool = False) -> None:
        self.l1 = nnx.Linear(1, 5, rngs=rngs)
        self.l2 = nnx.Linear(5, 5, rngs=rngs) if extra_layer else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.l1(x)
        return x if self.l2 is None else self.l2(x)


def test_nnx_optimizer_in_place(tmp_path):
    net = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.adam(0.1), wrt=nnx.Param)
    x = jnp.arange(4.0).reshape(4, 1)
    for _ in range(3):
        opt.update(net, nnx.grad(lambda n: jnp.mean(jnp.abs(n(x) - 1.0)))(net))
    path = jaxckpt.Checkpoint(optimizer=opt, net=net).save(tmp_path / "ckpt")

    # The model gained a layer and the optimizer a clipping transform.
    net2 = Net(nnx.Rngs(1), extra_layer=True)
    opt2 = nnx.Optimizer(net2, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)), wrt=nnx.Param)
    fresh_l2_mu = np.asarray(opt2.opt_state[1][0].mu["l2"]["kernel"][...])
    restored, report = jaxckpt.restore_slots(path, opt2, prefix="optimizer")

    assert restored is opt2
    assert same_bits(opt2.opt_state[1][0].mu["l1"]["kernel"][...], opt.opt_state[0].mu["l1"]["kernel"][...])
    assert same_bits(opt2.opt_state[1][0].nu["l1"]["bias"][...], opt.opt_state[0].nu["l1"]["bias"][...])
    assert same_bits(opt2.opt_state[1][0].mu["l2"]["kernel"][...], fresh_l2_mu)
    assert int(opt2.step[...]) == 3 and int(opt2.opt_state[1][0].count[...]) == 3
    assert report.matched["optimizer/opt_state/1/0/mu/l1/kernel"] == "optimizer/opt_state/0/mu/l1/kernel"
    assert report.matched["optimizer/step"] == "optimizer/step"
    assert sorted(report.unmatched) == [
        f"optimizer/opt_state/1/0/{s}/l2/{p}" for s in ("mu", "nu") for p in ("bias", "kernel")
    ]
    assert report.unused == []
    opt2.update(net2, nnx.grad(lambda n: jnp.mean(jnp.abs(n(x) - 1.0)))(net2))  # and it still trains


def test_nnx_counts_by_position_when_names_tie(tmp_path):
    # NNX keeps no state classes: two counts (adam's, the schedule's) match by their states' fields, in place.
    tx = optax.adam(optax.linear_schedule(0.1, 0.0, 10))
    net = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(net, tx, wrt=nnx.Param)
    opt.update(net, nnx.grad(lambda n: jnp.mean(n(jnp.ones((1, 1)))))(net))
    path = jaxckpt.save(tmp_path / "opt", {"optimizer": opt})
    opt2 = nnx.Optimizer(Net(nnx.Rngs(1)), tx, wrt=nnx.Param)
    _, report = jaxckpt.restore_slots(path, opt2, prefix="optimizer")
    assert report.matched["optimizer/opt_state/1/count"] == "optimizer/opt_state/1/count"
    assert report.unmatched == {} and report.unused == []
    assert int(opt2.opt_state[1].count[...]) == 1


def trained_nnx(tx: optax.GradientTransformation, updates: int) -> tuple[Net, nnx.Optimizer]:
    net = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(net, tx, wrt=nnx.Param)
    x = jnp.arange(4.0).reshape(4, 1)
    for _ in range(updates):
        opt.update(net, nnx.grad(lambda n: jnp.mean(jnp.abs(n(x) - 1.0)))(net))
    return net, opt


def test_nnx_adamw_schedule_counts_into_a_clipped_chain(tmp_path):
    # NNX keeps no state classes; the fields of the state holding each count tell adam's
    # (count, mu, nu) from the schedule's (count alone).
    schedule = optax.linear_schedule(1e-3, 1e-4, 10)
    _, opt = trained_nnx(optax.adamw(schedule), updates=3)
    path = jaxckpt.save(tmp_path / "opt", {"optimizer": opt})
    opt2 = nnx.Optimizer(
        Net(nnx.Rngs(1)), optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), wrt=nnx.Param
    )
    _, report = jaxckpt.restore_slots(path, opt2, prefix="optimizer")
    assert report.matched["optimizer/opt_state/1/0/count"] == "optimizer/opt_state/0/count"
    assert report.matched["optimizer/opt_state/1/2/count"] == "optimizer/opt_state/2/count"
    assert report.unmatched == {} and report.unused == []
    assert int(opt2.opt_state[1][0].count[...]) == 3 and int(opt2.opt_state[1][2].count[...]) == 3
    assert same_bits(opt2.opt_state[1][0].nu["l1"]["kernel"][...], opt.opt_state[0].nu["l1"]["kernel"][...])


def test_nnx_multisteps_into_a_clipped_chain(tmp_path):
    schedule = optax.linear_schedule(1e-3, 1e-4, 10)
    _, opt = trained_nnx(optax.MultiSteps(optax.adamw(schedule), every_k_schedule=2), updates=3)
    path = jaxckpt.save(tmp_path / "opt", {"optimizer": opt})
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    opt2 = nnx.Optimizer(Net(nnx.Rngs(1)), optax.MultiSteps(inner, every_k_schedule=2), wrt=nnx.Param)
    _, report = jaxckpt.restore_slots(path, opt2, prefix="optimizer")
    assert report.unmatched == {} and report.unused == []
    state, old = opt2.opt_state, opt.opt_state
    # Two updates of three made one inner step: the inner counts are 1, the mini step 1 (half way to the next).
    assert int(state.mini_step[...]) == 1 and int(state.gradient_step[...]) == 1
    assert int(state.inner_opt_state[1][0].count[...]) == 1 and int(state.inner_opt_state[1][2].count[...]) == 1
    assert (
        report.matched["optimizer/opt_state/inner_opt_state/1/2/count"] == "optimizer/opt_state/inner_opt_state/2/count"
    )
    assert same_bits(state.acc_grads["l1"]["kernel"][...], old.acc_grads["l1"]["kernel"][...])
    assert same_bits(state.inner_opt_state[1][0].mu["l1"]["bias"][...], old.inner_opt_state[0].mu["l1"]["bias"][...])


def test_optax_chain_from_nnx_counts(tmp_path):
    # The other way: the checkpoint's NNX dicts into a plain optax state, whose classes one side lacks.
    params = {"l1": {"kernel": jnp.ones((1, 5)), "bias": jnp.zeros(5)}}
    schedule = optax.linear_schedule(1e-3, 1e-4, 10)
    _, opt = trained_nnx(optax.adamw(schedule), updates=2)
    path = jaxckpt.save(tmp_path / "opt", {"optimizer": opt})
    fresh = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)).init(params)
    new, report = jaxckpt.restore_slots(path, fresh, prefix="optimizer/opt_state")
    assert int(new[1][0].count) == 2 and int(new[1][2].count) == 2 and report.unmatched == {}
