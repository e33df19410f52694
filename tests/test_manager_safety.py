"""CheckpointManager under attack: interrupts, rivals, other names, users' files, unwritable directories.

Each test reproduces one item of the data-safety issue (issue 10) that failed before its fix.
"""

import builtins
import concurrent.futures
import errno
import json
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt.manager import one_tier
from jaxckpt.saving import pipeline


def make_ckpt(step: int = 0, value: float = 0.0) -> jaxckpt.Checkpoint:
    return jaxckpt.Checkpoint(step=step, w=np.full((2, 3), value, np.float32))


def names(paths: list[str]) -> list[str]:
    return [os.path.basename(p) for p in paths]


@pytest.fixture
def held_save(monkeypatch):
    """Background saves block until ``gate`` is set, then fail with ``error`` if it is set, else finish."""

    class Held:
        gate = threading.Event()
        started = threading.Event()
        error: BaseException | None = None

    real_finish = pipeline.write_and_publish

    def finish(prepared):
        Held.started.set()
        Held.gate.wait()
        if Held.error is not None:
            raise Held.error
        return real_finish(prepared)

    monkeypatch.setattr(pipeline, "write_and_publish", finish)
    try:
        yield Held
    finally:
        Held.gate.set()  # never leave the worker thread blocked, whatever the test did


def interrupt_waits(monkeypatch, times: int) -> None:
    """The next ``times`` waits for a future are interrupted by Ctrl-C, as a SIGINT would interrupt them."""
    real_result = concurrent.futures.Future.result
    left = [times]

    def result(self, timeout=None):
        if left[0] > 0:
            left[0] -= 1
            raise KeyboardInterrupt
        return real_result(self, timeout)

    monkeypatch.setattr(concurrent.futures.Future, "result", result)


# --- item 4: Ctrl-C while waiting ------------------------------------------------------------------


def test_ctrl_c_in_wait_keeps_the_lock_and_the_error_until_the_save_is_done(tmp_path, monkeypatch, held_save):
    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    manager.save()
    held_save.started.wait()
    interrupt_waits(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        manager.wait_until_finished()
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C, in close(): the save still writes
        manager.close()
    with pytest.raises(jaxckpt.ManagerLockedError):  # so the directory stays locked
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    held_save.error = OSError(errno.EIO, "Input/output error")
    held_save.gate.set()
    with pytest.raises(OSError, match="Input/output"):  # the failure is reported, not dropped
        manager.close()
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as second:  # now released
        assert second.checkpoints == []


def test_ctrl_c_in_wait_then_the_save_finishes(tmp_path, monkeypatch, held_save):
    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    path = manager.save()
    held_save.started.wait()
    interrupt_waits(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        manager.wait_until_finished()
    held_save.gate.set()
    manager.close()
    assert jaxckpt.latest_checkpoint(tmp_path) == path


# --- item 14: looking does not consume a background error ------------------------------------------


def test_repr_and_properties_leave_a_background_error_for_the_next_wait(tmp_path, held_save):
    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    manager.save()
    held_save.error = OSError(errno.ENOSPC, "No space left on device")
    assert "saving" in repr(manager)  # never blocks, never raises
    held_save.gate.set()
    assert manager.checkpoints == []  # waits for the save, which failed: nothing new is listed
    assert manager.latest_checkpoint is None
    assert manager.checkpoint_infos == []
    assert "ckpt" not in repr(manager).split("latest=")[1].split(",")[0]
    with pytest.raises(OSError, match="No space left"):
        manager.wait_until_finished()
    manager.wait_until_finished()  # raised once, by the call that is meant to
    manager.close()


def test_a_background_error_is_raised_by_close_after_a_look(tmp_path, held_save):
    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    manager.save()
    held_save.error = OSError(errno.ENOSPC, "No space left on device")
    held_save.gate.set()
    repr(manager)
    assert manager.latest_checkpoint is None
    with pytest.raises(OSError, match="No space left"):
        manager.close()


def test_module_level_latest_checkpoint_after_wait_until_finished(tmp_path):
    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    manager.save()
    path = manager.save()
    manager.wait_until_finished()
    assert jaxckpt.latest_checkpoint(tmp_path) == path
    assert manager.latest_checkpoint == path
    manager.close()


# --- delete(step) (Orbax's rollback) under failures --------------------------------------------------


def test_delete_of_a_step_being_written_waits_for_it(tmp_path, held_save):
    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    manager.save(step=1)
    held_save.started.wait()  # step 1 is being written, not listed yet
    outcome: list[BaseException | None] = []

    def delete() -> None:
        try:
            manager.delete(1)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    deleting = threading.Thread(target=delete)
    deleting.start()
    held_save.gate.set()
    deleting.join(timeout=60)
    assert outcome == [None]  # not "no checkpoint of step 1": it waited for the write, then deleted
    assert manager.all_steps() == []
    manager.close()
    assert not [p.name for p in tmp_path.iterdir() if "ckpt" in p.name]


def test_delete_raises_a_failed_background_save_first(tmp_path, held_save):
    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    manager.save(step=1)
    held_save.error = OSError(errno.EIO, "Input/output error")
    held_save.gate.set()
    with pytest.raises(OSError, match="Input/output error"):
        manager.delete(1)
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"kept steps are \[\]"):
        manager.delete(1)
    manager.close()


def test_delete_that_cannot_write_the_state_file_leaves_the_step_listed_and_unmarked(tmp_path, monkeypatch):
    from jaxckpt.storage import statefile

    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path, async_save=False)
    manager.save(step=1)
    manager.save(step=2)

    def full(*args, **kwargs):
        raise jaxckpt.StorageError("No space left on device", errno.ENOSPC)

    monkeypatch.setattr(statefile, "write_state", full)
    with pytest.raises(jaxckpt.StorageError, match="No space"):
        manager.delete(1)
    monkeypatch.undo()
    assert manager.all_steps() == [1, 2]
    assert not (tmp_path / "ckpt-1" / ".jaxckpt-unrecorded").exists()  # still listed: not garbage
    manager.delete(1)
    manager.close()
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as manager:
        assert manager.all_steps() == [2]


