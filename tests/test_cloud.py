"""Object stores through TensorStore kvstores: the bucket suite, run on both S3 (a moto server on
127.0.0.1) and Google Cloud Storage (an emulator on 127.0.0.1; see tests/gcs_server.py), memory://,
and how gs:// paths reach their endpoint."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.saving import staging as _staging
from jaxckpt.storage import locations
from jaxckpt.tools import cli


def test_save_restore_and_inspect(bucket):
    tree = {"w": jnp.arange(300_000.0).reshape(600, 500), "b": np.ones(3, np.float32), "step": 4}
    path = jaxckpt.save(f"{bucket}/easy", tree)
    assert path == f"{bucket}/easy"
    restored = jaxckpt.restore(path, like=tree)
    np.testing.assert_array_equal(restored["w"], tree["w"])
    assert restored["step"] == 4
    assert dict(jaxckpt.list_variables(path))["w"] == (600, 500)
    np.testing.assert_array_equal(jaxckpt.load_variable(path, "b"), np.ones(3))
    with pytest.raises(jaxckpt.CheckpointExistsError):
        jaxckpt.save(path, tree)
    jaxckpt.save(path, {"other": 1}, overwrite=True)
    assert jaxckpt.restore(path) == {"other": 1}
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="nothing is stored"):
        jaxckpt.restore(f"{bucket}/missing")


def test_sharded_arrays_restore_onto_another_mesh(bucket, small_inner_chunks):
    """Each device's shards are written as their own objects (several inner chunks each); a restore
    onto another mesh assembles each device's part from several of them."""
    devices = np.array(jax.devices())
    x = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    written = jax.device_put(x, NamedSharding(Mesh(devices.reshape(4, 2), ("a", "b")), P("a", "b")))
    path = jaxckpt.save(f"{bucket}/sharded", {"x": written})
    target = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("b", "a"))
    like = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)}
    restored = jaxckpt.restore(path, like=like)["x"]
    assert restored.sharding == target
    np.testing.assert_array_equal(np.asarray(restored), x)


def test_manager_saves_retains_and_continues(bucket):
    ckpt = jaxckpt.Checkpoint(step=0, w=jnp.zeros(4))
    manager = jaxckpt.CheckpointManager(ckpt, f"{bucket}/run", max_to_keep=2, step_counter="step")
    for step in range(1, 5):
        ckpt.step, ckpt.w = step, jnp.full(4, float(step))
        manager.save(metrics={"loss": 1.0 / step})
    assert manager.checkpoints == [f"{bucket}/run/ckpt-3", f"{bucket}/run/ckpt-4"]
    manager.close()
    assert jaxckpt.latest_checkpoint(f"{bucket}/run") == f"{bucket}/run/ckpt-4"
    folder = locations.location(f"{bucket}/run")
    assert locations.children(folder) == ["checkpoint", "ckpt-3", "ckpt-4"]  # ckpt-1 and ckpt-2 deleted
    state = json.loads(locations.read_file(folder, "checkpoint"))
    assert [c["prefix"] for c in state["checkpoints"]] == ["ckpt-3", "ckpt-4"]

    fresh = jaxckpt.Checkpoint(step=0, w=jnp.zeros(4))
    restarted = jaxckpt.CheckpointManager(fresh, f"{bucket}/run", max_to_keep=2, step_counter="step")
    assert restarted.restore_or_initialize() == f"{bucket}/run/ckpt-4"
    assert fresh.step == 4 and float(fresh.w[0]) == 4.0
    assert restarted.save().endswith("ckpt-5")
    assert restarted.checkpoints == [f"{bucket}/run/ckpt-4", f"{bucket}/run/ckpt-5"]
    restarted.close()


def test_interrupted_save_is_not_a_checkpoint_and_is_cleaned(bucket, monkeypatch):
    from jaxckpt.storage import kvstore

    real_write = kvstore.kv_write

    def no_index(base, key, value):
        if key == "index.json":
            raise OSError("connection reset")  # the commit never happens
        real_write(base, key, value)

    monkeypatch.setattr(kvstore, "kv_write", no_index)
    with pytest.raises(OSError, match="connection reset"):
        jaxckpt.save(f"{bucket}/c", {"x": np.arange(5)})
    monkeypatch.setattr(kvstore, "kv_write", real_write)
    assert locations.children(locations.location(f"{bucket}/c")) == []  # the failed save removed its data
    jaxckpt.save(f"{bucket}/c", {"x": np.arange(5)})
    assert jaxckpt.restore(f"{bucket}/c")["x"].tolist() == [0, 1, 2, 3, 4]


