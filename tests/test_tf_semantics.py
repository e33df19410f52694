"""TensorFlow's Checkpoint and CheckpointManager semantics, tested as TF's own tests test them.

Ported in spirit from ``checkpoint_test.py`` and ``checkpoint_management_test.py``: save, restore,
``gc.disable()`` with ``weakref`` for reference cycles, a fake clock for the hours rule, and a
restart between managers.
"""

import contextlib
import gc
import json
import os
import subprocess
import sys
import warnings
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt


@contextlib.contextmanager
def no_gc():
    """As TF's tests do: with the cycle collector off, only reference counts free objects."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# --- no reference cycles -------------------------------------------------------------------------


def assert_freed(refs):
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} objects are still referenced: {[type(a) for a in alive]}"


def _arrays():
    return {"np": np.arange(6.0).reshape(2, 3), "jax": jnp.arange(4.0)}


@pytest.mark.parametrize("blocking", [True, False])
def test_save_keeps_no_reference_to_the_arrays(tmp_path, blocking):
    with no_gc():
        tree = _arrays()
        refs = [weakref.ref(v) for v in tree.values()]
        jaxckpt.save(tmp_path / "one", tree, blocking=blocking)
        jaxckpt.wait_until_finished()
        ckpt = jaxckpt.Checkpoint(params=tree)
        ckpt.save(tmp_path / "ckpt", blocking=blocking)
        ckpt.wait_until_finished()
        del tree, ckpt
        assert_freed(refs)


def test_manager_save_keeps_no_reference_to_the_arrays(tmp_path):
    with no_gc():
        ckpt = jaxckpt.Checkpoint(params=_arrays())
        refs = [weakref.ref(v) for v in ckpt.params.values()]
        with jaxckpt.CheckpointManager(ckpt, tmp_path / "m", max_to_keep=1) as manager:
            manager.save()
            manager.save()
        del ckpt, manager
        assert_freed(refs)


def test_restore_keeps_no_reference_to_templates_or_results(tmp_path):
    path = jaxckpt.save(tmp_path / "one", _arrays())
    with no_gc():
        like = _arrays()
        restored = jaxckpt.restore(path, like)
        loaded = jaxckpt.restore(path)
        refs = [weakref.ref(v) for tree in (like, restored, loaded) for v in tree.values()]
        del like, restored, loaded
        assert_freed(refs)


def test_checkpoint_restore_keeps_no_reference_to_the_old_or_new_values(tmp_path):
    path = jaxckpt.Checkpoint(params=_arrays(), later=_arrays()).save(tmp_path / "ckpt")
    with no_gc():
        ckpt = jaxckpt.Checkpoint(params=_arrays())
        old = [weakref.ref(v) for v in ckpt.params.values()]
        status = ckpt.restore(path)  # "later" waits for an assignment: a delayed restore
        new = [weakref.ref(v) for v in ckpt.params.values()]
        assert_freed(old)  # replaced by the restored values
        ckpt.later = _arrays()
        status.assert_consumed()
        new += [weakref.ref(v) for v in ckpt.later.values()]
        del ckpt, status
        assert_freed(new)


def test_a_failed_background_save_keeps_no_reference_once_collected(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "index.json").write_text("{}")
    with no_gc():
        tree = _arrays()
        refs = [weakref.ref(v) for v in tree.values()]
        ckpt = jaxckpt.Checkpoint(params=tree)
        del tree
        try:
            ckpt.write(tmp_path / "taken", blocking=False)
            ckpt.wait_until_finished()
        except jaxckpt.JaxckptError:
            pass
        del ckpt
        assert_freed(refs)


# --- warnings at the right time ------------------------------------------------------------------


def _thirty(tmp_path):
    return jaxckpt.Checkpoint(d={f"v{i}": i for i in range(30)}).save(tmp_path / "thirty")


def _one_of_thirty():
    return jaxckpt.Checkpoint(d={"v0": 0})


def test_unused_values_warn_at_the_next_call_not_at_garbage_collection(tmp_path):
    path = _thirty(tmp_path)
    ckpt = _one_of_thirty()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = ckpt.restore(path)
        del status
        gc.collect()
    assert not caught  # the collector says nothing
    with pytest.warns(
        jaxckpt.UnusedValuesWarning, match=r"(?s)29 value\(s\) in .*thirty-1.*never restored.*d/v1"
    ) as rec:
        ckpt.restore(path).expect_partial()  # the next call reports the previous restore, once
    assert len(rec) == 1 and rec[0].filename == __file__  # and points at the user's call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(tmp_path / "again")  # TF's chaining idiom silenced the second restore
        ckpt.restore(path).expect_partial()


def test_unused_values_warning_obeys_filterwarnings_error(tmp_path):
    path = _thirty(tmp_path)
    ckpt = _one_of_thirty()
    ckpt.restore(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxckpt.UnusedValuesWarning)
        with pytest.raises(jaxckpt.UnusedValuesWarning, match="29 value"):
            ckpt.write(tmp_path / "w")


def test_expect_partial_after_the_fact_and_assertions_silence_nothing_else(tmp_path):
    path = jaxckpt.Checkpoint(a=np.ones(2), b={"x": 1, "y": 2}).save(tmp_path / "c")
    ckpt = jaxckpt.Checkpoint(a=np.zeros(2), b={"x": 0})
    status = ckpt.restore(path)
    status.assert_existing_objects_matched()  # unused values are fine for this assertion...
    with pytest.warns(jaxckpt.UnusedValuesWarning, match=r"(?s)1 value\(s\).*b/y"):
        ckpt.save(tmp_path / "c")  # ...but still reported, once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(tmp_path / "c")
        status2 = ckpt.restore(path)
        status2.expect_partial()  # any time before the next call
        ckpt.save(tmp_path / "d")


def test_a_restore_that_raised_never_warns(tmp_path):
    import jax

    path = _thirty(tmp_path)
    ckpt = jaxckpt.Checkpoint(d={"v0": 0}, extra=jax.ShapeDtypeStruct((2,), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(jaxckpt.MissingKeyError, match="extra"):
            ckpt.restore(path)
        del ckpt.extra
        ckpt.save(tmp_path / "after")
        gc.collect()


def test_a_manager_reports_unused_values_at_close_at_the_latest(tmp_path):
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(a=1, b=2), tmp_path / "m", async_save=False) as manager:
        manager.save()
    manager = jaxckpt.CheckpointManager(jaxckpt.Checkpoint(a=0), tmp_path / "m")
    manager.restore_or_initialize()
    with pytest.warns(jaxckpt.UnusedValuesWarning, match=r"(?s)1 value\(s\).*\bb\b"):
        manager.close()
    with pytest.raises(KeyError), jaxckpt.CheckpointManager(jaxckpt.Checkpoint(a=0), tmp_path / "m") as manager:
        manager.restore_or_initialize()
        raise KeyError("leaving by an exception says nothing about unused values")


def test_no_warning_or_ignored_exception_at_interpreter_exit(tmp_path):
    path = _thirty(tmp_path)
    script = f"import jaxckpt\nstatus = jaxckpt.Checkpoint(d={{'v0': 0}}).restore({path!r})\n"
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Warning" not in done.stderr, done.stderr


# --- checkpoint_interval, as TF's CheckpointManager tracks _last_checkpoint_step -----------------


def test_checkpoint_interval_and_check_interval(tmp_path):
    """TF's testCheckpointInterval: the interval counts from the last checkpoint this manager saved."""
    ckpt = jaxckpt.Checkpoint(step=0, v=np.ones(2))
    manager = jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step", checkpoint_interval=2, async_save=False)
    saved = {}
    for step, check in [(0, False), (1, True), (2, True), (3, True), (4, False), (5, False), (6, True), (7, True)]:
        ckpt.step = step
        saved[step] = manager.save(check_interval=check) is not None
    # check_interval=False saves whatever the interval (4, 5); then 6 < 5 + 2 waits until 7.
    assert [s for s, ok in saved.items() if ok] == [0, 2, 4, 5, 7]
    assert manager.save(check_interval=False) is None  # never twice at the same step
    assert [c.step for c in manager.checkpoint_infos] == [0, 2, 4, 5, 7]
    manager.close()


