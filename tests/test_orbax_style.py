"""The Orbax-style manager surface beside the TF one: checkpoints by step, one state file, one retention.

Written as Orbax users write their loops (``manager.save(step)``, ``should_save``, ``all_steps``,
``latest_step``, ``restore``), with the NNX training loop of the Orbax docs: a model with dropout,
adamw, a data iterator, and a restart from an abstract model that continues bit for bit.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from guide_model import ToyIterator

import jaxckpt
from jaxckpt.storage import locations


def _manager(ckpt: jaxckpt.Checkpoint, directory: Path, **kwargs) -> jaxckpt.CheckpointManager:
    return jaxckpt.CheckpointManager(ckpt, directory, async_save=False, **kwargs)


def test_save_by_step_names_and_lists_checkpoints_by_step(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(3))
    with _manager(ckpt, tmp_path, max_to_keep=2) as manager:
        assert manager.latest_step() is None and manager.all_steps() == []
        for step in (100, 200, 300):
            ckpt.w = jnp.full(3, float(step))
            assert manager.save(step=step) == str(tmp_path / f"ckpt-{step}")
        assert manager.all_steps() == [200, 300] and manager.latest_step() == 300
        assert manager.save(step=300) is None  # not past the latest step: Orbax's should_save says no
    # A restarted job: a new manager restores by step into its Checkpoint.
    fresh = jaxckpt.Checkpoint(w=jnp.zeros(3))
    with _manager(fresh, tmp_path, max_to_keep=2) as manager:
        assert manager.all_steps() == [200, 300]
        manager.restore().assert_consumed()  # the latest
        np.testing.assert_array_equal(fresh.w, jnp.full(3, 300.0))
        manager.restore(200).assert_consumed()
        np.testing.assert_array_equal(fresh.w, jnp.full(3, 200.0))
        with pytest.raises(
            jaxckpt.CheckpointNotFoundError, match=r"no checkpoint of step 100; its kept steps are \[200, 300\]"
        ):
            manager.restore(100)
        manager.save(step=400)
        assert manager.all_steps() == [300, 400]
    assert jaxckpt.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-400")


def test_save_interval_steps_follows_orbax(tmp_path):
    ckpt = jaxckpt.Checkpoint(step=0)
    with _manager(ckpt, tmp_path, save_interval_steps=5) as manager:
        assert [s for s in range(12) if manager.should_save(s)] == [0, 5, 10]
        saved = [step for step in range(12) if manager.save(step=step) is not None]
        assert saved == [0, 5, 10] and manager.all_steps() == [0, 5, 10]
        assert not manager.should_save(10) and manager.should_save(15)
        assert manager.save(step=11, force=True) is not None  # force saves anyway
        # Orbax writes mngr.save(step, ...): positional, it is decided the same way (no step counter here).
        assert [s for s in range(12, 21) if manager.save(s) is not None] == [15, 20]
    with pytest.raises(ValueError, match="save_interval_steps must be a positive int"):
        jaxckpt.CheckpointManager(ckpt, tmp_path / "other", save_interval_steps=0)


def test_save_interval_steps_with_a_step_counter_and_the_tf_calls(tmp_path):
    """One state file and one retention: TF-style saves and step saves share both."""
    ckpt = jaxckpt.Checkpoint(step=0)
    with _manager(ckpt, tmp_path, step_counter="step", save_interval_steps=2, max_to_keep=3) as manager:
        for step in range(1, 9):
            ckpt.step = step
            manager.save()  # the step comes from the counter; odd steps are skipped
        assert manager.all_steps() == [4, 6, 8]
        assert [Path(p).name for p in manager.checkpoints] == ["ckpt-2", "ckpt-3", "ckpt-4"]
        with pytest.raises(ValueError, match="give one of them"):
            manager.save(5, step=6)


def test_a_read_only_manager_restores_by_step(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(2))
    with _manager(ckpt, tmp_path) as manager:
        manager.save(step=7)
    reader = jaxckpt.Checkpoint(w=jnp.zeros(2))
    with jaxckpt.CheckpointManager(reader, tmp_path, read_only=True) as manager:
        assert manager.latest_step() == 7
        manager.restore(7).assert_consumed()
    np.testing.assert_array_equal(reader.w, jnp.ones(2))


# --- delete(step): rolling back after a loss spike -------------------------------------------------


def _steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in directory.iterdir() if p.name.startswith("ckpt-"))


def test_delete_rolls_back_after_a_loss_spike(tmp_path):
    """Orbax's rollback: restore step 300, delete 400 and 500, train again and save a new step 400."""
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(3))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=5) as manager:  # async saves, as Orbax's
        for step in (100, 200, 300, 400, 500):
            ckpt.w = jnp.full(3, float(step))
            manager.save(step)
        manager.restore(300)  # the loss spiked after 300
        manager.delete(400)
        manager.delete(500)
        assert manager.all_steps() == [100, 200, 300] and manager.latest_step() == 300
        assert jaxckpt.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-300")  # the state file says so
        ckpt.w = jnp.full(3, -400.0)  # trained again, differently
        assert manager.should_save(400)
        assert manager.save(400) == str(tmp_path / "ckpt-400")
        manager.wait_until_finished()
        assert manager.all_steps() == [100, 200, 300, 400]
    assert _steps_on_disk(tmp_path) == [100, 200, 300, 400]  # 500's folder is gone, not only unlisted
    fresh = jaxckpt.Checkpoint(w=jnp.zeros(3))
    with jaxckpt.CheckpointManager(fresh, tmp_path, max_to_keep=5) as manager:
        assert manager.all_steps() == [100, 200, 300, 400]
        manager.restore(400).assert_consumed()
    np.testing.assert_array_equal(fresh.w, jnp.full(3, -400.0))  # the new step 400, not the deleted one


