"""Write the Orbax-migration golden fixtures under tests/golden/foreign/orbax_migration/ with the real
Orbax, Flax, Optax and Grain: what users coming from Flax ``TrainState`` / NNX / MaxText-style runs
have on disk, and how Orbax's retention policies behave.

Run once, by hand, never by the tests (they must not import Orbax, Flax, Optax or Grain)::

    python3.11 -m venv /work/scratch/venv-orbax41
    /work/scratch/venv-orbax41/bin/pip install -c constraints.txt \\
        orbax-checkpoint 'jax[cpu]' flax optax grain numpy ml_dtypes
    JAX_PLATFORMS=cpu /work/scratch/venv-orbax41/bin/python tests/golden/foreign/make_orbax_migration.py

It replaces the folder whole. Next to the checkpoints it writes what Orbax itself stores and restores:

* ``expected.json``: the versions used and, for each checkpoint fixture, its path, the calls that
  wrote it, the keys Orbax stored (from its ``_METADATA`` and ``array_metadatas/``), the keys and
  shapes/dtypes (or JSON values) that ``StandardCheckpointer().restore(path)`` gives back with no
  template (``restored``), and those it gives back into the saved state's own abstract template
  (``restored_template``, keyed by the pytree key path); for the Grain fixtures also the iterator
  files and the next elements after the saved position.
* ``expected.npz``: every restored array, keyed ``<fixture>:<key>`` (no template) and
  ``<fixture>@template:<key>`` (into the template). Typed PRNG keys are stored as their
  ``jax.random.key_data``.
* ``retention_*/record.json``: which steps a ``CheckpointManager`` keeps after each save (the
  checkpoints themselves are deleted).

Everything is seeded; the only timestamps are those Orbax writes into its own files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from importlib.metadata import version

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from flax.training import checkpoints as flax_checkpoints
from flax.training import train_state

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "orbax_migration")


# ---------------------------------------------------------------------------------------------------
# Recording helpers


def key_name(entry: object) -> str:
    """One pytree key-path entry as text: dict keys and attribute names as-is, indices as numbers."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def is_key_array(value: object) -> bool:
    return isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key)


def describe(value: object, name: str, key: str, arrays: dict[str, np.ndarray]) -> dict:
    if is_key_array(value):
        data = np.asarray(jax.random.key_data(value))
        arrays[f"{name}:{key}"] = data
        return {
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "key_impl": str(jax.random.key_impl(value)),
            "key_data_shape": list(data.shape),
            "key_data_dtype": data.dtype.name,
        }
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        array = np.asarray(value)
        arrays[f"{name}:{key}"] = array
        return {"shape": list(array.shape), "dtype": array.dtype.name, "type": type(value).__name__}
    return {"value": value, "type": type(value).__name__}


def flat_restored(tree: object, prefix: str = "") -> dict[str, object]:
    """The leaves of a template-less restore (nested dicts and lists) by '/'-joined key."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, object] = {}
    for k, v in items:
        out.update(flat_restored(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def flat_template(tree: object) -> dict[str, object]:
    """The leaves of a restore into a template, by '/'-joined pytree key path (None is kept)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {"/".join(key_name(e) for e in path): leaf for path, leaf in leaves}


