"""Two tiers (jaxckpt.manager.tiers): frequent local checkpoints, durable copies in another folder or a
bucket (s3:// on moto, gs:// on a GCS emulator, both on loopback), restore from the newest; training
continues bit for bit after each kind of restart."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.manager import durable_copy
from jaxckpt.tools.cli import main

STEPS = 16


def _manager(ckpt, durable, local, **kw):
    options = dict(max_to_keep=2, save_interval_steps=2, durable_interval_steps=4, step_counter="step")
    return jaxckpt.CheckpointManager(ckpt, durable, local_directory=local, **{**options, **kw})


def _durable_steps(manager):
    """The steps that the durable tier keeps (all_steps() lists either tier's)."""
    return [c.step for c in manager.checkpoint_infos]


def _fresh():
    return jaxckpt.Checkpoint(step=0, w=jnp.zeros(8, jnp.float32), rng=np.uint32(7))


def _train(ckpt, manager, until):
    """A deterministic 'training' loop: each step depends on the last, so a wrong restore shows."""
    while ckpt.step < until:
        ckpt.step += 1
        ckpt.w = ckpt.w * 0.5 + jnp.arange(8, dtype=jnp.float32) * ckpt.step + float(ckpt.rng)
        ckpt.rng = np.uint32((int(ckpt.rng) * 1103515245 + 12345) % 2**31)
        manager.save(step=ckpt.step)


def _reference(tmp_path):
    ckpt = _fresh()
    with _manager(ckpt, tmp_path / "ref-durable", tmp_path / "ref-local") as m:
        _train(ckpt, m, STEPS)
    return np.asarray(ckpt.w), int(ckpt.rng)


def test_saves_and_retention_in_both_tiers(tmp_path, capsys):
    ckpt = _fresh()
    with _manager(ckpt, tmp_path / "durable", tmp_path / "local") as m:
        # A copy still running when the next is due is superseded: wait for each, so that all are made.
        for until in (4, 8, 12):
            _train(ckpt, m, until)
            m.wait_until_finished()
        assert [c.step for c in m.local_checkpoint_infos] == [10, 12]  # the local default: the latest 2
        assert _durable_steps(m) == [8, 12]  # durable: every 4th step, max_to_keep=2
        assert m.copied == [str(tmp_path / "durable" / f"ckpt-{s}") for s in (4, 8, 12)]
        assert m.latest_checkpoint == str(tmp_path / "local" / "ckpt-12")
    assert sorted(p.name for p in (tmp_path / "local").iterdir() if p.name.startswith("ckpt")) == ["ckpt-10", "ckpt-12"]
    assert sorted(p.name for p in (tmp_path / "durable").iterdir() if p.name.startswith("ckpt")) == [
        "ckpt-12",
        "ckpt-8",
    ]
    # jaxckpt ls on either directory shows both tiers and where each lives
    for directory in ("local", "durable"):
        assert main(["ls", str(tmp_path / directory)]) == 0
        out = capsys.readouterr().out
        assert "local" in out and "durable" in out
        assert "ckpt-10" in out and "ckpt-8" in out
    assert main(["verify", str(tmp_path / "durable")]) == 0


@pytest.mark.parametrize("restart", ["local intact", "local removed", "local damaged"])
def test_training_continues_bit_for_bit_after_a_restart(tmp_path, restart):
    want_w, want_rng = _reference(tmp_path)
    durable, local = tmp_path / "durable", tmp_path / "local"
    ckpt = _fresh()
    with _manager(ckpt, durable, local) as m:
        _train(ckpt, m, 10)  # local: 8, 10; durable: 4, 8
    if restart == "local removed":  # a new machine
        shutil.rmtree(local)
    elif restart == "local damaged":
        data = max(
            (p for p in (local / "ckpt-10" / "data").rglob("*") if p.is_file() and p.name != "zarr.json"),
            key=lambda p: p.stat().st_size,
        )
        raw = bytearray(data.read_bytes())
        raw[0] ^= 0xFF  # the first value's first byte (a shard's file starts with data)
        data.write_bytes(bytes(raw))
    ckpt = _fresh()
    with _manager(ckpt, durable, local) as m:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = m.restore_or_initialize()
        expected = {"local intact": local / "ckpt-10", "local removed": durable / "ckpt-8"}
        assert restored == str(expected.get(restart, durable / "ckpt-8"))
        fell_back = [w for w in caught if "cannot be restored" in str(w.message)]
        assert len(fell_back) == (restart == "local damaged")
        if restart == "local damaged":  # the damaged local checkpoint no longer counts as the newest
            assert [c.step for c in m.local_checkpoint_infos] == [8]
        _train(ckpt, m, STEPS)
    np.testing.assert_array_equal(np.asarray(ckpt.w), want_w)
    assert int(ckpt.rng) == want_rng


def test_the_durable_tier_in_a_bucket(tmp_path, bucket):
    ckpt = _fresh()
    with _manager(ckpt, f"{bucket}/run", tmp_path / "local") as m:
        _train(ckpt, m, 8)
        m.wait_until_finished()
        assert _durable_steps(m) == [4, 8]
    assert jaxckpt.latest_checkpoint(f"{bucket}/run") == f"{bucket}/run/ckpt-8"
    assert main(["verify", f"{bucket}/run/ckpt-8"]) == 0
    shutil.rmtree(tmp_path / "local")  # a new machine: from the bucket
    again = _fresh()
    with _manager(again, f"{bucket}/run", tmp_path / "local") as m:
        assert m.restore_or_initialize() == f"{bucket}/run/ckpt-8"
    np.testing.assert_array_equal(np.asarray(again.w), np.asarray(ckpt.w))


def test_delete_rolls_back_in_both_tiers(tmp_path):
    """Orbax's rollback with two tiers: delete(step) drops the step in the local and the durable tier."""
    ckpt = _fresh()
    with _manager(ckpt, tmp_path / "durable", tmp_path / "local") as m:
        _train(ckpt, m, 12)  # local [10, 12], durable [8, 12]
        m.restore(10)
        m.delete(12)  # in both tiers (its durable copy may still be running: it is waited for)
        assert [c.step for c in m.local_checkpoint_infos] == [10] and _durable_steps(m) == [8]
        assert m.latest_step() == 10
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"no checkpoint of step 9.*\[10\].*\[8\]"):
            m.delete(9)
        m.delete(8)  # in the durable tier only
        assert _durable_steps(m) == []
        _train(ckpt, m, STEPS)  # a new step 12, saved and copied again
        m.wait_until_finished()
        assert _durable_steps(m) == [12, 16]
    for tier in ("local", "durable"):
        assert jaxckpt.latest_checkpoint(tmp_path / tier) == str(tmp_path / tier / "ckpt-16")
    assert not (tmp_path / "durable" / "ckpt-8").exists()
    want_w, want_rng = _reference(tmp_path)
    np.testing.assert_array_equal(np.asarray(ckpt.w), want_w)  # rolled back to 10, trained on: the same
    assert int(ckpt.rng) == want_rng


