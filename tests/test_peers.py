"""Peer copies of two tiers' local checkpoints, and restores after a host is replaced (issue 44).

Four ``jax.distributed`` CPU processes (gloo) save with two tiers (``benchmarks/peers_worker.py``,
started by ``benchmarks/peers.py``); a host that is replaced is a local directory wiped. Each
restoring process checks its shards and its data iterator's position bit for bit.
"""

import shutil
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt.manager import peer_files, peers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers as peers_bench
from conftest import BUCKET

TWO_HOSTS = [{"JAXCKPT_FAILURE_DOMAIN": h} for h in ("host-a", "host-a", "host-b", "host-b")]


def test_copies_go_to_another_failure_domain_where_there_is_one():
    # Two hosts of two processes: each copy on the other host (offset 2: 0 and 2, 1 and 3 hold each other's).
    assert peers.placement(["a", "a", "b", "b"], 1) == ([0, 1, 2, 3], [2])
    assert peers.placement(["b", "a", "b", "a"], 1) == ([1, 3, 0, 2], [2])
    # One host (a test machine): another process, then the next.
    assert peers.placement(["h"] * 4, 2) == ([0, 1, 2, 3], [1, 2])
    # Three on one host and one on another: no permutation keeps every copy off its host; the fewest share.
    assert len(peers.placement(["a", "a", "a", "b"], 1)[1]) == 1
    with pytest.raises(ValueError, match="local_replicas must be a whole number"):
        peers.replicas_for(-1, 4)
    assert peers.replicas_for(None, 1) == 0 and peers.replicas_for(None, 4) == 1
    with pytest.warns(UserWarning, match="only 3 other processes"):
        assert peers.replicas_for(5, 4) == 3


def _stream(folder, header, crcs=None, piece=7919):
    out = peer_files.Outgoing(folder, header, crcs)
    chunks = []
    while (offset := sum(len(c) for c in chunks)) < out.length:
        chunks.append(out.read(offset, min(piece, out.length - offset)))
    out.close()
    return b"".join(chunks)


def test_a_stream_carries_a_checkpoint_folder_bit_for_bit_and_finds_damage(tmp_path):
    jaxckpt.save(tmp_path / "c", {"w": np.arange(50_000, dtype=np.float32), "note": "x"})
    folder = tmp_path / "c"
    header = {"origin": 1, "name": "c", "files": peer_files.checkpoint_files(folder)}
    data = _stream(folder, header)
    incoming = peer_files.Incoming(tmp_path / "got", "process 1's c")
    for i in range(0, len(data), 4096):  # other boundaries than the sender's
        incoming.feed(memoryview(data)[i : i + 4096])
    got, crcs = incoming.finish()
    assert got["files"][-1][0] == "index.json"
    for rel, _ in header["files"]:
        assert (tmp_path / "got" / rel).read_bytes() == (folder / rel).read_bytes()
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "got")["w"], np.arange(50_000, dtype=np.float32))
    # A holder sends the origin's CRC-32C values: a byte changed on its disk is found where it arrives.
    largest = max(header["files"], key=lambda f: f[1])[0]
    raw = bytearray((folder / largest).read_bytes())
    raw[len(raw) // 2] ^= 1
    (folder / largest).write_bytes(bytes(raw))
    damaged = peer_files.Incoming(tmp_path / "again", "process 1's c")
    damaged.feed(memoryview(_stream(folder, header, crcs)))
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=f"{largest}.*CRC-32C"):
        damaged.finish()
    # A file the sender cannot read goes as zeros with a CRC-32C that refuses them, and the sender says why.
    (folder / largest).unlink()
    out = peer_files.Outgoing(folder, header)
    gone = peer_files.Incoming(tmp_path / "gone", "process 1's c")
    gone.feed(memoryview(out.read(0, out.length)))
    assert isinstance(out.error, FileNotFoundError), out.error
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=f"{largest}.*CRC-32C"):
        gone.finish()
    broken = peer_files.Incoming(tmp_path / "broken", "x")
    broken.feed(memoryview(b"\xff" * 64))  # never raises while the rounds go on
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="claims a header"):
        broken.finish()


def _restored(results):
    return [(r["restored"], r["step"]) for r in results]


