"""Incremental checkpoints on buckets (s3:// on moto; the main cases on gs:// too, the ``bucket`` fixture): unchanged arrays stored by reference (format 6, jaxckpt.incremental.refs),
held data kept while a kept checkpoint uses it, and hostile references refused."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from lora_state import adapter, base, expect_restores, run

import jaxckpt
from jaxckpt.arrays import store_write
from jaxckpt.incremental import refs as _refs
from jaxckpt.storage import kvstore, locations


@pytest.fixture(autouse=True)
def small_pack_limit(monkeypatch):
    """Arrays over 1 MiB are arrays of their own on a bucket too (not packed), so that tests stay small."""
    monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", 1 << 20)


def keys(path: str) -> list[str]:
    return sorted(kvstore.kv_keys(locations.location(path).spec()))


def index_of(path: str) -> dict:
    return json.loads(locations.read_file(locations.location(path), "index.json"))


def test_unchanged_arrays_are_stored_by_reference(bucket):
    frozen, paths = run(bucket, 3)
    first, *later = paths
    assert index_of(first)["version"] == 5  # nothing referred to: readable by format-5 readers
    for path in later:
        assert index_of(path)["version"] == 6
        refs = _refs.decode(locations.read_file(locations.location(path), "data/refs.json"), "", index_of(path)["save"])
        assert {r.checkpoint for r in refs.values()} == {"ckpt-1"} and len(refs) == 2
        arrays = {k.split("/")[2] for k in keys(path) if k.startswith("data/a/")}
        assert len(arrays) == 1  # the adapter's only
    for step, path in enumerate(paths, start=1):
        expect_restores(path, frozen, step)
    state = json.loads(locations.read_file(locations.location(bucket), "checkpoint"))
    assert [c.get("uses", []) for c in state["checkpoints"]] == [[], ["ckpt-1"], ["ckpt-1"]]


def test_retention_holds_referenced_data_and_frees_it_when_unused(bucket):
    frozen, paths = run(bucket, 5, keep=2)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["ckpt-4", "ckpt-5"]
    held = keys(f"{bucket}/ckpt-1")
    assert "index.json" not in held and "data/checksums.json" in held
    assert not any(k.startswith("data/p/") for k in held)  # its adapter pack and all else went
    assert not locations.children(locations.location(f"{bucket}/ckpt-2"))  # used nothing of its own
    for step, path in zip((4, 5), paths):
        expect_restores(path, frozen, step)
    # A new base: the next saves write it, and once no kept checkpoint uses ckpt-1, it goes.
    run(bucket, 0)  # a manager start-up keeps held data that kept checkpoints use
    assert keys(f"{bucket}/ckpt-1") == held
    ckpt = jaxckpt.Checkpoint(step=5, base=base(), adapter=adapter(5))
    with jaxckpt.CheckpointManager(ckpt, bucket, max_to_keep=2, step_counter="step") as manager:
        for step in (6, 7):
            ckpt.step, ckpt.adapter = step, adapter(step)
            manager.save()
        manager.wait_until_finished()
    assert not keys(f"{bucket}/ckpt-1")
    expect_restores(f"{bucket}/ckpt-7", frozen, 7)


def test_a_restart_refers_to_what_the_restore_returned(bucket):
    frozen, _ = run(bucket, 2)
    ckpt = jaxckpt.Checkpoint(step=0, base=base(), adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, bucket, max_to_keep=3, step_counter="step") as manager:
        manager.restore_or_initialize()
        ckpt.step, ckpt.adapter = 3, adapter(3)
        manager.save()
        manager.wait_until_finished()
    path = f"{bucket}/ckpt-3"
    refs = _refs.decode(locations.read_file(locations.location(path), "data/refs.json"), "", None)
    assert {r.checkpoint for r in refs.values()} == {"ckpt-1"}  # the holder, not ckpt-2 that referred to it
    expect_restores(path, frozen, 3)


def test_a_restart_in_tensorflows_idiom_refers_to_what_the_restore_returned(bucket):
    # TensorFlow's restart: ckpt.restore(manager.latest_checkpoint), not a call of the manager.
    frozen, _ = run(bucket, 2)
    ckpt = jaxckpt.Checkpoint(step=0, base=base(), adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, bucket, max_to_keep=3, step_counter="step") as manager:
        ckpt.restore(manager.latest_checkpoint)
        ckpt.step, ckpt.adapter = 3, adapter(3)
        manager.save()
        manager.wait_until_finished()
    path = f"{bucket}/ckpt-3"
    assert index_of(path)["version"] == 6
    refs = _refs.decode(locations.read_file(locations.location(path), "data/refs.json"), "", None)
    assert {r.checkpoint for r in refs.values()} == {"ckpt-1"}
    expect_restores(path, frozen, 3)


def test_delete_of_the_last_user_forgets_and_writes_again(s3):
    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    with jaxckpt.CheckpointManager(ckpt, s3, max_to_keep=3, step_counter="step") as manager:
        ckpt.step = 1
        manager.save()
        manager.delete(1)
        ckpt.step, ckpt.adapter = 2, adapter(2)
        manager.save()
        manager.wait_until_finished()
    assert index_of(f"{s3}/ckpt-2")["version"] == 5
    assert not keys(f"{s3}/ckpt-1")
    expect_restores(f"{s3}/ckpt-2", frozen, 2)


def test_incremental_false_and_one_off_saves_write_everything(s3):
    run(f"{s3}/off", 2, incremental=False)
    assert index_of(f"{s3}/off/ckpt-2")["version"] == 5
    tree = {"w": base()["w1"]}
    jaxckpt.save(f"{s3}/one/a", tree)
    jaxckpt.save(f"{s3}/one/b", tree)
    assert index_of(f"{s3}/one/b")["version"] == 5


def _rewrite_refs(path: str, change) -> None:
    location = locations.location(path)
    data = locations.read_file(location, "data/refs.json")
    body = json.loads(data)
    body.pop("checksum")
    change(body)
    from jaxckpt.format.checked_json import checksummed_json

    kvstore.kv_write(location.spec(), "data/refs.json", checksummed_json(body))


@pytest.mark.parametrize(
    "name", ["../elsewhere", "/abs", "a/b", "..", ".", ""], ids=["dotdot", "absolute", "slash", "up", "dot", "empty"]
)
def test_a_reference_to_anything_but_a_plain_sibling_is_refused(s3, name):
    run(s3, 2)

    def change(body):
        for entry in body["arrays"].values():
            entry["checkpoint"] = name

    _rewrite_refs(f"{s3}/ckpt-2", change)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="not a reference"):
        jaxckpt.restore(f"{s3}/ckpt-2")


def test_a_missing_referenced_checkpoint_names_the_key_and_both_checkpoints(bucket):
    run(bucket, 2)
    locations.delete_tree(locations.location(f"{bucket}/ckpt-1"))
    with pytest.raises(jaxckpt.CheckpointCorruptedError) as e:
        jaxckpt.restore(f"{bucket}/ckpt-2")
    assert "ckpt-2" in str(e.value) and "ckpt-1" in str(e.value) and "base/" in str(e.value)


def test_a_reference_to_another_save_or_other_crcs_is_refused(s3):
    run(s3, 2)

    def other_save(body):
        for entry in body["arrays"].values():
            entry["save"] = "ab" * 8

    _rewrite_refs(f"{s3}/ckpt-2", other_save)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="not by save"):
        jaxckpt.restore(f"{s3}/ckpt-2")


def test_other_crcs_are_refused(s3):
    run(s3, 2)

    def other_crcs(body):
        for entry in body["arrays"].values():
            for crcs in entry["shards"].values():
                crcs[0] ^= 1

    _rewrite_refs(f"{s3}/ckpt-2", other_crcs)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="other data"):
        jaxckpt.restore(f"{s3}/ckpt-2")


def test_a_referenced_array_of_another_shape_is_refused(s3):
    """The referenced array's zarr.json must say what the referencing index says."""
    run(s3, 2)
    location = locations.location(f"{s3}/ckpt-1")
    array = index_of(f"{s3}/ckpt-1")["leaves"]["base/w1"]["at"]["array"]
    meta = json.loads(locations.read_file(location, f"data/{array}/zarr.json"))
    meta["shape"] = [768, 1024]
    kvstore.kv_write(location.spec(), f"data/{array}/zarr.json", json.dumps(meta).encode())
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="ckpt-1"):
        jaxckpt.restore(f"{s3}/ckpt-2")


