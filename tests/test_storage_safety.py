"""Storage safety: a user's files are never deleted, odd paths never send data elsewhere, hostile small
files never hang or exhaust memory, and an interrupted save's staging folder does not linger."""

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import jaxckpt
from jaxckpt.saving import staging as _staging
from jaxckpt.storage import local_tree, locations

TREE = {"x": np.arange(6, dtype=np.float32), "big": np.ones((64, 64), np.float32)}


# --- item 2: object-store prefixes ---------------------------------------------------------------


def _kv(path):
    return ts.KvStore.open(locations.location(path).spec(), context=_tensorstore_context()).result()


def _tensorstore_context():
    from jaxckpt.arrays import store_write

    return store_write._context()  # memory:// stores live in jaxckpt's context


@pytest.mark.parametrize("folder", ["data", "data.p1"])
def test_save_into_a_prefix_with_a_users_data_folder_is_refused_and_keeps_it(folder):
    prefix = f"memory://users-{folder}/run"
    _kv(prefix).write(f"{folder}/notes.txt", b"mine").result()
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"users-.*not a jaxckpt checkpoint"):
        jaxckpt.save(prefix, TREE)
    assert [k for k in _kv(prefix).list().result()] == [f"{folder}/notes.txt".encode()]
    assert _kv(prefix).read(f"{folder}/notes.txt").result().value == b"mine"


def test_memory_save_leaves_no_marker_and_overwrite_still_works():
    path = jaxckpt.save("memory://marker/c", TREE)
    assert locations.children(locations.location(path)) == ["data", "index.json"]
    jaxckpt.save(path, {"y": 1}, overwrite=True)
    assert jaxckpt.restore(path) == {"y": 1}


# --- item 3: characters TensorStore's file driver changes ----------------------------------------


def test_backslash_in_a_local_path_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "run\\lr=0.1" / "ckpt"
    with pytest.raises(jaxckpt.UnsupportedValueError, match="backslash"):
        jaxckpt.save(path, TREE)
    assert list(tmp_path.iterdir()) == []  # nothing written, neither there nor in run/lr=0.1
    with pytest.raises(jaxckpt.UnsupportedValueError, match="backslash"):
        jaxckpt.restore(path)


@pytest.mark.parametrize("name", ["per%cent", "what?", "hash#tag", "with space", "new\nline", "naïve-日本", "a:b*c"])
def test_other_characters_in_local_paths_round_trip(tmp_path, name):
    path = jaxckpt.save(tmp_path / name / "ckpt", TREE)
    np.testing.assert_array_equal(jaxckpt.restore(path)["big"], TREE["big"])
    assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["ckpt"]


# --- item 11: the index and the state file -------------------------------------------------------


def test_index_symlinked_to_dev_zero_is_a_format_error(tmp_path):
    path = Path(jaxckpt.save(tmp_path / "c", TREE))
    (path / "index.json").unlink()
    (path / "index.json").symlink_to("/dev/zero")
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"index\.json.*symbolic link"):  # never followed
        jaxckpt.restore(path)


def test_state_file_symlinked_to_dev_zero_is_a_format_error(tmp_path):
    (tmp_path / "checkpoint").symlink_to("/dev/zero")
    with pytest.raises(jaxckpt.CheckpointFormatError, match="not a regular file"):
        locations.read_file(locations.location(tmp_path), "checkpoint")


