"""One process of a multi-process save or restore (tests/test_multihost.py starts several).

    python multihost_worker.py MODE PROCESS_ID NUM_PROCESSES DEVICES_PER_PROCESS PORT PATH MESH

MODE: save | restore (prints the data stores it opened) | save-then-die (process 1 dies by SIGKILL once its bytes are written) |
manager (two saves through a CheckpointManager) | manager-incremental (two saves, a restore by a new
manager, a third save: the unchanged arrays are hard-linked) | manager-fail (process 1 fails the first save before
its token; every process must raise there, and the next save must work) | manager-retention (each
process has its own clock and metrics; all must keep what process 0 decided) | save-dtypes (a manager's save_dtypes, across processes) | manager-by-time (save_interval_secs and
save_continuously with clocks that differ: every process saves where process 0 decides) | iterator-save, iterator-restore, iterator-tiers (each
process's data iterator state differs; each gets its own back) | tiers-save, tiers-restore (two tiers) | agree-alone (a wait for
a process that never comes ends in an error) | tiers-start
(process 0 takes over the durable folder while process 1 starts) | manager-start-fail (process 1's manager
fails to start: both raise at once) | stall-save (process 2 stops itself with SIGSTOP while it writes; the
others must raise at the deadline, naming it and what it was doing) | write-fail (process 1's writes fail: every
process raises, the step is listed nowhere, the next save works). MESH: e.g. 4x2 over all devices of all processes.
Every process builds the same global values from a seed, and checks its own shards after a restore.
"""

import faulthandler
import os
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)  # tests/test_multihost.py asks for the stacks of a hang

mode, pid, nproc, ndev, port, path, mesh_text = sys.argv[1:8]
pid, nproc, ndev = int(pid), int(nproc), int(ndev)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if nproc > 1:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.arrays import store_write  # noqa: E402

mesh_shape = tuple(int(d) for d in mesh_text.split("x"))
mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("x", "y"))
rng = np.random.default_rng(7)
VALUES = {
    "xy": rng.standard_normal((64, 48)).astype(np.float32),  # 12 KB: packed only when process 0 owns all of it
    "rows": rng.standard_normal((512, 640)).astype(np.float32),  # 1.3 MB: its own zarr3 array
    "cols": rng.integers(0, 100, (16, 40_000)).astype(np.int32),
    "replicated": rng.standard_normal((1024, 640)).astype(np.float32),  # 2.6 MB: each process writes a part
    "small_replicated": np.arange(10, dtype=np.float32),
}
SPECS = {"xy": P("x", "y"), "rows": P("x"), "cols": P(None, "y"), "replicated": P(), "small_replicated": P()}


def sharding(name):
    return NamedSharding(mesh, SPECS[name])


def state():
    arrays = {k: jax.make_array_from_callback(v.shape, sharding(k), lambda i, v=v: v[i]) for k, v in VALUES.items()}
    return {**arrays, "step": 7}


def check(restored):
    for name, value in VALUES.items():
        array = restored[name]
        assert array.sharding == sharding(name), (name, array.sharding)
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index], err_msg=name)
    assert restored["step"] == 7


def fail_first_snapshot_on_process_1() -> None:
    """Process 1's first save fails while snapshotting, before it takes the save's token."""
    from jaxckpt.saving import pipeline

    real_prepare, calls = pipeline.prepare, []

    def prepare_or_fail(*args, **kwargs):
        calls.append(1)
        if pid == 1 and len(calls) == 1:
            raise RuntimeError("process 1 cannot snapshot")
        return real_prepare(*args, **kwargs)

    pipeline.prepare = prepare_or_fail


if mode == "save":
    jaxckpt.Checkpoint(state=state()).write(path)
elif mode == "save-then-die":
    real_flush = store_write.Writer.flush

    def flush_then_die(self):
        real_flush(self)
        if pid == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    store_write.Writer.flush = flush_then_die
    try:
        jaxckpt.Checkpoint(state=state()).write(path)
    except Exception as e:  # process 0 cannot finish without process 1: it must fail, not publish
        print(f"save failed as expected: {type(e).__name__}", flush=True)
        os._exit(3)
