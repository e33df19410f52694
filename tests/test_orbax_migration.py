"""Moving an Orbax run to jaxckpt: what Orbax 0.12.8, Flax 0.12.8 and grain 0.2.18 wrote
(tests/golden/foreign/orbax_migration, see its README) restores into the objects a training script
holds (a Flax TrainState with its optax state, an NNX model and its State), bit for bit.

Orbax is not imported: the values are compared with expected.npz, which Orbax itself restored.
"""

from __future__ import annotations

import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import jaxckpt
from jaxckpt._errors import CheckpointFormatError, MismatchError

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "foreign", "orbax_migration")


@pytest.fixture(scope="module")
def expected() -> dict:
    with open(os.path.join(GOLDEN, "expected.json"), encoding="utf-8") as f:
        return json.load(f)["fixtures"]


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    with np.load(os.path.join(GOLDEN, "expected.npz"), allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def path_key(path: tuple) -> str:
    """A pytree key path as expected.npz names it: dict keys, attribute names and indices, '/'-joined."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    return "/".join(parts)


def leaves_by_key(tree) -> dict[str, np.ndarray]:
    """The array leaves of ``tree`` (Python values are not in expected.npz), keyed as expected.npz keys them."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not hasattr(leaf, "dtype"):
            continue
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[path_key(path)] = np.asarray(leaf)
    return out


def assert_bit_equal(got: dict[str, np.ndarray], arrays: dict[str, np.ndarray], prefix: str) -> None:
    want = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
    assert want and set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert got[key].tobytes() == value.tobytes(), key


# --- item 1: TrainStates with optax states -----------------------------------------------------------


class MLP(nn.Module):
    """The fixtures' model: 3 -> 4 -> 2 (Dense_0 is the 3->4 layer)."""

    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(4)(x))
        return nn.Dense(2)(hidden)


TXS = {
    "trainstate_sgd": lambda: optax.sgd(1e-3),
    "trainstate_adam": lambda: optax.adam(1e-3),
    "trainstate_adamw": lambda: optax.adamw(1e-3),
    "trainstate_adamw_schedule": lambda: optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10)),
}


def fresh_state(tx: optax.GradientTransformation) -> TrainState:
    """What a restarted job holds: a TrainState from freshly initialized params (other values)."""
    params = MLP().init(jax.random.key(42), jnp.ones((1, 3)))
    return TrainState.create(apply_fn=MLP().apply, params=params, tx=tx)


@pytest.mark.parametrize("fixture", sorted(TXS))
def test_trainstate_restores_into_its_own_template(fixture, expected, arrays):
    state = fresh_state(TXS[fixture]())
    restored = jaxckpt.restore(os.path.join(GOLDEN, fixture), like=state)  # no partial=True
    assert type(restored) is TrainState and restored.step == 1 and restored.tx is state.tx
    assert_bit_equal(leaves_by_key(restored), arrays, f"{fixture}@template:")
    # Orbax's None entries (optax's EmptyState) come back as the template's own nodes.
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(state.opt_state)
    stored = expected[fixture]["stored"]["tree_keys"]
    empties = [k for k, v in stored.items() if v["value_type"] == "None"]
    assert empties and all(stored[k]["skip_deserialize"] for k in empties)
    for key in empties:
        index = int(key.split("/")[1])
        assert type(restored.opt_state[index]) is optax.EmptyState, key
    # The restored state trains on: one more update works on it.
    grads = jax.tree.map(jnp.ones_like, restored.params)
    assert restored.apply_gradients(grads=grads).step == 2


def test_trainstate_restores_into_an_abstract_template(arrays):
    abstract = jax.eval_shape(lambda: fresh_state(optax.adamw(1e-3)))
    restored = jaxckpt.restore(os.path.join(GOLDEN, "trainstate_adamw"), like=abstract)
    assert isinstance(restored.params["params"]["Dense_0"]["kernel"], jax.Array)
    got = leaves_by_key(restored)
    assert got.pop("step") == 1  # a ShapeDtypeStruct in the template: an int32 array here
    assert_bit_equal(got, arrays, "trainstate_adamw@template:")


