"""Incremental checkpoints attacked (issue 42): retention deletes only what it can prove is its own
(a ``uses`` entry names a checkpoint of this manager, and held data is kept wherever the run lives),
a link never follows a symlink or reaches outside the manager's directory, and a restore closes what
it opened."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from lora_state import adapter, base, expect_restores, run

import jaxckpt
from jaxckpt.arrays import store_write
from jaxckpt.format import refs_json
from jaxckpt.storage import kvstore, locations


@pytest.fixture(autouse=True)
def small_pack_limit(monkeypatch):
    """Arrays over 1 MiB are arrays of their own on a bucket too (not packed), so that tests stay small."""
    monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", 1 << 20)


def keys(path: str) -> list[str]:
    return sorted(kvstore.kv_keys(locations.location(path).spec()))


def copy_prefix(prefix: str, folder: Path) -> None:
    """A bucket prefix copied whole to a local folder, as ``gsutil cp -r`` would."""
    spec = locations.location(prefix).spec()
    for key in kvstore.kv_keys(spec):
        target = folder / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(kvstore.kv_read(spec, key))


def edit_state(directory: str, edit) -> None:
    where = locations.location(directory)
    state = json.loads(locations.read_file(where, "checkpoint"))
    edit(state)
    kvstore.kv_write(where.spec(), "checkpoint", json.dumps(state).encode())


# --- 1. a run moved between a bucket and a local disk keeps its held data ---------------------------


def test_a_bucket_run_copied_to_a_local_disk_keeps_its_held_data(s3, tmp_path):
    frozen, kept = run(s3, 3, keep=2)
    assert [p.rsplit("/", 1)[1] for p in kept] == ["ckpt-2", "ckpt-3"]  # both refer to ckpt-1's base
    moved = tmp_path / "moved"
    copy_prefix(s3, moved)
    manager = jaxckpt.CheckpointManager(jaxckpt.Checkpoint(), moved, max_to_keep=2)  # start-up: adopt, clean
    manager.close()
    for step in (2, 3):
        expect_restores(str(moved / f"ckpt-{step}"), frozen, step)
    # Local retention drops a user of the held data, then the last one: held while used, gone after.
    ckpt = jaxckpt.Checkpoint(step=3, base=frozen, adapter=adapter(3))
    with jaxckpt.CheckpointManager(ckpt, moved, max_to_keep=2, step_counter="step") as manager:
        ckpt.step, ckpt.adapter = 4, adapter(4)
        manager.save()
        manager.wait_until_finished()
        expect_restores(str(moved / "ckpt-3"), frozen, 3)
        ckpt.step, ckpt.adapter = 5, adapter(5)
        manager.save()
        manager.wait_until_finished()
    assert sorted(n for n in os.listdir(moved) if n.startswith("ckpt")) == ["ckpt-4", "ckpt-5"]
    for step in (4, 5):
        expect_restores(str(moved / f"ckpt-{step}"), frozen, step)


# --- 2. "uses" names only checkpoints ------------------------------------------------------------


@pytest.mark.parametrize("uses", [["eval_results"], ["checkpoint"], ["eval_results", "checkpoint"], ["ckpt-x"]])
def test_uses_that_name_anything_but_a_checkpoint_are_refused_and_nothing_deleted(tmp_path, uses):
    directory = tmp_path / "ckpts"
    run(directory, 2, keep=2)
    (directory / "eval_results").mkdir()
    (directory / "eval_results" / "scores.json").write_text("{}")
    edit_state(str(directory), lambda s: s["checkpoints"][0].update(uses=uses))
    before = sorted(os.listdir(directory))
    ckpt = jaxckpt.Checkpoint(step=2, base=base(), adapter=adapter(2))
    with pytest.raises(jaxckpt.CheckpointFormatError, match="uses") as raised:
        jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=1, step_counter="step")
    assert repr(uses[0]) in str(raised.value)
    assert sorted(os.listdir(directory)) == before
    assert (directory / "eval_results" / "scores.json").read_text() == "{}"


def test_uses_naming_a_bucket_prefix_that_is_no_checkpoint_is_refused(s3):
    run(s3, 2, keep=2)
    spec = locations.location(s3).spec()
    kvstore.kv_write(spec, "logs/train.txt", b"loss 1.0")
    edit_state(s3, lambda s: s["checkpoints"][0].update(uses=["logs"]))
    with pytest.raises(jaxckpt.CheckpointFormatError, match="'logs'"):
        jaxckpt.CheckpointManager(jaxckpt.Checkpoint(), s3, max_to_keep=1)
    assert kvstore.kv_read(spec, "logs/train.txt") == b"loss 1.0"


def test_a_listed_user_naming_a_folder_that_holds_none_of_its_data_deletes_nothing_of_it(tmp_path):
    """``uses`` names ckpt-9, a checkpoint-shaped folder of the user's (no index, no mark) that no
    refs.json refers to: neither start-up nor retention dropping the user may delete any of it."""
    directory = tmp_path / "ckpts"
    run(directory, 2, keep=2)
    other = directory / "ckpt-9"
    (other / "data").mkdir(parents=True)
    (other / "data" / "notes.txt").write_text("mine")
    edit_state(str(directory), lambda s: s["checkpoints"][0].update(uses=["ckpt-9"]))
    ckpt = jaxckpt.Checkpoint(step=2, base=base(), adapter=adapter(2))
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=1, step_counter="step") as manager:
        assert (other / "data" / "notes.txt").read_text() == "mine"
        ckpt.step, ckpt.adapter = 10, adapter(10)
        manager.save()
        manager.wait_until_finished()
    assert (other / "data" / "notes.txt").read_text() == "mine"
    assert sorted(n for n in os.listdir(directory) if n.startswith("ckpt")) == ["ckpt-3", "ckpt-9"]


# --- 3. adoption trusts only what refs.json can prove ------------------------------------------------


def _plant_unlisted(bucket: str, name: str, refer_to: str | None, source: str = "ckpt-2") -> None:
    """``source``'s objects copied to ``name`` (unlisted), its refs.json naming ``refer_to`` instead."""
    spec = locations.location(bucket).spec()
    for key in kvstore.kv_keys(spec):
        if key.startswith(f"{source}/"):
            kvstore.kv_write(spec, f"{name}/{key[len(source) + 1 :]}", kvstore.kv_read(spec, key))
    if refer_to is not None:
        save = json.loads(kvstore.kv_read(spec, f"{name}/index.json"))["save"]
        refs = refs_json.decode(kvstore.kv_read(spec, f"{name}/data/refs.json"), "", save)
        moved = {k: r._replace(checkpoint=refer_to) for k, r in refs.items()}
        kvstore.kv_write(spec, f"{name}/data/refs.json", refs_json.encode(save, moved))