elif mode == "restore":
    from jaxckpt.reading import reader

    opened, real_init = [], reader.Opened.__init__

    def init_and_remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        opened.append(self)

    reader.Opened.__init__ = init_and_remember
    template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(k)) for k, v in VALUES.items()}
    ckpt = jaxckpt.Checkpoint(state={**template, "step": 0})
    ckpt.restore(path).assert_consumed()
    check(ckpt.state)
    print(f"process {pid}: stores {','.join(sorted({s for o in opened for s in o.stores_opened}))}", flush=True)
elif mode == "manager":
    ckpt = jaxckpt.Checkpoint(state=state())
    with jaxckpt.CheckpointManager(ckpt, path, max_to_keep=1) as manager:
        manager.save()
        manager.save()
        assert manager.checkpoints == [os.path.join(path, "ckpt-2")], manager.checkpoints
    fresh = jaxckpt.Checkpoint(
        state={
            **{k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(k)) for k, v in VALUES.items()},
            "step": 0,
        }
    )
    fresh.restore(jaxckpt.latest_checkpoint(path)).assert_consumed()
    check(fresh.state)
elif mode == "manager-incremental":  # the second save, and the one after a restore, link the large arrays
    ckpt = jaxckpt.Checkpoint(state=state())
    with jaxckpt.CheckpointManager(ckpt, path, max_to_keep=3) as manager:
        manager.save()
        manager.save()
    template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(k)) for k, v in VALUES.items()}
    fresh = jaxckpt.Checkpoint(state={**template, "step": 0})
    with jaxckpt.CheckpointManager(fresh, path, max_to_keep=3) as manager:
        manager.restore_or_initialize()
        check(fresh.state)
        manager.save()
elif mode == "manager-fail":
    fail_first_snapshot_on_process_1()
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(state=state()), path, max_to_keep=1) as manager:
        try:
            manager.save()
        except Exception as e:
            assert "process 1 cannot snapshot" in str(e), e
        else:
            raise AssertionError("the first save went on although process 1 failed it")
        second = manager.save()
        assert second == os.path.join(path, "ckpt-1"), second
        third = manager.save()
        assert manager.checkpoints == [third], manager.checkpoints
elif mode == "save-fail":  # the same, for plain saves: Checkpoint.save and jaxckpt.save
    fail_first_snapshot_on_process_1()
    ckpt = jaxckpt.Checkpoint(state=state())
    try:
        ckpt.save(os.path.join(path, "ckpt"))
    except Exception as e:
        assert "process 1 cannot snapshot" in str(e), e
    else:
        raise AssertionError("the first save went on although process 1 failed it")
    assert ckpt.save_counter == 0, ckpt.save_counter
    second = ckpt.save(os.path.join(path, "ckpt"))
    assert second == os.path.join(path, "ckpt-1"), second
    third = jaxckpt.save(os.path.join(path, "plain"), {"state": state()})
    assert jaxckpt.restore(third)["state"]["step"] == 7
elif mode == "manager-retention":
    import json

    losses = [[3.0, 1.0, 2.0], [1.0, 3.0, 2.0]][pid]  # alone, each process would keep another one
    ckpt = jaxckpt.Checkpoint(state=state())
    clock = lambda: 1_700_000_000.0 + 1000 * pid  # noqa: E731
    with jaxckpt.CheckpointManager(ckpt, path, policies=[jaxckpt.KeepBest(1, "loss")], clock=clock) as manager:
        for loss in losses:
            manager.save(metrics={"loss": loss})
        infos = manager.checkpoint_infos
    with open(os.path.join(path, "checkpoint"), encoding="utf-8") as f:
        listed = json.load(f)["checkpoints"]
    mine = [{"prefix": os.path.basename(c.path), "step": c.step, "time": c.time, "metrics": c.metrics} for c in infos]
    assert mine == listed, (mine, listed)
    assert [c["prefix"] for c in listed] == ["ckpt-2", "ckpt-3"], listed