# --- item 6: another checkpoint_name in the same directory -----------------------------------------


def test_a_manager_with_another_name_never_deletes_the_first_ones_checkpoints(tmp_path):
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=1) as first:
        first.save()
        kept = first.save()
    # As TensorFlow's managers: it finds the other name's (latest_checkpoint), numbers after them, and
    # never deletes them, whatever its retention; delete(step) refuses them too.
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, checkpoint_name="run", max_to_keep=1) as second:
        assert second.latest_checkpoint == kept
        with pytest.raises(
            jaxckpt.CheckpointNotFoundError, match=r"only \['ckpt-2'\], which this manager never deletes"
        ):
            second.delete(2)
        second.save()
        second.save()
        assert names(second.checkpoints) == ["ckpt-2", "run-4"]
    assert jaxckpt.latest_checkpoint(tmp_path) == str(tmp_path / "run-4")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-2"]
    make_ckpt().restore(kept).assert_consumed()
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=1) as again:  # the first name still works
        assert names(again.checkpoints) == ["ckpt-2", "run-4"]
        again.save()  # its own retention: ckpt-2 goes, run-4 stays
        assert names(again.checkpoints) == ["run-4", "ckpt-5"]


def test_leftovers_of_another_name_are_not_removed(tmp_path):
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, checkpoint_name="run") as manager:
        manager.save()
    other = tmp_path / ".ckpt-3.partial-0123456789ab"  # looks like another name's staging folder
    other.mkdir()
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, checkpoint_name="run") as manager:
        manager.save()
    assert other.is_dir()


# --- item 7: users' files that look like temp files ------------------------------------------------


def test_users_hidden_files_and_folders_are_left_alone(tmp_path):
    (tmp_path / ".events.tmp-1").mkdir()
    (tmp_path / ".notes.tmp-keep").write_text("mine")
    (tmp_path / ".checkpoint.tmp-keep").write_text("mine too: not a token jaxckpt makes")
    (tmp_path / ".checkpoint.tmp-0123456789ab").mkdir()  # a folder: jaxckpt only makes files there
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as manager:
        manager.save()
    leftover = tmp_path / ".checkpoint.tmp-00112233aabb"  # a state file write that crashed
    leftover.write_text("{")
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as manager:
        manager.save()
    assert (tmp_path / ".events.tmp-1").is_dir()
    assert (tmp_path / ".notes.tmp-keep").read_text() == "mine"
    assert (tmp_path / ".checkpoint.tmp-keep").read_text() == "mine too: not a token jaxckpt makes"
    assert (tmp_path / ".checkpoint.tmp-0123456789ab").is_dir()
    assert not leftover.exists()


# --- item 12: a directory this process cannot write ------------------------------------------------


