"""Incremental checkpoints: a manager hard-links the files of an unchanged jax.Array (the same object it
last saved or restored) from the checkpoint that holds them, instead of writing them again."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_state import adapter, base, expect_restores, run

import jaxckpt
from jaxckpt.arrays import zarr_write
from jaxckpt.tools import cli


def shard_files(checkpoint: str | Path, array: str) -> dict[str, os.stat_result]:
    """The shard files of ``array`` (``a/<n>``) in a checkpoint's data store: chunk key -> stat."""
    folder = Path(checkpoint, "data", array, "c")
    return {str(p.relative_to(folder)): p.stat() for p in sorted(folder.rglob("*")) if p.is_file()}


def array_of(checkpoint: str | Path, key: str) -> str:
    index = json.loads(Path(checkpoint, "index.json").read_text())
    return index["leaves"][key]["at"]["array"]


def inodes(checkpoint: str | Path, key: str) -> set[int]:
    return {s.st_ino for s in shard_files(checkpoint, array_of(checkpoint, key)).values()}


@pytest.fixture
def counted_writes(monkeypatch):
    """The shard files that jaxckpt writes (not those it links), by path."""
    written: list[str] = []
    real = zarr_write._write_shard

    def counting(shard):
        written.append(shard.file)
        return real(shard)

    monkeypatch.setattr(zarr_write, "_write_shard", counting)
    return written


def test_unchanged_arrays_are_hard_linked_and_changed_ones_written(tmp_path, counted_writes):
    frozen, paths = run(tmp_path / "ckpts", 3)
    first, *later = paths
    for key in ("base/w0", "base/w1"):
        assert all(inodes(p, key) == inodes(first, key) for p in later), key
        assert all(s.st_nlink == 3 for s in shard_files(first, array_of(first, key)).values())
        # its zarr.json too: nothing in it is a save's own
        zarr_json = {Path(p, "data", array_of(p, key), "zarr.json").stat().st_ino for p in paths}
        assert len(zarr_json) == 1, key
    assert len({frozenset(inodes(p, "adapter")) for p in paths}) == 3  # written at every step
    # The base's 9 shard files (8 + 1) were written once; the adapter's one at every step.
    assert len(counted_writes) == 9 + 3
    for step, path in enumerate(paths, start=1):
        expect_restores(path, frozen, step)


def test_every_kept_step_restores_after_retention_deleted_the_one_that_wrote_the_base(tmp_path):
    frozen, paths = run(tmp_path / "ckpts", 6, keep=2)
    assert [os.path.basename(p) for p in paths] == ["ckpt-5", "ckpt-6"]
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["checkpoint", "ckpt-5", "ckpt-6"]
    for step, path in zip((5, 6), paths):
        expect_restores(path, frozen, step)
        assert all(s.st_nlink == 2 for s in shard_files(path, array_of(path, "base/w0")).values())
    assert cli.main(["verify", paths[0]]) == 0


def test_a_save_right_after_a_restart_links_what_the_restore_returned(tmp_path, counted_writes):
    directory = tmp_path / "ckpts"
    frozen, paths = run(directory, 1)
    del counted_writes[:]
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in frozen.items()}
    ckpt = jaxckpt.Checkpoint(step=0, base=like, adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, directory, step_counter="step") as manager:
        assert manager.restore_or_initialize() == paths[0]
        ckpt.step += 1
        ckpt.adapter = adapter(2)
        new = manager.save()
    for key in ("base/w0", "base/w1"):
        assert inodes(new, key) == inodes(paths[0], key), key
    assert len(counted_writes) == 1  # the adapter
    expect_restores(new, frozen, 2)