def test_leftover_data_without_index_is_replaced_by_the_next_save(bucket, monkeypatch):
    from jaxckpt.storage import kvstore

    real_write = kvstore.kv_write

    def crash_before_index(base, key, value):
        if key == "index.json":
            raise KeyboardInterrupt  # the process dies before the commit: nothing cleans up
        real_write(base, key, value)

    real_discard = _staging.discard
    monkeypatch.setattr(kvstore, "kv_write", crash_before_index)
    monkeypatch.setattr(_staging, "discard", lambda staging: None)
    with pytest.raises(KeyboardInterrupt):
        jaxckpt.save(f"{bucket}/c", {"x": np.arange(3)})
    monkeypatch.setattr(kvstore, "kv_write", real_write)  # not undo(): that would drop the bucket's settings too
    monkeypatch.setattr(_staging, "discard", real_discard)
    path = f"{bucket}/c"
    assert locations.children(locations.location(path)) == [_staging.SAVE_MARKER, "data"]
    with pytest.raises(jaxckpt.NotACheckpointError, match=r"no index\.json"):
        jaxckpt.restore(path)
    jaxckpt.save(path, {"y": 2})
    assert jaxckpt.restore(path) == {"y": 2}
    assert locations.children(locations.location(path)) == ["index.json"]  # the leftover data and marker are gone


def test_data_without_index_or_marker_is_a_users_and_is_kept(bucket):
    """A user's data/ folder under the prefix looks like a save's data store; without jaxckpt's
    marker it is not provably jaxckpt's, so a save there is refused and nothing is deleted."""
    kv = ts.KvStore.open(locations.location(f"{bucket}/mine").spec()).result()
    kv.write("data/train.csv", b"a,b\n1,2\n").result()
    kv.write("data.p1/manifest.ocdbt", b"not ocdbt").result()
    with pytest.raises(jaxckpt.CheckpointExistsError, match=r"mine.*not a jaxckpt checkpoint"):
        jaxckpt.save(f"{bucket}/mine", {"x": np.arange(3)})
    assert sorted(kv.list().result()) == [b"data.p1/manifest.ocdbt", b"data/train.csv"]
    # A checkpoint whose index was deleted by hand has lost jaxckpt's claim on its data as well.
    path = jaxckpt.save(f"{bucket}/c", {"x": np.arange(3)})
    ts.KvStore.open(locations.location(path).spec()).result().delete_range(
        ts.KvStore.KeyRange("index.json", "index.json\0")
    ).result()
    with pytest.raises(jaxckpt.CheckpointExistsError, match="marker"):
        jaxckpt.save(path, {"y": 2}, overwrite=True)


def test_cli(bucket, capsys):
    """``python -m jaxckpt`` in a child process reaches the same server (the environment is passed on);
    the other commands run in this process, which is faster."""
    ckpt = jaxckpt.Checkpoint(w=np.arange(10, dtype=np.float32))
    with jaxckpt.CheckpointManager(ckpt, f"{bucket}/run", max_to_keep=3) as manager:
        manager.save()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the bucket fixture set the server's environment
    proc = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "ls", f"{bucket}/run"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "ckpt-1" in proc.stdout
    capsys.readouterr()
    assert cli.main(["ls", f"{bucket}/run/ckpt-1"]) == 0
    assert "w" in capsys.readouterr().out
    assert cli.main(["show", f"{bucket}/run/ckpt-1", "w"]) == 0
    assert "float32" in capsys.readouterr().out
    assert cli.main(["verify", f"{bucket}/run/ckpt-1"]) == 0


def test_async_saves(bucket):
    tree = {"w": jnp.arange(1000.0), "step": 1}
    path = jaxckpt.save(f"{bucket}/one", tree, blocking=False)
    jaxckpt.wait_until_finished()
    np.testing.assert_array_equal(jaxckpt.restore(path)["w"], np.arange(1000.0))
    ckpt = jaxckpt.Checkpoint(w=jnp.zeros(4), step=0)
    for step in (1, 2, 3):  # each save waits for the one before it
        ckpt.step, ckpt.w = step, jnp.full(4, float(step))
        ckpt.save(f"{bucket}/run/ckpt", blocking=False)
    ckpt.wait_until_finished()
    assert jaxckpt.latest_checkpoint(f"{bucket}/run") == f"{bucket}/run/ckpt-3"
    restored = jaxckpt.restore(f"{bucket}/run/ckpt-2")
    assert restored["step"] == 2 and restored["w"].tolist() == [2.0] * 4