@pytest.fixture
def unwritable(monkeypatch):
    """Make writes under the directories put in the returned set fail as on a read-only mount (tests run as
    root, where chmod does not stop writes)."""
    roots: set[Path] = set()

    def inside(path) -> bool:
        if isinstance(path, int):
            return False
        p = Path(os.fsdecode(path)).absolute()
        return any(p == r or r in p.parents for r in roots)

    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))

    real_open, real_os_open = builtins.open, os.open

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and inside(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def guard(real):
        def call(*args, **kwargs):
            for a in args[:2]:
                if inside(a):
                    refuse(a)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    for name in ("link", "rename", "replace", "unlink", "mkdir", "rmdir", "symlink"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))
    return roots


def test_a_read_only_directory_can_still_be_restored_from(tmp_path, unwritable):
    ckpt = make_ckpt(step=5, value=3.0)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step") as manager:
        path = manager.save()
    unwritable.add(tmp_path)
    with pytest.raises(jaxckpt.ManagerLockedError, match=r"read_only=True") as e:  # a training job: told why
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    assert str(tmp_path) in str(e.value) and "Permission denied" in str(e.value)
    assert jaxckpt.latest_checkpoint(tmp_path) == path
    restored = make_ckpt()
    with jaxckpt.CheckpointManager(restored, tmp_path, read_only=True) as manager:  # an evaluation job
        assert manager.restore_or_initialize() == path
        assert manager.checkpoints == [path]
        with pytest.raises(jaxckpt.ManagerLockedError, match="read_only"):
            manager.save()
    assert restored.step == 5
    np.testing.assert_array_equal(restored.w, np.full((2, 3), 3.0, np.float32))


def test_read_only_manager_of_a_missing_directory(tmp_path):
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path / "none", read_only=True) as manager:
        assert manager.restore_or_initialize() is None
        assert manager.checkpoints == []
    assert not (tmp_path / "none").exists()


# --- item 12: absurd times in the state file -------------------------------------------------------


@pytest.mark.parametrize("when", [1e20, -1.0, 253402300800.0])
def test_state_file_times_are_bounded(tmp_path, when):
    entry = {"prefix": "ckpt-1", "step": 1, "time": when, "metrics": {}}
    doc = {"format": "jaxckpt-manager-state", "version": 1, "latest": "ckpt-1", "checkpoints": [entry]}
    (tmp_path / "checkpoint").write_text(json.dumps(doc))
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"time of 'ckpt-1'.*year 9999"):
        jaxckpt.latest_checkpoint(tmp_path)


# --- item 11: the lock file is not a regular file --------------------------------------------------


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder"])
def test_a_lock_file_that_is_not_a_file_is_refused_clearly(tmp_path, kind):
    lock = tmp_path / "checkpoint.lock"
    if kind == "dev-zero":
        lock.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    with pytest.raises(jaxckpt.ManagerLockedError, match=r"checkpoint\.lock.*not a regular file"):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    assert lock.is_symlink() or lock.exists()  # left as it was


def test_a_huge_lock_file_is_not_read_whole(tmp_path, monkeypatch):
    lock = tmp_path / "checkpoint.lock"
    with open(lock, "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that takes no space
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as manager:  # nobody holds it: taken over
        manager.save()
    assert not lock.exists()
    assert one_tier.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")


# --- item 11: the state file is not a regular file (read by locations.read_file, bounded) -----------


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_state_file_that_is_not_a_file_is_refused_clearly(tmp_path, kind):
    import inspect

    from jaxckpt.storage import locations

    if "limit" not in inspect.signature(locations.read_file).parameters:
        pytest.skip("_storage.read_file does not bound its reads yet (issue 10, item 11)")
    state = tmp_path / "checkpoint"
    if kind == "dev-zero":
        state.symlink_to("/dev/zero")
    else:
        os.mkfifo(state)
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"checkpoint'.*not a regular file"):
        jaxckpt.latest_checkpoint(tmp_path)
    with pytest.raises(jaxckpt.CheckpointFormatError, match="not a regular file"):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    assert not (tmp_path / "checkpoint.lock").exists()


# --- round three, item 1: a checkpoint symlinked from another run ------------------------------------