def test_a_restore_onto_another_sharding_or_dtype_is_written_again(tmp_path):
    directory = tmp_path / "ckpts"
    frozen, paths = run(directory, 1)
    other = jax.sharding.NamedSharding(
        jax.make_mesh((4,), ("y",), devices=jax.devices()[:4]), jax.sharding.PartitionSpec("y")
    )
    like = {
        "w0": jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=other),
        "w1": jax.ShapeDtypeStruct((1536, 512), jnp.float32),  # cast from bfloat16
    }
    ckpt = jaxckpt.Checkpoint(step=0, base=like, adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, directory, step_counter="step") as manager:
        manager.restore_or_initialize()
        ckpt.step += 1
        new = manager.save()
    assert not inodes(new, "base/w0") & inodes(paths[0], "base/w0")
    assert not inodes(new, "base/w1") & inodes(paths[0], "base/w1")
    tree = jaxckpt.restore(new)
    np.testing.assert_array_equal(tree["base"]["w0"], np.asarray(frozen["w0"]))
    np.testing.assert_array_equal(tree["base"]["w1"], np.asarray(frozen["w1"]).astype(np.float32))


def test_an_equal_array_that_is_another_object_is_written(tmp_path):
    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts", step_counter="step") as manager:
        first = manager.save()
        ckpt.base = {k: v + 0 for k, v in frozen.items()}  # equal values, new arrays: identity decides
        ckpt.step = 1
        second = manager.save()
        manager.wait_until_finished()
    for key in ("base/w0", "base/w1"):
        assert not inodes(first, key) & inodes(second, key)


def test_a_deleted_array_is_refused_as_without_incremental_saves(tmp_path):
    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts", step_counter="step") as manager:
        first = manager.save()
        manager.wait_until_finished()
        frozen["w0"].delete()  # as a donation does
        with pytest.raises(jaxckpt.UnsupportedValueError, match="deleted"):
            manager.save(force=True)
        ckpt.base = {"w0": base()["w0"], "w1": frozen["w1"]}  # what the step returned instead
        second = manager.save(force=True)
        manager.wait_until_finished()
    assert not inodes(first, "base/w0") & inodes(second, "base/w0")
    assert inodes(first, "base/w1") == inodes(second, "base/w1")
    np.testing.assert_array_equal(jaxckpt.restore(second)["base"]["w0"], np.asarray(base()["w0"]))


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EPERM, errno.ENOENT])
def test_a_link_that_fails_falls_back_to_writing(tmp_path, monkeypatch, counted_writes, code):
    def refuse(src, dst, *args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "link", refuse)
    frozen, paths = run(tmp_path / "ckpts", 3)
    assert len(counted_writes) == 3 * (9 + 1)
    for step, path in enumerate(paths, start=1):
        assert all(s.st_nlink == 1 for s in shard_files(path, array_of(path, "base/w0")).values())
        expect_restores(path, frozen, step)


def test_a_link_that_fails_half_way_through_an_array_falls_back_to_writing_it(tmp_path, monkeypatch):
    real, calls = os.link, []

    def flaky(src, dst, *args, **kwargs):
        calls.append(dst)
        if len(calls) == 4:  # the fourth of w0's eight shards: its source was deleted meanwhile, say
            raise FileNotFoundError(errno.ENOENT, "gone", src)
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", flaky)
    frozen, (first, second) = run(tmp_path / "ckpts", 2)
    assert not inodes(first, "base/w0") & inodes(second, "base/w0")
    assert inodes(first, "base/w1") == inodes(second, "base/w1")
    expect_restores(second, frozen, 2)
    assert not [p for p in Path(second).rglob("*") if ".link" in p.name]  # no leftovers of the links


def test_incremental_false_writes_everything(tmp_path, counted_writes):
    _, paths = run(tmp_path / "ckpts", 2, incremental=False)
    assert not inodes(paths[0], "base/w0") & inodes(paths[1], "base/w0")
    assert len(counted_writes) == 2 * 10


def test_one_off_saves_write_everything(tmp_path):
    frozen = base()
    jaxckpt.save(tmp_path / "a", {"base": frozen})
    jaxckpt.save(tmp_path / "b", {"base": frozen})
    assert not inodes(tmp_path / "a", "base/w0") & inodes(tmp_path / "b", "base/w0")