elif mode == "save-dtypes":  # arrays sharded over both processes, saved in bfloat16, restored as float32
    import ml_dtypes

    half = {k: "bfloat16" for k, v in VALUES.items() if v.dtype == np.float32}
    ckpt = jaxckpt.Checkpoint(state=state())
    with jaxckpt.CheckpointManager(ckpt, path, save_dtypes={"state": half}) as manager:
        manager.save(step=1)
    template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(k)) for k, v in VALUES.items()}
    fresh = jaxckpt.Checkpoint(state={**template, "step": 0})
    fresh.restore(jaxckpt.latest_checkpoint(path)).assert_consumed()
    for name, value in VALUES.items():
        want = value.astype(ml_dtypes.bfloat16).astype(np.float32) if name in half else value
        array = fresh.state[name]
        assert array.dtype == value.dtype and array.sharding == sharding(name), (name, array.dtype)
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=name)
elif mode == "manager-by-time":  # each process's clock differs: every process saves where process 0's says
    from jaxckpt.runtime import multihost

    now = [1_800_000_000.0 + 5000 * pid]
    per_step = [7.0, 100.0][pid]  # alone, process 1 would save at every step

    def clock():
        return now[0]

    def loop(manager, steps):
        saved = []
        for step in steps:
            now[0] += per_step
            due = manager.should_save(step)
            if manager.save(step) is not None:
                saved.append(step)
            # save decides again: due then (continuous: the last save was written since should_save said no)
            assert not due or step in saved, (step, due, saved)
        manager.wait_until_finished()
        return saved

    ckpt = jaxckpt.Checkpoint(state=state())
    with jaxckpt.CheckpointManager(ckpt, os.path.join(path, "interval"), save_interval_secs=60, clock=clock) as m:
        saved = loop(m, range(1, 21))
        assert saved == m.all_steps() == [9, 18], saved  # by process 0's clock: 63 s, then 63 s after that
    # Continuous: process 0's background decides; which steps depends on its timing, but every process agrees.
    with jaxckpt.CheckpointManager(ckpt, os.path.join(path, "continuous"), save_continuously=True, clock=clock) as m:
        saved = loop(m, range(1, 31))
        saved += loop(m, [31])  # the last save is written (loop waited for it): due on every process
        assert saved[-1] == 31 and saved == m.all_steps(), (saved, m.all_steps())
    print(f"process {pid}: continuous saved {saved}", flush=True)
    try:  # a decision that fails on process 0 fails on every process, rather than leave them waiting
        multihost.primary_decides("save decision", lambda: 1 / 0)
    except (ZeroDivisionError, jaxckpt.JaxckptError) as e:
        assert "division by zero" in str(e), e
    else:
        raise AssertionError("a failed decision passed")
    multihost.barrier("decisions read")
    left = multihost._client().key_value_dir_get("jaxckpt/decision/")
    assert left == [], left  # each decision's keys went once every process read it
elif mode == "manager-delete":  # Orbax's rollback: every process calls delete, process 0 deletes
    ckpt = jaxckpt.Checkpoint(state=state())
    with jaxckpt.CheckpointManager(ckpt, path) as manager:
        for step in (1, 2, 3):
            manager.save(step=step)
        manager.restore(1)
        manager.delete(3)
        manager.delete(2)
        assert manager.all_steps() == [1], manager.all_steps()
        assert jaxckpt.latest_checkpoint(path) == os.path.join(path, "ckpt-1")  # listed on every process now
        manager.save(step=2)
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 2], manager.all_steps()
elif mode in ("iterator-save", "iterator-restore", "iterator-tiers"):  # each process its own data iterator position

    class Shard:
        """A data iterator over this process's shard: its state differs per process (bytes on process 1)."""

        def __init__(self):
            self.position = 0

        def get_state(self):
            return str(self.position).encode() if pid == 1 else {"position": self.position}

        def set_state(self, state):
            self.position = int(state) if pid == 1 else state["position"]

    class Epoch(Shard):  # the same on every process: one state, any process count restores it
        def get_state(self):
            return {"position": self.position}

        def set_state(self, state):
            self.position = state["position"]

    data, epoch = Shard(), Epoch()
    if mode == "iterator-tiers":  # copied from each process's local disk to the durable folder
        data.position = 10 * (pid + 1)
        ckpt = jaxckpt.Checkpoint(data=data, epoch=epoch, state=state())
        durable, local = os.path.join(path, "durable"), os.path.join(path, f"local-{pid}")
        with jaxckpt.CheckpointManager(ckpt, durable, local_directory=local, durable_interval_steps=1) as manager:
            manager.save(step=1)
            manager.wait_until_finished()
        data.position = 0
        jaxckpt.Checkpoint(data=data).restore(os.path.join(durable, "ckpt-1"))
        assert data.position == 10 * (pid + 1), data.position
    elif mode == "iterator-save":
        data.position, epoch.position = 10 * (pid + 1), 4
        ckpt = jaxckpt.Checkpoint(data=data, epoch=epoch, state=state())
        with jaxckpt.CheckpointManager(ckpt, path) as manager:
            manager.save(step=1)
            data.position += 1
            manager.save(step=2)
    else:
        with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(data=data, epoch=epoch), path) as manager:
            manager.restore(1)
        assert (data.position, epoch.position) == (10 * (pid + 1), 4), (data.position, epoch.position)
        jaxckpt.Checkpoint(data=data).restore(os.path.join(path, "ckpt-2"))
        assert data.position == 10 * (pid + 1) + 1, data.position