@pytest.mark.parametrize("where", ["trainstate_adam_legacy/checkpoint_1", "trainstate_adam_legacy"])
def test_flax_legacy_helper_layout(where, arrays):
    """``flax.training.checkpoints.save_checkpoint``: the checkpoint, or its directory (the latest)."""
    restored = jaxckpt.restore(os.path.join(GOLDEN, where), like=fresh_state(optax.adam(1e-3)))
    assert restored.step == 1 and type(restored.opt_state[1]) is optax.EmptyState
    assert_bit_equal(leaves_by_key(restored), arrays, "trainstate_adam_legacy@flax:")


def test_orbax_none_without_template_stays_none():
    as_saved = jaxckpt.restore(os.path.join(GOLDEN, "trainstate_sgd"))
    assert as_saved["opt_state"] == {"0": None, "1": None}  # as Orbax restores it without a template


def test_orbax_none_into_a_node_with_leaves_is_a_mismatch():
    """A None matches a leafless node only: a template with optimizer slots there needs them saved."""
    with pytest.raises(MismatchError) as e:
        jaxckpt.restore(os.path.join(GOLDEN, "trainstate_sgd"), like=fresh_state(optax.adam(1e-3)))
    text = str(e.value)
    assert "In `like` but not in the checkpoint" in text and "opt_state/0/count" in text
    assert "In the checkpoint but not in `like`" in text and "    opt_state/0\n" in text


def test_jaxckpt_none_does_not_stand_for_an_empty_node(tmp_path):
    """Only Orbax stores leafless nodes as None: jaxckpt's own None is a value, kept apart."""
    path = jaxckpt.save(str(tmp_path / "mine"), {"w": np.ones(2, np.float32), "s": None})
    with pytest.raises(MismatchError, match=r"not in `like` \(1\):\n    s"):
        jaxckpt.restore(path, like={"w": np.zeros(2, np.float32), "s": optax.EmptyState()})
    assert jaxckpt.restore(path, like={"w": np.zeros(2, np.float32), "s": None})["s"] is None


# --- item 2: NNX states ------------------------------------------------------------------------------


