"""Full disks and failing storage: a save that cannot write raises, and changes nothing that exists.

Writes fail on purpose (ENOSPC from the array writer at its N-th flush, from the index file, or
from the manager's state file), and on a real 20 MB tmpfs filled up by another file (skipped where
mounting is not allowed). In every case, for manager saves both synchronous and asynchronous: the
save raises, the kept checkpoints and the state file are untouched and still restore, no staging
folder is left behind, and once space is back the next save works.
"""

from __future__ import annotations

import builtins
import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import jaxckpt
from jaxckpt.arrays import store_write, zarr_write
from jaxckpt.storage import locations, statefile


def state(step: int) -> jaxckpt.Checkpoint:
    """Three own arrays (1.2 MB each, numpy: copied by a save) and packed ones; values encode ``step``."""
    ckpt = jaxckpt.Checkpoint(step=step)
    ckpt.arrays = {f"v{i}": np.full(300_000, step * 10 + i, np.float32) for i in range(3)}
    ckpt.small = {f"s{i}": np.full(100, step * 10 + i, np.int32) for i in range(5)}
    return ckpt


def check_step(path: str, step: int) -> None:
    tree = jaxckpt.restore(path)
    assert tree["step"] == step
    for name, group in (("arrays", 3), ("small", 5)):
        for i in range(group):
            value = tree[name][f"{'v' if name == 'arrays' else 's'}{i}"]
            assert (value == step * 10 + i).all(), f"{path}: {name}/{i}"


class Snapshot:
    """What a directory held: the state file's bytes, the folder listing, each listed checkpoint's step."""

    def __init__(self, directory: Path) -> None:
        self.state = (directory / "checkpoint").read_bytes()
        self.listing = sorted(os.listdir(directory))
        self.infos = statefile.read_state(str(directory))

    def assert_untouched(self, directory: Path, *, allow_unlisted: str | None = None) -> None:
        assert (directory / "checkpoint").read_bytes() == self.state, "the state file changed"
        listing = [n for n in sorted(os.listdir(directory)) if n != allow_unlisted]
        assert listing == self.listing, f"left behind: {set(listing) ^ set(self.listing)}"
        for info in self.infos:
            check_step(info.path, info.step)


def enospc(what: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), what)