def test_checkpoint_interval_after_a_restart_counts_from_the_restored_step(tmp_path):
    ckpt = jaxckpt.Checkpoint(step=7, v=np.ones(2))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step", checkpoint_interval=5) as manager:
        manager.save()
    ckpt = jaxckpt.Checkpoint(step=0, v=np.zeros(2))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step", checkpoint_interval=5) as manager:
        assert manager.restore_or_initialize() == str(tmp_path / "ckpt-1")  # TF: sets _last_checkpoint_step
        assert ckpt.step == 7
        ckpt.step = 11
        assert manager.save() is None
        ckpt.step = 12
        assert manager.save() == str(tmp_path / "ckpt-2")
    # A manager that restored nothing has saved nothing yet: its first save happens, as in TF.
    ckpt = jaxckpt.Checkpoint(step=13, v=np.zeros(2))
    with jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step", checkpoint_interval=5) as manager:
        assert manager.save() == str(tmp_path / "ckpt-3")


def test_checkpoint_interval_with_last_checkpoint_step(tmp_path):
    """TF's testCheckpointIntervalWithLastCheckpointStep: the interval starts at ``last_checkpoint_step``."""
    checkpoint = jaxckpt.Checkpoint(step=1, v=np.ones(2))
    manager = jaxckpt.CheckpointManager(
        checkpoint,
        tmp_path,
        max_to_keep=None,
        step_counter="step",
        checkpoint_interval=2,
        last_checkpoint_step=1,
        async_save=False,
    )
    # step_counter: 1, no checkpoint saved.
    assert manager.save(check_interval=True) is None
    # step_counter: 2, no checkpoint saved since the interval starts at 1.
    checkpoint.step += 1
    assert manager.save(check_interval=True) is None
    # step_counter: 3, checkpoint saved.
    checkpoint.step += 1
    path = manager.save(check_interval=True)
    assert os.path.isdir(path)
    manager.close()
    with pytest.raises(ValueError, match=r"last_checkpoint_step.*checkpoint_interval"):
        jaxckpt.CheckpointManager(checkpoint, tmp_path / "other", step_counter="step", last_checkpoint_step=1)


