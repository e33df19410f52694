"""Retention deletes in the background (jaxckpt.manager.retention.Deleter), on local disk and on s3:// (moto).

A save returns before the checkpoints it dropped are deleted; while one is half deleted, nothing
takes it for a checkpoint; a process killed in the middle of deleting leaves only garbage, which
the next manager removes, and that manager lists exactly the kept checkpoints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import jaxckpt
from jaxckpt.manager import retention
from jaxckpt.storage import locations, statefile

# Three leaves over the packing limit (each its own array: several objects per checkpoint), one packed.
ROWS = 300_000


def _ckpt(step: int = 0) -> jaxckpt.Checkpoint:
    return jaxckpt.Checkpoint(
        step=step, **{f"w{i}": np.full(ROWS, step * 10 + i, np.float32) for i in range(3)}, b=np.arange(10) + step
    )


def _check_whole(path: str, step: int) -> None:
    tree = jaxckpt.restore(path)
    assert tree["step"] == step
    for i in range(3):
        np.testing.assert_array_equal(tree[f"w{i}"], np.full(ROWS, step * 10 + i, np.float32))


def _names(directory: str) -> list[str]:
    """What the manager's directory holds (the lock file aside), local or in the bucket."""
    return sorted(n for n in locations.children(locations.location(directory)) if n != "checkpoint.lock")