def fail_writer_flush(monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """From the array writer's ``nth`` flush on, its file writes fail as on a full disk, after writing
    part of the file (jaxckpt's own writer of local data stores, below its error handling)."""
    real_flush, real_write, calls = store_write.Writer.flush, zarr_write._write_file, []

    def flush(self):
        calls.append(1)
        return real_flush(self)

    def write_file(path, pieces):
        if len(calls) < nth:
            return real_write(path, pieces)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise enospc(path)

    monkeypatch.setattr(store_write.Writer, "flush", flush)
    monkeypatch.setattr(zarr_write, "_write_file", write_file)


class _FullFile:
    """A file that takes the first half of what is written to it, then is out of space."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def write(self, data: bytes) -> int:
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise enospc(self._f.name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def fail_durable_write(monkeypatch: pytest.MonkeyPatch, name_prefix: str) -> None:
    """Writing a file whose name starts with ``name_prefix`` (through locations.write_durable, which
    every small file of a save and a manager goes through) fails halfway, as on a full disk."""

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = builtins.open(file, mode, *args, **kwargs)
        return _FullFile(f) if "w" in mode and Path(file).name.startswith(name_prefix) else f

    monkeypatch.setattr(locations, "open", open_, raising=False)


def fail_mark_creation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Creating the (empty) mark of an unlisted checkpoint fails, as on a disk out of space or inodes."""
    real = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT and os.path.basename(os.fspath(path)) == ".jaxckpt-unrecorded":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def fail_owner_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing the owner file of a new staging folder (the first file of a save) fails, as on a full disk."""
    real = os.write

    def write(fd: int, data: bytes) -> int:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".jaxckpt-owner"):
            raise enospc("owner file")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


FAILURES = {
    # the first flush: the only one with the default budget, so in the background for async saves
    "data, the last flush": lambda mp: fail_writer_flush(mp, 1),
    # the second of several flushes (a small host memory budget): during save(), with data written
    "data, an early flush": lambda mp: (mp.setenv("JAXCKPT_HOST_MEMORY_BUDGET", "65536"), fail_writer_flush(mp, 2)),
    "index.json": lambda mp: fail_durable_write(mp, "index.json"),
    "state file": lambda mp: fail_durable_write(mp, ".checkpoint.tmp-"),
    # a manager marks the new checkpoint's staging folder unlisted before anything else is written
    "unlisted marker": lambda mp: fail_mark_creation(mp),
    "owner file": fail_owner_file,
}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_failing_writes_change_nothing(tmp_path, monkeypatch, failure, async_save):
    ckpt = state(0)
    manager = jaxckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2, step_counter="step", async_save=async_save)
    for step in (1, 2, 3):
        ckpt.step, ckpt.arrays, ckpt.small = step, state(step).arrays, state(step).small
        manager.save()
    manager.wait_until_finished()
    before = Snapshot(tmp_path)
    kept = manager.checkpoints

    with monkeypatch.context() as mp:
        FAILURES[failure](mp)
        ckpt.step, ckpt.arrays, ckpt.small = 4, state(4).arrays, state(4).small
        # A StorageError (an OSError) whichever write failed, never a raw OSError
        with pytest.raises(jaxckpt.StorageError, match="No space left") as error:
            manager.save()
            manager.wait_until_finished()  # an async save reports its failure here
        assert error.value.errno == errno.ENOSPC
        if not failure.startswith("data"):  # the small files' messages: where, and what to do
            assert str(tmp_path) in str(error.value) and "free" in str(error.value).lower(), error.value
    # The state file's failure comes after the checkpoint is durable and published: an unlisted
    # folder, which the next manager removes (and which no listing ever names).
    unlisted = "ckpt-4" if failure == "state file" else None
    before.assert_untouched(tmp_path, allow_unlisted=unlisted)
    assert manager.checkpoints == kept

    # Space is back: the next save works, and retention goes on.
    ckpt.step, ckpt.arrays, ckpt.small = 5, state(5).arrays, state(5).small
    latest = manager.save()
    manager.close()
    assert jaxckpt.latest_checkpoint(tmp_path) == latest
    assert [c.step for c in statefile.read_state(str(tmp_path))] == [3, 5]
    check_step(latest, 5)
    with jaxckpt.CheckpointManager(state(0), tmp_path, max_to_keep=2):
        pass  # removes the unlisted folder, if any
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-3", os.path.basename(latest)]


# --- a real full disk --------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MB tmpfs; skipped where mounting is not allowed (not root, or a container without it)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all free space on ``disk`` but ``leave`` bytes."""
    filler = disk / "filler"
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    with open(filler, "wb") as f:
        chunk = b"\xff" * (1 << 20)
        remaining = max(0, free - leave)
        while remaining > 0:
            remaining -= f.write(chunk[: min(len(chunk), remaining)])
    return filler


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_full_tmpfs(small_disk, async_save):
    directory = small_disk / "ckpts"
    ckpt = state(0)
    manager = jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=2, step_counter="step", async_save=async_save)
    for step in (1, 2):
        ckpt.step, ckpt.arrays, ckpt.small = step, state(step).arrays, state(step).small
        manager.save()
    manager.wait_until_finished()
    before = Snapshot(directory)

    filler = fill(small_disk, leave=1 << 20)  # a save needs about 3.6 MB
    ckpt.step, ckpt.arrays, ckpt.small = 3, state(3).arrays, state(3).small
    with pytest.raises(Exception) as error:  # whichever layer hits ENOSPC first: TensorStore, or a file write
        manager.save()
        manager.wait_until_finished()
    assert "space" in str(error.value).lower() or getattr(error.value, "errno", None) == errno.ENOSPC, error.value
    print(f"\nfull tmpfs ({'async' if async_save else 'sync'}): {type(error.value).__name__}: {error.value}")
    before.assert_untouched(directory)

    filler.unlink()  # space is back
    latest = manager.save()
    manager.close()
    check_step(latest, 3)
    assert [c.step for c in statefile.read_state(str(directory))] == [2, 3]
    assert sorted(os.listdir(directory)) == ["checkpoint", "ckpt-2", os.path.basename(latest)]


