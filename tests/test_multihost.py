"""Multi-process saves and restores on jax.distributed (local CPU processes, gloo collectives)."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt.format import index_json, records
from jaxckpt.tools import cli

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode, path, nproc, ndev, mesh, timeout=240, env=None):
    """Start ``nproc`` processes of the worker; return their (returncode, output).

    Each writes to its own file, not a pipe: a worker whose pipe filled up while the test waited on
    another would block in a write, and the others would wait for it in the next agreement.
    """
    port = free_port()
    env = {**os.environ, **(env or {})}
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory(prefix="jaxckpt-mh-") as logs:
        files = [open(Path(logs) / f"{i}.log", "w+") for i in range(nproc)]
        try:
            procs = [
                subprocess.Popen(
                    [sys.executable, str(WORKER), mode, str(i), str(nproc), str(ndev), str(port), str(path), mesh],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=env,
                )
                for i, f in enumerate(files)
            ]
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(
                        f"{mode}: the processes did not finish in {timeout} s:\n{stacks(procs, files)}"
                    ) from None
            return [(p.returncode, _output(f)) for p, f in zip(procs, files, strict=True)]
        finally:
            for f in files:
                f.close()


def _output(f):
    f.flush()
    f.seek(0)
    return f.read()


def stacks(procs, files):
    """Every process's threads' stacks (the worker dumps them on SIGUSR1), then the processes killed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    outs = []
    for i, (p, f) in enumerate(zip(procs, files, strict=True)):
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        outs.append(f"--- process {i} ({p.returncode}):\n{_output(f)[-8000:]}")
    for p in procs:
        p.kill()
    return "\n".join(outs)


def ok(results, mode):
    for i, (code, out) in enumerate(results):
        assert code == 0 and f"process {i}: {mode} ok" in out, f"process {i} exited {code}:\n{out[-3000:]}"


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    path = tmp_path_factory.mktemp("mh") / "by-two"
    ok(run("save", path, nproc=2, ndev=2, mesh="2x2"), "save")
    return path


def test_two_processes_write_one_checkpoint_each_its_own_shards(saved_by_two):
    raw = (saved_by_two / "index.json").read_bytes()
    index = json.loads(raw)
    assert sorted(p.name for p in saved_by_two.iterdir()) == ["data", "data.p1", "index.json"]
    # The sharding is recorded once (the device table, the mesh, a spec per array); no regions are listed.
    ids = index["devices"]["id"]
    assert index["devices"]["process"] == [0, 0, 1, 1] and len(set(ids)) == 4
    assert index["meshes"] == [{"axes": ["x", "y"], "shape": [2, 2], "devices": ids}]
    assert b'"regions"' not in raw
    rows = index["leaves"]["state/rows"]["at"]
    assert (rows["mesh"], rows["spec"]) == (0, [["x"], None])
    parsed = index_json.decode_index(raw, "index.json").leaves
    # each process its half
    assert records.regions(parsed["state/rows"].at, (512, 640)) == {
        "data": [[(0, 256), (0, 640)]],
        "data.p1": [[(256, 512), (0, 640)]],
    }
    # Replicated over both processes (2.6 MB): each writes half, split by the axis that replicates it
    # across processes (x), recorded as a spec like any other (issue 43).
    assert index["leaves"]["state/replicated"]["at"]["spec"] == [["x"], None]
    assert records.regions(parsed["state/replicated"].at, (1024, 640)) == {
        "data": [[(0, 512), (0, 640)]],
        "data.p1": [[(512, 1024), (0, 640)]],
    }
    # "cols" is split by y, within each process: process 0 holds all of it and writes it whole.
    assert "spec" not in index["leaves"]["state/cols"]["at"]
    assert "pack" in index["leaves"]["state/small_replicated"]["at"]
    assert index["leaves"]["state/xy"]["at"]["spec"] == [["x"], ["y"]]  # small but sharded over processes: not packed


def test_restore_with_other_process_counts_and_meshes(saved_by_two):
    ok(run("restore", saved_by_two, nproc=4, ndev=2, mesh="2x4"), "restore")
    ok(run("restore", saved_by_two, nproc=1, ndev=8, mesh="4x2"), "restore")