# --- keep_checkpoint_every_n_hours as TF defines it ----------------------------------------------


class FakeClock:
    """Unix seconds that move only when a test says so."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _names(paths):
    return [os.path.basename(p) for p in paths]


def _folders(directory):
    return sorted((p.name for p in directory.iterdir() if p.name.startswith("ckpt-")), key=lambda n: int(n[5:]))


def test_keep_checkpoint_every_n_hours_preserves_as_tf_and_records_it(tmp_path):
    """TF's testKeepCheckpointEveryNHours: upon removal from the max_to_keep active set, a checkpoint
    is preserved if at least N hours passed since the last preserved one (at first, since the first
    manager started): the first checkpoint is not preserved automatically."""
    clock = FakeClock()
    ckpt = jaxckpt.Checkpoint(v=np.ones(2))
    manager = jaxckpt.CheckpointManager(
        ckpt, tmp_path, max_to_keep=2, keep_checkpoint_every_n_hours=1, clock=clock, async_save=False
    )
    for _ in range(7):  # at 0, 25, 50, 75, 100, 125, 150 minutes
        manager.save()
        clock.now += 25 * 60
    # ckpt-4 (75 min) is the first dropped one at least an hour after the manager started; ckpt-5
    # (100 min) is not an hour after ckpt-4. ckpt-1..3 are deleted.
    assert _names(manager.checkpoints) == ["ckpt-4", "ckpt-6", "ckpt-7"] == _folders(tmp_path)
    assert [c.preserved for c in manager.checkpoint_infos] == [True, False, False]
    state = json.loads((tmp_path / "checkpoint").read_text())
    assert state["version"] == 1 and [r.get("preserved", False) for r in state["checkpoints"]] == [True, False, False]
    manager.close()

    # A restarted manager without the option, keeping one, with another policy: never deletes it.
    ckpt = jaxckpt.Checkpoint(v=np.zeros(2))
    with jaxckpt.CheckpointManager(
        ckpt, tmp_path, max_to_keep=1, policies=[jaxckpt.KeepBest(1, "loss")], clock=clock
    ) as manager:
        for loss in (0.5, 0.4, 0.3):
            manager.save(metrics={"loss": loss})
    assert _names(manager.checkpoints) == ["ckpt-4", "ckpt-10"] == _folders(tmp_path)


def test_a_restarted_manager_counts_hours_from_the_recorded_last_preserved_time(tmp_path):
    clock = FakeClock()
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(v=1), tmp_path, clock=clock, async_save=False) as manager:
        clock.now += 2 * 3600
        manager.save()  # two hours after the first manager started
    clock.now += 1800
    with jaxckpt.CheckpointManager(
        jaxckpt.Checkpoint(v=2), tmp_path, max_to_keep=1, keep_checkpoint_every_n_hours=1, clock=clock
    ) as manager:
        manager.save()  # drops ckpt-1, at least an hour after the first manager started: preserved
    assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2"] == _folders(tmp_path)


def test_clock_reset(tmp_path):
    """TF's testClockReset: a manager whose clock is behind the last preserved time recorded "errs on
    the side of keeping": every existing checkpoint stays, whatever its options."""
    clock = FakeClock(10000.0)
    checkpoint = jaxckpt.Checkpoint(v=np.ones(2))
    first_manager = jaxckpt.CheckpointManager(
        checkpoint, tmp_path, max_to_keep=1, keep_checkpoint_every_n_hours=1.0, clock=clock, async_save=False
    )
    first_path = first_manager.save()
    clock.now += 3600.0
    second_path = first_manager.save()
    clock.now += 3600.0
    third_path = first_manager.save()
    assert not os.path.exists(first_path)
    assert os.path.isdir(second_path) and os.path.isdir(third_path)
    # TF lists [third_path]: jaxckpt lists the preserved one too (see docs/from-tensorflow.md's differences table).
    assert first_manager.checkpoints == [second_path, third_path]
    assert json.loads((tmp_path / "checkpoint").read_text())["last_preserved_time"] == 13600.0
    # Set the clock back in time
    clock.now = 5000.0
    first_manager.close()
    with pytest.warns(UserWarning, match="behind the last preserved checkpoint"):
        second_manager = jaxckpt.CheckpointManager(checkpoint, tmp_path, max_to_keep=1, clock=clock, async_save=False)
    # We should err on the side of keeping checkpoints around when we're not sure whether they were
    # preserved or not due to clock funkiness.
    assert os.path.isdir(second_path)
    assert second_manager.latest_checkpoint == third_path
    # TF forgets them (checkpoints == []); jaxckpt lists them, preserved: no manager deletes them.
    assert [c.preserved for c in second_manager.checkpoint_infos] == [True, True]
    clock.now += 10.0
    fourth_path = second_manager.save()
    assert os.path.isdir(second_path) and os.path.isdir(third_path)
    assert second_manager.latest_checkpoint == fourth_path
    assert second_manager.checkpoints == [second_path, third_path, fourth_path]
    clock.now += 10.0
    fifth_path = second_manager.save()
    assert os.path.isdir(second_path) and os.path.isdir(third_path)
    assert second_manager.checkpoints == [second_path, third_path, fifth_path]
    second_manager.close()
    state = json.loads((tmp_path / "checkpoint").read_text())
    assert state["last_preserved_time"] == 5000.0
    assert [r["time"] for r in state["checkpoints"] if not r.get("preserved")] == [5020.0]