def many_values(n: int, value: int) -> dict[str, Any]:
    """``n`` Python ints: no array data at all, every value in the index (about 60 bytes each)."""
    return {f"leaf{i:06d}": value for i in range(n)}


def test_full_tmpfs_at_the_index(small_disk):
    """The disk fills up exactly while index.json is written: the data fits, the index does not."""
    path = small_disk / "ckpt"
    jaxckpt.save(path, many_values(10, 1))
    filler = fill(small_disk, leave=256 << 10)
    values = many_values(50_000, 2)  # an index of some 3 MB: the disk has 256 KB left
    with pytest.raises(jaxckpt.StorageError, match="No space left") as error:
        jaxckpt.save(path, values, overwrite=True)
    assert error.value.errno == errno.ENOSPC
    assert str(path) in str(error.value) and "index.json" in str(error.value), error.value
    assert "free" in str(error.value).lower(), error.value
    print(f"\nfull tmpfs at the index: {type(error.value).__name__}: {error.value}")
    assert sorted(os.listdir(small_disk)) == ["ckpt", "filler"], "a staging folder was left behind"
    assert jaxckpt.restore(path) == many_values(10, 1)

    ckpt = jaxckpt.Checkpoint(step=0)
    ckpt.values = many_values(10, 3)
    filler.unlink()
    manager = jaxckpt.CheckpointManager(ckpt, small_disk / "ckpts", max_to_keep=2, step_counter="step")
    manager.save()
    manager.wait_until_finished()
    before = Snapshot(small_disk / "ckpts")
    filler = fill(small_disk, leave=256 << 10)
    ckpt.step, ckpt.values = 1, values
    with pytest.raises(jaxckpt.StorageError, match="No space left") as error:
        manager.save()
        manager.wait_until_finished()
    assert error.value.errno == errno.ENOSPC and "index.json" in str(error.value), error.value
    assert manager.checkpoints == [str(small_disk / "ckpts" / "ckpt-1")]
    filler.unlink()
    listing = sorted(os.listdir(small_disk / "ckpts"))
    assert listing == before.listing, f"left behind: {set(listing) ^ set(before.listing)}"
    assert jaxckpt.restore(manager.checkpoints[0])["values"] == many_values(10, 3)
    manager.close()


@pytest.mark.parametrize("failure", ["index.json", "state file", "unlisted marker"])
def test_checkpoint_save_on_a_full_disk_raises(tmp_path, monkeypatch, failure):
    """Checkpoint.save (which lists its checkpoint in the state file too): a full disk is an error, not
    a warning, and the checkpoint listed before stays the latest."""
    ckpt = state(1)
    first = ckpt.save(tmp_path / "ckpt")
    with monkeypatch.context() as mp:
        FAILURES[failure](mp)
        with pytest.raises(jaxckpt.StorageError, match="No space left") as error:
            ckpt.save(tmp_path / "ckpt")
    assert error.value.errno == errno.ENOSPC
    assert jaxckpt.latest_checkpoint(tmp_path) == first
    check_step(first, 1)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "left behind"
    with jaxckpt.CheckpointManager(state(0), tmp_path):  # the save's lock was released
        pass  # and this removes a checkpoint left unlisted (the state file's failure)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1"]