def test_a_replaced_host_restores_from_its_peer_without_the_bucket(s3_server, tmp_path):
    durable = f"s3://{BUCKET}/peers-{uuid.uuid4().hex[:8]}"
    run = lambda mode: peers_bench.run(mode, str(tmp_path), durable, each=TWO_HOSTS, moto_env=s3_server)  # noqa: E731
    saved = run("save")
    assert all(r["local"] == [2, 3] and r["durable"] == [2] for r in saved), saved
    # Each copy is on the other host: process 0 holds process 2's, and 2 holds 0's; 1 and 3 likewise.
    held = {i: sorted(p.name for p in (tmp_path / f"local-{i}" / "peer-copies").iterdir()) for i in range(4)}
    assert held == {0: ["p2"], 1: ["p3"], 2: ["p0"], 3: ["p1"]}, held
    copy = tmp_path / "local-3" / "peer-copies" / "p1"
    assert (copy / "ckpt-3.json").is_file() and (copy / "ckpt-2.json").is_file()
    for f in (tmp_path / "local-1" / "ckpt-3").rglob("*"):
        if f.is_file():
            assert (copy / "ckpt-3" / f.relative_to(tmp_path / "local-1" / "ckpt-3")).read_bytes() == f.read_bytes()

    shutil.rmtree(tmp_path / "local-1")  # process 1's host was replaced
    results = run("restore")
    assert _restored(results) == [(str(tmp_path / f"local-{i}" / "ckpt-3"), 3) for i in range(4)], results
    assert [r["requests"] for r in results] == [0, 0, 0, 0], results  # the bucket was not asked for anything
    assert results[1]["local"] == [3] and not any(r["warnings"] for r in results), results

    # Processes 0 and 2 hold each other's copies: both gone, step 3 cannot be assembled; the bucket serves.
    shutil.rmtree(tmp_path / "local-0")
    shutil.rmtree(tmp_path / "local-2")
    results = run("restore")
    assert _restored(results) == [(f"{durable}/ckpt-2", 2)] * 4, results
    for r in results:
        assert any("ckpt-3 lacks process 0's and process 2's part" in w for w in r["warnings"]), r["warnings"]
        assert any("restoring the durable tier's" in w for w in r["warnings"]), r["warnings"]


def test_a_damaged_peer_copy_is_found_and_another_copy_or_the_durable_tier_serves(tmp_path):
    durable = str(tmp_path / "durable")
    env = {"PEERS_REPLICAS": "2", "PEERS_DURABLE_EVERY": "1"}  # one host: process 1's copies on 2 and 3
    run = lambda mode: peers_bench.run(mode, str(tmp_path), durable, env=env)  # noqa: E731
    saved = run("save")
    assert all(r["durable"] == [2, 3] for r in saved), saved

    def damage(holder):
        copy = tmp_path / f"local-{holder}" / "peer-copies" / "p1" / "ckpt-3"
        largest = max((p for p in copy.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        raw = bytearray(largest.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        largest.write_bytes(bytes(raw))

    damage(2)
    shutil.rmtree(tmp_path / "local-1")
    results = run("restore")
    assert _restored(results) == [(str(tmp_path / f"local-{i}" / "ckpt-3"), 3) for i in range(4)], results
    for r in results:  # named on every process, and the copy that process 3 holds served
        assert any("from the copy that process 2 holds" in w and "CRC-32C" in w for w in r["warnings"]), r

    damage(3)  # now both copies are damaged
    shutil.rmtree(tmp_path / "local-1")
    results = run("restore")
    assert _restored(results) == [(str(tmp_path / "durable" / "ckpt-3"), 3)] * 4, results
    for r in results:
        said = " ".join(r["warnings"])
        assert "process 2 holds" in said and "process 3 holds" in said and "lacks process 1's part" in said, said


def test_local_replicas_is_an_option_of_two_tiers_and_nothing_to_do_with_one_process(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=np.arange(3))
    with pytest.raises(ValueError, match="local_replicas is an option of two tiers"):
        jaxckpt.CheckpointManager(ckpt, tmp_path / "d", local_replicas=1)
    with pytest.raises(ValueError, match="local_replicas must be a whole number"):
        jaxckpt.CheckpointManager(ckpt, tmp_path / "d", local_directory=tmp_path / "l", local_replicas=True)
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "d", local_directory=tmp_path / "l", local_replicas=2) as manager:
        manager.save(step=1)
        manager.wait_until_finished()
    assert not (tmp_path / "l" / peer_files.PEERS).exists()  # one process: no peer to copy to
