"""Asynchronous saves: the call returns after the snapshot; everything else runs behind, safely."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.arrays import store_write


def sharded_state(seed=0):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    w = jax.random.normal(jax.random.key(seed), (512, 1024))  # 2 MiB: its own zarr3 array
    return {"w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))), "b": jnp.arange(8.0), "step": 3}


def test_values_are_those_of_the_call_even_when_the_train_step_donates(tmp_path):
    state = sharded_state()
    expected = jax.tree.map(np.asarray, state)
    ckpt = jaxckpt.Checkpoint(state=state)

    donating = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    path = ckpt.save(tmp_path / "ckpt", blocking=False)
    for _ in range(3):  # the training loop goes on at once, donating the saved buffers
        ckpt.state = {**donating({k: v for k, v in ckpt.state.items() if k != "step"}), "step": ckpt.state["step"] + 1}
    ckpt.wait_until_finished()
    restored = jaxckpt.restore(path)["state"]
    np.testing.assert_array_equal(restored["w"], expected["w"])
    np.testing.assert_array_equal(restored["b"], expected["b"])
    assert restored["step"] == 3


def test_numpy_leaves_changed_in_place_after_the_call_are_saved_as_they_were(tmp_path):
    data = {"buffer": np.arange(400_000, dtype=np.float32), "small": np.ones(3)}
    path = jaxckpt.save(tmp_path / "c", data, blocking=False)
    data["buffer"][:] = -1
    data["small"][:] = -1
    jaxckpt.wait_until_finished()
    restored = jaxckpt.restore(path)
    np.testing.assert_array_equal(restored["buffer"], np.arange(400_000, dtype=np.float32))
    np.testing.assert_array_equal(restored["small"], np.ones(3))


def test_a_save_waits_for_the_previous_one(tmp_path):
    ckpt = jaxckpt.Checkpoint(state=sharded_state())
    first = ckpt.save(tmp_path / "ckpt", blocking=False)
    second = ckpt.save(tmp_path / "ckpt", blocking=False)
    assert jaxckpt.restore(first)["save_counter"] == 1  # finished before the second call returned
    ckpt.wait_until_finished()
    assert jaxckpt.restore(second)["save_counter"] == 2


def test_background_errors_surface_on_the_next_call_and_on_wait(tmp_path, monkeypatch):
    real_flush = store_write.Writer.flush
    release = threading.Event()

    def failing_flush(self):
        release.wait()
        raise OSError("No space left on device")

    monkeypatch.setattr(store_write.Writer, "flush", failing_flush)
    ckpt = jaxckpt.Checkpoint(state=sharded_state())
    path = ckpt.save(tmp_path / "ckpt", blocking=False)
    release.set()
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(tmp_path / "ckpt", blocking=False)  # the next call raises the earlier failure
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
    ckpt.wait_until_finished()  # the error was reported once; nothing is pending any more

    path = ckpt.save(tmp_path / "ckpt", blocking=False)
    with pytest.raises(OSError, match="No space left"):
        ckpt.wait_until_finished()
    monkeypatch.setattr(store_write.Writer, "flush", real_flush)
    path = ckpt.save(tmp_path / "ckpt", blocking=False)  # space is back: saving works again
    ckpt.wait_until_finished()
    assert jaxckpt.restore(path)["save_counter"] == ckpt.save_counter


def test_manager_saves_in_the_background_by_default(tmp_path):
    ckpt = jaxckpt.Checkpoint(state=sharded_state(), step=0)
    with jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2, step_counter="step") as manager:
        for step in range(1, 5):
            ckpt.step = step
            manager.save()
        assert manager.checkpoints == [str(tmp_path / "ckpt-3"), str(tmp_path / "ckpt-4")]  # waits, then lists
    assert jaxckpt.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-4")
    fresh = jaxckpt.Checkpoint(state=sharded_state(seed=1), step=0)
    fresh.restore(jaxckpt.latest_checkpoint(tmp_path)).assert_consumed()
    assert fresh.step == 4 and fresh.state["w"].sharding == ckpt.state["w"].sharding


def test_manager_background_failure_leaves_the_state_file_as_it_was(tmp_path, monkeypatch):
    ckpt = jaxckpt.Checkpoint(state=sharded_state())
    manager = jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    manager.save()
    manager.wait_until_finished()
    before = (tmp_path / "checkpoint").read_bytes()

    def failing_flush(self):
        raise OSError("disk full")

    monkeypatch.setattr(store_write.Writer, "flush", failing_flush)
    manager.save()
    with pytest.raises(OSError, match="disk full"):
        manager.wait_until_finished()
    assert (tmp_path / "checkpoint").read_bytes() == before
    assert manager.checkpoints == [str(tmp_path / "ckpt-1")]
    manager.close()


def _run(script, env=None):
    env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=180
    )


def test_pending_save_is_finished_at_interpreter_exit(tmp_path):
    proc = _run(
        f"""
        import numpy as np, jaxckpt
        ckpt = jaxckpt.Checkpoint(x=np.arange(3_000_000, dtype=np.float32))
        ckpt.save({str(tmp_path / "ckpt")!r}, blocking=False)
        """  # exits at once, with the save pending
    )
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(
        jaxckpt.load_variable(tmp_path / "ckpt-1", "x"), np.arange(3_000_000, dtype=np.float32)
    )


def test_failed_save_at_exit_is_reported(tmp_path):
    proc = _run(
        f"""
        import numpy as np, jaxckpt
        from jaxckpt.arrays import store_write
        def fail(self):
            raise OSError("disk full at exit")
        store_write.Writer.flush = fail
        jaxckpt.save({str(tmp_path / "c")!r}, {{"x": np.ones(3)}}, blocking=False)
        """
    )
    assert "background save failed" in proc.stderr and "disk full at exit" in proc.stderr
    assert not (tmp_path / "c").exists()


def test_host_memory_stays_within_the_budget(tmp_path):
    """Copies held by a save are bounded: a state four times the budget is written in parts."""
    proc = _run(
        f"""
        import numpy as np, jaxckpt
        def rss(field):
            return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024
        state = {{f"a{{i}}": np.random.default_rng(i).standard_normal(8_000_000).astype(np.float32) for i in range(8)}}
        size = sum(a.nbytes for a in state.values())  # 256 MB of numpy arrays: each one copied by a save
        open("/proc/self/clear_refs", "w").write("5")
        base = rss("VmRSS")
        jaxckpt.save({str(tmp_path / "c")!r}, state)
        print(size, rss("VmHWM") - base)
        """,
        env={"JAXCKPT_HOST_MEMORY_BUDGET": str(64 << 20)},
    )
    assert proc.returncode == 0, proc.stderr
    size, growth = map(int, proc.stdout.split())
    assert growth < size / 2, f"peak RSS grew by {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB state"
    assert len(jaxckpt.list_variables(tmp_path / "c")) == 8


def test_the_caller_only_snapshots_records_packs_and_index_are_made_in_the_background(tmp_path, monkeypatch):
    """Issue 14: the per-leaf work (records, packing with its CRC-32s, the index) is not the caller's."""
    from jaxckpt.saving import pipeline

    threads = {"pack": set(), "index": set()}
    real_add, real_index = pipeline._Packer.add, pipeline.Index

    def add(self, data):
        threads["pack"].add(threading.current_thread())
        return real_add(self, data)

    def index(*args, **kwargs):
        threads["index"].add(threading.current_thread())
        return real_index(*args, **kwargs)

    monkeypatch.setattr(pipeline._Packer, "add", add)
    monkeypatch.setattr(pipeline, "Index", index)
    one = jax.devices()[0]
    tree = {f"l{i}": jax.device_put(np.full((3, 4), i, np.float32), one) for i in range(50)}
    tree["host"] = np.arange(10.0)
    path = jaxckpt.save(tmp_path / "c", tree, blocking=False)
    jaxckpt.wait_until_finished()
    me = threading.current_thread()
    assert threads["pack"] and me not in threads["pack"]
    assert threads["index"] and me not in threads["index"]
    np.testing.assert_array_equal(jaxckpt.restore(path)["l7"], np.full((3, 4), 7, np.float32))

    ckpt = jaxckpt.Checkpoint(state=tree)  # Checkpoint.write and a manager's save alike
    threads["pack"].clear()
    ckpt.write(tmp_path / "w", blocking=False)
    ckpt.wait_until_finished()
    assert threads["pack"] and me not in threads["pack"]
    threads["pack"].clear()
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "m", max_to_keep=1) as manager:
        manager.save()
    assert threads["pack"] and me not in threads["pack"]

    threads["pack"].clear()
    jaxckpt.save(tmp_path / "sync", tree)  # a blocking save does it all in the caller
    assert threads["pack"] == {me}