def test_state_files_without_the_new_fields_stay_readable(tmp_path):
    (tmp_path / "ckpt-3").mkdir()
    jaxckpt.Checkpoint(v=1).write(tmp_path / "ckpt-3" / "x")  # content does not matter here
    (tmp_path / "checkpoint").write_text(
        json.dumps(
            {
                "format": "jaxckpt-manager-state",
                "version": 1,
                "latest": "ckpt-3",
                "checkpoints": [{"prefix": "ckpt-3", "step": 3, "time": 1.0, "metrics": {}}],
            }
        )
    )
    assert [
        c.preserved for c in jaxckpt.CheckpointManager(jaxckpt.Checkpoint(), tmp_path, read_only=True).checkpoint_infos
    ] == [False]


# --- Checkpoint.save records itself; a manager adopts what it did not write ----------------------


def test_checkpoint_save_records_itself_and_a_manager_adopts_it(tmp_path):
    directory = tmp_path / "ckpts"
    ckpt = jaxckpt.Checkpoint(v=np.ones(2))
    first = ckpt.save(directory / "ckpt")
    assert jaxckpt.latest_checkpoint(directory) == first  # as tf.train.latest_checkpoint finds it
    second = ckpt.save(directory / "ckpt", blocking=False)
    ckpt.wait_until_finished()
    assert jaxckpt.latest_checkpoint(directory) == second
    restored = jaxckpt.Checkpoint(v=np.zeros(2))
    restored.restore(jaxckpt.latest_checkpoint(directory)).assert_consumed()

    with jaxckpt.CheckpointManager(restored, directory, max_to_keep=3, async_save=False) as manager:
        assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2"]  # adopted, not refused or deleted
        assert manager.restore_or_initialize() == second
        assert manager.save() == str(directory / "ckpt-3")  # numbered after them
    assert _folders(directory) == ["ckpt-1", "ckpt-2", "ckpt-3"]


