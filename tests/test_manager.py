"""CheckpointManager, latest_checkpoint, retention policies, the state file, the lock, crash safety."""

import json
import os
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest

import jaxckpt
from jaxckpt.manager import retention as _retention
from jaxckpt.storage.statefile import CheckpointInfo


class FakeClock:
    """Unix seconds that move only when a test says so."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_ckpt(step: int = 0, value: float = 0.0) -> jaxckpt.Checkpoint:
    return jaxckpt.Checkpoint(step=step, w=np.full((2, 3), value, np.float32))


def names(paths: list[str]) -> list[str]:
    return [os.path.basename(p) for p in paths]


def folders(directory) -> list[str]:
    return sorted(e for e in os.listdir(directory) if e.startswith("ckpt-"))


def read_state(directory) -> dict:
    with open(os.path.join(directory, "checkpoint"), encoding="utf-8") as f:
        return json.load(f)


# --- numbering, retention, the state file ------------------------------------------------------


def test_numbering_and_max_to_keep(tmp_path):
    ckpt = make_ckpt()
    d = str(tmp_path / "ckpts")
    with jaxckpt.CheckpointManager(ckpt, d, max_to_keep=3) as manager:
        assert manager.latest_checkpoint is None
        paths = []
        for i in range(5):
            ckpt.w = np.full((2, 3), i, np.float32)
            paths.append(manager.save())
        assert paths == [os.path.join(d, f"ckpt-{i}") for i in range(1, 6)]
        assert names(manager.checkpoints) == ["ckpt-3", "ckpt-4", "ckpt-5"]
        assert manager.latest_checkpoint == paths[-1]
        assert folders(d) == ["ckpt-3", "ckpt-4", "ckpt-5"]
        assert ckpt.save_counter == 5
    restored = make_ckpt(value=-1.0)
    restored.restore(paths[2]).assert_consumed()
    np.testing.assert_array_equal(restored.w, np.full((2, 3), 2, np.float32))
    assert restored.save_counter == 3


def test_checkpoint_number_names_by_step(tmp_path):
    ckpt = make_ckpt()
    with jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2) as manager:
        assert manager.save(checkpoint_number=100) == os.path.join(str(tmp_path), "ckpt-100")
        assert manager.save(checkpoint_number=np.int64(200)).endswith("ckpt-200")
        assert ckpt.save_counter == 2  # every save advances the counter, as in TensorFlow
        with pytest.raises(jaxckpt.CheckpointExistsError, match="ckpt-200"):
            manager.save(checkpoint_number=200)
        assert names(manager.checkpoints) == ["ckpt-100", "ckpt-200"]
        assert [c.step for c in manager.checkpoint_infos] == [100, 200]
        assert ckpt.save_counter == 2


def test_state_file_content(tmp_path):
    clock = FakeClock()
    ckpt = make_ckpt(step=7)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2, step_counter="step", clock=clock) as manager:
        assert read_state(tmp_path) == {
            "format": "jaxckpt-manager-state",
            "version": 1,
            "latest": None,
            "last_preserved_time": 1_699_999_999.0,  # TF's: a second before the first manager started
            "checkpoints": [],
        }
        for loss in (0.5, 0.25, float("nan")):
            manager.save(metrics={"loss": loss, "acc": np.float32(0.75)})
            ckpt.step += 10
            clock.now += 60
    assert read_state(tmp_path) == {
        "format": "jaxckpt-manager-state",
        "version": 1,
        "latest": "ckpt-3",
        "last_preserved_time": 1_699_999_999.0,
        "checkpoints": [
            {"prefix": "ckpt-2", "step": 17, "time": 1_700_000_060.0, "metrics": {"loss": 0.25, "acc": 0.75}},
            {"prefix": "ckpt-3", "step": 27, "time": 1_700_000_120.0, "metrics": {"loss": None, "acc": 0.75}},
        ],
    }
    text = (tmp_path / "checkpoint").read_text()
    assert text.count("\n") == 10 and '"prefix": "ckpt-3"' in text.splitlines()[7]  # one checkpoint a line
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2", "ckpt-3"]  # no temp files, lock released


def test_latest_checkpoint_with_and_without_manager(tmp_path):
    d = tmp_path / "ckpts"
    assert jaxckpt.latest_checkpoint(d) is None  # no directory
    manager = jaxckpt.CheckpointManager(make_ckpt(), d)
    assert jaxckpt.latest_checkpoint(d) is None  # a state file with nothing in it
    manager.save()
    path = manager.save()
    assert manager.latest_checkpoint == path == jaxckpt.latest_checkpoint(d) == str(d / "ckpt-2")
    manager.close()
    assert jaxckpt.latest_checkpoint(str(d)) == path
    assert manager.checkpoints == [str(d / "ckpt-1"), path]  # still readable after close
    with pytest.raises(jaxckpt.ManagerLockedError, match="closed"):
        manager.save()


def test_restart_continues_numbering_and_retention(tmp_path):
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=2) as manager:
        for _ in range(4):
            manager.save()
    ckpt = make_ckpt()
    with jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2) as manager:
        assert names(manager.checkpoints) == ["ckpt-3", "ckpt-4"]
        assert manager.restore_or_initialize() == str(tmp_path / "ckpt-4")
        assert ckpt.save_counter == 4
        assert manager.save() == str(tmp_path / "ckpt-5")
        assert names(manager.checkpoints) == ["ckpt-4", "ckpt-5"]
    assert folders(tmp_path) == ["ckpt-4", "ckpt-5"]
    # A job that does not restore still continues after the listed numbers, never over them.
    fresh = make_ckpt()
    with jaxckpt.CheckpointManager(fresh, tmp_path, max_to_keep=2) as manager:
        assert manager.save() == str(tmp_path / "ckpt-6")
        assert fresh.save_counter == 6


def test_restart_in_a_new_process(tmp_path):
    with jaxckpt.CheckpointManager(make_ckpt(step=3), tmp_path, max_to_keep=2, step_counter="step") as manager:
        manager.save()
        manager.save()
    script = (
        "import sys, numpy as np, jaxckpt\n"
        "ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros((2, 3), np.float32))\n"
        "m = jaxckpt.CheckpointManager(ckpt, sys.argv[1], max_to_keep=2, step_counter='step')\n"
        "print(m.restore_or_initialize(), ckpt.step)\n"
        "ckpt.step += 1\n"
        "print(m.save())\n"  # no close(): the lock must go at interpreter exit
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ["XLA_FLAGS"]}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # import this checkout's jaxckpt
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(tmp_path / "ckpt-2"), "3", str(tmp_path / "ckpt-3")]
    assert not (tmp_path / "checkpoint.lock").exists()
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=2) as manager:
        assert names(manager.checkpoints) == ["ckpt-2", "ckpt-3"]
        assert [c.step for c in manager.checkpoint_infos] == [3, 4]
    assert folders(tmp_path) == ["ckpt-2", "ckpt-3"]


# --- step counter, interval, force -------------------------------------------------------------


def test_step_counter_interval_and_force(tmp_path):
    ckpt = make_ckpt(step=0)
    manager = jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step", checkpoint_interval=10)
    assert manager.save() is not None  # the first save always happens
    ckpt.step = 9
    assert manager.save() is None
    assert ckpt.save_counter == 1  # a skipped save numbers nothing
    ckpt.step = 10
    assert manager.save() == str(tmp_path / "ckpt-2")
    ckpt.step = 12
    assert manager.save() is None
    assert manager.save(force=True) == str(tmp_path / "ckpt-3")
    assert [c.step for c in manager.checkpoint_infos] == [0, 10, 12]
    manager.close()
    # As in TF, after a restart the interval counts from the step restore_or_initialize restored.
    ckpt = make_ckpt(step=0)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step", checkpoint_interval=10) as manager:
        manager.restore_or_initialize()
        assert ckpt.step == 12
        ckpt.step = 21
        assert manager.save() is None
        ckpt.step = 22
        assert manager.save() == str(tmp_path / "ckpt-4")


def test_callable_step_counter(tmp_path):
    state = {"step": np.int32(5)}
    with jaxckpt.CheckpointManager(
        make_ckpt(), tmp_path, step_counter=lambda: state["step"], checkpoint_interval=5
    ) as manager:
        manager.save()
        state["step"] = np.int32(7)
        assert manager.save() is None
        state["step"] = np.int32(10)
        manager.save()
        assert [c.step for c in manager.checkpoint_infos] == [5, 10]
        state["step"] = 12.5
        with pytest.raises(TypeError, match="not an integer step"):
            manager.save(force=True)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="step_counter"):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path, checkpoint_interval=10)
    with pytest.raises(ValueError, match="positive"):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="checkpoint_name"):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path, checkpoint_name="../x")
    with pytest.raises(TypeError, match="retention policy"):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path, policies=[3])
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as manager:
        with pytest.raises(jaxckpt.UnsupportedValueError, match="'loss'"):
            manager.save(metrics={"loss": "low"})
        assert manager.checkpoints == [] and folders(tmp_path) == []


# --- policies ------------------------------------------------------------------------------------


def infos(*specs: tuple[int, float, dict]) -> list[CheckpointInfo]:
    return [CheckpointInfo(f"d/ckpt-{i}", step, t, m) for i, (step, t, m) in enumerate(specs)]


def kept(policy, checkpoints) -> list[str]:
    paths = {c.path for c in policy.keep(tuple(checkpoints))}
    return [c.path.split("-")[-1] for c in checkpoints if c.path in paths]


def test_keep_latest():
    cs = infos(*[(i, i, {}) for i in range(5)])
    assert kept(jaxckpt.KeepLatest(2), cs) == ["3", "4"]
    assert kept(jaxckpt.KeepLatest(9), cs) == ["0", "1", "2", "3", "4"]
    with pytest.raises(ValueError):
        jaxckpt.KeepLatest(0)


def test_keep_every_steps():
    # Saved every 300 steps: one per 1000-step window, the lowest step in each.
    cs = infos(*[(s, 0.0, {}) for s in range(0, 3001, 300)])
    assert [c.step for c in jaxckpt.KeepEvery(steps=1000).keep(cs)] == [0, 1200, 2100, 3000]
    # The choice does not change when the others are gone.
    survivors = list(jaxckpt.KeepEvery(steps=1000).keep(cs))
    assert list(jaxckpt.KeepEvery(steps=1000).keep(survivors)) == survivors


def test_keep_every_hours():
    hour = 3600.0
    cs = infos(*[(i, 100 * hour + i * 0.75 * hour, {}) for i in range(8)])  # every 45 minutes
    assert [c.step for c in jaxckpt.KeepEvery(hours=2).keep(cs)] == [0, 3, 6]
    with pytest.raises(ValueError, match="exactly one"):
        jaxckpt.KeepEvery()
    with pytest.raises(ValueError, match="exactly one"):
        jaxckpt.KeepEvery(steps=1, hours=1)


def test_keep_best():
    cs = infos((0, 0, {"loss": 0.5}), (1, 0, {}), (2, 0, {"loss": 0.1}), (3, 0, {"loss": None}), (4, 0, {"loss": 0.3}))
    assert kept(jaxckpt.KeepBest(2, metric="loss"), cs) == ["2", "4"]
    assert kept(jaxckpt.KeepBest(2, "loss", mode="max"), cs) == ["0", "4"]
    assert kept(jaxckpt.KeepBest(2, metric="acc"), cs) == []
    with pytest.raises(ValueError, match="mode"):
        jaxckpt.KeepBest(1, "loss", mode="lowest")


def test_combined_policies():
    cs = infos(*[(i, 0.0, {"loss": 1.0 / (1 + (i % 3))}) for i in range(7)])  # best loss at i = 2, 5
    either = jaxckpt.KeepLatest(1) | jaxckpt.KeepBest(1, "loss") | jaxckpt.KeepEvery(steps=5)
    assert isinstance(either, jaxckpt.KeepAny) and len(either.policies) == 3
    assert isinstance(either, jaxckpt.RetentionPolicy)
    assert kept(either, cs) == ["0", "2", "5", "6"]


def test_manager_policies_with_a_clock(tmp_path):
    clock = FakeClock(start=10 * 3600.0)
    ckpt = make_ckpt()
    manager = jaxckpt.CheckpointManager(
        ckpt, tmp_path, max_to_keep=2, policies=[jaxckpt.KeepEvery(hours=1)], clock=clock
    )  # keep_checkpoint_every_n_hours is TF's rule: see test_tf_semantics
    for _ in range(7):  # every 25 minutes: 0, 25, 50 | 75, 100 | 125, 150
        manager.save()
        clock.now += 25 * 60
    # One an hour (ckpt-1 opens hour 10, ckpt-4 hour 11, ckpt-6 hour 12), and the latest two.
    assert names(manager.checkpoints) == ["ckpt-1", "ckpt-4", "ckpt-6", "ckpt-7"]
    assert folders(tmp_path) == ["ckpt-1", "ckpt-4", "ckpt-6", "ckpt-7"]
    manager.close()


def test_manager_keep_best_always_keeps_latest(tmp_path):
    ckpt = make_ckpt()
    with jaxckpt.CheckpointManager(ckpt, tmp_path, policies=[jaxckpt.KeepBest(2, "loss")]) as manager:
        for loss in (0.9, 0.2, 0.5, 0.1, 0.8):
            manager.save(metrics={"loss": loss})
        assert names(manager.checkpoints) == ["ckpt-2", "ckpt-4", "ckpt-5"]
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as manager:  # no retention: keeps all
        for _ in range(3):
            manager.save()
        assert names(manager.checkpoints) == ["ckpt-2", "ckpt-4", "ckpt-5", "ckpt-6", "ckpt-7", "ckpt-8"]


# --- crash safety and leftovers ------------------------------------------------------------------


def test_leftovers_cleaned_at_start(tmp_path):
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=2) as manager:
        for _ in range(3):
            manager.save()
    (tmp_path / ".ckpt-4.partial-0123456789ab" / "data").mkdir(parents=True)  # an unfinished save
    (tmp_path / "ckpt-1").mkdir()  # an interrupted deletion: marked before the state file dropped it
    (tmp_path / "ckpt-1" / "index.json").write_text("{}")
    (tmp_path / "ckpt-1" / ".jaxckpt-unrecorded").write_text("")
    (tmp_path / ".checkpoint.tmp-0123456789ab").write_text("{")  # an unfinished state update
    (tmp_path / "notes.txt").write_text("mine")  # not the manager's: left alone
    (tmp_path / "other-1").mkdir()
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=2) as manager:
        assert names(manager.checkpoints) == ["ckpt-2", "ckpt-3"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2", "ckpt-3", "notes.txt", "other-1"]
    for path in manager.checkpoints:
        make_ckpt().restore(path).assert_consumed()


def test_leftover_temp_files_of_the_run_metadata_and_tiers_file_are_cleaned_at_start(tmp_path):
    """checkpoint.metadata and checkpoint.tiers are replaced as the state file is (a temp file, then
    a rename): what a crash in between leaves goes at the next start, as the state file's does."""
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, metadata={"a": 1}) as manager:
        manager.save()
    (tmp_path / ".checkpoint.metadata.tmp-0123456789ab").write_text("{")
    (tmp_path / ".checkpoint.tiers.tmp-0123456789ab").write_text("{")
    (tmp_path / ".checkpoint.metadata.tmp-mine").write_text("not a token jaxckpt makes: left alone")
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as manager:
        assert manager.metadata() == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == [
        ".checkpoint.metadata.tmp-mine",
        "checkpoint",
        "checkpoint.metadata",
        "ckpt-1",
    ]


