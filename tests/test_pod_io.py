"""A pod reads each byte once and writes in parallel (issue 43): four ``jax.distributed`` CPU
processes save and restore on ``s3://`` (moto), each through its own counting proxy, as
``benchmarks/pod_io.py`` measures them. Bytes and requests are counted, never timed."""

import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pod_io
from conftest import BUCKET


@pytest.fixture
def bucket(s3_server):
    return lambda layout: f"s3://{BUCKET}/{layout}-{uuid.uuid4().hex[:8]}"


def save_and_restore(s3_server, url, layout, share="auto"):
    saved = pod_io.run("save", layout, url, s3_server)
    restored = pod_io.run("restore", layout, url, s3_server, share=share)  # each checks its shards bit for bit
    return pod_io.stored_bytes(saved), [r["bytes_written"] for r in saved], [r["bytes_read"] for r in restored]


@pytest.mark.parametrize("layout", ["dp", "mix"])
def test_a_state_that_processes_share_is_read_once_in_all_and_written_in_equal_parts(s3_server, bucket, layout):
    # dp: every array replicated on all four processes; mix: sharded over 2 FSDP processes, replicated
    # over 2 data-parallel groups. Before, a dp restore read the whole checkpoint on every process
    # (4x), and process 0 wrote every replicated byte.
    total, written, read = save_and_restore(s3_server, bucket(layout), layout)
    assert sum(read) <= 1.05 * total, (read, total)
    assert all(0.2 * total <= r <= 0.3 * total for r in read), (read, total)
    assert max(written) <= 1.3 * sum(written) / len(written), written


def test_share_reads_false_reads_what_each_process_needs_itself(s3_server, bucket):
    total, _, read = save_and_restore(s3_server, bucket("dp"), "dp", share="off")
    assert all(r >= 0.95 * total for r in read), (read, total)  # every process read all of it


def test_a_process_whose_read_fails_makes_every_process_raise_naming_it(s3_server, bucket):
    # Process 2 cannot read its slabs (the bucket answers 404): it raises its own error; the others,
    # whose reads went well, raise at the same call naming process 2, and none waits in the collective.
    url = bucket("dp")
    pod_io.run("save", "dp", url, s3_server)
    missing = {2: lambda method, path: 404 if method == "GET" and "/data.p2/a/" in path else None}
    results = pod_io.run("restore", "dp", url, s3_server, faults=missing, failing=True)
    assert all(r["returncode"] != 0 for r in results), [r["output"][-2000:] for r in results]
    for i, r in enumerate(results):
        if i != 2:
            assert "Process 2 failed in its part of a restore that shares reads" in r["output"], r["output"][-3000:]


def test_a_state_saved_on_one_layout_restores_shared_onto_another(s3_server, bucket, monkeypatch):
    # Saved as the 2 x 2 mix (slabs split by fsdp, then data), read as slabs of the data-parallel
    # cut: each process checks its shards bit for bit (pod_worker.py), and the bytes are read once.
    url = bucket("mix")
    saved = pod_io.run("save", "mix", url, s3_server)
    monkeypatch.setenv("POD_RESTORE_LAYOUT", "dp")
    read = [r["bytes_read"] for r in pod_io.run("restore", "mix", url, s3_server, share="on")]
    assert sum(read) <= 1.05 * pod_io.stored_bytes(saved), read


def test_share_reads_takes_a_bool_or_none_and_the_variable_on_or_off(tmp_path, monkeypatch):
    import jaxckpt

    jaxckpt.save(tmp_path / "c", {"x": np.arange(4)})
    with pytest.raises(TypeError, match="share_reads must be True, False or None"):
        jaxckpt.restore(tmp_path / "c", share_reads="yes")
    monkeypatch.setenv("JAXCKPT_SHARE_READS", "sometimes")
    with pytest.raises(jaxckpt.JaxckptError, match="JAXCKPT_SHARE_READS='sometimes' is neither on"):
        jaxckpt.restore(tmp_path / "c")
    for said in ("1", "off"):  # one process: nothing to share either way
        monkeypatch.setenv("JAXCKPT_SHARE_READS", said)
        np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "c", share_reads=None)["x"], np.arange(4))