@pytest.fixture(params=["local", "s3"])
def directory(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpts")
    return request.getfixturevalue("s3") + "/ckpts"


def test_deletes_run_after_the_save_and_a_half_deleted_checkpoint_is_none(directory, monkeypatch):
    halfway, release = threading.Event(), threading.Event()
    real_rest, real_renamed = retention._delete_rest, retention._delete_renamed

    def held(real):
        def delete(target):  # the index is gone (bucket) or the folder renamed away (local): half, then wait
            if locations.location(target).local is not None:
                files = sorted(p for p in target.rglob("*") if p.is_file())
                for f in files[: len(files) // 2]:
                    f.unlink()
            else:
                from jaxckpt.storage import kvstore

                keys = kvstore.kv_keys(target.spec())
                for key in keys[: len(keys) // 2]:
                    kvstore.kv_delete(target.spec(), key)
            halfway.set()
            assert release.wait(120), "the test never released the deletion"
            real(target)

        return delete

    monkeypatch.setattr(retention, "_delete_rest", held(real_rest))
    monkeypatch.setattr(retention, "_delete_renamed", held(real_renamed))
    ckpt = _ckpt()
    manager = jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=2, step_counter="step", async_save=False)
    try:
        for step in (1, 2, 3):
            ckpt.step = step
            for i in range(3):
                setattr(ckpt, f"w{i}", np.full(ROWS, step * 10 + i, np.float32))
            ckpt.b = np.arange(10) + step
            manager.save()  # a synchronous save: it returns while ckpt-1 is still being deleted
        assert halfway.wait(120)
        kept = [f"{directory}/ckpt-{n}" for n in (2, 3)]
        assert manager.checkpoints == kept
        assert manager.latest_checkpoint == kept[-1] == jaxckpt.latest_checkpoint(directory)
        assert statefile.read_state(directory) == manager.checkpoint_infos
        for step, path in zip((2, 3), kept):
            _check_whole(path, step)
        with pytest.raises(jaxckpt.CheckpointNotFoundError):  # half deleted: no index, no checkpoint
            jaxckpt.restore(f"{directory}/ckpt-1")
        if not directory.startswith("s3://"):
            assert "ckpt-1" not in _names(directory)  # renamed away when the save returned
        assert not locations.is_checkpoint(locations.location(directory) / "ckpt-1")
        release.set()
        manager.wait_until_finished()
        assert _names(directory) == ["checkpoint", "ckpt-2", "ckpt-3"]
    finally:
        release.set()
        manager.close()


WORKER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import jaxckpt
    from jaxckpt.manager import retention
    from jaxckpt.storage import kvstore, statefile

    directory, hook = sys.argv[1], sys.argv[2]
    ROWS = int(sys.argv[3])

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    def half_then_die_bucket(path):  # the deletion of a prefix, one request per object, its mark last
        spec = path.spec()
        keys = sorted(k for k in kvstore.kv_keys(spec) if k != statefile.UNRECORDED)
        for key in keys[: len(keys) // 2]:
            kvstore.kv_delete(spec, key)
        die()

    def half_then_die_local(hidden):  # renamed away already
        files = sorted(p for p in hidden.rglob("*") if p.is_file())
        for f in files[: len(files) // 2]:
            f.unlink()
        die()

    if hook == "before-deleting":  # the state file dropped ckpt-1; nothing of it is deleted yet
        retention._erase = die
    else:
        retention._delete_rest, retention._delete_renamed = half_then_die_bucket, half_then_die_local
    ckpt = jaxckpt.Checkpoint(step=0, **{f"w{i}": np.zeros(ROWS, np.float32) for i in range(3)}, b=np.arange(10))
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=2, step_counter="step") as manager:
        for step in (1, 2, 3):
            ckpt.step = step
            for i in range(3):
                setattr(ckpt, f"w{i}", np.full(ROWS, step * 10 + i, np.float32))
            ckpt.b = np.arange(10) + step
            manager.save()
    print("not killed")
    """
)


@pytest.mark.parametrize("hook", ["before-deleting", "mid-deletion"])
def test_a_kill_while_deleting_leaves_only_the_kept_checkpoints(directory, hook, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # The jaxckpt under test, wherever the script is (sys.path[0] is the script's folder).
    root = os.path.dirname(os.path.dirname(jaxckpt.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(script), directory, hook, str(ROWS)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-3000:]
    kept = [f"{directory}/ckpt-{n}" for n in (2, 3)]
    # Killed in the middle of deleting ckpt-1: the state file lists the kept ones, each whole, and
    # what is left of ckpt-1 is no checkpoint (renamed away, or without its index), or is marked.
    assert [c.path for c in statefile.read_state(directory)] == kept
    assert jaxckpt.latest_checkpoint(directory) == kept[-1]
    for step, path in zip((2, 3), kept):
        _check_whole(path, step)
    left = locations.location(directory) / "ckpt-1"
    assert not locations.is_checkpoint(left) or statefile.is_marked(left)
    # The next manager lists exactly the kept ones, removes the rest, and goes on.
    ckpt = _ckpt()
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=2, step_counter="step") as manager:
        assert manager.checkpoints == kept
        assert _names(directory) == ["checkpoint", "ckpt-2", "ckpt-3"]
        assert manager.restore_or_initialize() == kept[-1]
        assert ckpt.step == 3
        ckpt.step = 4
        manager.save()
    assert _names(directory) == ["checkpoint", "ckpt-3", "ckpt-4"]


def test_a_number_saved_again_while_its_old_checkpoint_is_deleted_waits_for_the_deletion(directory, monkeypatch):
    release = threading.Event()
    real_erase, real_wait = retention._erase, retention.Deleter.wait

    def held_erase(target):
        assert release.wait(120), "the save never waited for the deletion"
        real_erase(target)

    def wait(self):
        release.set()  # the save waits for the deletion of the name it reuses: let it finish
        real_wait(self)

    monkeypatch.setattr(retention, "_erase", held_erase)
    monkeypatch.setattr(retention.Deleter, "wait", wait)
    ckpt = _ckpt()
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=1, step_counter="step", async_save=False) as manager:
        for step in (1, 2):
            ckpt.step = step
            manager.save()  # ckpt-1 dropped: its deletion is held
        assert not release.is_set()
        ckpt.step = 7
        assert manager.save(checkpoint_number=1) == f"{directory}/ckpt-1"
        assert release.is_set()
        assert jaxckpt.restore(f"{directory}/ckpt-1")["step"] == 7
    assert _names(directory) == ["checkpoint", "ckpt-1"]