def test_inspect(bucket):
    ckpt = jaxckpt.Checkpoint(step=0, w=np.arange(6, dtype=np.int32).reshape(2, 3))
    with jaxckpt.CheckpointManager(ckpt, f"{bucket}/run", max_to_keep=2, step_counter="step") as manager:
        for step in (1, 2, 3):
            ckpt.step = step
            manager.save()
    view = jaxckpt.inspect(f"{bucket}/run/ckpt-3")
    assert sorted(view.keys()) == ["save_counter", "step", "w"]
    np.testing.assert_array_equal(view["w"], np.arange(6).reshape(2, 3))
    assert "int32" in str(view)
    runs = jaxckpt.inspect(f"{bucket}/run")
    assert len(runs) == 2 and runs.latest is not None
    assert "ckpt-2" in str(runs) and "ckpt-3" in str(runs) and "ckpt-1" not in str(runs)


def test_the_servers_answer_as_the_bucket_services_do(bucket):
    """What jaxckpt relies on from a bucket, through TensorStore, on both test servers (the GCS
    emulator needed fixes for each, see tests/gcs_server.py): empty values, ranges (past the end:
    OUT_OF_RANGE), conditional writes, listings by key range."""
    kv = ts.KvStore.open(locations.location(f"{bucket}/kv").spec()).result()
    kv.write("empty", b"").result()
    assert kv.read("empty").result().value == b""
    kv.write("five", b"01234").result()
    assert kv.read("five", byte_range=slice(1, 3)).result().value == b"12"
    assert kv.read("five", byte_range=slice(-2, None)).result().value == b"34"
    with pytest.raises(ValueError, match="OUT_OF_RANGE"):
        kv.read("five", byte_range=slice(5, 6)).result()
    absent = kv.read("nothing").result().stamp.generation
    assert kv.write("five", b"x", if_equal=absent).result().generation == b""  # refused: it exists
    current = kv.read("five").result().stamp.generation
    assert kv.write("five", b"56789", if_equal=current).result().generation != b""
    assert kv.write("five", b"x", if_equal=current).result().generation == b""  # refused: stale
    assert kv.read("five").result().value == b"56789"
    kv.write("fivefold", b"").result()
    assert kv.list(ts.KvStore.KeyRange("five", "five\0")).result() == [b"five"]
    kv.delete_range(ts.KvStore.KeyRange("five", "five\0")).result()
    assert sorted(kv.list().result()) == [b"empty", b"fivefold"]


def test_deleting_a_checkpoint_leaves_the_keys_that_share_its_prefix(bucket):
    """A checkpoint's objects are deleted by key range: ``ckpt-1/`` only, never ``ckpt-10/`` or
    ``ckpt-1-other`` (the GCS emulator's listings ignored the range until tests/gcs_server.py fixed it)."""
    for name in ("ckpt-1", "ckpt-10", "ckpt-1-other"):
        jaxckpt.save(f"{bucket}/run/{name}", {"name": name, "x": np.arange(4)})
    jaxckpt.save(f"{bucket}/run/ckpt-1", {"name": "again"}, overwrite=True)
    assert jaxckpt.restore(f"{bucket}/run/ckpt-1") == {"name": "again"}
    for name in ("ckpt-10", "ckpt-1-other"):
        assert jaxckpt.restore(f"{bucket}/run/{name}")["name"] == name


def _data_objects(path):
    kv = ts.KvStore.open(locations.location(path).spec()).result()
    return kv, [k.decode() for k in kv.list().result() if "/c/" in k.decode()]


@pytest.mark.parametrize(
    "damage", ["garbage", "garbage before the shard index", "truncated", "deleted", "no zarr.json"]
)
def test_a_damaged_or_missing_object_is_an_error_naming_the_key(bucket, damage, capsys):
    """Whatever happened to a data object in the bucket, a restore raises CheckpointCorruptedError
    naming the leaf whose data it is, never returns other values; verify reports it DAMAGED. A
    missing zarr.json is damage to verify, which reads what TensorStore reads; a restore does not
    read it (the checksummed index says how the bytes are laid out)."""
    tree = {"w": np.arange(3000, dtype=np.float32).reshape(60, 50), "step": 4}
    path = jaxckpt.save(f"{bucket}/c", tree)
    kv, (data,) = _data_objects(path)
    value = bytes(kv.read(data).result().value)
    if damage == "garbage":
        kv.write(data, bytes(len(value))).result()
    elif damage == "garbage before the shard index":  # the shard index (at the end) still matches
        kv.write(data, b"\xff" * 64 + value[64:]).result()
    elif damage == "truncated":
        kv.write(data, value[:100]).result()
    elif damage == "deleted":
        kv.delete_range(ts.KvStore.KeyRange(data, data + "\0")).result()
    else:
        meta = data.split("/c/")[0] + "/zarr.json"
        kv.delete_range(ts.KvStore.KeyRange(meta, meta + "\0")).result()
    if damage == "no zarr.json":  # a restore reads as the index says, every byte checked: nothing is wrong
        np.testing.assert_array_equal(jaxckpt.restore(path, like=tree)["w"], tree["w"])
    else:
        with pytest.raises(jaxckpt.CheckpointCorruptedError, match="'w'"):
            jaxckpt.restore(path, like=tree)
    assert cli.main(["verify", path]) == 1  # but TensorStore and zarr-python could not read it
    assert "DAMAGED" in capsys.readouterr().out