class Crash(BaseException):
    """Stands for the process dying: nothing catches it."""


def test_crash_between_state_update_and_deletion(tmp_path, monkeypatch):
    manager = jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=2, async_save=False)
    manager.save()
    manager.save()

    def crash(path, keep_name=False):
        raise Crash(path)

    monkeypatch.setattr(_retention, "_hide", crash)  # deletion's first step, on the save's path
    with pytest.raises(Crash):
        manager.save()
    monkeypatch.undo()
    assert names(manager.checkpoints) == ["ckpt-2", "ckpt-3"]
    assert jaxckpt.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-3")
    assert folders(tmp_path) == ["ckpt-1", "ckpt-2", "ckpt-3"]  # ckpt-1 delisted but not yet deleted
    for path in manager.checkpoints:
        make_ckpt().restore(path).assert_consumed()
    manager.close()
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=2) as manager:
        assert names(manager.checkpoints) == ["ckpt-2", "ckpt-3"]
    assert folders(tmp_path) == ["ckpt-2", "ckpt-3"]


def test_failed_deletion_warns_and_keeps_going(tmp_path, monkeypatch):
    """A deletion that fails in the background: the next saves warn and go on, wait_until_finished
    raises, and the next manager removes what is left."""

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(_retention, "_erase", refuse)
    said = []
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=1, async_save=False) as manager:
        manager.save()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # ckpt-1's deletion is done before save 4 starts (one batch at a time): save 4 warns at the latest
            assert [manager.save() for _ in range(3)] == [str(tmp_path / f"ckpt-{n}") for n in (2, 3, 4)]
        said += [str(w.message) for w in caught]
        assert any("ckpt-1" in m for m in said)
        with pytest.raises(jaxckpt.StorageError, match="Permission denied") as raised:
            manager.wait_until_finished()  # what no save warned of yet
        said.append(str(raised.value))
        assert names(manager.checkpoints) == ["ckpt-4"]
    assert all(f"ckpt-{n}'" in " ".join(said) for n in (1, 2, 3)), said
    assert "no longer listed" in said[-1]
    monkeypatch.undo()
    assert folders(tmp_path) == ["ckpt-4"]  # the others renamed out of the way, not deleted
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path, max_to_keep=1) as manager:
        assert names(manager.checkpoints) == ["ckpt-4"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-4"]


def test_failed_save_changes_nothing(tmp_path):
    ckpt = make_ckpt()
    manager = jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2, async_save=False)
    manager.save()
    manager.save()
    before = (tmp_path / "checkpoint").read_bytes()
    ckpt.bad = object()  # fails while writing
    with pytest.raises(jaxckpt.UnsupportedValueError):
        manager.save()
    assert (tmp_path / "checkpoint").read_bytes() == before
    assert names(manager.checkpoints) == ["ckpt-1", "ckpt-2"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "checkpoint.lock", "ckpt-1", "ckpt-2"]
    assert ckpt.save_counter == 2
    del ckpt.bad
    assert manager.save() == str(tmp_path / "ckpt-3")
    manager.close()


