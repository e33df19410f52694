"""When a manager saves: by step (Orbax's ``save_interval_steps``), every ``save_interval_secs`` seconds,
and continuously (Orbax's ``ContinuousCheckpointingPolicy``: again as soon as the last save is
durable, at most every ``save_interval_secs``).

Written as Orbax loops are (``mngr.save(step)`` at every step, ``should_save``), with the manager's
injectable clock: no sleeps and no timing assertions. A save held in the background is a gate that the
test opens; whatever must not wait for it is called while it is shut.
"""

from __future__ import annotations

import threading

import jax.numpy as jnp
import pytest

import jaxckpt
from jaxckpt.saving import pipeline


class Clock:
    """The manager's clock, moved by the test."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def gate(monkeypatch):
    """A gate that every background write waits at (30 s at most) until the test opens it."""
    opened = threading.Event()
    real = pipeline.write_and_publish

    def held(prepared):
        opened.wait(timeout=30)
        return real(prepared)

    monkeypatch.setattr(pipeline, "write_and_publish", held)
    yield opened
    opened.set()


def test_a_step_not_due_returns_at_once_while_the_last_save_is_written(tmp_path, gate):
    """Orbax's loop calls save(step) at every step: the steps between saves must not wait for the
    background save, or an asynchronous save blocks the next training step."""
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, save_interval_steps=10) as mngr:
        assert mngr.save(10) is not None  # held at the gate, in the background
        assert not mngr.should_save(10) and not mngr.should_save(11)
        assert mngr.save(11) is None and mngr.save(12) is None
        assert "saving" in repr(mngr)  # nothing above waited for it
        gate.set()
        assert mngr.should_save(20) and mngr.save(20) is not None
        assert mngr.all_steps() == [10, 20]