def stored_keys(path: str) -> dict:
    """What Orbax wrote about the tree: the _METADATA tree keys and array_metadatas' ext_metadata."""
    with open(os.path.join(path, "_METADATA")) as f:
        meta = json.load(f)
    keys = {}
    for entry in meta["tree_metadata"].values():
        key = "/".join(k["key"] for k in entry["key_metadata"])
        keys[key] = {
            "key_types": [k["key_type"] for k in entry["key_metadata"]],
            **entry["value_metadata"],
        }
    ext = {}
    array_dir = os.path.join(path, "array_metadatas")
    if os.path.isdir(array_dir):
        for fname in sorted(os.listdir(array_dir)):
            with open(os.path.join(array_dir, fname)) as f:
                for item in json.load(f)["array_metadatas"]:
                    am = item["array_metadata"]
                    if am.get("ext_metadata"):
                        ext[am["param_name"]] = am["ext_metadata"]
    files = sorted(os.path.relpath(os.path.join(root, f), path) for root, _, names in os.walk(path) for f in names)
    return {
        "tree_keys": keys,
        "ext_metadata": ext,
        "use_ocdbt": meta.get("use_ocdbt"),
        "use_zarr3": meta.get("use_zarr3"),
        "custom_metadata": meta.get("custom_metadata"),
        "files": [f for f in files if not f.startswith(("d/", "ocdbt.process_"))],
    }


def treedef_text(tree: object) -> str:
    """str() of a tree's structure without the memory addresses of the functions in it."""
    return re.sub(r" at 0x[0-9a-f]+", "", str(jax.tree_util.tree_structure(tree)))


def abstract(tree: object) -> object:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def record_checkpoint(
    name: str,
    path: str,
    calls: str,
    saved: object,
    arrays: dict[str, np.ndarray],
    listing: dict[str, dict],
) -> dict:
    """Restore ``path`` with Orbax (without and with the saved state's template) and record both."""
    entry: dict = {"path": os.path.relpath(path, HERE), "calls": calls, "stored": stored_keys(path)}
    with ocp.StandardCheckpointer() as ckptr:
        raw = ckptr.restore(path)
        entry["restored"] = {k: describe(v, name, k, arrays) for k, v in flat_restored(raw).items()}
        restored = ckptr.restore(path, abstract(saved))
        entry["restored_template_treedef"] = treedef_text(restored)
        entry["restored_template"] = {
            k: describe(v, f"{name}@template", k, arrays) for k, v in flat_template(restored).items()
        }
        # Orbax gives back what was saved.
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
            if is_key_array(a):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... and the template-less restore has the same leaves under the same '/'-joined keys.
    for key in entry["restored_template"]:
        np.testing.assert_array_equal(arrays.get(f"{name}:{key}"), arrays.get(f"{name}@template:{key}"))
        assert entry["restored"][key] == entry["restored_template"][key], key
    listing[name] = entry
    return entry


# ---------------------------------------------------------------------------------------------------
# States


class MLP(nn.Module):
    """3 -> 4 -> 2: Dense_0 is the 3->4 layer, Dense_1 the 4->2 one."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(4)(x))
        return nn.Dense(2)(h)


def trained_state(tx: optax.GradientTransformation) -> train_state.TrainState:
    """A TrainState after one real gradient step (step == 1, optimizer counts/moments non-trivial)."""
    model = MLP()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))
    y = jnp.asarray(np.random.default_rng(1).standard_normal((5, 2)).astype(np.float32))
    params = model.init(jax.random.key(0), x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss_fn(p):
        return jnp.mean((state.apply_fn(p, x) - y) ** 2)

    grads = jax.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)


class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=1))
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.bn(self.linear(x)))))


def nnx_model() -> NNXModel:
    """The model after one forward pass in train mode (BatchNorm stats and the RNG count move)."""
    model = NNXModel(nnx.Rngs(0))
    model.train()
    model(jnp.asarray(np.random.default_rng(2).standard_normal((5, 3)).astype(np.float32)))
    return model


def to_json(value: object) -> object:
    """numpy / jax values in iterator elements and states, as JSON."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        return np.asarray(value).tolist()
    return value


# ---------------------------------------------------------------------------------------------------
# Fixtures