def test_checkpoints_saved_without_a_manager_are_adopted(tmp_path):
    ckpt = make_ckpt()
    ckpt.save(tmp_path / "ckpt")  # Checkpoint.save lists it in the directory's state file, as TF's does
    with jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=1) as manager:
        assert names(manager.checkpoints) == ["ckpt-1"]
        assert manager.save() == str(tmp_path / "ckpt-2")
    assert folders(tmp_path) == ["ckpt-2"]  # adopted: retention applies to it like any other
    assert not (tmp_path / "checkpoint.lock").exists()
    with jaxckpt.CheckpointManager(ckpt, tmp_path, checkpoint_name="run", max_to_keep=1) as manager:
        assert manager.save() == str(tmp_path / "run-3")  # numbered after another name's: never deleted
    assert folders(tmp_path) == ["ckpt-2"] and (tmp_path / "run-3").is_dir()


# --- the lock ------------------------------------------------------------------------------------


def test_second_manager_is_refused(tmp_path):
    first = jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    with pytest.raises(jaxckpt.ManagerLockedError, match=rf"process {os.getpid()}.*checkpoint\.lock"):
        jaxckpt.CheckpointManager(make_ckpt(), str(tmp_path) + "/./")
    first.save()  # the refused one did not break the first
    first.close()
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as second:
        assert second.save() == str(tmp_path / "ckpt-2")
    assert not (tmp_path / "checkpoint.lock").exists()