def test_a_format_5_reader_refuses_version_6_clearly(s3, monkeypatch):
    from jaxckpt.format import index_json

    run(s3, 2)
    monkeypatch.setattr(index_json, "FORMAT_VERSION", 5)
    with pytest.raises(jaxckpt.JaxckptError, match="format version 6; this jaxckpt reads versions up to 5"):
        jaxckpt.restore(f"{s3}/ckpt-2")


@pytest.mark.parametrize("after", [0, 1, 2, 4, 8, 16])
def test_a_deletion_of_shared_data_cut_short_anywhere_loses_nothing(s3, monkeypatch, after):
    """Retention's deletions stop (as a crash would) after ``after`` object deletions; a manager started
    next finishes them: every kept checkpoint restores, held data stays, the rest goes."""
    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    manager = jaxckpt.CheckpointManager(ckpt, s3, max_to_keep=2, step_counter="step")
    for step in (1, 2):
        ckpt.step, ckpt.adapter = step, adapter(step)
        manager.save()
    manager.wait_until_finished()
    real, real_all, count = kvstore.kv_delete, kvstore.kv_delete_all, [0]

    def failing(base, key):
        if base["path"].rstrip("/").rsplit("/", 1)[-1] in ("ckpt-1", "ckpt-2"):  # the dropped ones
            count[0] += 1
            if count[0] > after:
                raise jaxckpt.StorageError("cut short", 5)
        return real(base, key) if key else real_all(base)

    monkeypatch.setattr(kvstore, "kv_delete", failing)
    monkeypatch.setattr(kvstore, "kv_delete_all", lambda base: failing(base, ""))
    with warnings.catch_warnings():  # the deletions' failures are reported: the next manager cleans up
        warnings.simplefilter("ignore")
        for step in (3, 4):
            ckpt.step, ckpt.adapter = step, adapter(step)
            manager.save()
        try:
            manager.close()
        except jaxckpt.StorageError:
            pass  # the deletions' failure: what the next manager cleans up
    monkeypatch.setattr(kvstore, "kv_delete", real)
    monkeypatch.setattr(kvstore, "kv_delete_all", real_all)
    restarted = jaxckpt.CheckpointManager(jaxckpt.Checkpoint(), s3, max_to_keep=2)  # its start-up cleans up
    assert [p.rsplit("/", 1)[1] for p in restarted.checkpoints] == ["ckpt-3", "ckpt-4"]
    restarted.close()
    for step in (3, 4):
        expect_restores(f"{s3}/ckpt-{step}", frozen, step)
    held = keys(f"{s3}/ckpt-1")
    assert "index.json" not in held and not any(k.startswith("data/p/") for k in held)
    assert not keys(f"{s3}/ckpt-2")