def write_trainstates(arrays: dict, listing: dict) -> None:
    txs = {
        "trainstate_sgd": ("optax.sgd(1e-3)", optax.sgd(1e-3)),
        "trainstate_adam": ("optax.adam(1e-3)", optax.adam(1e-3)),
        "trainstate_adamw": ("optax.adamw(1e-3)", optax.adamw(1e-3)),
        # A schedule for the learning rate adds a ScaleByScheduleState(count).
        "trainstate_adamw_schedule": (
            "optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10))",
            optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10)),
        ),
    }
    for name, (tx_text, tx) in txs.items():
        state = trained_state(tx)
        path = os.path.join(HERE, name)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, state)
            ckptr.wait_until_finished()
        entry = record_checkpoint(
            name,
            path,
            f"state = TrainState.create(apply_fn=MLP().apply, params=params, tx={tx_text}); "
            "state = state.apply_gradients(grads=grads); ocp.StandardCheckpointer().save(path, state)",
            state,
            arrays,
            listing,
        )
        entry["opt_state_treedef"] = treedef_text(state.opt_state)

    # The same adam state through Flax's legacy helper (Orbax PyTreeCheckpointHandler underneath);
    # it writes <dir>/checkpoint_1.
    state = trained_state(optax.adam(1e-3))
    ckpt_dir = os.path.join(HERE, "trainstate_adam_legacy")
    path = flax_checkpoints.save_checkpoint(ckpt_dir, state, step=1)
    entry = record_checkpoint(
        "trainstate_adam_legacy",
        path,
        "flax.training.checkpoints.save_checkpoint(dir, state, step=1)  # adam state as trainstate_adam",
        state,
        arrays,
        listing,
    )
    entry["save_checkpoint_returned"] = os.path.relpath(path, HERE)
    entry["flax_restore_checkpoint"] = {
        k: describe(v, "trainstate_adam_legacy@flax", k, arrays)
        for k, v in flat_template(flax_checkpoints.restore_checkpoint(ckpt_dir, target=state)).items()
    }
    entry["flax_latest_checkpoint"] = os.path.relpath(flax_checkpoints.latest_checkpoint(ckpt_dir), HERE)


def write_nnx(arrays: dict, listing: dict) -> None:
    model = nnx_model()
    _, state = nnx.split(model)
    path = os.path.join(HERE, "nnx_state")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
        ckptr.wait_until_finished()
    entry = record_checkpoint(
        "nnx_state",
        path,
        "_, state = nnx.split(model); ocp.StandardCheckpointer().save(path, state)",
        state,
        arrays,
        listing,
    )
    # The NNX guide's restore: split an abstract model, restore into its state, merge.
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: NNXModel(nnx.Rngs(0))))
    with ocp.StandardCheckpointer() as ckptr:
        restored_state = ckptr.restore(path, abstract_state)
    merged = nnx.merge(graphdef, restored_state)
    entry["guide_restore"] = {
        "calls": "graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: NNXModel(nnx.Rngs(0)))); "
        "nnx.merge(graphdef, ocp.StandardCheckpointer().restore(path, abstract_state))",
        "state_types": {
            "/".join(key_name(e) for e in p): type(v).__name__
            for p, v in jax.tree_util.tree_flatten_with_path(
                nnx.state(merged), is_leaf=lambda x: isinstance(x, nnx.Variable)
            )[0]
        },
    }
    entry["pure_dict_keys"] = sorted(flat_restored(nnx.to_pure_dict(state)).keys())


def range_dataset_iter():
    return grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset()


def range_dataloader():
    return grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 100, 1),
        sampler=grain.samplers.IndexSampler(
            num_records=100, shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=0
        ),
        operations=[grain.transforms.Batch(batch_size=4)],
        worker_count=0,
    )


