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


def _loop(mngr, clock, steps, seconds_per_step):
    """Orbax's loop: a training step, then mngr.save(step) at every step; the steps it saved."""
    saved = []
    for step in steps:
        clock.now += seconds_per_step
        due = mngr.should_save(step)
        if mngr.save(step) is not None:
            saved.append(step)
        assert due == (saved[-1:] == [step]), step  # should_save said what save then did
    return saved


def test_save_interval_secs_saves_when_that_many_seconds_passed_since_the_last_save(tmp_path):
    clock = Clock()
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, save_interval_secs=60, clock=clock) as mngr:
        # 7 s a step: 63 s at step 9, and 63 s after that at step 18 (the seconds count from the last save).
        assert _loop(mngr, clock, range(1, 30), 7) == [9, 18, 27]
        mngr.wait_until_finished()
        assert mngr.all_steps() == [9, 18, 27]
        assert [c.time - clock.now for c in mngr.checkpoint_infos] == [-140.0, -77.0, -14.0]
        assert mngr.save(30, force=True) is not None  # force saves, and the next 60 s count from it
        assert _loop(mngr, clock, range(31, 40), 7) == [39]


def test_steps_and_seconds_together_save_when_either_says_so(tmp_path):
    """Orbax's AnySavePolicy([FixedIntervalPolicy(10), ...]): every 10th step, and 60 s after the last save."""
    clock = Clock()
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(
        ckpt, tmp_path, save_interval_steps=10, save_interval_secs=60, clock=clock, async_save=False
    ) as mngr:
        assert _loop(mngr, clock, range(1, 41), 5) == [10, 20, 30, 40]  # 50 s apart: the steps decide
        assert _loop(mngr, clock, range(41, 61), 25) == [43, 46, 49, 50, 53, 56, 59, 60]
        assert not mngr.should_save(60)  # a step already saved is never due, whatever the clock says
        clock.now += 3600
        assert not mngr.should_save(55)


def test_a_restarted_run_counts_the_seconds_from_its_start_not_from_the_last_checkpoint(tmp_path):
    clock = Clock()
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, save_interval_secs=600, clock=clock) as mngr:
        assert _loop(mngr, clock, range(1, 8), 100) == [6]
    clock.now += 86_400  # restarted a day later: the restored checkpoint holds all there is to save
    with jaxckpt.CheckpointManager(ckpt, tmp_path, save_interval_secs=600, clock=clock) as mngr:
        mngr.restore()
        assert _loop(mngr, clock, range(7, 20), 100) == [12, 18]  # 600 s after the start, not at once
        mngr.wait_until_finished()
        assert mngr.all_steps() == [6, 12, 18]


def test_continuous_saves_again_as_soon_as_the_last_save_is_written(tmp_path, gate):
    """Orbax's ContinuousCheckpointingPolicy(): a step is due once no save is being written; neither
    should_save nor save waits for the one that is."""
    clock = Clock()
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, save_continuously=True, clock=clock) as mngr:
        assert mngr.should_save(1) and mngr.save(1) is not None  # held at the gate
        assert _loop(mngr, clock, range(2, 6), 1) == []
        assert "saving" in repr(mngr)  # nothing above waited for it
        gate.set()
        mngr.wait_until_finished()  # the training loop went on; the save is written now
        for step in (6, 7, 8):  # written before the next step: each step is due
            assert _loop(mngr, clock, [step], 1) == [step]
            mngr.wait_until_finished()
        gate.clear()
        assert mngr.save(9) is not None
        assert _loop(mngr, clock, range(10, 13), 1) == []
        gate.set()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 6, 7, 8, 9]