def test_two_tiers_link_in_the_local_tier(tmp_path):
    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    local = tmp_path / "local"
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "durable", step_counter="step", local_directory=local) as manager:
        for step in (1, 2):
            ckpt.step = step
            ckpt.adapter = adapter(step)
            manager.save()
        manager.wait_until_finished()
    assert inodes(local / "ckpt-1", "base/w0") == inodes(local / "ckpt-2", "base/w0")
    expect_restores(str(tmp_path / "durable" / "ckpt-2"), frozen, 2)
    expect_restores(str(local / "ckpt-2"), frozen, 2)


def test_damage_to_a_shared_file_is_found_in_every_checkpoint_that_holds_it(tmp_path, capsys):
    directory = tmp_path / "ckpts"
    _, paths = run(directory, 3)
    shard = Path(paths[0], "data", array_of(paths[0], "base/w0"), "c", "3", "0")
    with open(shard, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x10]))
    assert cli.main(["verify", "--json", str(directory)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in report if not r["ok"]] == paths
    assert all([d["key"] for d in r["damaged"]] == ["base/w0"] for r in report)
    for path in paths:
        with pytest.raises(jaxckpt.CheckpointCorruptedError):
            jaxckpt.restore(path)


def test_ls_tells_what_each_checkpoint_shares(tmp_path, capsys):
    directory = tmp_path / "ckpts"
    run(directory, 3)
    view = jaxckpt.inspect(str(directory))
    doc = view.to_json()
    shared = [c["shared_bytes"] for c in doc["checkpoints"]]
    sizes = [c["disk_bytes"] for c in doc["checkpoints"]]
    base_bytes = 1024 * 512 * 4 + 1536 * 512 * 2
    assert all(base_bytes <= s < base_bytes + 64 * 1024 for s in shared)  # the shards, with their indexes
    assert all(size - s > 2 << 20 for size, s in zip(sizes, shared))  # each holds its own adapter
    assert doc["unique_bytes"] == sum(sizes) - 2 * shared[0]
    assert cli.main(["ls", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "shared" in out and out.count("shared") >= 3


def test_a_file_put_in_place_of_a_saved_one_is_not_linked(tmp_path):
    """The manager links the file it wrote (its inode), not whatever is at that path now."""
    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts", step_counter="step") as manager:
        first = manager.save()
        manager.wait_until_finished()
        shard = Path(first, "data", array_of(first, "base/w1"), "c", "0", "0")
        copy = shard.with_name("copy")
        copy.write_bytes(shard.read_bytes())
        os.replace(copy, shard)  # the same bytes, another file
        ckpt.step = 1
        second = manager.save()
        manager.wait_until_finished()
    assert not inodes(first, "base/w1") & inodes(second, "base/w1")
    assert inodes(first, "base/w0") == inodes(second, "base/w0")
    tree = jaxckpt.restore(second)
    for k, v in frozen.items():
        np.testing.assert_array_equal(tree["base"][k], np.asarray(v))


def restarted(frozen: dict[str, jax.Array]) -> tuple[jaxckpt.Checkpoint, dict[str, jax.ShapeDtypeStruct]]:
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in frozen.items()}
    return jaxckpt.Checkpoint(step=0, base=like, adapter=adapter(0)), like


def test_a_save_after_tensorflow_s_restart_idiom_links_what_checkpoint_restore_returned(tmp_path, counted_writes):
    """TF's idiom: the manager made first, then ``ckpt.restore(manager.latest_checkpoint)`` directly."""
    directory = tmp_path / "ckpts"
    frozen, paths = run(directory, 1)
    del counted_writes[:]
    ckpt, _ = restarted(frozen)
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=3, step_counter="step") as manager:
        ckpt.restore(manager.latest_checkpoint).assert_consumed()
        ckpt.step += 1
        ckpt.adapter = adapter(2)
        new = manager.save()
    for key in ("base/w0", "base/w1"):
        assert inodes(new, key) == inodes(paths[0], key), key
    assert len(counted_writes) == 1  # the adapter
    expect_restores(new, frozen, 2)


def test_a_child_assigned_after_checkpoint_restore_is_linked_too(tmp_path, counted_writes):
    """TF's deferred restoration: the value waits for its child, and is read when it is assigned."""
    directory = tmp_path / "ckpts"
    frozen, paths = run(directory, 1)
    del counted_writes[:]
    ckpt, like = restarted(frozen)
    del ckpt.base
    with jaxckpt.CheckpointManager(ckpt, directory, step_counter="step") as manager:
        ckpt.restore(manager.latest_checkpoint)
        ckpt.base = like  # restored now
        ckpt.step += 1
        ckpt.adapter = adapter(2)
        new = manager.save()
    assert inodes(new, "base/w0") == inodes(paths[0], "base/w0")
    assert len(counted_writes) == 1
    expect_restores(new, frozen, 2)


def test_a_save_after_jaxckpt_restore_of_the_manager_s_checkpoint_links_it(tmp_path, counted_writes):
    directory = tmp_path / "ckpts"
    frozen, paths = run(directory, 1)
    del counted_writes[:]
    ckpt, like = restarted(frozen)
    with jaxckpt.CheckpointManager(ckpt, directory, step_counter="step") as manager:
        ckpt.base = jaxckpt.restore(manager.latest_checkpoint, {"base": like}, partial=True)["base"]
        ckpt.step = 2
        ckpt.adapter = adapter(2)
        new = manager.save()
    assert inodes(new, "base/w0") == inodes(paths[0], "base/w0")
    assert len(counted_writes) == 1
    expect_restores(new, frozen, 2)


def test_arrays_restored_from_outside_the_manager_s_directory_are_written(tmp_path, counted_writes):
    """A checkpoint that is not the manager's may be changed in place by others: never linked from."""
    frozen = base()
    outside = jaxckpt.save(tmp_path / "pretrained", {"base": frozen})
    del counted_writes[:]
    ckpt, _ = restarted(frozen)
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts", step_counter="step") as manager:
        ckpt.restore(outside).expect_partial()
        new = manager.save()
    assert not inodes(new, "base/w0") & inodes(outside, "base/w0")
    assert len(counted_writes) == 9 + 1
    np.testing.assert_array_equal(jaxckpt.restore(new)["base"]["w0"], np.asarray(frozen["w0"]))


def host_table(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB: own files


def crc_blind_change(table: np.ndarray) -> np.ndarray:
    """``table`` with bits flipped in 5 bytes past its first 64 KiB, such that the CRC-32C of every
    same-length message is unchanged (CRC is linear: a combination of 33 bit flips whose CRCs cancel
    exists), so that only comparing the bytes finds the change."""
    import crc32c

    n, at = table.nbytes, 200_000
    zero = crc32c.crc32c(bytes(n))

    def effect(bit: int) -> int:
        e = bytearray(n)
        e[at + bit // 8] |= 1 << (bit % 8)
        return crc32c.crc32c(bytes(e)) ^ zero

    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (vector, bits combined)
    for bit in range(40):
        v, used = effect(bit), 1 << bit
        while v:
            top = v.bit_length() - 1
            if top not in basis:
                basis[top] = (v, used)
                break
            v, used = v ^ basis[top][0], used ^ basis[top][1]
        else:  # the flips in `used` cancel
            raw = bytearray(table.tobytes())
            for b in range(40):
                if used >> b & 1:
                    raw[at + b // 8] ^= 1 << (b % 8)
            out = np.frombuffer(bytes(raw), table.dtype).reshape(table.shape).copy()
            assert crc32c.crc32c(out.tobytes()) == crc32c.crc32c(table.tobytes()) and not np.array_equal(out, table)
            return out
    raise AssertionError("40 bit flips always hold a dependency in 32 dimensions")


def host_run(directory: Path, tables: list[np.ndarray]) -> list[str]:
    ckpt = jaxckpt.Checkpoint(step=0, table=tables[0], small=np.zeros(4))
    with jaxckpt.CheckpointManager(ckpt, directory, step_counter="step", max_to_keep=5) as manager:
        for step, table in enumerate(tables, start=1):
            ckpt.step, ckpt.table = step, table
            manager.save()
        manager.wait_until_finished()
        return manager.checkpoints


def test_a_numpy_array_of_the_same_content_is_linked_whatever_object_holds_it(tmp_path, counted_writes):
    table = host_table()
    paths = host_run(tmp_path / "ckpts", [table, table, table.copy()])
    assert len(counted_writes) == 1  # the first save's; the small one goes into the pack
    assert inodes(paths[0], "table") == inodes(paths[1], "table") == inodes(paths[2], "table")
    for path in paths:
        restored = jaxckpt.restore(path)["table"]
        assert isinstance(restored, np.ndarray)
        np.testing.assert_array_equal(restored, table)


def test_a_numpy_array_changed_anywhere_is_written(tmp_path, counted_writes):
    table = host_table()
    last = table.copy()
    last[-1, -1] += 1  # in its last inner chunk
    first = table.copy()
    first[0, 0] += 1  # in its first bytes
    blind = crc_blind_change(table)
    tables = [table, last, blind, first, table]
    paths = host_run(tmp_path / "ckpts", tables)
    assert len(counted_writes) == 5
    assert len({frozenset(inodes(p, "table")) for p in paths}) == 5
    for path, expected in zip(paths, tables):
        np.testing.assert_array_equal(jaxckpt.restore(path)["table"], expected)


def test_a_numpy_array_changed_in_place_after_an_async_save_is_written_as_it_was(tmp_path):
    table = host_table()
    ckpt = jaxckpt.Checkpoint(step=0, table=table)
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts", step_counter="step", async_save=True) as manager:
        first = manager.save()
        table[0, 0] = 7.0  # the snapshot was taken: the first checkpoint keeps the old value
        ckpt.step = 1
        second = manager.save()
        ckpt.step = 2
        third = manager.save()  # unchanged since the second: linked from it
        manager.wait_until_finished()
    assert jaxckpt.restore(first)["table"][0, 0] == host_table()[0, 0]
    np.testing.assert_array_equal(jaxckpt.restore(second)["table"], table)
    assert inodes(second, "table") == inodes(third, "table") != inodes(first, "table")


def test_two_tiers_link_an_unchanged_numpy_array_in_the_local_tier(tmp_path):
    table = host_table()
    ckpt = jaxckpt.Checkpoint(step=0, table=table)
    local = tmp_path / "local"
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "durable", step_counter="step", local_directory=local) as manager:
        for step in (1, 2):
            ckpt.step = step
            manager.save()
        manager.wait_until_finished()
    assert inodes(local / "ckpt-1", "table") == inodes(local / "ckpt-2", "table")
    np.testing.assert_array_equal(jaxckpt.restore(str(tmp_path / "durable" / "ckpt-2"))["table"], table)


def test_a_numpy_array_restored_from_the_manager_s_checkpoint_is_linked_if_unchanged(tmp_path, counted_writes):
    directory = tmp_path / "ckpts"
    (first,) = host_run(directory, [host_table()])
    del counted_writes[:]
    ckpt = jaxckpt.Checkpoint(step=0, table=np.zeros((1024, 1024), np.float32), small=np.zeros(4))
    with jaxckpt.CheckpointManager(ckpt, directory, step_counter="step") as manager:
        ckpt.restore(manager.latest_checkpoint).assert_consumed()
        ckpt.step = 2
        second = manager.save()
        ckpt.table = ckpt.table.copy()
        ckpt.table[5, 5] += 1
        ckpt.step = 3
        third = manager.save()
        manager.wait_until_finished()
    assert inodes(second, "table") == inodes(first, "table") != inodes(third, "table")
    assert len(counted_writes) == 1  # the third's
    np.testing.assert_array_equal(jaxckpt.restore(second)["table"], host_table())


def test_a_numpy_array_of_the_same_bytes_in_another_byte_order_is_refused_as_without_incremental_saves(tmp_path):
    table = host_table()
    ckpt = jaxckpt.Checkpoint(step=0, table=table)
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts", step_counter="step") as manager:
        manager.save()
        ckpt.table = table.view(table.dtype.newbyteorder(">"))  # the same bytes, other values
        ckpt.step = 1
        with pytest.raises(jaxckpt.UnsupportedValueError, match=">f4"):
            manager.save()