def write_grain(arrays: dict, listing: dict) -> None:
    state = trained_state(optax.adam(1e-3))
    variants = {
        "grain_iter": (
            "iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset())",
            lambda: iter(range_dataset_iter()),
        ),
        "grain_dataloader_iter": (
            "iter(grain.DataLoader(data_source=grain.sources.RangeDataSource(0, 100, 1), "
            "sampler=grain.samplers.IndexSampler(num_records=100, shard_options=grain.sharding.NoSharding(), "
            "shuffle=True, num_epochs=1, seed=0), operations=[grain.transforms.Batch(batch_size=4)], "
            "worker_count=0))",
            lambda: iter(range_dataloader()),
        ),
    }
    for name, (iter_text, make_iter) in variants.items():
        run = os.path.join(HERE, name)
        iterator = make_iter()
        consumed = [to_json(next(iterator)) for _ in range(5)]
        with ocp.CheckpointManager(run, item_names=("items", "iter")) as manager:
            manager.save(
                5,
                args=ocp.args.Composite(
                    items=ocp.args.StandardSave(state), iter=grain.checkpoint.CheckpointSave(iterator)
                ),
            )
            manager.wait_until_finished()
        following = [to_json(next(iterator)) for _ in range(3)]

        # Orbax + Grain restore into a fresh iterator: it continues where the saved one stopped.
        with ocp.CheckpointManager(run, item_names=("items", "iter")) as manager:
            restored = manager.restore(
                5,
                args=ocp.args.Composite(
                    items=ocp.args.StandardRestore(abstract(state)),
                    iter=grain.checkpoint.CheckpointRestore(make_iter()),
                ),
            )
            all_steps = list(manager.all_steps())
        after_restore = [to_json(next(restored["iter"])) for _ in range(3)]
        assert after_restore == following, (after_restore, following)

        iter_dir = os.path.join(run, "5", "iter")
        files = {}
        for fname in sorted(os.listdir(iter_dir)):
            with open(os.path.join(iter_dir, fname)) as f:
                text = f.read()
            files[fname] = {"text": text, "json": json.loads(text)} if fname.endswith(".json") else {"text": text}
        entry = record_checkpoint(name, os.path.join(run, "5", "items"), "", state, arrays, listing)
        entry.update(
            {
                "calls": f"iterator = {iter_text}; 5 x next(iterator); "
                "ocp.CheckpointManager(dir, item_names=('items', 'iter')).save(5, args=ocp.args.Composite("
                "items=ocp.args.StandardSave(state), iter=grain.checkpoint.CheckpointSave(iterator)))"
                "  # state as trainstate_adam",
                "run_path": name,
                "all_steps": all_steps,
                "step_files": sorted(
                    os.path.relpath(os.path.join(root, f), run)
                    for root, _, names in os.walk(run)
                    for f in names
                    if "/items/d/" not in os.path.join(root, f) and "ocdbt.process_" not in root
                ),
                "iter_files": files,
                "consumed_before_save": consumed,
                "next_after_save": following,
            }
        )