def write_lock(directory, pid: int, hostname: str) -> None:
    (directory / "checkpoint.lock").write_text(json.dumps({"pid": pid, "hostname": hostname, "token": "old"}))


@pytest.mark.parametrize(
    "who",
    ["dead", "alive", "me", "remote"],  # a description is only a description: the kernel lock decides
)
def test_a_lock_file_nobody_holds_is_taken_over(tmp_path, who):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = {"dead": int(dead.stdout), "alive": os.getppid(), "me": os.getpid(), "remote": 1}[who]
    write_lock(tmp_path, pid, "another-host" if who == "remote" else socket.gethostname())
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path) as manager:
        assert json.loads((tmp_path / "checkpoint.lock").read_text())["pid"] == os.getpid()
        manager.save()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1"]


# --- bad state files -----------------------------------------------------------------------------


GOOD = {"format": "jaxckpt-manager-state", "version": 1, "latest": "ckpt-1"}
ENTRY = {"prefix": "ckpt-1", "step": 1, "time": 1.0, "metrics": {}}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("not json", "not JSON"),
        ("model_checkpoint_path: 'ckpt-1'\n", "TensorFlow"),
        (json.dumps({**GOOD, "format": "other", "checkpoints": [ENTRY]}), "format"),
        (json.dumps({**GOOD, "version": "1", "checkpoints": [ENTRY]}), "version"),
        (json.dumps({**GOOD, "checkpoints": {}}), "list"),
        (json.dumps({**GOOD, "latest": "../x", "checkpoints": [{**ENTRY, "prefix": "../x"}]}), "prefix '../x'"),
        (json.dumps({**GOOD, "checkpoints": [{**ENTRY, "step": "1"}]}), "step"),
        (json.dumps({**GOOD, "checkpoints": [{**ENTRY, "metrics": {"loss": "low"}}]}), "metrics"),
        (json.dumps({**GOOD, "latest": "ckpt-2", "checkpoints": [ENTRY]}), "latest"),
        (json.dumps({**GOOD, "checkpoints": [ENTRY, ENTRY]}), "twice"),
    ],
)
def test_malformed_state_file(tmp_path, text, why):
    (tmp_path / "checkpoint").write_text(text)
    where = str(tmp_path / "checkpoint")
    with pytest.raises(jaxckpt.CheckpointFormatError, match=why) as e:
        jaxckpt.latest_checkpoint(tmp_path)
    assert where in str(e.value) and not isinstance(e.value, jaxckpt.UnsupportedVersionError)
    with pytest.raises(jaxckpt.CheckpointFormatError, match=why):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path)
    assert not (tmp_path / "checkpoint.lock").exists()  # a refused manager releases its lock
    assert (tmp_path / "checkpoint").read_text() == text


