"""The two-tier copy (jaxckpt.manager.durable_copy): several files in flight within the host memory budget, a file
over the budget alone, and a local destination streamed in chunks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from jaxckpt.manager import durable_copy
from jaxckpt.storage import kvstore, locations


def _source(tmp_path, sizes: dict[str, int]):
    source = tmp_path / "ckpt-1"
    (source / "data").mkdir(parents=True)
    (source / "index.json").write_text("{}")
    for name, size in sizes.items():
        (source / "data" / name).write_bytes(bytes([(len(name) * 7 + i) % 256 for i in range(256)]) * (size // 256))
    return source


def test_files_are_copied_several_at_once_within_the_budget(tmp_path, monkeypatch):
    size = 64 << 10
    cost = durable_copy.file_cost(size, locations.location("memory://x"))  # three copies of a value, in TensorStore
    sizes = {f"f{i}": size for i in range(6)} | {"huge": 4 * size}
    source = _source(tmp_path, sizes)
    budget = 2 * cost + cost // 2  # two of the small files fit at once, never three; "huge" never fits
    real, lock = durable_copy._copy_file, threading.Lock()
    in_flight: list[str] = []
    seen: list[list[str]] = []
    second = threading.Event()

    def tracked(path, staging, rel):
        with lock:
            in_flight.append(path.name)
            seen.append(sorted(in_flight))
            if len(in_flight) == 2:
                second.set()
        try:
            if path.name == "f0":  # the first file waits until a second one is in flight
                assert second.wait(60), "a second file was never copied while the first one was"
            return real(path, staging, rel)
        finally:
            with lock:
                in_flight.remove(path.name)

    monkeypatch.setattr(durable_copy, "_copy_file", tracked)
    dest = locations.location(f"memory://{tmp_path.name}/ckpt-1")
    durable_copy.copy_checkpoint(source, dest, budget=budget)
    assert max(len(s) for s in seen) == 2  # several at once, never more than the budget holds
    assert ["huge"] in seen and not any("huge" in s and len(s) > 1 for s in seen)  # over the budget: alone
    for name in sizes:
        assert kvstore.kv_read(dest.spec(), f"data/{name}") == (source / "data" / name).read_bytes()
    assert kvstore.kv_read(dest.spec(), "index.json") == b"{}"


def test_a_failed_file_stops_the_copy_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    source = _source(tmp_path, {f"f{i}": 1024 for i in range(20)})
    real = durable_copy._copy_file

    def failing(path, staging, rel):
        if path.name == "f3":
            raise OSError(5, "Input/output error", str(path))
        return real(path, staging, rel)

    monkeypatch.setattr(durable_copy, "_copy_file", failing)
    dest = tmp_path / "durable" / "ckpt-1"
    with pytest.raises(OSError, match="Input/output error"):
        durable_copy.copy_checkpoint(source, locations.location(dest))
    assert not dest.exists()
    assert not any((tmp_path / "durable").iterdir())  # the staging folder is gone too


STREAMED = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from jaxckpt.manager import durable_copy
    from jaxckpt.storage import locations

    source, dest = Path(sys.argv[1]), Path(sys.argv[2])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    durable_copy.copy_checkpoint(source, locations.location(dest))
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """
)


def test_a_local_copy_streams_a_file_larger_than_memory_holds(tmp_path):
    source = tmp_path / "ckpt-1"
    (source / "data").mkdir(parents=True)
    (source / "index.json").write_text("{}")
    big = source / "data" / "big"
    with open(big, "wb") as f:  # 384 MiB, not sparse, a pattern that shows a misplaced chunk
        for i in range(24):
            f.write(bytes([i]) * (16 << 20))
    root = os.path.dirname(os.path.dirname(durable_copy.__file__))
    done = subprocess.run(
        [sys.executable, "-c", STREAMED, str(source), str(tmp_path / "durable" / "ckpt-1")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    grown_mib = int(done.stdout.split()[-1])
    assert grown_mib < 128, f"the copy of a 384 MiB file grew the peak memory by {grown_mib} MiB"
    copied = tmp_path / "durable" / "ckpt-1" / "data" / "big"
    with open(big, "rb") as a, open(copied, "rb") as b:
        while chunk := a.read(16 << 20):
            assert b.read(16 << 20) == chunk
        assert b.read(1) == b""