class NNXModel(nnx.Module):
    """The fixture's model (make_orbax_migration.py)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=1))
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.bn(self.linear(x)))))


def state_leaves(state) -> dict[str, np.ndarray]:
    """The pure values of an nnx.State, keyed as Orbax stored them (``.../value``)."""
    return {f"{k}/value": v for k, v in leaves_by_key(nnx.to_pure_dict(state)).items()}


NNX_PATH = os.path.join(GOLDEN, "nnx_state")


def test_nnx_state_into_abstract_state(expected, arrays):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: NNXModel(nnx.Rngs(7))))
    restored = jaxckpt.restore(NNX_PATH, like=abstract)  # no key_map
    assert_bit_equal(state_leaves(restored), arrays, "nnx_state@template:")
    types = expected["nnx_state"]["guide_restore"]["state_types"]
    flat = dict(nnx.to_flat_state(restored))
    assert {"/".join(map(str, k)): type(v).__name__ for k, v in flat.items()} == types
    key = flat[("dropout", "rngs", "key")].get_value()
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and str(jax.random.key_impl(key)) == "threefry2x32"
    model = nnx.merge(graphdef, restored)  # Orbax's guide: split, restore, merge
    assert model(jnp.ones((2, 3))).shape == (2, 2)


def test_nnx_model_restored_in_place(arrays):
    model = nnx.eval_shape(lambda: NNXModel(nnx.Rngs(7)))
    assert jaxckpt.restore(NNX_PATH, like=model) is model
    assert_bit_equal(state_leaves(nnx.state(model)), arrays, "nnx_state@template:")
    # The dropout stream continues where the saved one was: the same masks as a model built from those values.
    twin = nnx.merge(*nnx.split(model))
    model.train()
    twin.train()
    x = jnp.ones((8, 3))
    np.testing.assert_array_equal(model(x), twin(x))


def test_nnx_key_without_template_is_a_typed_key(arrays):
    as_saved = jaxckpt.restore(NNX_PATH)
    key = as_saved["dropout"]["rngs"]["key"]["value"]  # no template: the keys as Orbax stored them
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
    assert np.asarray(jax.random.key_data(key)).tobytes() == arrays["nnx_state:dropout/rngs/key/value"].tobytes()
    assert ("dropout/rngs/key/value", ()) in jaxckpt.list_variables(NNX_PATH)


def test_value_edge_is_stripped_only_for_nnx_templates():
    """A plain dict template is not an NNX Variable: its keys must match as saved."""
    plain = {
        name: {"kernel": jax.ShapeDtypeStruct(shape, jnp.float32)}
        for name, shape in (("linear", (3, 4)), ("out", (4, 2)))
    }
    with pytest.raises(
        MismatchError, match=r"(?s)In `like` but not.*linear/kernel\n.*not in `like`.*linear/kernel/value"
    ):
        jaxckpt.restore(NNX_PATH, like=plain, partial=False)
    with pytest.raises(jaxckpt.MissingKeyError):
        jaxckpt.restore(NNX_PATH, like=plain, partial=True)


def test_a_users_key_named_value_is_kept(tmp_path):
    """A jaxckpt checkpoint keyed ``kernel/value`` is not an NNX Variable's: no template key takes it by another name."""
    path = jaxckpt.save(str(tmp_path / "mine"), {"linear": {"kernel": {"value": np.ones((3, 4), np.float32)}}})
    model = nnx.eval_shape(lambda: nnx.Sequential(nnx.Linear(3, 4, use_bias=False, rngs=nnx.Rngs(0))))
    with pytest.raises(MismatchError, match="kernel/value"):
        jaxckpt.restore(path, like={"linear": nnx.state(model)["layers"][0]})
    restored = jaxckpt.restore(path, like={"linear": {"kernel": {"value": np.zeros((3, 4), np.float32)}}})
    np.testing.assert_array_equal(restored["linear"]["kernel"]["value"], 1)


def crafted(tmp_path, edit) -> str:
    target = str(tmp_path / "nnx_state")
    shutil.copytree(NNX_PATH, target)
    file = os.path.join(target, "array_metadatas", "process_0")
    with open(file, encoding="utf-8") as f:
        listing = json.load(f)
    for record in listing["array_metadatas"]:
        edit(record["array_metadata"])
    with open(file, "w", encoding="utf-8") as f:
        json.dump(listing, f)
    return target


def test_unknown_key_impl_is_refused(tmp_path):
    def rename(meta):
        if meta["ext_metadata"]:
            meta["ext_metadata"]["random_key_impl"] = "no_such_impl"

    with pytest.raises(CheckpointFormatError, match=r"dropout/rngs/key/value.*'no_such_impl'.*not registered"):
        jaxckpt.restore(crafted(tmp_path, rename))


def test_key_impl_on_an_array_of_another_shape_is_refused(tmp_path):
    def mark(meta):
        if meta["param_name"] == "linear.kernel.value":
            meta["ext_metadata"] = {"random_key_impl": "threefry2x32"}

    with pytest.raises(CheckpointFormatError, match=r"linear/kernel/value.*float32 of shape \(3, 4\)"):
        jaxckpt.restore(crafted(tmp_path, mark))


# --- item 4: grain's data-iterator item ------------------------------------------------------------

grain = pytest.importorskip("grain")


def map_dataset_iterator():
    """The fixture's iterator, as a restarted job builds it: at its start."""
    return iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset())