def _tree_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes): what a run outside must find unchanged."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", ["listed", "written"])
def test_a_checkpoint_symlinked_from_another_run_is_never_marked_or_deleted(tmp_path, how):
    other, mine = tmp_path / "other", tmp_path / "mine"
    target = other / "ckpt-3"
    if how == "listed":  # the other run's manager lists it in its state file
        with jaxckpt.CheckpointManager(make_ckpt(3, 3.0), other, async_save=False) as theirs:
            theirs.save(checkpoint_number=3)
    else:  # Checkpoint.write: a checkpoint that a manager opened on the other run adopts
        other.mkdir()
        make_ckpt(3, 3.0).write(str(target))
    before = _tree_of(other)
    mine.mkdir()
    (mine / "ckpt-3").symlink_to(target, target_is_directory=True)
    with jaxckpt.CheckpointManager(make_ckpt(), mine, max_to_keep=1, async_save=False) as manager:
        manager.save()
        manager.save()  # retention drops ckpt-3: the link, never what it points to
    with jaxckpt.CheckpointManager(make_ckpt(), mine, max_to_keep=1, async_save=False) as manager:
        manager.save()  # a restart: adoption and the removal of leftovers see the directory again
    assert not (target / ".jaxckpt-unrecorded").exists()
    assert _tree_of(other) == before
    assert not os.path.lexists(mine / "ckpt-3")
    assert not [p for p in os.listdir(mine) if p.startswith(".ckpt-3")]  # no hidden leftover link either
    with jaxckpt.CheckpointManager(make_ckpt(), other, async_save=False) as theirs:
        assert names(theirs.checkpoints) == ["ckpt-3"]
        theirs.save(checkpoint_number=4)
        assert names(theirs.checkpoints) == ["ckpt-3", "ckpt-4"]
    restored = make_ckpt()
    restored.restore(str(target)).assert_consumed()
    assert restored.step == 3


def test_a_symlinked_checkpoint_whose_target_is_marked_is_not_deleted_through_the_link(tmp_path):
    other, mine = tmp_path / "other", tmp_path / "mine"
    other.mkdir()
    target = other / "ckpt-3"
    make_ckpt(3, 3.0).write(str(target))
    (target / ".jaxckpt-unrecorded").write_bytes(b"")  # the other run's save, not yet listed there
    before = _tree_of(other)
    mine.mkdir()
    (mine / "ckpt-3").symlink_to(target, target_is_directory=True)
    (mine / "ckpt-9").symlink_to(tmp_path / "gone", target_is_directory=True)  # dangling
    with jaxckpt.CheckpointManager(make_ckpt(), mine, max_to_keep=1, async_save=False) as manager:
        manager.save()
    assert _tree_of(other) == before
    # Unlisted and nothing proves them this manager's (a mark seen through a link is another run's): left alone.
    assert os.path.islink(mine / "ckpt-3") and os.path.islink(mine / "ckpt-9")


def test_a_mark_symlinked_out_of_a_dropped_checkpoint_is_never_written_through(tmp_path):
    outside = tmp_path / "notes.txt"
    outside.write_text("mine")
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path / "run", max_to_keep=1, async_save=False) as manager:
        first = Path(manager.save())
        (first / ".jaxckpt-unrecorded").symlink_to(outside)  # a crafted checkpoint's file
        manager.save()  # retention marks ckpt-1, then deletes it
    assert outside.read_text() == "mine"
    assert not first.exists()


def _nest(folder: Path, levels: int) -> None:
    for _ in range(levels):  # os.makedirs recurses once per level
        folder.mkdir()
        folder = folder / "d"


def test_a_checkpoint_holding_a_folder_1100_levels_deep_is_deleted_without_recursion_error(tmp_path):
    directory = tmp_path / "run"
    try:
        with jaxckpt.CheckpointManager(make_ckpt(), directory, max_to_keep=1, async_save=False) as manager:
            first = Path(manager.save())
            _nest(first / "data" / "x", 1100)
            manager.save()  # retention deletes ckpt-1: shutil.rmtree recursed once per level
        (directory / "ckpt-7").mkdir()  # a leftover without an index, marked as retention marks: removed at start
        (directory / "ckpt-7" / ".jaxckpt-unrecorded").write_bytes(b"")
        _nest(directory / "ckpt-7" / "x", 1100)
        with jaxckpt.CheckpointManager(make_ckpt(), directory, max_to_keep=1, async_save=False) as manager:
            assert names(manager.checkpoints) == ["ckpt-2"]
        assert sorted(n for n in os.listdir(directory) if "ckpt" in n) == ["ckpt-2"]
    finally:  # pytest's own clean-up of old temporary folders uses a recursive rmtree too
        subprocess.run(["rm", "-rf", str(directory)], check=False)