def test_delete_of_a_step_being_saved_waits_for_the_save(tmp_path):
    """The save in flight is finished (and recorded) first, then deleted: never a half-written step."""
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(1000))
    with jaxckpt.CheckpointManager(ckpt, tmp_path) as manager:
        manager.save(1)
        manager.save(2)  # returns once snapshotted: still being written in the background
        manager.delete(2)
        assert manager.all_steps() == [1]
        manager.wait_until_finished()
    assert _steps_on_disk(tmp_path) == [1]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or hidden leftovers


def test_delete_refuses_what_it_must_not_delete(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(2))
    with _manager(ckpt, tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(step)
        with pytest.raises(
            jaxckpt.CheckpointNotFoundError, match=r"no checkpoint of step 7; its kept steps are \[1, 2, 3\]"
        ):
            manager.delete(7)
        with pytest.raises(TypeError):
            manager.delete("2")
    with pytest.raises(jaxckpt.ManagerLockedError, match="closed"):
        manager.delete(1)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, read_only=True) as reader:
        with pytest.raises(jaxckpt.ManagerLockedError, match="read_only=True"):
            reader.delete(1)
        assert reader.all_steps() == [1, 2, 3]
    assert _steps_on_disk(tmp_path) == [1, 2, 3]


def test_delete_lets_the_step_be_saved_again_with_a_checkpoint_interval(tmp_path):
    """TF's checkpoint_interval counts from the step last saved: once that checkpoint is deleted, the
    same step saves again (the rollback re-trains it)."""
    ckpt = jaxckpt.Checkpoint(step=0, w=jnp.ones(2))
    with _manager(ckpt, tmp_path, step_counter="step", checkpoint_interval=5) as manager:
        ckpt.step = 10
        manager.save()
        manager.delete(10)
        assert manager.save() == str(tmp_path / "ckpt-2")
        assert manager.all_steps() == [10]


def test_delete_in_a_bucket(s3):
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(2))
    with _manager(ckpt, s3) as manager:
        for step in (1, 2, 3):
            manager.save(step)
        manager.delete(3)
        manager.delete(2)
        assert manager.all_steps() == [1]
        manager.wait_until_finished()
        assert not locations.is_checkpoint(locations.location(f"{s3}/ckpt-2"))
        assert not locations.children(locations.location(f"{s3}/ckpt-3"))  # every object gone, the index first
        ckpt.w = jnp.full(2, 5.0)
        manager.save(2)
    assert jaxckpt.latest_checkpoint(s3) == f"{s3}/ckpt-2"
    fresh = jaxckpt.Checkpoint(w=jnp.zeros(2))
    with _manager(fresh, s3) as manager:
        assert manager.all_steps() == [1, 2]
        manager.restore(2).assert_consumed()
    np.testing.assert_array_equal(fresh.w, jnp.full(2, 5.0))