def test_a_manager_adopts_unlisted_complete_checkpoints_and_never_deletes_them(tmp_path):
    # Written without any state file (as an older jaxckpt's Checkpoint.save did, or copied in).
    for n in (1, 4):
        jaxckpt.Checkpoint(v=np.full(2, float(n))).write(tmp_path / f"ckpt-{n}")
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(v=np.zeros(2)), tmp_path, async_save=False) as manager:
        assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-4"]
        assert manager.save() == str(tmp_path / "ckpt-5")
    # One more appears beside a state file that does not list it: the next manager adopts it too.
    jaxckpt.Checkpoint(v=np.full(2, 9.0)).write(tmp_path / "ckpt-9")
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(v=np.zeros(2)), tmp_path, max_to_keep=5) as manager:
        assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-4", "ckpt-5", "ckpt-9"]
    assert _folders(tmp_path) == ["ckpt-1", "ckpt-4", "ckpt-5", "ckpt-9"]


def test_continue_from_unmanaged(tmp_path):
    """TF's testContinueFromUnmanaged: checkpoints that Checkpoint.save wrote under another prefix are
    found by latest_checkpoint, numbered after, and never deleted."""
    directory = str(tmp_path)
    prefix = os.path.join(directory, "unusual_prefix")
    checkpoint = jaxckpt.Checkpoint(v=np.ones(2))
    first_path = checkpoint.save(prefix)
    second_path = checkpoint.save(prefix)
    del checkpoint
    checkpoint = jaxckpt.Checkpoint(v=np.zeros(2))
    manager = jaxckpt.CheckpointManager(checkpoint, directory, max_to_keep=2, async_save=False)
    checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    assert checkpoint.save_counter == 2
    third_path = manager.save()
    assert third_path == os.path.join(directory, "ckpt-3")
    # TF lists only its own ([third_path]); jaxckpt lists what it found too, and never deletes it
    # (see docs/from-tensorflow.md's differences table).
    assert manager.checkpoints == [first_path, second_path, third_path]
    fourth_path = manager.save()
    assert manager.checkpoints == [first_path, second_path, third_path, fourth_path]
    fifth_path = manager.save()
    assert manager.checkpoints == [first_path, second_path, fourth_path, fifth_path]
    assert os.path.isdir(first_path)
    assert os.path.isdir(second_path)
    assert not os.path.exists(third_path)
    assert os.path.isdir(fourth_path)
    assert os.path.isdir(fifth_path)
    manager.close()


def test_custom_checkpoint_prefix(tmp_path):
    """TF's testCustomCheckpointPrefix: a manager of another checkpoint_name works in the same directory."""
    directory = str(tmp_path)
    checkpoint = jaxckpt.Checkpoint(v=np.ones(2))
    manager = jaxckpt.CheckpointManager(checkpoint, directory, max_to_keep=2, checkpoint_name="ckpt_name")
    path = manager.save(checkpoint_number=5)
    assert os.path.basename(path) == "ckpt_name-5"
    manager.close()  # one manager at a time in a directory (TF: "only one should be active")
    manager = jaxckpt.CheckpointManager(checkpoint, directory, max_to_keep=2)
    assert manager.latest_checkpoint == path  # found, as tf.train.latest_checkpoint finds it
    path = manager.save(checkpoint_number=5)
    assert os.path.basename(path) == "ckpt-5"
    # Beyond TF's test: numbering goes on after both, and retention never deletes the other name's.
    assert [os.path.basename(manager.save()) for _ in range(3)] == ["ckpt-6", "ckpt-7", "ckpt-8"]
    manager.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == [
        "ckpt-7",
        "ckpt-8",
        "ckpt_name-5",
    ]
    with jaxckpt.CheckpointManager(checkpoint, directory, checkpoint_name="other") as manager:
        assert manager.save() == os.path.join(directory, "other-9")  # a manager that did not restore