def test_arrays_between_8_and_128_mib_are_arrays_of_their_own_in_incremental_bucket_saves(s3, monkeypatch):
    """Without incremental saves a bucket packs leaves up to 128 MiB: no weight matrix of most models
    could be referred to. An incremental manager's saves pack only leaves up to 8 MiB."""
    monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", 128 << 20)  # the real limit
    frozen = {"w": jnp.full((3 << 20,), 2.0, jnp.float32)}  # 12 MiB
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, small=jnp.zeros(1 << 20))  # 4 MiB: packed
    with jaxckpt.CheckpointManager(ckpt, s3, max_to_keep=2, step_counter="step") as manager:
        for step in (1, 2):
            ckpt.step, ckpt.small = step, jnp.full(1 << 20, float(step))
            manager.save()
        manager.wait_until_finished()
    at = index_of(f"{s3}/ckpt-2")["leaves"]
    assert "array" in at["base/w"]["at"] and "pack" in at["small"]["at"]
    assert not any(k.startswith("data/a/") for k in keys(f"{s3}/ckpt-2"))
    np.testing.assert_array_equal(np.asarray(jaxckpt.restore(f"{s3}/ckpt-2")["base"]["w"]), np.asarray(frozen["w"]))
    jaxckpt.save(f"{s3}/one-off", {"w": frozen["w"]})
    assert "pack" in index_of(f"{s3}/one-off")["leaves"]["w"]["at"]  # one-off saves unchanged


def test_an_adopted_checkpoint_keeps_the_data_it_refers_to(s3):
    """A bucket save that published but was not listed yet (killed in between) is adopted by the next
    manager: what it refers to must stay held when retention drops the checkpoint that holds it."""
    frozen, _ = run(s3, 2)
    from jaxckpt.storage import statefile

    folder = locations.location(s3)
    infos = statefile.read_state(s3)
    statefile.write_state(folder, infos[:1])  # as if killed before the state file listed ckpt-2
    manager = jaxckpt.CheckpointManager(jaxckpt.Checkpoint(), s3, max_to_keep=3)
    assert [c.uses for c in manager.checkpoint_infos] == [(), ("ckpt-1",)]
    manager.delete(1)
    manager.close()
    expect_restores(f"{s3}/ckpt-2", frozen, 2)