def test_adoption_refuses_a_refs_json_naming_what_is_no_checkpoint(s3):
    run(s3, 2, keep=3)
    spec = locations.location(s3).spec()
    kvstore.kv_write(spec, "eval/results.json", b"{}")
    _plant_unlisted(s3, "ckpt-7", "eval")
    with pytest.warns(UserWarning, match="'eval'"):
        manager = jaxckpt.CheckpointManager(jaxckpt.Checkpoint(), s3, max_to_keep=3)
    assert all("eval" not in c.uses for c in manager.checkpoint_infos)
    manager.delete(7)
    manager.close()
    assert kvstore.kv_read(spec, "eval/results.json") == b"{}"


def test_adoption_reads_refs_json_only_for_the_save_its_index_names(s3):
    """A version-5 index refers to nothing: a refs.json planted beside it is no evidence that the
    checkpoint uses a sibling. A version-6 one whose refs.json is another save's proves nothing either
    (adopted, with a warning, using nothing)."""
    run(s3, 2, keep=3)
    spec = locations.location(s3).spec()
    _plant_unlisted(s3, "ckpt-7", None, source="ckpt-1")  # version 5
    kvstore.kv_write(spec, "ckpt-7/data/refs.json", kvstore.kv_read(spec, "ckpt-2/data/refs.json"))
    _plant_unlisted(s3, "ckpt-8", None)  # version 6, its refs.json replaced by another save's
    index = json.loads(kvstore.kv_read(spec, "ckpt-8/index.json"))
    refs = refs_json.decode(kvstore.kv_read(spec, "ckpt-8/data/refs.json"), "", index["save"])
    kvstore.kv_write(spec, "ckpt-8/data/refs.json", refs_json.encode("0" * 32, refs))
    with pytest.warns(UserWarning, match="ckpt-8"):
        manager = jaxckpt.CheckpointManager(jaxckpt.Checkpoint(), s3, max_to_keep=3)
    adopted = {c.path.rsplit("/", 1)[1]: c.uses for c in manager.checkpoint_infos}
    manager.close()
    assert adopted["ckpt-7"] == () and adopted["ckpt-8"] == ()


# --- 7, 8. links: never a symlink, never outside the manager's directory ------------------------------