def test_checkpoint_save_into_a_directory_a_manager_holds_is_refused(tmp_path):
    manager = jaxckpt.CheckpointManager(jaxckpt.Checkpoint(v=1), tmp_path, async_save=False)
    manager.save()
    state = (tmp_path / "checkpoint").read_bytes()
    ckpt = jaxckpt.Checkpoint(v=2)
    with pytest.raises(jaxckpt.ManagerLockedError, match=r"(?s)CheckpointManager.*manager\.save\(\)"):
        ckpt.save(tmp_path / "ckpt")
    assert ckpt.save_counter == 0 and _folders(tmp_path) == ["ckpt-1"]
    assert (tmp_path / "checkpoint").read_bytes() == state  # the manager's state file is untouched
    manager.close()
    ckpt.save_counter = 1
    assert ckpt.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-2") == jaxckpt.latest_checkpoint(tmp_path)
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(v=0), tmp_path, read_only=True) as manager:
        assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2"]


def test_a_save_a_crash_interrupted_before_it_was_listed_is_still_removed(tmp_path):
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(v=1), tmp_path, async_save=False) as manager:
        manager.save()
    assert not (tmp_path / "ckpt-1" / ".jaxckpt-unrecorded").exists()  # listed: its mark is gone
    # What a kill between publishing ckpt-2 and listing it leaves: a complete folder with the mark.
    jaxckpt.Checkpoint(v=2).write(tmp_path / "ckpt-2")
    (tmp_path / "ckpt-2" / ".jaxckpt-unrecorded").write_bytes(b"")
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(v=0), tmp_path) as manager:
        assert _names(manager.checkpoints) == ["ckpt-1"]
    assert _folders(tmp_path) == ["ckpt-1"]


# --- partial restores and object graphs, as TF's checkpoint_test writes them ------------------------