def test_damage_to_referenced_data_is_found_in_every_checkpoint_that_uses_it(s3, capsys):
    from jaxckpt.tools import cli

    _, paths = run(s3, 3)
    array = index_of(paths[0])["leaves"]["base/w1"]["at"]["array"]
    location = locations.location(paths[0])
    shard = next(k for k in keys(paths[0]) if k.startswith(f"data/{array}/c/"))
    data = bytearray(locations.read_file(location, shard, 1 << 30))
    data[100] ^= 0x10
    kvstore.kv_write(location.spec(), shard, bytes(data))
    assert cli.main(["verify", "--json", s3]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in report if not r["ok"]] == paths
    assert all([d["key"] for d in r["damaged"]] == ["base/w1"] for r in report)


def test_ls_tells_what_each_bucket_checkpoint_refers_to(s3, capsys):
    from jaxckpt.tools import cli

    run(s3, 3)
    doc = jaxckpt.inspect(s3).to_json()
    shared = [c["shared_bytes"] for c in doc["checkpoints"]]
    sizes = [c["disk_bytes"] for c in doc["checkpoints"]]
    base_bytes = 1024 * 512 * 4 + 1536 * 512 * 2
    assert shared == [0, base_bytes, base_bytes]  # ckpt-1 holds the base; the others refer to it
    assert doc["unique_bytes"] == sum(sizes) - 2 * base_bytes
    assert cli.main(["ls", s3]) == 0
    assert capsys.readouterr().out.count("shared") >= 2


def test_two_tiers_upload_only_what_the_bucket_lacks(bucket, tmp_path):
    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    local = tmp_path / "local"
    with jaxckpt.CheckpointManager(ckpt, bucket, step_counter="step", local_directory=local, max_to_keep=2) as manager:
        for step in (1, 2, 3):
            ckpt.step, ckpt.adapter = step, adapter(step)
            manager.save()
            manager.wait_until_finished()  # each copied (one queued behind a running copy may be skipped)
        infos = manager.checkpoint_infos
    assert [(c.path.rsplit("/", 1)[1], c.uses) for c in infos] == [("ckpt-2", ("ckpt-1",)), ("ckpt-3", ("ckpt-1",))]
    for info in infos:
        if info.uses:
            assert index_of(info.path)["version"] == 6
            assert len({k.split("/")[2] for k in keys(info.path) if k.startswith("data/a/")}) == 1  # the adapter's
        expect_restores(info.path, frozen, info.step)
    if not any(c.path.endswith("ckpt-1") for c in infos):  # dropped: held for the kept ones
        assert "index.json" not in keys(f"{bucket}/ckpt-1") and keys(f"{bucket}/ckpt-1")


def test_two_tiers_to_a_local_folder_hard_link_what_the_durable_tier_holds(tmp_path):
    from pathlib import Path

    frozen = base()
    ckpt = jaxckpt.Checkpoint(step=0, base=frozen, adapter=adapter(0))
    durable = tmp_path / "durable"
    with jaxckpt.CheckpointManager(ckpt, durable, step_counter="step", local_directory=tmp_path / "local") as manager:
        for step in (1, 2):
            ckpt.step, ckpt.adapter = step, adapter(step)
            manager.save()
        manager.wait_until_finished()

    def inodes(path, key):
        array = json.loads(Path(path, "index.json").read_text())["leaves"][key]["at"]["array"]
        return {p.stat().st_ino for p in Path(path, "data", array, "c").rglob("*") if p.is_file()}

    assert inodes(durable / "ckpt-1", "base/w0") == inodes(durable / "ckpt-2", "base/w0")
    assert inodes(durable / "ckpt-1", "adapter") != inodes(durable / "ckpt-2", "adapter")
    expect_restores(str(durable / "ckpt-2"), frozen, 2)


def test_a_manager_prefix_copied_to_a_local_folder_reads_as_in_the_bucket(s3, tmp_path):
    """Copied whole (as ``gsutil cp -r`` would), the references resolve among the local siblings."""
    frozen, _ = run(s3, 3, keep=2)
    base = locations.location(s3).spec()
    for key in kvstore.kv_keys(base):
        target = tmp_path / "copy" / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(kvstore.kv_read(base, key))
    for step in (2, 3):
        expect_restores(str(tmp_path / "copy" / f"ckpt-{step}"), frozen, step)