def test_a_symlink_planted_in_place_of_a_restored_shard_file_is_never_linked(tmp_path):
    directory = tmp_path / "ckpts"
    frozen, _ = run(directory, 1)
    ckpt = jaxckpt.Checkpoint(step=0, base=base(), adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=3, step_counter="step") as manager:
        manager.restore_or_initialize()
        # After the restore, before the next save: a shard file replaced by a link to a copy of it.
        shards = [p for p in sorted((directory / "ckpt-1" / "data").rglob("*")) if p.is_file() and "/c/" in str(p)]
        for shard in shards:
            copy = tmp_path / "elsewhere" / shard.relative_to(directory)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shard, copy)
            shard.unlink()
            shard.symlink_to(copy)
        ckpt.step, ckpt.adapter = 2, adapter(2)
        manager.save()
        manager.wait_until_finished()
    assert not any(p.is_symlink() for p in (directory / "ckpt-2").rglob("*"))
    expect_restores(str(directory / "ckpt-2"), frozen, 2)


def test_another_runs_checkpoint_symlinked_into_the_directory_is_never_linked_from(tmp_path):
    other_frozen, _ = run(tmp_path / "other", 1)
    directory = tmp_path / "ckpts"
    directory.mkdir()
    (directory / "ckpt-5").symlink_to(tmp_path / "other" / "ckpt-1")
    ckpt = jaxckpt.Checkpoint(step=0, base=base(), adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=3, step_counter="step") as manager:
        manager.restore(5)
        ckpt.step, ckpt.adapter = 6, adapter(6)
        manager.save()
        manager.wait_until_finished()
    theirs = {p.stat().st_ino for p in (tmp_path / "other" / "ckpt-1").rglob("*") if p.is_file()}
    ours = {p.stat().st_ino for p in (directory / "ckpt-6").rglob("*") if p.is_file()}
    assert not theirs & ours
    expect_restores(str(directory / "ckpt-6"), other_frozen, 6)


# --- 9. a restore closes what it opened -------------------------------------------------------------


def _open_under(folder: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target == str(folder) or target.startswith(str(folder) + "/"):
            found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_no_file_of_a_checkpoint_is_open_after_a_restore(tmp_path):
    # TensorFlow's testNoFileLeaks-style check: nothing under the checkpoint stays open.
    path = tmp_path / "c"
    jaxckpt.save(path, {"w": jnp.arange(300_000.0), "b": np.ones(3)})
    restored = jaxckpt.restore(path)
    assert restored["w"].shape == (300_000,)
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(300_000), b=np.zeros(3))
    ckpt.read(str(path)).assert_consumed()
    jaxckpt.load_variable(path, "w")
    assert _open_under(path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_an_inspected_checkpoint_closes_with_its_view(tmp_path):
    path = tmp_path / "c"
    jaxckpt.save(path, {"w": np.ones(3)})
    with jaxckpt.inspect(path) as view:
        assert "w" in view.keys()
        np.testing.assert_array_equal(view["w"], np.ones(3))
    assert _open_under(path) == []


def test_an_interrupted_incremental_bucket_save_is_provably_garbage(s3):
    """Killed before its index: the marker, data and the refs.json of a version-6 save. The next
    manager removes it (found by the random kills of test_crash), and a save to that path replaces it."""
    run(s3, 2, keep=3)
    spec = locations.location(s3).spec()
    for key in ("ckpt-3/.jaxckpt-save", "ckpt-3/data/refs.json", "ckpt-3/data/a/1/zarr.json"):
        kvstore.kv_write(spec, key, b"{}")
    kvstore.kv_write(spec, "ckpt-4/.jaxckpt-save", b"")
    kvstore.kv_write(spec, "ckpt-4/data/refs.json", b"{}")
    jaxckpt.save(f"{s3}/ckpt-4", {"x": np.ones(3)})  # replaces an interrupted save's leftovers
    manager = jaxckpt.CheckpointManager(jaxckpt.Checkpoint(), s3, max_to_keep=3)
    manager.close()
    assert keys(f"{s3}/ckpt-3") == []


# --- 4. inode identity is weak evidence: a copy to a bucket durable tier ------------------------------


def test_a_two_tier_copy_refers_to_durable_bytes_only_for_the_very_file_it_copied(s3, tmp_path):
    """The durable copy of step 2 may refer to step 1's durable base only if each local shard file is
    the one step 1's copy copied: same inode, but also the same size and modification time (a new
    file may get the inode of one that local retention freed)."""
    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=1, base=frozen, adapter=adapter(1))
    local = tmp_path / "local"
    with jaxckpt.CheckpointManager(ckpt, s3, step_counter="step", local_directory=local, max_to_keep=3) as manager:
        manager.save()
        manager.wait_until_finished()
        for shard in (p for p in (local / "ckpt-1" / "data" / "a").rglob("*") if p.is_file() and "/c/" in str(p)):
            stat = shard.stat()
            os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # same inode, another file's time
        ckpt.step, ckpt.adapter = 2, adapter(2)
        manager.save()
        manager.wait_until_finished()
        infos = manager.checkpoint_infos
    assert [c.uses for c in infos] == [(), ()]  # step 2's base uploaded again, not referred to
    for info in infos:
        expect_restores(info.path, frozen, info.step)


