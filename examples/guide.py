"""The "Training checkpoints" guide's main example, in JAX and Flax NNX (`make demo`).

Train a one-layer net on a toy dataset for 50 steps, saving every 10 steps and keeping 3
checkpoints; then build new objects, restore the latest checkpoint (weights, optimizer slots, step
and the data iterator's position) and train 50 more steps. A run of 100 steps without interruption
checks that the restarted run continues exactly: same losses, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jaxckpt

CKPT_DIR = Path(os.environ.get("JAXCKPT_DEMO_DIR", "demo_ckpts"))


class ToyData:
    """inputs 0..9, labels ``inputs * 5 + range(5)``, repeated, in batches of 2; its position is saved."""

    def __init__(self) -> None:
        self.inputs = np.arange(10, dtype=np.float32)[:, None]
        self.labels = self.inputs * 5 + np.arange(5, dtype=np.float32)[None, :]
        self.position = 0

    def __next__(self) -> tuple[jnp.ndarray, jnp.ndarray]:
        i = self.position % 5 * 2
        self.position += 1
        return jnp.asarray(self.inputs[i : i + 2]), jnp.asarray(self.labels[i : i + 2])

    def get_state(self) -> dict[str, int]:
        return {"position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Net(nnx.Module):
    """A simple linear model."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(1, 5, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self.l1(x)


@nnx.jit
def train_step(net: Net, optimizer: nnx.Optimizer, x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    def loss_fn(net: Net) -> jnp.ndarray:
        return jnp.mean(jnp.abs(net(x) - y))  # mean absolute error

    loss, grads = nnx.value_and_grad(loss_fn)(net)
    optimizer.update(net, grads)
    return loss


def new_objects() -> jaxckpt.Checkpoint:
    net = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(net, optax.adam(0.1), wrt=nnx.Param)
    return jaxckpt.Checkpoint(step=1, optimizer=optimizer, net=net, iterator=ToyData())


def train_and_checkpoint(ckpt: jaxckpt.Checkpoint, manager: jaxckpt.CheckpointManager | None, steps: int) -> list:
    """Train ``steps`` steps from wherever ``manager`` restores to; returns the losses."""
    if manager is not None:
        restored = manager.restore_or_initialize()
        print(f"Restored from {restored} (step {ckpt.step})" if restored else "Initializing from scratch.")
    losses = []
    for _ in range(steps):
        x, y = next(ckpt.iterator)
        loss = train_step(ckpt.net, ckpt.optimizer, x, y)
        losses.append(np.asarray(loss))
        ckpt.step = ckpt.step + 1
        if manager is not None and ckpt.step % 10 == 0:
            path = manager.save(metrics={"loss": float(loss)})
            print(f"Saved checkpoint for step {ckpt.step}: {path}")
            print(f"loss {float(loss):1.2f}")
    return losses


def main() -> None:
    shutil.rmtree(CKPT_DIR, ignore_errors=True)

    print("== First run: 50 steps, a checkpoint every 10 steps, keeping 3 ==")
    ckpt = new_objects()
    manager = jaxckpt.CheckpointManager(ckpt, CKPT_DIR, max_to_keep=3, step_counter="step")
    first = train_and_checkpoint(ckpt, manager, 50)
    manager.close()

    print("\n== Restart: new objects, restore the latest checkpoint, 50 more steps ==")
    ckpt = new_objects()
    manager = jaxckpt.CheckpointManager(ckpt, CKPT_DIR, max_to_keep=3, step_counter="step")
    second = train_and_checkpoint(ckpt, manager, 50)
    print(f"Kept checkpoints: {manager.checkpoints}")
    manager.close()

    print("\n== What the latest checkpoint holds (jaxckpt.list_variables) ==")
    for key, shape in jaxckpt.list_variables(manager.latest_checkpoint):
        print(f"  {key:40s} {shape}")

    # The restart resumed from the step-50 checkpoint, taken after 49 updates (steps count from 1),
    # so its 50 updates are updates 50..99 of a run that never stopped.
    print("\n== Exact resumption: one run of 99 updates without a restart ==")
    reference = train_and_checkpoint(new_objects(), None, 99)
    same = len(second) == 50 and all(np.array_equal(a, b) for a, b in zip(first[:49] + second, reference))
    print(f"losses after the restart, every 10th: {[round(float(x), 4) for x in second[::10]]}")
    print(f"same losses as the uninterrupted run, bit for bit: {same}")
    if not same:
        sys.exit("The restarted run diverged from the uninterrupted one.")


if __name__ == "__main__":
    main()