def test_one_cpu_device_reads_what_many_processes_wrote(saved_by_two):
    expected = np.random.default_rng(7).standard_normal((64, 48)).astype(np.float32)
    np.testing.assert_array_equal(jaxckpt.load_variable(saved_by_two, "state/xy"), expected)
    assert dict(jaxckpt.list_variables(saved_by_two))["state/cols"] == (16, 40_000)
    assert jaxckpt.restore(saved_by_two)["state"]["step"] == 7


def test_four_processes_save_and_two_restore(tmp_path):
    path = tmp_path / "by-four"
    ok(run("save", path, nproc=4, ndev=2, mesh="4x2"), "save")
    assert sorted(p.name for p in path.iterdir()) == ["data", "data.p1", "data.p2", "data.p3", "index.json"]
    ok(run("restore", path, nproc=2, ndev=2, mesh="2x2"), "restore")


def stores_opened(results):
    """The data stores each restoring process opened (the worker prints them)."""
    return [
        set(out.split(f"process {i}: stores ", 1)[1].split("\n", 1)[0].split(",")) for i, (_, out) in enumerate(results)
    ]


def test_eight_processes_of_one_device_save_and_two_of_four_restore(tmp_path):
    path = tmp_path / "by-eight"
    ok(run("save", path, nproc=8, ndev=1, mesh="4x2"), "save")
    assert sorted(p.name for p in path.iterdir()) == ["data", *(f"data.p{i}" for i in range(1, 8)), "index.json"]
    index = json.loads((path / "index.json").read_text())
    assert index["devices"]["process"] == list(range(8)) and len(index["meshes"]) == 1
    results = run("restore", path, nproc=2, ndev=4, mesh="4x2")
    ok(results, "restore")
    # Process 0 holds mesh rows 0-1 (written by processes 0-3), process 1 rows 2-3 (processes 4-7);
    # "cols" (split by y only) was written by processes 0 and 1, and so was "replicated": in halves
    # split by y (eighths or quarters would be slabs under 1 MiB).
    assert stores_opened(results) == [
        {"data", "data.p1", "data.p2", "data.p3"},
        {"data", "data.p1", "data.p4", "data.p5", "data.p6", "data.p7"},
    ]
    index = json.loads((path / "index.json").read_text())
    assert index["leaves"]["state/cols"]["at"]["spec"] == [None, ["y"]]
    assert index["leaves"]["state/replicated"]["at"]["spec"] == [["y"], None]


def test_manager_across_processes(tmp_path):
    ok(run("manager", tmp_path, nproc=2, ndev=2, mesh="2x2"), "manager")
    state = json.loads((tmp_path / "checkpoint").read_text())
    assert [c["prefix"] for c in state["checkpoints"]] == ["ckpt-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-2"]  # lock released, ckpt-1 gone


def test_incremental_saves_across_processes_link_each_process_s_own_shards(tmp_path):
    ok(run("manager-incremental", tmp_path, nproc=2, ndev=2, mesh="2x2"), "manager-incremental")
    names = ["ckpt-1", "ckpt-2", "ckpt-3"]
    index = json.loads((tmp_path / "ckpt-1" / "index.json").read_text())
    # over 1 MiB, or sharded over both processes (never packed): remembered, so linked
    for key in ("state/rows", "state/cols", "state/replicated", "state/xy"):
        array = index["leaves"][key]["at"]["array"]
        files = [
            {
                str(p.relative_to(tmp_path / n)): p.stat()
                for p in (tmp_path / n).glob(f"data*/{array}/c/**/*")
                if p.is_file()
            }
            for n in names
        ]
        assert files[0] and all(f.keys() == files[0].keys() for f in files), (key, files)
        stores = {name.split("/")[0] for name in files[0]}
        # each process writes its part: "replicated" is split further by the axis that replicates it
        # across processes (x); "cols" is not (its halves would be under 1 MiB): process 0 writes it
        assert stores == ({"data"} if key == "state/cols" else {"data", "data.p1"}), (key, stores)
        for name, first in files[0].items():  # written once, by the process that owns the shard
            assert all(f[name].st_ino == first.st_ino for f in files[1:]) and first.st_nlink == 3, (key, name)
    rng = np.random.default_rng(7)  # the worker's values
    values = {
        "xy": rng.standard_normal((64, 48)).astype(np.float32),
        "rows": rng.standard_normal((512, 640)).astype(np.float32),
        "cols": rng.integers(0, 100, (16, 40_000)).astype(np.int32),
        "replicated": rng.standard_normal((1024, 640)).astype(np.float32),
    }
    for n in names:
        restored = jaxckpt.restore(tmp_path / n)
        for name, value in values.items():
            np.testing.assert_array_equal(restored["state"][name], value, err_msg=f"{n} {name}")