# --- the Orbax docs' NNX training loop, restarted from an abstract model --------------------------


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(1, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.dropout(nnx.relu(self.l1(x))))


def _create(seed: int) -> tuple[Model, nnx.Optimizer]:
    model = Model(nnx.Rngs(params=seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


@nnx.jit
def _train_step(model: Model, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: Model) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _train(model, optimizer, data, manager, start: int, stop: int) -> dict[int, np.ndarray]:
    losses = {}
    for step in range(start, stop):
        batch = next(data)
        losses[step] = np.asarray(_train_step(model, optimizer, batch["x"], batch["y"]))
        manager.save(step=step + 1)  # the step count after this update; should_save decides
    manager.wait_until_finished()
    return losses


def test_orbax_style_nnx_loop_restarts_from_an_abstract_model_bit_for_bit(tmp_path):
    model, optimizer = _create(0)
    data = ToyIterator()
    ckpt = jaxckpt.Checkpoint(model=model, optimizer=optimizer, data=data)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2, save_interval_steps=5) as manager:
        uninterrupted = _train(model, optimizer, data, manager, 0, 20)
        assert manager.all_steps() == [15, 20]

    # A new job: an abstract model and optimizer (no memory allocated), restored in place.
    abstract_model, abstract_optimizer = nnx.eval_shape(lambda: _create(7))
    data = ToyIterator()
    ckpt = jaxckpt.Checkpoint(model=abstract_model, optimizer=abstract_optimizer, data=data)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2, save_interval_steps=5) as manager:
        manager.restore(15).assert_consumed()
        assert data.position == 15 and isinstance(abstract_model.l1.kernel[...], jax.Array)
        restarted = _train(abstract_model, abstract_optimizer, data, manager, 15, 20)
    assert sorted(restarted) == [15, 16, 17, 18, 19]
    for step, loss in restarted.items():
        assert loss.view(np.uint32) == uninterrupted[step].view(np.uint32), step


# --- run-level metadata, as Orbax's CheckpointManager(..., metadata={...}) -------------------------

CONFIG = {"model": "mlp", "lr": 0.001, "layers": [64, 64], "data": {"name": "toy", "shuffle": True, "seed": None}}


