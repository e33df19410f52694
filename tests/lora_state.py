"""The LoRA-shaped training state that the incremental tests save, locally and on buckets: a frozen
base (unchanged from save to save) and an adapter that changes at every step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxckpt

MESH = jax.make_mesh((8,), ("x",))
SHARDED = jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec("x"))


def base() -> dict[str, jax.Array]:
    """A frozen base of two arrays over the pack limit (1 MiB): one sharded over 8 devices, one on one."""
    return {
        "w0": jax.device_put(jnp.arange(512 * 1024, dtype=jnp.float32).reshape(1024, 512), SHARDED),
        "w1": jnp.full((1536, 512), 3.0, jnp.bfloat16) * jnp.arange(512, dtype=jnp.bfloat16),
    }


def adapter(step: int) -> jax.Array:
    return jnp.full((512, 1024), float(step), jnp.float32)  # 2 MiB: an array of its own too


def expect_restores(path: str, frozen: dict[str, jax.Array], step: int) -> None:
    tree = jaxckpt.restore(path)
    for k, v in frozen.items():
        np.testing.assert_array_equal(np.asarray(tree["base"][k]), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(tree["adapter"]), np.asarray(adapter(step)))
    assert tree["step"] == step


def run(
    directory: Any, steps: int, *, keep: int = 3, frozen: dict[str, jax.Array] | None = None, **options: Any
) -> tuple[dict[str, jax.Array], list[str]]:
    """A manager saving ``steps`` steps of the state, keeping ``keep``: (the base, the kept checkpoints)."""
    frozen = base() if frozen is None else frozen
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=keep, step_counter="step", **options) as manager:
        for step in range(1, steps + 1):
            ckpt.step = step
            ckpt.adapter = adapter(step)
            manager.save()
        manager.wait_until_finished()
        return frozen, manager.checkpoints
