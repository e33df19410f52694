"""The guide's example in Flax NNX: a toy dataset, its iterator, a linear net, and a training loop.

It follows TensorFlow's "Training checkpoints" guide: inputs 0..9, labels ``inputs * 5 + range(5)``,
batches of 2 repeated forever, one ``Linear(1, 5)`` trained with Adam on the mean absolute error, and
a checkpoint of ``step``, ``optimizer``, ``net`` and ``iterator`` every 10 steps::

    ckpt = make_checkpoint(seed=0)
    ckpt.restore(latest_path)          # or None: start from scratch
    losses = train_and_checkpoint(ckpt, "ckpts/ckpt", until=50)

Tests import it (``tests/test_resume.py``), and ``examples/guide.py`` is written from it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxckpt


def toy_dataset() -> tuple[np.ndarray, np.ndarray]:
    """``inputs``: 0..9 as float32 of shape [10, 1]; ``labels``: ``inputs * 5 + range(5)``, shape [10, 5]."""
    inputs = np.arange(10, dtype=np.float32)[:, None]
    labels = inputs * 5 + np.arange(5, dtype=np.float32)[None, :]
    return inputs, labels


class ToyIterator:
    """Batches of the toy dataset, repeated forever.

    Its position is its whole state: ``get_state()`` returns it as a JSON-able dict, and a checkpoint
    saves it beside the model, so that a restored run sees the same next batch as the original run.
    """

    def __init__(self, batch_size: int = 2) -> None:
        self.inputs, self.labels = toy_dataset()
        self.batch_size = batch_size
        self.position = 0  # batches taken so far

    def __iter__(self) -> ToyIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batches = len(self.inputs) // self.batch_size
        start = (self.position % batches) * self.batch_size
        self.position += 1
        stop = start + self.batch_size
        return {"x": self.inputs[start:stop], "y": self.labels[start:stop]}

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position, "batch_size": self.batch_size}

    def set_state(self, state: dict[str, Any]) -> None:
        if state["batch_size"] != self.batch_size:
            # Another batch size would silently replay or skip data; refuse instead.
            raise ValueError(f"The checkpoint's iterator used batches of {state['batch_size']}, not {self.batch_size}.")
        self.position = int(state["position"])


class Net(nnx.Module):
    """A simple linear model."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(1, 5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l1(x)


def make_optimizer(net: nnx.Module, learning_rate: float = 0.1) -> nnx.Optimizer:
    return nnx.Optimizer(net, optax.adam(learning_rate), wrt=nnx.Param)


@nnx.jit
def train_step(net: nnx.Module, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    """One step on one batch (mean absolute error); updates ``net`` and ``optimizer`` in place."""

    def loss_fn(net: nnx.Module) -> jax.Array:
        return jnp.mean(jnp.abs(net(x) - y))

    loss, grads = nnx.value_and_grad(loss_fn)(net)
    optimizer.update(net, grads)
    return loss


def make_checkpoint(seed: int = 0) -> jaxckpt.Checkpoint:
    """A fresh net, optimizer and iterator, tracked by one Checkpoint (``step`` counts train steps)."""
    net = Net(nnx.Rngs(seed))
    return jaxckpt.Checkpoint(step=0, optimizer=make_optimizer(net), net=net, iterator=ToyIterator())


def train_and_checkpoint(
    ckpt: jaxckpt.Checkpoint, file_prefix: str | os.PathLike[str], until: int = 50, save_every: int = 10
) -> dict[int, np.ndarray]:
    """Train from ``ckpt.step`` up to step ``until``, saving every ``save_every`` steps.

    Returns the loss of each step, keyed by the step number it completes (1-based), as host numpy
    arrays, so that runs can be compared bit for bit.
    """
    losses: dict[int, np.ndarray] = {}
    while ckpt.step < until:
        example = next(ckpt.iterator)
        loss = train_step(ckpt.net, ckpt.optimizer, example["x"], example["y"])
        ckpt.step += 1
        losses[ckpt.step] = np.asarray(loss)
        if ckpt.step % save_every == 0:
            ckpt.save(file_prefix)
    return losses