def test_continuous_with_a_minimum_interval(tmp_path, gate):
    """ContinuousCheckpointingPolicy(minimum_interval_secs=30): written, and 30 s since the last save began."""
    gate.set()
    clock = Clock()
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(
        ckpt, tmp_path, save_continuously=True, save_interval_secs=30, clock=clock, async_save=False
    ) as mngr:
        assert _loop(mngr, clock, range(1, 13), 10) == [3, 6, 9, 12]
    gate.clear()
    with jaxckpt.CheckpointManager(
        ckpt, tmp_path / "held", save_continuously=True, save_interval_secs=30, clock=clock
    ) as mngr:
        assert _loop(mngr, clock, range(1, 5), 10) == [3]  # held at the gate
        assert _loop(mngr, clock, range(5, 12), 10) == []  # 30 s and more since, but not written yet
        gate.set()
        mngr.wait_until_finished()
        assert _loop(mngr, clock, range(12, 14), 10) == [12]  # written and 90 s since: at once


def test_two_tiers_decide_by_the_local_save(tmp_path, gate):
    clock = Clock()
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(
        ckpt, tmp_path / "durable", local_directory=tmp_path / "local", save_continuously=True, clock=clock
    ) as mngr:
        assert mngr.save(1) is not None
        assert _loop(mngr, clock, range(2, 4), 1) == []
        gate.set()
        mngr.wait_until_finished()
        assert _loop(mngr, clock, [4], 1) == [4]
        mngr.wait_until_finished()
        assert _loop(mngr, clock, [5], 1) == [5]
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 4, 5]


def test_only_a_rule_by_time_asks_process_0(tmp_path, monkeypatch):
    """With several processes every process must take the same decision: a rule by the clock is
    process 0's, shared (jaxckpt.runtime.multihost.primary_decides); a rule by step is the same on every
    process and costs no round trip."""
    from jaxckpt.runtime import multihost

    asked = []
    real = multihost.primary_decides
    monkeypatch.setattr(multihost, "primary_decides", lambda what, decide: asked.append(what) or real(what, decide))
    clock = Clock()
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "steps", save_interval_steps=5, async_save=False) as mngr:
        assert _loop(mngr, clock, range(1, 11), 1) == [5, 10]
    assert asked == []
    with jaxckpt.CheckpointManager(
        ckpt, tmp_path / "both", save_interval_steps=5, save_interval_secs=60, clock=clock, async_save=False
    ) as mngr:
        assert _loop(mngr, clock, range(1, 11), 1) == [5, 10]
        assert mngr.save(10) is None and not mngr.should_save(9)  # not past the latest: no question
        assert mngr.save(11, force=True) is not None  # forced: no question
    assert asked == ["save decision"] * 16  # should_save and save at each step no rule by step decided: 1-4, 6-9


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"save_interval_secs": 0}, ValueError, "save_interval_secs must be a positive number, not 0"),
        ({"save_interval_secs": -5.0}, ValueError, "save_interval_secs must be a positive number"),
        ({"save_interval_secs": float("inf")}, ValueError, "save_interval_secs must be a positive number"),
        ({"save_interval_secs": "60"}, ValueError, "save_interval_secs must be a positive number, not '60'"),
        ({"save_interval_secs": True}, ValueError, "save_interval_secs must be a positive number, not True"),
        ({"save_continuously": "yes"}, TypeError, "save_continuously must be True or False, not 'yes'"),
    ],
)
def test_bad_save_decision_options_are_refused_before_the_directory_is_touched(tmp_path, options, error, message):
    with pytest.raises(error, match=message):
        jaxckpt.CheckpointManager(jaxckpt.Checkpoint(w=jnp.ones(3)), tmp_path / "ckpts", **options)
    assert not (tmp_path / "ckpts").exists()


def test_tensorflow_style_saves_by_time(tmp_path):
    """save() with no step (TensorFlow's call) keeps to save_interval_secs too."""
    clock = Clock()
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, save_interval_secs=30, clock=clock, async_save=False) as mngr:
        saved = []
        for _ in range(10):
            clock.now += 12
            saved.append(mngr.save())
    names = [p and p.rsplit("/", 1)[-1] for p in saved]
    assert names == [None, None, "ckpt-1", None, None, "ckpt-2", None, None, "ckpt-3", None]  # every 36 s