def test_fifo_index_does_not_hang(tmp_path):
    """In a subprocess with a timeout: a hang fails the test instead of stopping the suite."""
    path = Path(jaxckpt.save(tmp_path / "c", TREE))
    (path / "index.json").unlink()
    os.mkfifo(path / "index.json")
    code = textwrap.dedent(f"""
        import jaxckpt
        try:
            jaxckpt.restore({str(path)!r})
        except jaxckpt.CheckpointFormatError as e:
            print("refused:", e)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "refused:" in proc.stdout and "FIFO" in proc.stdout, proc.stderr


def test_oversized_files_are_refused_by_size(tmp_path, monkeypatch):
    folder = locations.location(tmp_path)
    (tmp_path / "checkpoint").write_bytes(b"x" * 2000)
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"2,000 bytes.*limit of 1,000 bytes"):
        locations.read_file(folder, "checkpoint", limit=1000)
    assert locations.read_file(folder, "checkpoint", limit=2000) == b"x" * 2000
    mem = locations.location("memory://oversized")
    _kv("memory://oversized").write("checkpoint", b"x" * 2000).result()
    with pytest.raises(jaxckpt.CheckpointFormatError, match="limit of 1,000 bytes"):
        locations.read_file(mem, "checkpoint", limit=1000)
    assert locations.read_file(mem, "checkpoint", limit=2000) == b"x" * 2000
    assert locations.read_file(mem, "absent", limit=10) is None
    monkeypatch.setattr(locations, "INDEX_READ_LIMIT", 100)
    path = jaxckpt.save(tmp_path / "c", TREE)
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"index\.json.*limit of 100 bytes"):
        jaxckpt.restore(path)


# --- item 12: paths that are not jaxckpt's to use ------------------------------------------------


def test_bytes_and_undecodable_paths_are_refused_by_name(tmp_path):
    with pytest.raises(jaxckpt.UnsupportedValueError, match="not bytes"):
        jaxckpt.save(os.fsencode(tmp_path / "c"), TREE)
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff\xfe")
    with pytest.raises(jaxckpt.UnsupportedValueError, match="UTF-8"):
        jaxckpt.save(bad, TREE)
    with pytest.raises(jaxckpt.UnsupportedValueError, match="UTF-8"):
        jaxckpt.restore(bad)


def test_a_name_near_name_max_saves_with_a_shortened_staging_name(tmp_path):
    name = "n" * 250
    path = jaxckpt.save(tmp_path / name, TREE)
    np.testing.assert_array_equal(jaxckpt.restore(path)["x"], TREE["x"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    with pytest.raises(jaxckpt.UnsupportedValueError, match="256 bytes long"):
        jaxckpt.save(tmp_path / ("n" * 256), TREE)


def test_a_file_as_a_parent_folder_is_named(tmp_path):
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"notes'? is a file, not a folder"):
        jaxckpt.save(tmp_path / "notes" / "sub" / "c", TREE)
    assert (tmp_path / "notes").read_text() == "mine"


def test_restore_of_none_says_there_is_no_checkpoint():
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="None"):
        jaxckpt.restore(None)
    assert repr(jaxckpt.Checkpoint().restore(None)) == "RestoreStatus(nothing restored)"


# --- item 17: staging folders of interrupted saves -----------------------------------------------


def _staging_folders(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if _staging.PARTIAL_MARK in p.name)


def test_keyboard_interrupt_during_a_blocking_save_removes_its_staging(tmp_path, monkeypatch):
    from jaxckpt.arrays import store_write

    real_flush = store_write.Writer.flush

    def interrupted(self):
        real_flush(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(store_write.Writer, "flush", interrupted)
    with pytest.raises(KeyboardInterrupt):
        jaxckpt.save(tmp_path / "c", TREE)
    assert list(tmp_path.iterdir()) == []


def test_next_save_removes_a_dead_saves_staging_but_not_a_live_ones(tmp_path):
    dest = locations.location(tmp_path / "c")
    dead = _staging.staging_folder(dest, "0123456789ab")
    (dead.local / "data").mkdir()
    _staging._release(dead.local)  # as if its process had died: the kernel drops the lock
    live = _staging.staging_folder(dest, "ba9876543210")  # this one stays owned, as by a running save
    other = _staging.staging_folder(locations.location(tmp_path / "c-2"), "0123456789ab")
    _staging._release(other.local)  # stale, but another destination's: not this save's to remove
    jaxckpt.save(tmp_path / "c", TREE)
    assert _staging_folders(tmp_path) == sorted([live.local.name, other.local.name])
    # The live one is still locked by its owner: another process cannot take the lock.
    fd = os.open(live.local / ".jaxckpt-owner", os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    _staging.discard(live)


def test_a_killed_save_leaves_staging_that_the_next_save_removes(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from jaxckpt.saving import staging as _staging
        from jaxckpt.storage import local_tree, locations
        _staging.staging_folder(locations.location({str(tmp_path / "c")!r}), "0123456789ab")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], timeout=120, env=env)
    assert _staging_folders(tmp_path) == [".c.partial-0123456789ab"]
    jaxckpt.save(tmp_path / "c", TREE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# --- item 18 (part): created parent folders are synced -------------------------------------------


def test_parents_of_created_folders_are_synced(tmp_path, monkeypatch):
    synced = []
    real = locations.fsync_dir
    monkeypatch.setattr(locations, "fsync_dir", lambda p: (synced.append(Path(p)), real(p)))
    jaxckpt.save(tmp_path / "a" / "b" / "c", TREE)
    for parent in (tmp_path, tmp_path / "a", tmp_path / "a" / "b"):
        assert parent in synced


def test_an_async_save_syncs_no_folder_in_the_callers_thread(tmp_path, monkeypatch):
    """A folder's fsync waits for the file system's journal (a retention's deletions, say), so the
    caller of an async save does none; publishing syncs the parent after the rename."""
    import threading

    jaxckpt.save(tmp_path / "first", TREE)  # the parent folder exists
    caller, synced = threading.current_thread(), []
    real = locations.fsync_dir
    monkeypatch.setattr(
        locations, "fsync_dir", lambda p: (synced.append((threading.current_thread(), Path(p))), real(p))
    )
    jaxckpt.save(tmp_path / "c", TREE, blocking=False)
    by_caller = [p for thread, p in synced if thread is caller]
    jaxckpt.wait_until_finished()
    assert by_caller == []
    assert tmp_path in [p for _, p in synced]  # the new entry made durable, in the background


# --- item 8: a deferred restore whose checkpoint is gone -----------------------------------------


def test_deferred_restore_of_a_deleted_checkpoint_fails_clearly_and_keeps_the_value(tmp_path):
    import shutil

    path = jaxckpt.Checkpoint(a=np.zeros(3), b=np.ones((64, 64)), c=np.full(2, 7.0)).save(tmp_path / "ckpt")
    ckpt = jaxckpt.Checkpoint(a=np.zeros(3))
    ckpt.restore(path).expect_partial()
    shutil.rmtree(path)  # as a manager's retention does
    assigned = np.full((64, 64), 5.0)
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"'b'.*ckpt-1.*deleted"):
        ckpt.b = assigned
    assert ckpt.b is assigned  # the object holds what was assigned...
    ckpt.d = 4  # ...a later assignment without a value in the checkpoint runs no stale job
    again = ckpt.save(tmp_path / "ckpt")
    restored = jaxckpt.restore(again)
    np.testing.assert_array_equal(restored["b"], assigned)  # ...and the next save includes it
    assert restored["d"] == 4


# --- round three, item 7: deep and symlinked folders inside a checkpoint ----------------------------


def _remove_deep(top: Path) -> None:
    """Remove a folder nested deeper than shutil.rmtree recurses, innermost first."""
    chain = [top]
    while True:
        inner = [p for p in chain[-1].iterdir() if p.is_dir() and not p.is_symlink()]
        if not inner:
            break
        chain.append(inner[0])
    for folder in reversed(chain):
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def test_a_folder_nested_1100_levels_deep_is_no_recursion_error(tmp_path, capsys):
    from jaxckpt.tools import cli

    directory = tmp_path / "run"
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(**TREE), directory, async_save=False) as manager:
        path = Path(manager.save())
    deep = path / "data" / "x"
    folder = deep
    for _ in range(1100):  # 1,100 levels: os.walk recursed once per level (and so does os.makedirs)
        folder.mkdir()
        folder = folder / "d"
    try:
        with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"/data'.*levels deep"):
            jaxckpt.restore(path)
        for argv in (["verify", str(path)], ["ls", str(directory)]):
            cli.main(argv)
            out = capsys.readouterr()
            assert "RecursionError" not in out.out + out.err and "Traceback" not in out.err, (argv, out)
    finally:
        _remove_deep(deep)


@pytest.mark.parametrize("what", ["a folder 1,100 levels deep", "a symlinked file", "a symlinked folder"])
def test_a_copy_to_the_durable_tier_lists_only_the_checkpoint_s_own_files(tmp_path, what):
    """The two-tier copy lists a local checkpoint's files: no RecursionError (os.walk recursed), and
    never a file through a symlink (it would copy what the link names, from outside the checkpoint)."""
    from jaxckpt.manager import durable_copy

    path = Path(jaxckpt.save(tmp_path / "c", TREE))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not the checkpoint's")
    deep = path / "data" / "x"
    if what == "a symlinked file":
        (path / "data" / "link").symlink_to(outside / "secret")
    elif what == "a symlinked folder":
        (path / "data" / "link").symlink_to(outside, target_is_directory=True)
    else:
        folder = deep
        for _ in range(1100):
            folder.mkdir()
            folder = folder / "d"
    try:
        with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"levels deep|symbolic link"):
            durable_copy.data_files(path)
    finally:
        if deep.exists():
            _remove_deep(deep)


def test_a_symlinked_data_store_is_neither_walked_nor_counted(tmp_path, monkeypatch):
    path = Path(jaxckpt.save(tmp_path / "c", TREE))
    outside = tmp_path / "outside"
    os.rename(path / "data", outside)  # the real data elsewhere, linked back in
    (outside / "more").mkdir()
    (outside / "more" / "big.bin").write_bytes(b"\0" * 100_000)
    (path / "data").symlink_to(outside, target_is_directory=True)
    scanned: list[str] = []
    real_scandir = os.scandir

    def scandir(p="."):
        scanned.append(os.fspath(p))
        return real_scandir(p)

    monkeypatch.setattr(os, "scandir", scandir)
    for folder in (locations.location(path), locations.location(path) / "data"):
        held = local_tree.total_bytes(folder)
        assert held is None or held == (path / "index.json").stat().st_size, folder
    assert not [p for p in scanned if str(outside) in os.path.realpath(p)], scanned
    monkeypatch.undo()
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="symlink"):
        jaxckpt.restore(path)


def test_a_symlinked_file_in_a_data_store_is_not_counted(tmp_path):
    path = Path(jaxckpt.save(tmp_path / "c", TREE))
    before = local_tree.total_bytes(locations.location(path) / "data")
    outside = tmp_path / "big.bin"
    outside.write_bytes(b"\1" * 100_000)
    (path / "data" / "extra").symlink_to(outside)
    assert local_tree.total_bytes(locations.location(path) / "data") == before


# --- round three, item 9: a size claim backed by a sparse file ------------------------------------


_RESTORE_UNDER_LIMIT = """
import os, resource, sys
import jaxckpt
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 30), resource.RLIM_INFINITY))
try:
    jaxckpt.restore(sys.argv[1])