def test_partial_restore_warning_attribute(tmp_path):
    """TF's testPartialRestoreWarningAttribute: an edge ``v1`` that holds an empty object where the
    file has a value is named by the warning (TF warns at garbage collection, jaxckpt at the next call
    on the Checkpoint: see docs/from-tensorflow.md's differences table)."""
    original_root = jaxckpt.Checkpoint(v1=np.array(2.0), v2=np.array(3.0))
    prefix = os.path.join(tmp_path, "ckpt")
    save_path = original_root.save(prefix)
    partial_root = jaxckpt.Checkpoint(v1=jaxckpt.Checkpoint(), v2=np.array(0.0))
    weak_partial_root = weakref.ref(partial_root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        partial_root.restore(save_path)
        assert partial_root.v2 == 3.0
        partial_root.write(os.path.join(tmp_path, "next"))  # the next call reports it
        del partial_root
        gc.collect()
        assert weak_partial_root() is None
    messages = "\n".join(str(w.message) for w in caught)
    assert "v1" in messages
    assert "v2" not in messages
    assert "expect_partial()" in messages


def test_attribute_exception(tmp_path):
    """TF's testAttributeException."""
    original_root = jaxckpt.Checkpoint(v1=np.array(2.0), v2=np.array(3.0))
    save_path = original_root.save(os.path.join(tmp_path, "ckpt"))
    partial_root = jaxckpt.Checkpoint(v1=jaxckpt.Checkpoint(), v2=np.array(0.0))
    status = partial_root.restore(save_path)
    with pytest.raises(AssertionError, match=r"(?s)value\(s\) found no object.*\bv1\b"):
        status.assert_consumed()
    status.expect_partial()


def test_objects_combined(tmp_path):
    """TF's testObjectsCombined: two saved objects loaded into one shared Checkpoint."""
    save_root = jaxckpt.Checkpoint()
    save_root.dep_one = jaxckpt.Checkpoint(var1=np.array(32.0, np.float64))
    save_root.dep_two = jaxckpt.Checkpoint(var2=np.array(64.0, np.float64))
    save_path = save_root.save(os.path.join(tmp_path, "ckpt"))
    load_root = jaxckpt.Checkpoint()
    load_root.dep_one = jaxckpt.Checkpoint()
    load_root.dep_two = load_root.dep_one
    load_root.dep_one.var1 = np.zeros((), np.float64)
    load_root.dep_one.var2 = np.zeros((), np.float64)
    load_root.restore(save_path).assert_consumed().assert_existing_objects_matched()
    assert load_root.dep_one.var1 == 32.0
    assert load_root.dep_one.var2 == 64.0


def test_ambiguous_load(tmp_path):
    """TF's testAmbiguousLoad: one saved object split into two is not OK."""
    save_root = jaxckpt.Checkpoint()
    save_root.dep_one = jaxckpt.Checkpoint()
    save_root.dep_two = jaxckpt.Checkpoint()
    dep_three = jaxckpt.Checkpoint(var=np.array(0.0))
    save_root.dep_one.dep_three = dep_three
    save_root.dep_two.dep_three = dep_three
    save_path = save_root.save(os.path.join(tmp_path, "ckpt"))
    load_root = jaxckpt.Checkpoint()
    status = load_root.restore(save_path)
    load_root.dep_one = jaxckpt.Checkpoint()
    load_root.dep_two = jaxckpt.Checkpoint()
    load_root.dep_one.dep_three = jaxckpt.Checkpoint(var=np.array(1.0))
    load_root.dep_two.dep_three = jaxckpt.Checkpoint(var=np.array(1.0))
    with pytest.raises(AssertionError):
        status.assert_consumed()
    with pytest.raises(AssertionError):
        status.assert_existing_objects_matched()
    status.expect_partial()


def test_values_still_waiting_for_a_child_keep_no_cycle(tmp_path):
    path = jaxckpt.Checkpoint(params=_arrays(), later=_arrays()).save(tmp_path / "ckpt")
    with no_gc():
        ckpt = jaxckpt.Checkpoint(params=_arrays())
        status = ckpt.restore(path)  # "later" waits, and is never assigned
        status.expect_partial()
        refs = [weakref.ref(ckpt)] + [weakref.ref(v) for v in ckpt.params.values()]
        del ckpt, status
        assert_freed(refs)


# --- overlapping restores -------------------------------------------------------------------------


def _two_saves(tmp_path):
    save_root = jaxckpt.Checkpoint(dep=jaxckpt.Checkpoint(var=np.float32(12.0)))
    first = save_root.save(tmp_path / "first")
    save_root.dep.var = np.float32(13.0)
    second = save_root.save(tmp_path / "second")
    return first, second


def test_overlapping_restores_the_latest_restore_call_wins(tmp_path):
    """TF's testOverlappingRestores: two roots restored, one object assigned to both."""
    first_path, second_path = _two_saves(tmp_path)
    # The order of the restore() calls decides the final value: the last one wins.
    for second_restored_last, final in ((True, 13.0), (False, 12.0)):
        first_root, second_root = jaxckpt.Checkpoint(), jaxckpt.Checkpoint()
        if second_restored_last:
            first_status = first_root.restore(first_path)
            second_status = second_root.restore(second_path)
        else:
            second_status = second_root.restore(second_path)
            first_status = first_root.restore(first_path)
        load_dep = jaxckpt.Checkpoint(var=np.float32(0.0))
        first_root.dep = load_dep
        first_status.assert_consumed()
        assert load_dep.var == 12.0
        second_root.dep = load_dep
        second_status.assert_consumed()
        assert load_dep.var == final


def test_two_restores_waiting_in_one_checkpoint_each_track_their_own_values(tmp_path):
    first_path, second_path = _two_saves(tmp_path)
    root = jaxckpt.Checkpoint()
    first_status = root.restore(first_path)
    second_status = root.restore(second_path)  # both leave "dep" waiting
    root.dep = jaxckpt.Checkpoint(var=np.float32(0.0))
    assert root.dep.var == 13.0  # the most recent restore() wins
    first_status.assert_consumed()  # and each status counts its own values as used
    second_status.assert_consumed()
    root.save(tmp_path / "after")  # nothing waits any more: no warning


def test_values_waiting_for_a_child_are_named_by_saves_not_by_the_next_restore(tmp_path):
    path = _thirty(tmp_path)
    ckpt = jaxckpt.Checkpoint()
    ckpt.restore(path)  # "d" waits for a child: it may yet be assigned
    ckpt.restore(path).expect_partial()  # so the next restore does not call it unused
    ckpt.d = {"v0": -1}  # the latest restore's values; its status expected a partial match
    with pytest.raises(jaxckpt.UnusedValuesWarning, match=r"29 value\(s\).*never restored"), warnings.catch_warnings():
        warnings.simplefilter("error", jaxckpt.UnusedValuesWarning)
        ckpt.save(tmp_path / "c")  # the first restore's d/v1..d/v29 found no place: said once