def data_loader_iterator():
    sampler = grain.samplers.IndexSampler(
        num_records=100, shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=0
    )
    return iter(
        grain.DataLoader(
            data_source=grain.sources.RangeDataSource(0, 100, 1),
            sampler=sampler,
            operations=[grain.transforms.Batch(batch_size=4)],
            worker_count=0,
        )
    )


def batches(iterator, n: int = 3) -> list[list[int]]:
    return [np.asarray(next(iterator)).tolist() for _ in range(n)]


def test_grain_dataset_iterator_continues_where_orbax_saved_it(expected, arrays):
    step = os.path.join(GOLDEN, "grain_iter", "5")
    iterator = map_dataset_iterator()
    restored = jaxckpt.restore(step, like={"items": fresh_state(optax.adam(1e-3)), "iter": iterator})
    assert restored["iter"] is iterator
    assert batches(iterator) == expected["grain_iter"]["next_after_save"]
    assert_bit_equal(leaves_by_key(restored["items"]), arrays, "grain_iter@template:")


def test_grain_data_loader_iterator_in_a_checkpoint(expected):
    """A DataLoader's iterator takes its state as bytes: given the JSON's bytes, as grain's handler does."""
    iterator = data_loader_iterator()
    assert batches(iterator, 1) != expected["grain_dataloader_iter"]["next_after_save"][:1]  # at its start
    iterator = data_loader_iterator()
    ckpt = jaxckpt.Checkpoint(items=fresh_state(optax.adam(1e-3)), iter=iterator)
    status = ckpt.restore(os.path.join(GOLDEN, "grain_dataloader_iter", "5"))
    status.assert_consumed()
    assert status.skipped_keys == []
    assert batches(iterator) == expected["grain_dataloader_iter"]["next_after_save"]


def test_grain_state_without_template(expected):
    step = os.path.join(GOLDEN, "grain_dataloader_iter", "5")
    assert (
        jaxckpt.restore(step)["iter"] == expected["grain_dataloader_iter"]["iter_files"]["process_0-of-1.json"]["json"]
    )
    assert jaxckpt.load_variable(os.path.join(GOLDEN, "grain_iter", "5"), "iter") == {"next_index": 5}
    assert ("iter", ()) in jaxckpt.list_variables(step)


def grain_copy(tmp_path, files: dict[str, dict]) -> str:
    step = str(tmp_path / "5")
    shutil.copytree(os.path.join(GOLDEN, "grain_iter", "5"), step)
    os.remove(os.path.join(step, "iter", "process_0-of-1.json"))
    for name, state in files.items():
        with open(os.path.join(step, "iter", name), "w", encoding="utf-8") as f:
            json.dump(state, f)
    return step


def test_grain_states_of_two_processes(tmp_path):
    step = grain_copy(tmp_path, {"process_0-of-2.json": {"next_index": 5}, "process_1-of-2.json": {"next_index": 6}})
    assert jaxckpt.load_variable(step, "iter") == [{"next_index": 5}, {"next_index": 6}]
    with pytest.raises(MismatchError, match=r"'iter'.*the object states of 2 processes.*this run has 1 process"):
        jaxckpt.restore(step, like={"items": fresh_state(optax.adam(1e-3)), "iter": map_dataset_iterator()})


def test_grain_item_missing_a_process_file(tmp_path):
    step = grain_copy(tmp_path, {"process_1-of-2.json": {"next_index": 6}})
    with pytest.raises(
        jaxckpt.CheckpointCorruptedError, match=r"one file process_<i>-of-<n>.json.*process_1-of-2.json"
    ):
        jaxckpt.restore(step)


# --- item 5: Orbax's retention, step by step -------------------------------------------------------