except jaxckpt.CheckpointCorruptedError as e:
    print("REFUSED:", e)
    sys.exit(0)
except MemoryError as e:
    print("ALLOCATED:", e)
    sys.exit(3)
print("RESTORED")
sys.exit(4)
"""


def test_a_huge_claim_backed_by_a_sparse_file_allocates_nothing(tmp_path, monkeypatch):
    import json
    import zlib

    from jaxckpt.arrays import store_write, zarr_meta

    monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", 0)  # an array of its own, in data/a/0
    path = Path(jaxckpt.save(tmp_path / "c", {"w": np.ones(1000, np.float32)}))
    body = json.loads((path / "index.json").read_text())
    claimed = 1 << 34  # float32: 64 GiB
    body["leaves"]["w"]["shape"] = [claimed]
    body["leaves"]["w"]["at"]["chunks"] = [claimed]
    body.pop("checksum")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    index = b'{"checksum":"crc32:%08x",' % zlib.crc32(canonical) + canonical[1:] + b"\n"
    (path / "index.json").write_bytes(index)
    meta = zarr_meta.metadata([claimed], "float32", [claimed], 4)
    (path / "data" / "a" / "0" / "zarr.json").write_text(json.dumps(meta))
    shard = path / "data" / "a" / "0" / "c" / "0"
    os.truncate(shard, 4 * claimed + 4096)  # 64 GiB that the file system does not hold: a hole
    if shard.stat().st_blocks * 512 >= 4 * claimed:
        pytest.skip("this file system does not make sparse files")
    run = subprocess.run(
        [sys.executable, "-c", _RESTORE_UNDER_LIMIT, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(jaxckpt.__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(jaxckpt.__file__).parent.parent)},
    )
    assert run.returncode == 0 and "REFUSED" in run.stdout, run.stdout + run.stderr
    assert "68,719,476,736 bytes" in run.stdout and "sparse" in run.stdout, run.stdout


def test_real_files_back_their_sizes(tmp_path):
    path = Path(jaxckpt.save(tmp_path / "c", TREE))
    apparent = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert local_tree.total_bytes(locations.location(path)) == apparent
    assert jaxckpt.restore(path)["x"].tolist() == TREE["x"].tolist()


def test_removing_a_folder_never_follows_a_symlink_inside(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_text("mine")
    folder = tmp_path / "c"
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "a" / "b" / "x").write_text("x")
    (folder / "a" / "link").symlink_to(outside, target_is_directory=True)
    (folder / "a" / "b" / "file-link").symlink_to(outside / "sub" / "f")
    local_tree.rmtree(folder)
    assert not folder.exists() and (outside / "sub" / "f").read_text() == "mine"