def write_retention() -> None:
    state = {"w": np.arange(4, dtype=np.float32)}
    cm = ocp.checkpoint_managers

    def run(name: str, options_text: str, options: ocp.CheckpointManagerOptions, saves: list) -> dict:
        """``saves`` is a list of (step, metrics or None)."""
        history = []
        with tempfile.TemporaryDirectory() as tmp:
            with ocp.CheckpointManager(os.path.join(tmp, "run"), options=options) as manager:
                for step, metrics in saves:
                    saved = manager.save(step, args=ocp.args.StandardSave(state), metrics=metrics)
                    manager.wait_until_finished()
                    row = {
                        "step": step,
                        "saved": bool(saved),
                        "all_steps": list(manager.all_steps()),
                        "latest_step": manager.latest_step(),
                        "best_step": manager.best_step(),
                        "on_disk": sorted(int(d) for d in os.listdir(os.path.join(tmp, "run")) if d.isdigit()),
                    }
                    if metrics is not None:
                        row["metrics"] = metrics
                    history.append(row)
            with ocp.CheckpointManager(os.path.join(tmp, "run"), options=options) as reopened:
                final = {
                    "all_steps": list(reopened.all_steps()),
                    "latest_step": reopened.latest_step(),
                    "best_step": reopened.best_step(),
                }
        return {"name": name, "options": options_text, "saves": history, "reopened": final}

    steps = list(range(0, 16384 + 1, 2048))
    offset_steps = (1000, 4000, 7000, 8192, 10000, 13000, 16000, 16384, 19000)
    keep_period = [
        run(
            "keep_period",
            "ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=8192, save_interval_steps=2048)",
            ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=8192, save_interval_steps=2048),
            [(s, None) for s in steps],
        ),
        run(
            "preservation_policy_exact",
            "ocp.CheckpointManagerOptions(preservation_policy=cm.AnyPreservationPolicy("
            "[cm.LatestN(n=2), cm.EveryNSteps(interval_steps=8192)]), save_decision_policy="
            "cm.FixedIntervalPolicy(2048))  # cm = ocp.checkpoint_managers",
            ocp.CheckpointManagerOptions(
                preservation_policy=cm.AnyPreservationPolicy([cm.LatestN(n=2), cm.EveryNSteps(interval_steps=8192)]),
                save_decision_policy=cm.FixedIntervalPolicy(2048),
            ),
            [(s, None) for s in steps],
        ),
        run(
            "preservation_policy_not_exact",
            "ocp.CheckpointManagerOptions(preservation_policy=cm.AnyPreservationPolicy("
            "[cm.LatestN(n=2), cm.EveryNSteps(interval_steps=8192, exact_interval=False)]), "
            "save_decision_policy=cm.FixedIntervalPolicy(2048))",
            ocp.CheckpointManagerOptions(
                preservation_policy=cm.AnyPreservationPolicy(
                    [cm.LatestN(n=2), cm.EveryNSteps(interval_steps=8192, exact_interval=False)]
                ),
                save_decision_policy=cm.FixedIntervalPolicy(2048),
            ),
            [(s, None) for s in steps],
        ),
        # Steps that are not multiples of the period (every 3000): which survive?
        run(
            "keep_period_offset_steps",
            "ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=8192, save_interval_steps=1)",
            ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=8192, save_interval_steps=1),
            [(s, None) for s in offset_steps],
        ),
        run(
            "preservation_policy_not_exact_offset_steps",
            "ocp.CheckpointManagerOptions(preservation_policy=cm.AnyPreservationPolicy("
            "[cm.LatestN(n=2), cm.EveryNSteps(interval_steps=8192, exact_interval=False)]))",
            ocp.CheckpointManagerOptions(
                preservation_policy=cm.AnyPreservationPolicy(
                    [cm.LatestN(n=2), cm.EveryNSteps(interval_steps=8192, exact_interval=False)]
                ),
            ),
            [(s, None) for s in offset_steps],
        ),
    ]
    losses = [5, 3, 4, 1, 2, 6, 0.5, 7]
    best_fn = [
        run(
            "best_fn_min",
            "ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m['loss'], best_mode='min')",
            ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min"),
            [(i, {"loss": loss}) for i, loss in enumerate(losses)],
        ),
    ]
    for name, runs in (("retention_keep_period", keep_period), ("retention_best_fn", best_fn)):
        os.makedirs(os.path.join(HERE, name))
        with open(os.path.join(HERE, name, "record.json"), "w") as f:
            json.dump({"runs": runs, "versions": versions()}, f, indent=1, sort_keys=True)
            f.write("\n")


def versions() -> dict:
    out = {p: version(p) for p in ("orbax-checkpoint", "jax", "flax", "optax", "grain", "tensorstore", "numpy")}
    out["python"] = sys.version.split()[0]
    return out