@pytest.mark.parametrize("kind", ["save", "write", "manager"])
def test_state_changed_donated_or_deleted_after_the_call_is_saved_as_it_was(tmp_path, held_background, kind):
    one = jax.devices()[0]
    small = {f"s{i}": jax.device_put(np.full((4, 8), i, np.float32), one) for i in range(20)}  # packed
    big = jax.device_put(np.arange(600_000, dtype=np.float32), one)  # an array of its own
    sharded = sharded_state()["w"]
    numpy = {"small": np.ones(5), "big": np.arange(300_000, dtype=np.float64)}
    state = {"small": small, "big": big, "sharded": sharded, "numpy": numpy, "key": jax.random.key(3)}
    expected = jax.tree.map(np.array, {k: v for k, v in state.items() if k != "key"})  # copies
    expected_key = np.asarray(jax.random.key_data(state["key"]))

    ckpt = jaxckpt.Checkpoint(state=state)
    if kind == "save":
        path = jaxckpt.save(tmp_path / "c", state, blocking=False)
    elif kind == "write":
        path = ckpt.write(tmp_path / "c", blocking=False)
    else:
        manager = jaxckpt.CheckpointManager(ckpt, tmp_path / "m", max_to_keep=1)
        path = manager.save()
    # The caller's thread goes on before anything is recorded: it donates, deletes and changes in place.
    donate = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 7, t), donate_argnums=0)
    state["small"] = donate(small)
    state["big"] = donate(big)
    for x in [*small.values(), big, sharded]:
        x.delete()
    del small, big, sharded
    numpy["small"][:] = -1
    numpy["big"][:] = -1
    state["key"].delete()
    held_background.set()
    if kind == "save":
        jaxckpt.wait_until_finished()
    elif kind == "write":
        ckpt.wait_until_finished()
    else:
        manager.close()
    restored = jaxckpt.restore(path)
    if kind != "save":
        restored = restored["state"]
    for name, want in jax.tree_util.tree_leaves_with_path(expected):
        got = restored
        for entry in name:
            got = got[entry.key]
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(name))
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), expected_key)