def test_newer_state_file_version(tmp_path):
    (tmp_path / "checkpoint").write_text(json.dumps({**GOOD, "version": 2, "checkpoints": [ENTRY]}))
    with pytest.raises(jaxckpt.UnsupportedVersionError, match="version 2"):
        jaxckpt.latest_checkpoint(tmp_path)
    with pytest.raises(jaxckpt.UnsupportedVersionError, match="newer jaxckpt"):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path)


def test_unknown_fields_are_ignored(tmp_path):
    extra = {**GOOD, "note": "from a later minor", "checkpoints": [{**ENTRY, "host": "a"}]}
    (tmp_path / "checkpoint").write_text(json.dumps(extra))
    assert jaxckpt.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")


# --- restore_or_initialize -----------------------------------------------------------------------


def test_restore_or_initialize(tmp_path):
    calls = []
    ckpt = make_ckpt(step=0)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, init_fn=lambda: calls.append("init")) as manager:
        assert manager.restore_or_initialize() is None
        assert calls == ["init"]
        ckpt.step = 42
        ckpt.w = np.ones((2, 3), np.float32)
        manager.save()
    ckpt = make_ckpt(step=0)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, init_fn=lambda: calls.append("init")) as manager:
        assert manager.restore_or_initialize() == str(tmp_path / "ckpt-1")
    assert calls == ["init"]
    assert ckpt.step == 42
    np.testing.assert_array_equal(ckpt.w, np.ones((2, 3), np.float32))
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path / "empty") as manager:
        assert manager.restore_or_initialize() is None  # no init_fn: nothing happens