elif mode == "manager-start-fail":  # process 1's manager fails to start; process 0's must not wait for it
    from jaxckpt.manager import startup

    real_take_over = startup.take_over

    def take_over_or_fail(*args, **kwargs):
        if pid == 1:
            raise OSError("process 1 lost its disk")
        return real_take_over(*args, **kwargs)

    startup.take_over = take_over_or_fail
    try:
        jaxckpt.CheckpointManager(jaxckpt.Checkpoint(state=state()), path, max_to_keep=1)
    except Exception as e:
        expected = "process 1 lost its disk" if pid == 1 else "Process 1 failed in starting its manager"
        assert expected in str(e), e
    else:
        raise AssertionError("the manager started although process 1's did not")
    # A read-only manager needs no other process: process 0 alone may open one (to list, to restore).
    if pid == 0:
        startup.take_over = real_take_over
        jaxckpt.CheckpointManager(jaxckpt.Checkpoint(state=state()), path, read_only=True).close()
elif mode == "agree-alone":  # process 1 never joins process 0's agreement (JAXCKPT_BARRIER_TIMEOUT_S is short)
    from jax._src import distributed

    from jaxckpt.runtime import multihost

    client = distributed.global_state.client
    if pid == 0:
        try:
            multihost.gather("alone", "1")
        except jaxckpt.JaxckptError as e:
            assert "at the agreement 'alone' for process 1" in str(e), e
        else:
            raise AssertionError("process 0 agreed without process 1")
        client.key_value_set("test/done", "1")
    else:
        client.blocking_key_value_get("test/done", 120_000)
elif mode == "stall-save":  # JAXCKPT_BARRIER_TIMEOUT_S is short; the test kills process 2 afterwards
    from jaxckpt.arrays import store_write as writes

    if pid == 2:
        real_flush = writes.Writer.flush

        def stop_then_flush(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGSTOP)  # a hung host: it never comes back by itself
            return real_flush(self, *args, **kwargs)

        writes.Writer.flush = stop_then_flush
    try:
        jaxckpt.save(os.path.join(path, "stalled"), {"state": state()})
    except jaxckpt.JaxckptError as e:
        said = str(e)
        assert "at barrier" in said and "for process 2, which never came" in said, said
        assert "process 2 last said it was writing its part of save" in said, said
        print(f"process {pid}: {said}", flush=True)
    else:
        raise AssertionError("the save went on without process 2")
    assert not os.path.exists(os.path.join(path, "stalled")), "published without process 2"
    print(f"process {pid}: {mode} ok", flush=True)
    os._exit(0)  # process 2 is stopped: a shutdown would wait for it