def test_a_slow_copy_never_blocks_saving(tmp_path, monkeypatch):
    """The copy runs in its own thread: saves return while it is held; the newest due checkpoint is
    copied next, the ones in between are skipped, and local retention keeps what is being copied."""
    gate, started = threading.Event(), threading.Event()
    real = durable_copy.copy_checkpoint

    def held(source, dest, **kw):
        started.set()
        assert gate.wait(timeout=60)
        return real(source, dest, **kw)

    monkeypatch.setattr(durable_copy, "copy_checkpoint", held)
    ckpt = _fresh()
    m = _manager(ckpt, tmp_path / "durable", tmp_path / "local", local_policies=jaxckpt.KeepLatest(1))
    try:
        _train(ckpt, m, 4)  # the copy of ckpt-4 starts and is held
        assert started.wait(timeout=60)
        _train(ckpt, m, 12)  # 8 and 12 come due while 4 is held: 8 is skipped for 12
        assert m.latest_checkpoint == str(tmp_path / "local" / "ckpt-12")  # a listing does not wait for the copy
        assert m.latest_step() == 12
        # local_checkpoint_infos waits for the local save (its retention included), not for the copy.
        assert [c.step for c in m.local_checkpoint_infos] == [4, 12]  # 4 kept while copied; 8 dropped
        gate.set()
        m.wait_until_finished()
        assert _durable_steps(m) == [4, 12]
        _train(ckpt, m, 14)
        m.wait_until_finished()
        assert [c.step for c in m.local_checkpoint_infos] == [14]  # 4 released once copied
    finally:
        gate.set()
        m.close()


def test_a_failed_copy_warns_and_saving_goes_on(tmp_path, monkeypatch):
    real = durable_copy.copy_checkpoint
    calls = []

    def flaky(source, dest, **kw):
        calls.append(source)
        if len(calls) == 1:
            raise jaxckpt.StorageError("the bucket is unreachable", 5)
        return real(source, dest, **kw)

    monkeypatch.setattr(durable_copy, "copy_checkpoint", flaky)
    ckpt = _fresh()
    with _manager(ckpt, tmp_path / "durable", tmp_path / "local") as m:
        _train(ckpt, m, 4)
        m._part._background.settle()  # the copy has failed (no public call waits for it without raising)
        with pytest.warns(UserWarning, match="copy to the durable tier .* failed: .*unreachable"):
            _train(ckpt, m, 8)
        m.wait_until_finished()
        assert _durable_steps(m) == [8]