def test_memory_store_everywhere(capsys):
    ckpt = jaxckpt.Checkpoint(w=jnp.ones(3), step=1)
    with jaxckpt.CheckpointManager(ckpt, "memory://mem-run", max_to_keep=1) as manager:
        manager.save()
        ckpt.step = 2
        manager.save()
        assert manager.checkpoints == ["memory://mem-run/ckpt-2"]
    assert jaxckpt.latest_checkpoint("memory://mem-run") == "memory://mem-run/ckpt-2"
    assert jaxckpt.restore("memory://mem-run/ckpt-2")["step"] == 2
    assert cli.main(["verify", "memory://mem-run/ckpt-2"]) == 0
    assert cli.main(["ls", "memory://mem-run"]) == 0
    assert "ckpt-2" in capsys.readouterr().out
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore("memory://nothing-here")


def test_gcs_paths_map_to_the_gcs_kvstore():
    """Google Cloud Storage cannot be reached from the tests; what jaxckpt controls is the spec."""
    loc = locations.location("gs://my-bucket/runs/a/")
    assert loc.spec() == {"driver": "gcs", "bucket": "my-bucket", "path": "runs/a/"}
    assert (loc / "ckpt-3").spec()["path"] == "runs/a/ckpt-3/"
    with pytest.raises(ValueError, match="names no bucket"):
        locations.location("s3:///nothing")
    with pytest.raises(NotImplementedError, match="ftp"):
        locations.location("ftp://host/x")


_ENDPOINT_RULE = """
import os, jaxckpt
from jaxckpt import StorageError
from jaxckpt.storage import locations
host = os.environ["STORAGE_EMULATOR_HOST"].removeprefix("http://")  # the form without a scheme works too


def refused(why):
    try:
        locations.location("gs://jaxckpt-tests/endpoint/x")
    except StorageError as e:
        assert why in str(e), str(e)
    else:
        raise AssertionError("not refused: " + why)


os.environ["TENSORSTORE_GCS_HTTP_URL"] = "http://127.0.0.1:1"  # the user's, and another endpoint
refused("TENSORSTORE_GCS_HTTP_URL is 'http://127.0.0.1:1'")
del os.environ["TENSORSTORE_GCS_HTTP_URL"]
# Before the first request, the endpoint follows STORAGE_EMULATOR_HOST, set, changed or unset.
os.environ["STORAGE_EMULATOR_HOST"] = "127.0.0.1:1"
locations.location("gs://jaxckpt-tests/endpoint/x")
assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:1"
del os.environ["STORAGE_EMULATOR_HOST"]
locations.location("gs://jaxckpt-tests/endpoint/x")
assert "TENSORSTORE_GCS_HTTP_URL" not in os.environ and "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in os.environ
os.environ["STORAGE_EMULATOR_HOST"] = host
path = jaxckpt.save("gs://jaxckpt-tests/endpoint/c", {"x": 1})
assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://" + host
assert jaxckpt.restore(path) == {"x": 1}
# After it, another endpoint is refused, and so is Google Cloud Storage itself.
os.environ["STORAGE_EMULATOR_HOST"] = "127.0.0.1:1"
refused("already made requests to 'http://" + host + "'")
del os.environ["STORAGE_EMULATOR_HOST"]
refused("STORAGE_EMULATOR_HOST is unset, but this process already made requests")
print("ok")
"""


def test_gs_follows_storage_emulator_host_and_one_process_keeps_one_endpoint(gcs_server):
    """``STORAGE_EMULATOR_HOST`` points gs:// at an emulator; TensorStore keeps the endpoint of its
    first GCS request, so a path that would need another is a StorageError. In a fresh process."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
    }
    proc = subprocess.run(
        [sys.executable, "-c", _ENDPOINT_RULE],
        capture_output=True,
        text=True,
        env={**env, **gcs_server, "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