# --- 5. arrays that alias host memory -----------------------------------------------------------------


def _aligned(n: int) -> np.ndarray:
    raw = np.empty(n + 64, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start : start + n]


@pytest.mark.parametrize("how", ["may_alias", "dlpack"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_array_aliasing_host_memory_changed_in_place_is_written_again(tmp_path, how, where, request):
    import jax

    directory = str(tmp_path / "ckpts") if where == "local" else request.getfixturevalue("s3")

    buf = _aligned(600_000)  # 2.4 MB: an array of its own
    buf[:] = np.arange(buf.size, dtype=np.float32)
    x = jax.device_put(buf, may_alias=True) if how == "may_alias" else jax.dlpack.from_dlpack(buf)
    buf[:3] = -1.0
    assert np.asarray(x)[0] == -1.0  # it is the host buffer
    ckpt = jaxckpt.Checkpoint(w=x)
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=3) as manager:
        manager.save()
        manager.wait_until_finished()
        buf[:] = 7.0  # the same jax.Array object, other values
        manager.save()
        manager.wait_until_finished()
        second = manager.checkpoints[-1]
    np.testing.assert_array_equal(jaxckpt.restore(second)["w"], np.full(buf.size, 7.0, np.float32))


# --- 6. one bad byte is never shared on -------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _shard_of(checkpoint: Path, key: str) -> Path:
    array = json.loads((checkpoint / "index.json").read_text())["leaves"][key]["at"]["array"]
    return next(p for p in sorted((checkpoint / "data" / array / "c").rglob("*")) if p.is_file())


@pytest.mark.parametrize("kind", ["jax", "numpy"])
@pytest.mark.parametrize("where", ["a chunk's crc", "the shard index", "the values"])
def test_a_damaged_file_is_written_afresh_not_linked(tmp_path, kind, where):
    if kind == "numpy" and where == "the values":
        pytest.skip("a numpy array's values are compared with the file's: changed values are written anyway")
    w = jnp.arange(600_000, dtype=jnp.float32) if kind == "jax" else np.arange(600_000, dtype=np.float32)
    ckpt = jaxckpt.Checkpoint(w=w, step=0)
    directory = tmp_path / "ckpts"
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=5) as manager:
        first = Path(manager.save())
        manager.wait_until_finished()
        shard = _shard_of(first, "w")
        size = shard.stat().st_size
        offset = {"a chunk's crc": 600_000 * 4 + 1, "the shard index": size - 10, "the values": 1000}[where]
        _flip(shard, offset)
        ckpt.step = 1
        second = Path(manager.save())
        manager.wait_until_finished()
    assert _shard_of(second, "w").stat().st_ino != shard.stat().st_ino  # its own copy, written from memory
    np.testing.assert_array_equal(jaxckpt.restore(second)["w"], np.arange(600_000, dtype=np.float32))


def test_a_save_cut_short_while_clearing_an_interrupted_save_leaves_provable_leftovers(s3, monkeypatch):
    """Found by test_crash's kills: a save that removes an interrupted save's leftovers, cut short after
    one deletion, must leave what the next save (or start-up) still proves jaxckpt's."""
    path = f"{s3}/ckpt-5"
    spec = locations.location(path).spec()
    for key in (".jaxckpt-save", "data/refs.json", "data/a/1/zarr.json", "data/checksums.json"):
        kvstore.kv_write(spec, key, b"{}")
    real = kvstore.kv_delete
    calls = []

    class Killed(Exception):
        pass

    def delete_once(base, key):
        calls.append(key)
        if len(calls) > 1:
            raise Killed(key)
        real(base, key)

    monkeypatch.setattr(kvstore, "kv_delete", delete_once)
    with pytest.raises(Killed):
        jaxckpt.save(path, {"x": np.ones(3)})
    monkeypatch.setattr(kvstore, "kv_delete", real)
    jaxckpt.save(path, {"x": np.arange(3)})
    np.testing.assert_array_equal(jaxckpt.restore(path)["x"], np.arange(3))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_managers_view_closes_the_views_it_gave(tmp_path):
    directory = tmp_path / "ckpts"
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(w=np.ones(3)), directory) as manager:
        manager.save()
    with jaxckpt.inspect(directory) as view:
        assert view.latest["w"].tolist() == [1.0, 1.0, 1.0]
        assert _open_under(directory) != []  # the latest's folder, held while the view is open
    assert _open_under(directory) == []