# Each Orbax run of record.json, as a jaxckpt manager's options.
RETENTION = {
    "ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=8192, save_interval_steps=2048)": dict(
        max_to_keep=2, policies=[jaxckpt.KeepMultiplesOf(8192)], save_interval_steps=2048
    ),
    "ocp.CheckpointManagerOptions(preservation_policy=cm.AnyPreservationPolicy([cm.LatestN(n=2), "
    "cm.EveryNSteps(interval_steps=8192)]), save_decision_policy=cm.FixedIntervalPolicy(2048))  "
    "# cm = ocp.checkpoint_managers": dict(
        policies=[jaxckpt.KeepLatest(2) | jaxckpt.KeepMultiplesOf(8192)], save_interval_steps=2048
    ),
    "ocp.CheckpointManagerOptions(preservation_policy=cm.AnyPreservationPolicy([cm.LatestN(n=2), "
    "cm.EveryNSteps(interval_steps=8192, exact_interval=False)]), save_decision_policy=cm.FixedIntervalPolicy(2048))": dict(
        policies=[jaxckpt.KeepLatest(2) | jaxckpt.KeepSpaced(8192)], save_interval_steps=2048
    ),
    "ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=8192, save_interval_steps=1)": dict(
        max_to_keep=2, policies=[jaxckpt.KeepMultiplesOf(8192)], save_interval_steps=1
    ),
    "ocp.CheckpointManagerOptions(preservation_policy=cm.AnyPreservationPolicy([cm.LatestN(n=2), "
    "cm.EveryNSteps(interval_steps=8192, exact_interval=False)]))": dict(
        policies=[jaxckpt.KeepLatest(2) | jaxckpt.KeepSpaced(8192)]
    ),
    "ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m['loss'], best_mode='min')": dict(
        policies=[jaxckpt.KeepBest(2, metric="loss", mode="min")]
    ),
}


def runs(name: str) -> list[dict]:
    with open(os.path.join(GOLDEN, name, "record.json"), encoding="utf-8") as f:
        return json.load(f)["runs"]


def replay(tmp_path, run: dict, index: int):
    """Each save of ``run`` on a jaxckpt manager with the options that stand for Orbax's; yields
    (the Orbax record of the save, the manager after it)."""
    options = RETENTION[run["options"]]
    directory = str(tmp_path / f"run{index}")
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(w=np.zeros(2, np.float32)), directory, **options) as manager:
        for record in run["saves"]:
            saved = manager.save(record["step"], metrics=record.get("metrics"))  # its path, or None
            assert (saved is not None) == record["saved"]
            manager.wait_until_finished()
            yield record, manager
    reopened = jaxckpt.CheckpointManager(
        jaxckpt.Checkpoint(w=np.zeros(2, np.float32)), directory, read_only=True, **options
    )
    with reopened:
        yield run["reopened"], reopened


@pytest.mark.parametrize("run", range(5))
def test_keep_period_and_every_n_steps_as_orbax(tmp_path, run):
    """KeepMultiplesOf is keep_period / EveryNSteps(N); KeepSpaced is EveryNSteps(N, exact_interval=False)."""
    recorded = runs("retention_keep_period")[run]
    for record, manager in replay(tmp_path, recorded, run):
        assert manager.all_steps() == record["all_steps"], record.get("step")
        assert manager.latest_step() == record["latest_step"]
        assert manager.best_step() == record["best_step"]  # without KeepBest: the latest, as Orbax's


def test_keep_every_differs_where_no_step_is_a_multiple(tmp_path):
    """KeepEvery(steps=N) keeps the first checkpoint of each window: Orbax keeps multiples only."""
    recorded = runs("retention_keep_period")[3]
    assert recorded["saves"][-1]["all_steps"] == [8192, 16384, 19000]
    ckpt = jaxckpt.Checkpoint(w=np.zeros(2, np.float32))
    policy = jaxckpt.KeepLatest(2) | jaxckpt.KeepEvery(steps=8192)
    with jaxckpt.CheckpointManager(ckpt, str(tmp_path / "every"), policies=[policy]) as manager:
        for record in recorded["saves"]:
            manager.save(record["step"])
        assert manager.all_steps() == [1000, 8192, 16384, 19000]  # 1000: the first of [0, 8192)