def test_public_names():
    for name in (
        "CheckpointManager",
        "latest_checkpoint",
        "ManagerLockedError",
        "CheckpointInfo",
        "RetentionPolicy",
        "KeepAny",
        "KeepBest",
        "KeepEvery",
        "KeepLatest",
    ):
        assert name in jaxckpt.__all__
    assert issubclass(jaxckpt.ManagerLockedError, jaxckpt.JaxckptError)


# --- an evaluator follows a live trainer (Orbax's reload) -----------------------------------------


def test_a_read_only_manager_follows_a_trainer_in_the_same_directory(tmp_path):
    trainer_ckpt = make_ckpt()
    evaluated = make_ckpt()
    with (
        jaxckpt.CheckpointManager(trainer_ckpt, tmp_path, max_to_keep=3, async_save=False) as trainer,
        jaxckpt.CheckpointManager(evaluated, tmp_path, read_only=True) as evaluator,
    ):
        assert evaluator.all_steps() == [] and evaluator.latest_step() is None
        for step in (1, 2, 3):
            trainer_ckpt.w = np.full((2, 3), step, np.float32)
            trainer.save(step=step)
        assert evaluator.all_steps() == []  # what it read when it opened, until reload()
        evaluator.reload()
        assert evaluator.all_steps() == [1, 2, 3] and evaluator.latest_step() == 3
        assert evaluator.latest_checkpoint == str(tmp_path / "ckpt-3")
        for step in (4, 5):
            trainer_ckpt.w = np.full((2, 3), step, np.float32)
            trainer.save(step=step)
        # A step that appeared since: restore re-reads the state file, no reload() needed.
        evaluator.restore(5).assert_consumed()
        assert evaluated.w.tolist() == [[5.0] * 3] * 2
        assert evaluator.all_steps() == [3, 4, 5]  # and the manager now knows it
        with pytest.raises(
            jaxckpt.CheckpointNotFoundError, match=r"no checkpoint of step 1; its kept steps are \[3, 4, 5\]"
        ):
            evaluator.restore(1)  # deleted by the trainer's retention: still refused, naming the kept ones
        trainer.reload()  # a manager that writes reloads too: it lists what it has
        assert trainer.all_steps() == [3, 4, 5]