elif mode == "write-fail":
    from jaxckpt.arrays import store_write as writes

    if pid == 1:
        real_flush, calls = writes.Writer.flush, []

        def fail_first_flush(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise OSError("process 1's disk failed")
            return real_flush(self, *args, **kwargs)

        writes.Writer.flush = fail_first_flush
    ckpt = jaxckpt.Checkpoint(state=state())
    with jaxckpt.CheckpointManager(ckpt, path, max_to_keep=2) as manager:
        manager.save(step=1)  # asynchronous: the writes fail in the background
        try:
            manager.wait_until_finished()
        except Exception as e:
            expected = "process 1's disk failed" if pid == 1 else "Process 1 failed to write its part of this save"
            assert expected in str(e), e
        else:
            raise AssertionError("the save of step 1 went on although process 1 could not write")
        assert manager.latest_step() is None and manager.all_steps() == [], manager.all_steps()
        manager.save(step=2)
        manager.wait_until_finished()
        assert manager.all_steps() == [2], manager.all_steps()
    assert jaxckpt.latest_checkpoint(path) == os.path.join(path, "ckpt-2"), jaxckpt.latest_checkpoint(path)
    restored = jaxckpt.restore(path)["state"]  # numpy, whole
    for name, value in VALUES.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
elif mode == "tiers-start":  # process 0 takes over the durable folder while process 1 starts its manager
    # The order that a busy machine can give: process 1 writes a temp file in the durable folder, and
    # process 0's start-up lists and removes such leftovers before process 1 renames it. A non-primary
    # must never write there (process 0 owns it): it then fails, and its restores are never agreed.
    from jax._src import distributed

    from jaxckpt.manager import startup
    from jaxckpt.runtime import multihost
    from jaxckpt.storage import locations

    client, durable = distributed.global_state.client, os.path.join(path, "durable")
    real_write, real_take_over, signalled = locations.write_durable, startup.take_over, []

    def signal_once():
        if not signalled:
            signalled.append(1)
            client.key_value_set("test/p1-wrote-or-started", "1")

    def write_then_wait(tmp, data):  # process 1: its temp file exists until process 0 has taken over
        real_write(tmp, data)
        if os.path.dirname(str(tmp)) == durable:
            signal_once()
            client.blocking_key_value_get("test/p0-took-over", 60_000)

    def wait_then_take_over(folder, directory, *args, **kwargs):  # process 0
        if directory == durable:
            client.blocking_key_value_get("test/p1-wrote-or-started", 60_000)
        try:
            return real_take_over(folder, directory, *args, **kwargs)
        finally:
            if directory == durable:
                client.key_value_set("test/p0-took-over", "1")

    def signal_then_agree(what, error):  # process 1 has started, before the start-up agreement
        signal_once()
        real_started(what, error)

    real_started = multihost.started
    if pid == 1:
        locations.write_durable = write_then_wait
        multihost.started = signal_then_agree
    else:
        startup.take_over = wait_then_take_over
    ckpt = jaxckpt.Checkpoint(state=state())
    local = os.path.join(path, f"local-{pid}")
    with jaxckpt.CheckpointManager(ckpt, durable, local_directory=local) as manager:
        assert manager.restore_or_initialize() is None
elif mode in ("tiers-save", "tiers-restore"):  # two tiers: each process's local disk, one durable folder
    local, durable = os.path.join(path, f"local-{pid}"), os.path.join(path, "durable")

    def stepped(step):
        values = {
            k: jax.make_array_from_callback(v.shape, sharding(k), lambda i, v=v: v[i] * step) for k, v in VALUES.items()
        }
        return {**values, "step": step}

    options = dict(max_to_keep=2, local_directory=local, save_interval_steps=2, durable_interval_steps=4)
    if mode == "tiers-save":
        ckpt = jaxckpt.Checkpoint(state=stepped(0))
        with jaxckpt.CheckpointManager(ckpt, durable, **options) as manager:
            for step in range(1, 11):
                ckpt.state = stepped(step)
                manager.save(step=step)
            manager.wait_until_finished()
            assert [c.step for c in manager.local_checkpoint_infos] == [8, 10], manager.local_checkpoint_infos
            assert [c.step for c in manager.checkpoint_infos] == [4, 8], manager.checkpoint_infos  # durable
            assert manager.all_steps() == [4, 8, 10], manager.all_steps()  # either tier
    else:
        template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(k)) for k, v in VALUES.items()}
        ckpt = jaxckpt.Checkpoint(state={**template, "step": 0})
        with jaxckpt.CheckpointManager(ckpt, durable, **options) as manager:
            restored = manager.restore_or_initialize()
        step = ckpt.state["step"]
        for name, value in VALUES.items():
            for shard in ckpt.state[name].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index] * step, err_msg=name)
        print(f"process {pid}: restored {restored} at step {step}", flush=True)
print(f"process {pid}: {mode} ok", flush=True)
if nproc > 1:
    jax.distributed.shutdown()
