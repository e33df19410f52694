"""A pod reads each byte once and writes in parallel (issue 43): four ``jax.distributed`` CPU
processes save and restore on ``s3://`` (moto), each through its own counting proxy, as
``benchmarks/pod_io.py`` measures them. Bytes and requests are counted, never timed."""

import sys
import uuid
from pathlib import Path

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
