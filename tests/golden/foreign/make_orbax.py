"""Write the Orbax golden fixtures under tests/golden/foreign/orbax/ with the real Orbax.

Run once, by hand, never by the tests (they must not import Orbax)::

    python3.11 -m venv /tmp/venv-orbax
    /tmp/venv-orbax/bin/pip install -c constraints.txt orbax-checkpoint 'jax[cpu]' numpy ml_dtypes
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        /tmp/venv-orbax/bin/python tests/golden/foreign/make_orbax.py

It replaces the folder whole. Next to the checkpoints it writes what Orbax itself restores:
``expected.npz`` (every array, keyed by ``<fixture>:<key>``) and ``expected.json`` (for each fixture
its keys with their shape and dtype, or their JSON value; and the versions that wrote them).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "orbax")


def make_state(seed: int) -> dict:
    """A small state: nested dicts and a list, a float32 kernel sharded over 8 devices, a bfloat16
    array, int32 arrays, a numpy scalar and Python scalars."""
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    rng = np.random.default_rng(seed)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    kernel = jax.device_put(
        rng.standard_normal((8, 16)).astype(np.float32), NamedSharding(mesh, PartitionSpec("data", "model"))
    )
    return {
        "params": {
            "dense": {"kernel": kernel, "bias": jnp.asarray(rng.standard_normal(16).astype(np.float32))},
            "embed": jnp.asarray(rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)),
        },
        "layers": [
            {"w": np.arange(15, dtype=np.int32).reshape(3, 5) * (seed + 1)},
            {"w": np.full((2, 3), -7 - seed, dtype=np.int32)},
        ],
        "opt": {"count": np.int32(seed), "scale": np.float32(0.25)},
        "step": 100 + seed,  # a Python int
        "lr": 0.5,  # a Python float
    }


def flat(tree: object, prefix: str = "") -> dict[str, object]:
    """The leaves of a restored tree by '/'-joined key (list indices as numbers)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, object] = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def record(name: str, tree: object, arrays: dict[str, np.ndarray], listing: dict[str, dict]) -> None:
    """What Orbax restored for fixture ``name``: arrays into ``arrays``, the rest into ``listing``."""
    keys: dict[str, dict] = {}
    for key, value in flat(tree).items():
        if isinstance(value, jax.Array | np.ndarray | np.generic):
            array = np.asarray(value)
            arrays[f"{name}:{key}"] = array
            keys[key] = {"shape": list(array.shape), "dtype": array.dtype.name}
        else:
            keys[key] = {"value": value, "type": type(value).__name__}
    listing[name] = keys


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    os.makedirs(HERE)
    arrays: dict[str, np.ndarray] = {}
    listing: dict[str, dict] = {}

    state = make_state(0)

    # 1. StandardCheckpointer, OCDBT (the default).
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(HERE, "standard"), state)
        getattr(ckptr, "wait_until_finished", lambda: None)()
        record("standard", ckptr.restore(os.path.join(HERE, "standard")), arrays, listing)

    # 2. The same, OCDBT off: one zarr (v2) array folder per leaf.
    with ocp.StandardCheckpointer(use_ocdbt=False) as ckptr:
        ckptr.save(os.path.join(HERE, "standard_no_ocdbt"), state)
        getattr(ckptr, "wait_until_finished", lambda: None)()
        record("standard_no_ocdbt", ckptr.restore(os.path.join(HERE, "standard_no_ocdbt")), arrays, listing)

    # 2b. zarr3 arrays, in OCDBT and not.
    for name, ocdbt in (("zarr3", True), ("zarr3_no_ocdbt", False)):
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_ocdbt=ocdbt)) as ckptr:
            ckptr.save(os.path.join(HERE, name), args=ocp.args.PyTreeSave(state))
            getattr(ckptr, "wait_until_finished", lambda: None)()  # sync Checkpointers have none
            record(name, ckptr.restore(os.path.join(HERE, name)), arrays, listing)

    # 3. PyTreeCheckpointer, which also takes strings, None and empty containers.
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(os.path.join(HERE, "pytree"), {**state, "tag": "hello", "nothing": None, "empty": {}})
        getattr(ckptr, "wait_until_finished", lambda: None)()
        record("pytree", ckptr.restore(os.path.join(HERE, "pytree")), arrays, listing)

    # 4. A CheckpointManager with Composite items; max_to_keep=2 leaves steps 20 and 30.
    run = os.path.join(HERE, "run")
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(run, options=options) as manager:
        for step in (10, 20, 30):
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(make_state(step)),
                    meta=ocp.args.JsonSave({"step": step, "lr": 0.1, "name": "exp"}),
                ),
            )
        manager.wait_until_finished()
        assert manager.all_steps() == [20, 30], manager.all_steps()
        for step in (20, 30):
            restored = manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
            )
            record(f"run/{step}", {"state": restored["state"], "meta": restored["meta"]}, arrays, listing)

    np.savez(os.path.join(HERE, "expected.npz"), **arrays)
    versions = {
        "orbax-checkpoint": ocp.__version__ if hasattr(ocp, "__version__") else "",
        "jax": jax.__version__,
        "tensorstore": getattr(tensorstore, "__version__", ""),
        "python": sys.version.split()[0],
    }
    from importlib.metadata import version

    versions["orbax-checkpoint"] = version("orbax-checkpoint")
    versions["tensorstore"] = version("tensorstore")
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump({"versions": versions, "fixtures": listing}, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