KILLED_COPY = """
import os, signal, sys
import jax.numpy as jnp
import jaxckpt
from jaxckpt.manager import durable_copy

real = durable_copy._copy_file
count = [0]
def killing(path, staging, rel):
    count[0] += 1
    if "ckpt-8" in str(path) and count[0] > 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-copy of ckpt-8, its first file already there
    return real(path, staging, rel)
durable_copy._copy_file = killing

ckpt = jaxckpt.Checkpoint(step=0, w=jnp.zeros(8))
m = jaxckpt.CheckpointManager(ckpt, sys.argv[1], max_to_keep=2, local_directory=sys.argv[2],
                              save_interval_steps=2, durable_interval_steps=4, step_counter="step")
for s in range(1, 9):
    ckpt.step = s
    ckpt.w = ckpt.w + 1
    m.save(step=s)
m.wait_until_finished()
"""


def test_sigkill_during_a_background_copy(tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "local"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_COPY), str(durable), str(local)],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL
    # The durable tier keeps its previous checkpoint; the copy's leftovers are no checkpoint.
    assert jaxckpt.latest_checkpoint(durable) == str(durable / "ckpt-4")
    assert any(p.name.startswith(".ckpt-8.partial-") for p in durable.iterdir())
    ckpt = jaxckpt.Checkpoint(step=0, w=jnp.zeros(8))
    with _manager(ckpt, durable, local) as m:
        assert m.restore_or_initialize() == str(local / "ckpt-8")  # the local save had finished
        assert ckpt.step == 8
        _train_plain(ckpt, m, 12)
        m.wait_until_finished()
        assert _durable_steps(m) == [4, 12]
    assert not any(p.name.startswith(".ckpt-8.partial-") for p in durable.iterdir())  # cleaned up
    assert main(["verify", str(durable)]) == 0


def _train_plain(ckpt, manager, until):
    while ckpt.step < until:
        ckpt.step += 1
        ckpt.w = ckpt.w + 1
        manager.save(step=ckpt.step)


PREEMPTED = """
import os, signal, sys
import jax.numpy as jnp
import jaxckpt

ckpt = jaxckpt.Checkpoint(step=0, w=jnp.zeros(8))
m = jaxckpt.CheckpointManager(ckpt, sys.argv[1], max_to_keep=2, local_directory=sys.argv[2], step_counter="step",
                              save_interval_steps=10, durable_interval_steps=100, save_on_preemption=True,
                              preemption_grace_s=float(sys.argv[3]))
while True:
    ckpt.step += 1
    ckpt.w = ckpt.w + 1
    m.save(step=ckpt.step)
    if ckpt.step == 13:
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
    m.save_if_preempted()
"""


def test_preemption_saves_locally_and_copies_within_the_grace_period(tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "local"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PREEMPTED), str(durable), str(local), "60"],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "durable copy" in done.stderr and "is complete" in done.stderr
    latest = jaxckpt.latest_checkpoint(local)
    assert jaxckpt.load_variable(latest, "step") == 13  # the step the notice came at
    assert jaxckpt.latest_checkpoint(durable) == os.path.join(durable, os.path.basename(latest))
    assert jaxckpt.load_variable(durable, "step") == 13


def test_options_are_checked(tmp_path):
    ckpt = _fresh()
    with pytest.raises(ValueError, match="durable_interval_steps"):
        _manager(ckpt, tmp_path / "d", tmp_path / "l", durable_interval_steps=0)
    with pytest.raises(ValueError, match="different folders"):
        _manager(ckpt, tmp_path / "d", tmp_path / "d")
    with pytest.raises(ValueError, match="this host's disk"):
        _manager(ckpt, tmp_path / "d", "memory://local")
    assert not (tmp_path / "d").exists() or not any(Path(tmp_path / "d").iterdir())