TRAINER = """
import sys
import numpy as np
import jaxckpt

ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros((2, 3), np.float32))
with jaxckpt.CheckpointManager(ckpt, sys.argv[1], max_to_keep=2, metadata={"lr": 0.5}) as manager:
    for step in range(1, 4):
        ckpt.step, ckpt.w = step, np.full((2, 3), step, np.float32)
        manager.save(step=step)
        manager.wait_until_finished()
        print("saved", step, flush=True)
        sys.stdin.readline()  # the evaluator has looked: train on
"""


def test_an_evaluator_process_follows_a_trainer_process(tmp_path):
    """The evaluation job of docs/training-loops.md: a read-only manager, opened before the trainer's first save,
    restores each step the trainer saves as it appears (the trainer waits for it by a pipe)."""
    evaluated = make_ckpt()
    evaluator = jaxckpt.CheckpointManager(evaluated, tmp_path, read_only=True)
    assert evaluator.all_steps() == [] and evaluator.metadata() == {}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # import this checkout's jaxckpt
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for step in range(1, 4):
            line = trainer.stdout.readline()
            assert line.split() == ["saved", str(step)], (
                f"{line!r}\n{trainer.stderr.read()[-3000:] if not line else ''}"
            )
            evaluator.restore(step).assert_consumed()  # appeared since the evaluator opened
            assert evaluated.step == step and evaluated.w.tolist() == [[float(step)] * 3] * 2
            evaluator.reload()
            assert evaluator.latest_step() == step and evaluator.all_steps() == list(range(max(1, step - 1), step + 1))
            assert evaluator.metadata() == {"lr": 0.5}  # recorded after the evaluator opened
            trainer.stdin.write("next\n")
            trainer.stdin.flush()
        _, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
    assert trainer.returncode == 0, err[-3000:]
    evaluator.close()