def test_incremental_saves_across_processes_on_a_bucket_refer_to_each_process_s_own_shards(s3):
    # On a bucket an array of its own that each process saved or restored is a reference in that
    # process's data store; leaves that process 0 alone holds, and replicated ones of up to 1 MiB, are packed.
    ok(run("manager-incremental", s3, nproc=2, ndev=2, mesh="2x2"), "manager-incremental")
    from jaxckpt.format import refs_json
    from jaxckpt.storage import locations

    for n in ("ckpt-2", "ckpt-3"):
        where = locations.location(f"{s3}/{n}")
        index = json.loads(locations.read_file(where, "index.json"))
        assert index["version"] == 6, n
        # "rows" and "xy" are sharded over both processes: arrays of their own, however small;
        # "replicated" is written half by each process, so each refers to its half
        arrays = {index["leaves"][f"state/{k}"]["at"]["array"] for k in ("rows", "xy", "replicated")}
        for store in ("data", "data.p1"):  # each process's shards, referred to by that process
            refs = refs_json.decode(locations.read_file(where, f"{store}/refs.json"), "", None)
            assert set(refs) == arrays, (n, store)
            assert {(r.checkpoint, r.store) for r in refs.values()} == {("ckpt-1", store)}, (n, store)
    rng = np.random.default_rng(7)  # the worker's values
    xy = rng.standard_normal((64, 48)).astype(np.float32)
    rows = rng.standard_normal((512, 640)).astype(np.float32)
    for n in ("ckpt-1", "ckpt-2", "ckpt-3"):
        restored = jaxckpt.restore(f"{s3}/{n}")["state"]
        np.testing.assert_array_equal(restored["rows"], rows, err_msg=n)
        np.testing.assert_array_equal(restored["xy"], xy, err_msg=n)


def test_a_save_one_process_fails_before_its_token_fails_everywhere_and_the_next_works(tmp_path):
    # Before: the others went on and waited at a barrier, and the failed process's save counter lagged
    # behind, so every later save waited for a token of another save until the barrier timeout.
    results = run("manager-fail", tmp_path, nproc=2, ndev=2, mesh="2x2", env={"JAXCKPT_BARRIER_TIMEOUT_S": "30"})
    ok(results, "manager-fail")
    assert jaxckpt.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-2"]  # no staging folder left


def test_a_plain_save_one_process_fails_fails_everywhere_and_the_next_works(tmp_path):
    results = run("save-fail", tmp_path, nproc=2, ndev=2, mesh="2x2", env={"JAXCKPT_BARRIER_TIMEOUT_S": "30"})
    ok(results, "save-fail")
    # no staging folder left (Checkpoint.save may also write a "checkpoint" state file, as TensorFlow's does)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "checkpoint") == ["ckpt-1", "plain"]


def test_process_0_decides_retention_and_the_others_follow(tmp_path):
    ok(run("manager-retention", tmp_path, nproc=2, ndev=2, mesh="2x2"), "manager-retention")


def test_save_dtypes_across_processes(tmp_path):
    """Each process casts its shards on its own devices and writes them in bfloat16; the index says so."""
    ok(run("save-dtypes", tmp_path, nproc=2, ndev=2, mesh="2x2"), "save-dtypes")
    index = json.loads((tmp_path / "ckpt-1" / "index.json").read_text())
    assert {k: v["dtype"] for k, v in index["leaves"].items() if "dtype" in v} == {
        "state/xy": "bfloat16",
        "state/rows": "bfloat16",
        "state/cols": "int32",
        "state/replicated": "bfloat16",
        "state/small_replicated": "bfloat16",
    }
    assert index["leaves"]["state/rows"]["at"]["spec"] == [["x"], None]  # its mesh layout, as in float32


def test_a_save_decision_by_time_is_process_0_s_on_every_process(tmp_path):
    """save_interval_secs and save_continuously decide by a clock, and each process's differs (and its
    background save ends at its own moment): a process that decided alone would wait for the others'
    save forever. Process 0 decides for all (short barrier timeout: a disagreement fails fast)."""
    results = run("manager-by-time", tmp_path, nproc=2, ndev=2, mesh="2x2", env={"JAXCKPT_BARRIER_TIMEOUT_S": "60"})
    ok(results, "manager-by-time")
    said = [next(line for line in out.splitlines() if "continuous saved" in line) for _, out in results]
    assert said[0].split(":", 1)[1] == said[1].split(":", 1)[1], said
    assert "saved [1" in said[0]  # the first step is due: nothing is being written yet