def test_under_disk_pressure_local_checkpoints_the_durable_tier_holds_go_first(tmp_path, monkeypatch):
    ckpt = _fresh()
    with _manager(ckpt, tmp_path / "durable", tmp_path / "local", local_policies=jaxckpt.KeepLatest(5)) as m:
        _train(ckpt, m, 10)  # local: 2..10; durable: 4, 8
        m.wait_until_finished()
        assert [c.step for c in m.local_checkpoint_infos] == [2, 4, 6, 8, 10]
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1))  # a full disk
        _train(ckpt, m, 14)
        m.wait_until_finished()
        # 4 and 8 are in the durable tier: dropped first, one for each save under pressure (12, then 14;
        # a step that is not due saves nothing and makes no room); 2 and 6 exist nowhere else and stay.
        assert [c.step for c in m.local_checkpoint_infos] == [2, 6, 10, 12, 14]
        assert sorted(p.name for p in (tmp_path / "local").iterdir() if p.name.startswith("ckpt")) == [
            "ckpt-10",
            "ckpt-12",
            "ckpt-14",
            "ckpt-2",
            "ckpt-6",
        ]


def test_under_disk_pressure_room_is_counted_in_bytes_a_save_writes_new(tmp_path, monkeypatch):
    """Incremental local saves link a frozen base: a save needs room for what it writes new (the
    latest save's own files), not for the checkpoint's full size."""
    frozen = jnp.arange(4 << 20, dtype=jnp.float32)  # 16 MiB, linked by every local save
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, w=jnp.zeros(8, jnp.float32), rng=np.uint32(7))
    with _manager(ckpt, tmp_path / "durable", tmp_path / "local", local_policies=jaxckpt.KeepLatest(5)) as m:
        _train(ckpt, m, 10)  # local: 2..10; durable: 4, 8
        m.wait_until_finished()
        assert [c.step for c in m.local_checkpoint_infos] == [2, 4, 6, 8, 10]
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=4 << 20))  # < 16 MiB
        _train(ckpt, m, 12)
        m.wait_until_finished()
        # 4 MiB is room enough for a save that writes a few KiB: nothing is dropped but by retention.
        assert [c.step for c in m.local_checkpoint_infos] == [4, 6, 8, 10, 12]
    np.testing.assert_array_equal(jaxckpt.restore(str(tmp_path / "local" / "ckpt-12"))["base"], np.asarray(frozen))


def test_local_retention_lets_go_of_a_checkpoint_once_its_copy_ends(tmp_path, monkeypatch):
    """Local retention keeps a checkpoint while its durable copy runs; when the copy ends, retention
    applies again (before, ckpt-8 stayed in the local tier until the next local save, or for good)."""
    real_copy, copying, release = durable_copy.copy_checkpoint, threading.Event(), threading.Event()

    def held_copy(source, dest, **kw):
        if Path(source).name == "ckpt-8":  # held until the local saves of steps 10 and 12 are recorded
            copying.set()
            assert release.wait(120), "the test never released the copy"
        return real_copy(source, dest, **kw)

    monkeypatch.setattr(durable_copy, "copy_checkpoint", held_copy)
    ckpt = _fresh()
    with _manager(ckpt, tmp_path / "durable", tmp_path / "local") as m:
        _train(ckpt, m, 12)
        assert copying.wait(120), "the copy of ckpt-8 never started"
        # local_checkpoint_infos waits for the local save (its retention included), not for the copy.
        assert [c.step for c in m.local_checkpoint_infos] == [8, 10, 12]  # 8: still being copied
        release.set()
        m.wait_until_finished()
        assert [c.step for c in m.local_checkpoint_infos] == [10, 12]
        assert _durable_steps(m) == [8, 12]
    assert sorted(p.name for p in (tmp_path / "local").iterdir() if "ckpt" in p.name) == ["ckpt-10", "ckpt-12"]
    assert [
        c.step for c in jaxckpt.CheckpointManager(_fresh(), tmp_path / "local", read_only=True).checkpoint_infos
    ] == [10, 12]


def test_all_steps_lists_the_steps_of_either_tier_as_latest_step_and_restore_take_them(tmp_path):
    """Orbax's calls agree with one another on two tiers: all_steps() lists every step that
    restore(step) takes (the local tier's and the durable tier's), so latest_step() is always in it."""
    ckpt = _fresh()
    with _manager(ckpt, tmp_path / "durable", tmp_path / "local") as m:
        _train(ckpt, m, 10)  # saves 2, 4, 6, 8, 10; local keeps 8, 10; the durable tier 4 and 8
        m.wait_until_finished()
        assert [c.step for c in m.local_checkpoint_infos] == [8, 10]
        assert m.all_steps() == [4, 8, 10]
        assert m.latest_step() == 10
        want = np.asarray(ckpt.w)
    restored = _fresh()
    with _manager(restored, tmp_path / "durable", tmp_path / "local", read_only=True) as m:
        assert m.all_steps() == [4, 8, 10]
        m.restore(4)  # from the durable tier only
        assert restored.step == 4
        m.restore(10)
        np.testing.assert_array_equal(np.asarray(restored.w), want)