README = """\
# Orbax-migration golden fixtures

Written by `tests/golden/foreign/make_orbax_migration.py` (run once by hand, see its docstring) with
orbax-checkpoint 0.12.8, jax 0.10.2, flax 0.12.8, optax 0.2.8, grain 0.2.18 (exact versions in
`expected.json` under `versions`). The script replaces this folder whole, this README included.
Tests must not import Orbax, Flax, Optax or Grain: read the checkpoints with jaxckpt and compare with
`expected.json` / `expected.npz`.

## Files

* `expected.json`: `fixtures.<name>` for every checkpoint fixture below, with
  * `path`: the Orbax checkpoint folder (the one holding `_METADATA`), relative to this folder;
  * `calls`: the calls that wrote it;
  * `stored`: what Orbax wrote: `tree_keys` (the `_METADATA` tree keys, '/'-joined, with
    `key_types` (1 = sequence index, 2 = dict key / attribute), `value_type`, `write_shape`,
    `skip_deserialize`), `ext_metadata` (from `array_metadatas/process_0`), `use_ocdbt`,
    `use_zarr3`, and the non-data files;
  * `restored`: `ocp.StandardCheckpointer().restore(path)` with no template (nested dicts/lists),
    each leaf '/'-joined with its shape and dtype, or its JSON value;
  * `restored_template` / `restored_template_treedef`: the restore into the saved state's own
    abstract template (`jax.tree.map(ocp.utils.to_shape_dtype_struct, state)`), keyed by the pytree
    key path ('/'-joined dict keys, attribute names, indices).
* `expected.npz`: every restored array, keyed `<fixture>:<key>` (no template) and
  `<fixture>@template:<key>` (into the template); also `trainstate_adam_legacy@flax:<key>`
  (`flax.training.checkpoints.restore_checkpoint(dir, target=state)`). Typed PRNG keys are stored
  as `jax.random.key_data` (uint32). Both restores give the same values, equal to what was saved.
* `retention_*/record.json`: `runs[]`, each with `options` (the Python that built them),
  `saves[]` (per save: `step`, `saved`, `metrics`, then, after `wait_until_finished()`,
  `all_steps`, `latest_step`, `best_step`, and the step folders `on_disk`) and `reopened` (a new
  `CheckpointManager` on the same folder). The checkpoints themselves are not kept.

The `d/` and `ocdbt.process_0/d/` file names and the `*_timestamp_nsecs` in `_CHECKPOINT_METADATA`
change on every run (Orbax/TensorStore choose them); everything else is reproducible.
`commit_success.txt` holds the absolute path Orbax wrote to (for `iter/`, the temporary
`5.orbax-checkpoint-tmp` path).

## Fixtures

The model for the TrainStates is a linen MLP 3 -> 4 -> 2 (`Dense_0` kernel (3, 4), `Dense_1`
kernel (4, 2)), `params = model.init(jax.random.key(0), x)`, one `apply_gradients` on an MSE loss,
so `step` is 1 (a Python int, stored as `value_type: scalar`) and optimizer counts are 1.

| folder | calls | what a jaxckpt test should expect |
|---|---|---|
| `trainstate_sgd/` | `ocp.StandardCheckpointer().save(path, TrainState(tx=optax.sgd(1e-3)))` | keys `step`, `params/params/Dense_{0,1}/{kernel,bias}`; `opt_state` is `(EmptyState(), EmptyState())`, stored as `opt_state/0`, `opt_state/1` with `value_type: None`, `skip_deserialize: true` and no data; Orbax restores them as `None` (no template) or `EmptyState()` (template) |
| `trainstate_adam/` | same, `optax.adam(1e-3)` | `opt_state/0/{count,mu/...,nu/...}` (ScaleByAdamState; `count` int32 scalar = 1), `opt_state/1` None (EmptyState) |
| `trainstate_adamw/` | same, `optax.adamw(1e-3)` | as adam, plus `opt_state/2` None (EmptyState of add_decayed_weights and of scale_by_learning_rate) |
| `trainstate_adamw_schedule/` | same, `optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10))` | `opt_state/1` None, `opt_state/2/count` int32 = 1 (ScaleByScheduleState) |
| `trainstate_adam_legacy/checkpoint_1/` | `flax.training.checkpoints.save_checkpoint(dir, adam_state, step=1)` | the same keys and values as `trainstate_adam` (Flax uses `ocp.Checkpointer(ocp.PyTreeCheckpointHandler())`); written under `checkpoint_1`; `_CHECKPOINT_METADATA` names PyTreeCheckpointHandler |
| `nnx_state/` | `_, state = nnx.split(model); ocp.StandardCheckpointer().save(path, state)`, model = Linear(3,4), BatchNorm(4), Dropout(0.1, rngs=nnx.Rngs(dropout=1)), Linear(4,2) after one train-mode call | every key ends in `/value` (`linear/kernel/value`, `bn/mean/value`, ...); `dropout/rngs/count/value` uint32 scalar = 1; `dropout/rngs/key/value` is stored as its raw key data, uint32 shape (2,) (`write_shape: [2]`), with `ext_metadata {"random_key_impl": "threefry2x32"}` in `array_metadatas/process_0`; Orbax restores it as a typed `key<fry>` scalar, with or without template |
| `grain_iter/5/` | `it = iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset())`, 5 x `next(it)`, `ocp.CheckpointManager(dir, item_names=('items','iter')).save(5, args=ocp.args.Composite(items=ocp.args.StandardSave(adam_state), iter=grain.checkpoint.CheckpointSave(it)))` | `5/items/` is a StandardCheckpointer checkpoint of the adam TrainState; `5/iter/process_0-of-1.json` is `{"next_index": 5}` (indent 4); the iterator's next 3 batches are `next_after_save` in expected.json (a restored iterator, `grain.checkpoint.CheckpointRestore`, continues there) |
| `grain_dataloader_iter/5/` | the same with `iter(grain.DataLoader(RangeDataSource(0,100,1), IndexSampler(100, NoSharding(), shuffle=True, num_epochs=1, seed=0), [Batch(4)], worker_count=0))` | `5/iter/process_0-of-1.json` holds the DataLoader state: `version` 2, `last_seen_indices {"0": 19}`, `last_worker_index` -1, `worker_count` 0, `sampler` and `data_source` reprs |
| `retention_keep_period/record.json` | `CheckpointManagerOptions(max_to_keep=2, keep_period=8192, save_interval_steps=2048)` and the same through `preservation_policy=AnyPreservationPolicy([LatestN(2), EveryNSteps(8192)])`, steps 0..16384 every 2048; and steps not multiples of 8192 | after 16384: `[0, 8192, 14336, 16384]` (the 2 latest plus every step with step % 8192 == 0, step 0 included; Orbax 0.12.8 does not keep 4096). Steps 1000, 4000, 7000, 8192, 10000, 13000, 16000, 16384, 19000 end at `[8192, 16384, 19000]`; with `EveryNSteps(8192, exact_interval=False)` (keeps the first step and then each at least 8192 after the last kept) at `[1000, 10000, 16384, 19000]`. Without `best_fn`, `best_step()` is the latest step |
| `retention_best_fn/record.json` | `CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m['loss'], best_mode='min')`, losses 5,3,4,1,2,6,0.5,7 at steps 0..7 | keeps the 2 lowest losses; a new step worse than both kept ones is deleted as soon as it is saved: after step 5 (loss 6) `all_steps` [3, 4], `latest_step` 4; after step 7 (loss 7) `all_steps` [3, 6], `latest_step` 6, `best_step` 6 |
"""


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    os.makedirs(HERE)
    arrays: dict[str, np.ndarray] = {}
    listing: dict[str, dict] = {}
    write_trainstates(arrays, listing)
    write_nnx(arrays, listing)
    write_grain(arrays, listing)
    write_retention()
    np.savez(os.path.join(HERE, "expected.npz"), **arrays)
    with open(os.path.join(HERE, "README.md"), "w") as f:
        f.write(README)
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump({"versions": versions(), "fixtures": listing}, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