def test_delete_across_processes(tmp_path):
    ok(run("manager-delete", tmp_path, nproc=2, ndev=2, mesh="2x2"), "manager-delete")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-1", "ckpt-2"]


def test_a_process_killed_mid_save_publishes_nothing(tmp_path, saved_by_two):
    path = tmp_path / "never"
    results = run("save-then-die", path, nproc=2, ndev=2, mesh="2x2", env={"JAXCKPT_BARRIER_TIMEOUT_S": "20"})
    assert results[1][0] == -9  # process 1 was killed after writing its bytes
    assert results[0][0] != 0, results[0][1]  # process 0 failed (or was stopped by the runtime): no publish
    assert not path.exists()
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(path)
    assert jaxckpt.restore(saved_by_two)["state"]["step"] == 7  # the previous checkpoint still restores


def test_two_tiers_across_processes_restore_locally_only_if_every_process_can(tmp_path):
    """Each process keeps its own local tier (its regions, the packs, the index); the durable copy is
    the checkpoint all of them would have saved there. A restart restores the local step only if every
    process has it (or, for a process that lost its local tier, a peer holds a copy of its part);
    otherwise every process restores the durable one."""
    ok(run("tiers-save", tmp_path, nproc=2, ndev=2, mesh="2x2"), "tiers-save")
    durable = tmp_path / "durable"
    # The durable ckpt-8 is one whole checkpoint: one process without the others reads all of it.
    assert jaxckpt.load_variable(durable / "ckpt-8", "state/step") == 8
    rng = np.random.default_rng(7)  # the worker's values: "xy", then "rows"
    rng.standard_normal((64, 48))
    expected_rows = rng.standard_normal((512, 640)).astype(np.float32) * 8
    np.testing.assert_array_equal(jaxckpt.load_variable(durable / "ckpt-8", "state/rows"), expected_rows)
    assert cli.main(["verify", str(durable)]) == 0
    results = run("tiers-restore", tmp_path, nproc=2, ndev=2, mesh="2x2")
    ok(results, "tiers-restore")
    for i, (_, out) in enumerate(results):
        assert f"restored {tmp_path / f'local-{i}' / 'ckpt-10'} at step 10" in out, out
    # Process 1's local copy is damaged: it cannot restore it, so no process restores locally.
    shards = (tmp_path / "local-1" / "ckpt-10" / "data.p1").rglob("*")
    data = max((p for p in shards if p.is_file() and p.name != "zarr.json"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF  # the first value's first byte (a shard's file starts with data)
    data.write_bytes(bytes(raw))
    results = run("tiers-restore", tmp_path, nproc=2, ndev=2, mesh="2x2")
    ok(results, "tiers-restore")
    for _, out in results:
        assert f"restored {durable / 'ckpt-8'} at step 8" in out, out
    import shutil

    shutil.rmtree(tmp_path / "local-1")  # process 1's host was replaced: process 0 holds its peer copy of ckpt-8
    results = run("tiers-restore", tmp_path, nproc=2, ndev=2, mesh="2x2")
    ok(results, "tiers-restore")
    for i, (_, out) in enumerate(results):
        assert f"restored {tmp_path / f'local-{i}' / 'ckpt-8'} at step 8" in out, out


def test_two_tiers_start_while_process_0_cleans_the_durable_folder(tmp_path):
    # Before: every process wrote the durable folder's checkpoint.tiers, through a temp file that
    # process 0's start-up removed as a crash's leftover when it came at the wrong time (a busy
    # machine); process 1 then failed to start, and process 0 waited for its restore for 30 minutes.
    results = run("tiers-start", tmp_path, nproc=2, ndev=2, mesh="2x2", env={"JAXCKPT_BARRIER_TIMEOUT_S": "60"})
    ok(results, "tiers-start")
    tiers = json.loads((tmp_path / "durable" / "checkpoint.tiers").read_text())
    assert tiers["local"] == str(tmp_path / "local-0"), tiers  # process 0's, the folder's owner


def test_a_manager_that_fails_to_start_on_one_process_fails_at_once_on_every_process(tmp_path):
    # Before: process 0's manager started, and its first save waited for process 1's token until
    # JAXCKPT_BARRIER_TIMEOUT_S (30 minutes by default).
    env = {"JAXCKPT_BARRIER_TIMEOUT_S": "600"}
    ok(run("manager-start-fail", tmp_path, nproc=2, ndev=1, mesh="2x1", timeout=120, env=env), "manager-start-fail")


def test_an_agreement_a_process_never_joins_ends_in_an_error_that_names_it(tmp_path):
    ok(run("agree-alone", tmp_path, nproc=2, ndev=1, mesh="2x1", env={"JAXCKPT_BARRIER_TIMEOUT_S": "2"}), "agree-alone")


def test_each_process_gets_its_own_iterator_state_back(tmp_path):
    path = tmp_path / "iterators"
    ok(run("iterator-save", path, nproc=2, ndev=1, mesh="2x1"), "iterator-save")
    leaves = json.loads((path / "ckpt-1" / "index.json").read_text())["leaves"]
    assert leaves["data"] == {
        "type": "state_per_process",
        "value": [{"type": "state", "value": {"position": 10}}, {"type": "state_bytes", "value": "MjA="}],
    }
    assert leaves["epoch"] == {"type": "state", "value": {"position": 4}}  # the same everywhere: once
    ok(run("iterator-restore", path, nproc=2, ndev=1, mesh="2x1"), "iterator-restore")
    # Another process count: refused, naming the key and both counts, never another process's state.
    with pytest.raises(jaxckpt.MismatchError, match=r"'data'.*2 processes.*1 process"):
        jaxckpt.Checkpoint(data=_Position()).restore(path / "ckpt-1")
    epoch = _Position()
    jaxckpt.Checkpoint(epoch=epoch).restore(path / "ckpt-1")
    assert epoch.position == 4


class _Position:
    def __init__(self):
        self.position = 0

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = state["position"]


def test_each_process_gets_its_own_iterator_state_back_from_the_durable_tier(tmp_path):
    ok(run("iterator-tiers", tmp_path, nproc=2, ndev=1, mesh="2x1"), "iterator-tiers")
    leaves = json.loads((tmp_path / "durable" / "ckpt-1" / "index.json").read_text())["leaves"]
    assert leaves["data"]["type"] == "state_per_process", leaves["data"]


def test_a_process_stopped_mid_save_is_named_with_what_it_was_doing(tmp_path):
    # Issue 44: process 2 stops (SIGSTOP) while it writes its part. The other three wait at the
    # barrier after the writes only until the deadline (a short margin here, plus their bytes at the
    # least rate), then raise, naming process 2 and the phase it last reported; nothing is published.
    port = free_port()
    env = {**os.environ, "JAXCKPT_BARRIER_TIMEOUT_S": "3", "JAXCKPT_MIN_RATE_MIB_S": "1000"}
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory(prefix="jaxckpt-mh-") as logs:
        files = [open(Path(logs) / f"{i}.log", "w+") for i in range(4)]
        argv = [sys.executable, str(WORKER), "stall-save"]
        procs = [
            subprocess.Popen(
                [*argv, str(i), "4", "1", str(port), str(tmp_path), "4x1"], stdout=f, stderr=subprocess.STDOUT, env=env
            )
            for i, f in enumerate(files)
        ]
        try:
            for i in (0, 1, 3):
                try:
                    procs[i].wait(timeout=180)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"process {i} still waits:\n{stacks(procs, files)}") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        outputs = [_output(f) for f in files]
        for f in files:
            f.close()
    for i in (0, 1, 3):
        assert procs[i].returncode == 0 and "stall-save ok" in outputs[i], outputs[i][-3000:]
        assert "waited 3.0 s at barrier" in outputs[i], outputs[i][-3000:]  # 3 s, plus 5 MiB at 1000 MiB/s
    assert not (tmp_path / "stalled").exists()


def test_a_save_whose_writes_fail_on_one_process_is_listed_nowhere_and_the_next_works(tmp_path):
    # Before: process 1 raised alone; the others waited for it at the barrier after the writes until
    # the barrier timeout (30 minutes). Now it comes and says so, and all four raise at once.
    ok(run("write-fail", tmp_path, nproc=4, ndev=1, mesh="4x1", env={"JAXCKPT_BARRIER_TIMEOUT_S": "120"}), "write-fail")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-2"]