def test_best_fn_keeps_the_latest_too(tmp_path):
    """Orbax's max_to_keep with best_fn keeps the best N alone, deleting a new step worse than them
    at once; jaxckpt always keeps the latest as well (a restart resumes from it). best_step() agrees."""
    (recorded,) = runs("retention_best_fn")
    deleted_at_once = 0
    latest = None
    for record, manager in replay(tmp_path, recorded, 0):
        latest = record.get("step", latest)  # the reopened manager's record has none: the last save's
        assert manager.all_steps() == sorted({*record["all_steps"], latest})
        assert manager.latest_step() == latest
        assert manager.best_step() == record["best_step"]
        deleted_at_once += latest not in record["all_steps"]
    assert deleted_at_once == 3  # steps 5 and 7 as saved, and 7 again on reopening: Orbax lost its newest


# --- PLACEHOLDER: a leaf or subtree left out of a restore, as Orbax's ocp.PLACEHOLDER ---------------


def test_placeholder_leaves_a_leaf_or_a_subtree_out_of_the_restore(tmp_path):
    path = tmp_path / "c"
    jaxckpt.save(path, {"params": {"w": np.arange(4.0), "b": np.ones(2)}, "opt": {"mu": np.zeros(4)}, "step": 3})
    like = {"params": {"w": np.zeros(4), "b": jaxckpt.PLACEHOLDER}, "opt": jaxckpt.PLACEHOLDER, "step": 0}
    restored = jaxckpt.restore(path, like=like)
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(4.0))
    assert restored["params"]["b"] is jaxckpt.PLACEHOLDER and restored["opt"] is jaxckpt.PLACEHOLDER
    assert restored["step"] == 3
    # A placeholder for a key the checkpoint lacks is no mismatch either; a real template still is.
    jaxckpt.restore(path, like={**like, "extra": jaxckpt.PLACEHOLDER})
    with pytest.raises(jaxckpt.MismatchError, match="extra"):
        jaxckpt.restore(path, like={**like, "extra": np.zeros(1)})
    assert repr(jaxckpt.PLACEHOLDER) == "jaxckpt.PLACEHOLDER"


def test_a_float_array_restores_as_ints_only_where_every_value_is_whole(tmp_path):
    """Orbax's guide restores a float32 array through an int16 template; jaxckpt does too where nothing
    is lost, and says which value would be where something would."""
    path = tmp_path / "c"
    jaxckpt.save(path, {"whole": np.arange(6, dtype=np.float32) - 2, "half": np.array([1.0, 2.5], np.float32)})
    like = {"whole": jax.ShapeDtypeStruct((6,), jnp.int16), "half": jax.ShapeDtypeStruct((2,), jnp.float32)}
    restored = jaxckpt.restore(path, like=like)
    assert restored["whole"].dtype == jnp.int16 and restored["whole"].tolist() == [-2, -1, 0, 1, 2, 3]
    with pytest.raises(jaxckpt.MismatchError, match=r"'half'.*such as 2\.5"):
        jaxckpt.restore(path, like={**like, "half": jax.ShapeDtypeStruct((2,), jnp.int16)})
    with pytest.raises(jaxckpt.MismatchError, match="int16"):  # out of range: never wrapped around
        jaxckpt.save(tmp_path / "big", {"x": np.array([70000.0], np.float32)})
        jaxckpt.restore(tmp_path / "big", like={"x": jax.ShapeDtypeStruct((1,), jnp.int16)})
    jaxckpt.save(tmp_path / "ints", {"i": np.array([1, 2], np.int32)})
    with pytest.raises(jaxckpt.MismatchError, match="never int to float"):  # the other way: refused by kind
        jaxckpt.restore(tmp_path / "ints", like={"i": jax.ShapeDtypeStruct((2,), jnp.float32)})