def test_the_background_holds_the_callers_data_not_its_arrays(tmp_path, held_background):
    """After the call, the save holds host data only (views or copies), not the caller's arrays: on
    an accelerator, those would keep the old state's device memory until the write is done."""
    import gc
    import weakref

    one = jax.devices()[0]
    state = {
        "sharded": sharded_state()["w"],  # per-shard views
        "one": jax.device_put(np.arange(600_000, dtype=np.float32), one),  # one view
        "small": jax.device_put(np.ones(4, np.float32), one),
        "numpy": np.arange(10.0),  # copied
        "key": jax.random.key(0),
    }
    expected = {k: np.array(v) for k, v in state.items() if k != "key"}
    refs = {k: weakref.ref(v) for k, v in state.items()}
    path = jaxckpt.save(tmp_path / "c", state, blocking=False)
    del state
    gc.collect()
    # A view of one CPU buffer may hold its array object (the exporter), which holds that same memory.
    assert {k for k, r in refs.items() if r() is not None} <= {"one", "small"}
    held_background.set()
    jaxckpt.wait_until_finished()
    restored = jaxckpt.restore(path)
    for k, v in expected.items():
        np.testing.assert_array_equal(restored[k], v, err_msg=k)


@pytest.fixture
def released_by_reads(held_background, monkeypatch):
    """The held background save is let go when a read starts waiting for saves in flight; a read
    that does not wait finds no checkpoint there (the save has not written anything)."""
    from jaxckpt.runtime import background as _async

    real = _async.settle_writes

    def settle(place):
        held_background.set()
        return real(place)

    monkeypatch.setattr(_async, "settle_writes", settle)
    return held_background


@pytest.mark.parametrize("read", ["restore", "list_variables", "load_variable", "inspect"])
def test_reading_a_checkpoint_this_process_is_still_writing_waits_for_it(tmp_path, released_by_reads, read):
    ckpt = jaxckpt.Checkpoint(w=jnp.arange(6.0), step=4)
    path = ckpt.save(tmp_path / "ckpt", blocking=False)
    if read == "restore":
        np.testing.assert_array_equal(jaxckpt.restore(path)["w"], np.arange(6.0))
    elif read == "list_variables":
        assert ("w", (6,)) in jaxckpt.list_variables(path)
    elif read == "inspect":
        assert "w" in jaxckpt.inspect(path).keys()
    else:
        assert jaxckpt.load_variable(path, "step") == 4
    ckpt.wait_until_finished()


def test_restoring_a_managers_directory_waits_for_its_save_in_flight(tmp_path, released_by_reads):
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(3), step=0)
    manager = jaxckpt.CheckpointManager(ckpt, tmp_path / "run", step_counter="step")
    released_by_reads.set()
    manager.save()
    manager.wait_until_finished()
    released_by_reads.clear()
    ckpt.w, ckpt.step = jnp.ones(3), 1
    manager.save()  # in the background, held
    restored = jaxckpt.restore(tmp_path / "run")
    assert restored["step"] == 1
    np.testing.assert_array_equal(restored["w"], np.ones(3))
    manager.close()


def test_a_failed_save_in_flight_is_named_by_the_read_and_still_raised_by_its_owner(tmp_path, monkeypatch):
    from jaxckpt.saving import pipeline

    def broken(prepared):
        raise OSError("disk on fire")

    monkeypatch.setattr(pipeline, "write_and_publish", broken)
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(3))
    path = ckpt.save(tmp_path / "ckpt", blocking=False)
    with pytest.raises(
        jaxckpt.CheckpointNotFoundError, match=r"background save to it in this process failed.*disk on fire"
    ):
        jaxckpt.restore(path)
    with pytest.raises(OSError, match="disk on fire"):
        ckpt.wait_until_finished()