def test_run_metadata_is_written_once_and_read_back_by_any_manager(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(2))
    with _manager(ckpt, tmp_path, metadata=CONFIG) as manager:
        assert manager.metadata() == CONFIG
        manager.metadata()["lr"] = 1.0  # a copy: the manager's record stays as written
        assert manager.metadata() == CONFIG
    # A read-only manager (an evaluator) reads it before any step exists.
    with jaxckpt.CheckpointManager(ckpt, tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [] and reader.metadata() == CONFIG
    # Orbax's rule: written once, when the directory first gets metadata; a later manager's is ignored
    # (with a warning here, since it differs), and the first one's is what every manager reads.
    with pytest.warns(UserWarning, match=r"checkpoint\.metadata.*keeps the metadata it has"):
        with _manager(ckpt, tmp_path, metadata={**CONFIG, "lr": 0.1}) as manager:
            assert manager.metadata() == CONFIG
            manager.save(step=1)
    with _manager(ckpt, tmp_path) as manager:  # none given: the recorded one
        assert manager.metadata() == CONFIG
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _manager(ckpt, tmp_path, metadata=dict(reversed(CONFIG.items()))) as manager:  # the same: no warning
            assert manager.metadata() == CONFIG


def test_run_metadata_where_none_was_written(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(2))
    with _manager(ckpt, tmp_path) as manager:
        assert manager.metadata() == {}
        manager.save(step=1)
    # Read-only: never written; the given metadata is what it reports (as Orbax's read-only manager).
    with jaxckpt.CheckpointManager(ckpt, tmp_path, read_only=True, metadata={"a": 1}) as reader:
        assert reader.metadata() == {"a": 1}
    assert not (tmp_path / "checkpoint.metadata").exists()
    # A writing manager gives a directory without metadata its first.
    with _manager(ckpt, tmp_path, metadata={"a": 2}) as manager:
        assert manager.metadata() == {"a": 2}
    with jaxckpt.CheckpointManager(ckpt, tmp_path, read_only=True) as reader:
        assert reader.metadata() == {"a": 2} and reader.all_steps() == [1]


@pytest.mark.parametrize(
    ("metadata", "named"),
    [
        ({"lr": np.float32(0.1)}, r"metadata\['lr'\] = np\.float32\(0\.1\).*float\(\)"),
        ({"mesh": {"shape": (2, 4)}}, r"metadata\['mesh'\]\['shape'\] = \(2, 4\).*tuple.*list"),
        ({"loss": float("nan")}, r"metadata\['loss'\] = nan"),
        ({"layers": [64, print]}, r"metadata\['layers'\]\[1\] = <built-in function print>"),
        ({3: "x"}, r"metadata has the key 3"),
        ({"cfg": {"a": {(1, 2): 0}}}, r"metadata\['cfg'\]\['a'\] has the key \(1, 2\)"),
        ([("a", 1)], r"metadata must be a mapping"),
    ],
)
def test_run_metadata_must_be_json(tmp_path, metadata, named):
    with pytest.raises(jaxckpt.UnsupportedValueError, match=named):
        jaxckpt.CheckpointManager(jaxckpt.Checkpoint(w=jnp.zeros(2)), tmp_path / "ckpts", metadata=metadata)
    assert not (tmp_path / "ckpts").exists()  # refused before the directory was touched


def test_a_damaged_run_metadata_file_is_named(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(2))
    with _manager(ckpt, tmp_path, metadata={"a": 1}):
        pass
    (tmp_path / "checkpoint.metadata").write_text('{"format": "jaxckpt-run-metadata", "version": 1, "metadata": [')
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"checkpoint\.metadata"):
        jaxckpt.CheckpointManager(ckpt, tmp_path, read_only=True).metadata()


# --- iterator state that is bytes, as grain's DataLoader iterator gives it ------------------------


class BytesStateIterator:
    """A data iterator whose ``get_state()`` returns bytes, as grain's ``DataLoader`` iterator does
    (its state is JSON encoded to bytes); ``set_state`` takes them back."""

    def __init__(self) -> None:
        self.position = 0

    def __next__(self) -> int:
        self.position += 1
        return self.position

    def get_state(self) -> bytes:
        return json.dumps({"last_seen_indices": {"0": self.position - 1}, "worker": 0}).encode() + b"\x00\xff"

    def set_state(self, state: bytes) -> None:
        assert isinstance(state, bytes), type(state)
        assert state.endswith(b"\x00\xff")
        self.position = json.loads(state[:-2])["last_seen_indices"]["0"] + 1


def test_iterator_state_that_is_bytes_is_saved_and_given_back(tmp_path):
    data = BytesStateIterator()
    ckpt = jaxckpt.Checkpoint(data=data, w=jnp.zeros(2))
    with _manager(ckpt, tmp_path) as manager:
        for step in range(3):
            next(data)
            manager.save(step=step)
    resumed = BytesStateIterator()
    with _manager(jaxckpt.Checkpoint(data=resumed, w=jnp.zeros(2)), tmp_path) as manager:
        manager.restore(1).assert_consumed()
        assert resumed.position == 2 and next(resumed) == 3
    saved = tmp_path / "ckpt-2"
    assert jaxckpt.restore(saved)["data"] == data.get_state()  # without a template: the bytes
    view = jaxckpt.inspect(saved)
    assert "data" in view.keys()
    # JSON states still work beside it, and a state that is neither is refused, naming the key.
    with pytest.raises(jaxckpt.UnsupportedValueError, match=r"'data'.*get_state\(\).*not JSON or bytes"):
        jaxckpt.save(tmp_path / "bad", {"data": _Odd(), "json": ToyIterator()})


class _Odd:
    def get_state(self) -> set[int]:
        return {1, 2}

    def set_state(self, state: object) -> None:
        pass
