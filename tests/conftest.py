"""Every test runs on CPU with 8 host devices, so meshes and sharded arrays are real."""

import os
import re
import threading

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import gcs_server as gcs_emulator
import jax
import moto_server
import pytest
from bucket_proxy import BucketProxy

jax.config.update("jax_enable_x64", False)


@pytest.fixture
def small_packs(monkeypatch):
    """Store every array leaf as its own zarr3 array, so tests cover that path as well as packing."""
    from jaxckpt.arrays import store_write

    monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", -1)
    monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", -1)


@pytest.fixture
def local_packing(monkeypatch):
    """Object stores pack only the leaves that local disks pack (1 MiB), in packs of the same size, and
    write arrays in device shards, so that their layouts compare."""
    from jaxckpt.arrays import store_write

    monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", store_write.PACK_LEAF_LIMIT)
    monkeypatch.setattr(store_write, "BUCKET_PACK_MIN_BYTES", 0)
    monkeypatch.setattr(store_write, "pack_target", lambda data_bytes, largest: store_write.PACK_TARGET_BYTES)


@pytest.fixture
def stress_scale() -> int:
    """How many times over the stress marker's trials run: ``JAXCKPT_STRESS_SCALE``, 1 by default (CI's
    ``pytest -m stress``); ``make stress`` runs them tenfold."""
    return max(1, int(os.environ.get("JAXCKPT_STRESS_SCALE", "1")))


@pytest.fixture
def small_inner_chunks(monkeypatch):
    """Inner chunks of at most 1 KiB (the format's limit is 8 MiB): several per shard, cheaply; leaves
    over 1 KiB have their own array."""
    from jaxckpt.arrays import store_write, zarr_meta

    monkeypatch.setattr(zarr_meta, "INNER_CHUNK_LIMIT", 1024)
    monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", 1024)
    monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", 1024)


# --- bucket servers on loopback: S3 (moto) for s3://, a GCS emulator for gs:// ---------------------

BUCKET = "jaxckpt-tests"


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server on loopback (moto), started once per test process, stopped at the end."""
    pytest.importorskip("moto")
    proc, env = moto_server.start(BUCKET)
    yield env
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    return f"s3://{BUCKET}/{request.node.name}"


@pytest.fixture(scope="session")
def gcs_session_proxy():
    """A GCS emulator on loopback behind a :class:`bucket_proxy.BucketProxy` (recording, and faulting
    on demand), both started once per test process, stopped at the end. Every gs:// request of the
    process goes through this proxy: TensorStore keeps the first GCS endpoint of a process (see
    jaxckpt.storage.locations), so a test cannot put a proxy of its own in front of the emulator. Its
    ``upstream`` is the emulator itself, for subprocesses (which may use any endpoint)."""
    pytest.importorskip("gcp_storage_emulator")
    proc, env = gcs_emulator.start(BUCKET)
    try:
        with BucketProxy(env["STORAGE_EMULATOR_HOST"]) as proxy:
            yield proxy
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def gcs_server(gcs_session_proxy):
    """The environment that points jaxckpt at the GCS emulator (through the session's proxy), set in
    ``os.environ`` for the whole session, not per test: TensorStore keeps the first GCS endpoint of a
    process (see jaxckpt.storage.locations)."""
    env = {"STORAGE_EMULATOR_HOST": gcs_session_proxy.endpoint}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def gcs_proxy(gcs_server, gcs_session_proxy):
    """The session's proxy in front of the GCS emulator, with no records and no faults before and after
    this test (a failing test leaves no faults to the next)."""
    gcs_session_proxy.faults = None
    gcs_session_proxy.clear()
    yield gcs_session_proxy
    gcs_session_proxy.faults = None
    gcs_session_proxy.clear()


@pytest.fixture(params=["s3", "gs"])
def bucket(request, monkeypatch):
    """A prefix of its own in a bucket, for each test: on the S3 server (``s3://``) and on the GCS
    emulator (``gs://``), with the environment that points jaxckpt at it set in ``os.environ`` (a
    subprocess given ``os.environ`` reaches the same server)."""
    if request.param == "s3":
        for k, v in request.getfixturevalue("s3_server").items():
            monkeypatch.setenv(k, v)
    else:
        request.getfixturevalue("gcs_proxy")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")
    return f"{request.param}://{BUCKET}/{name}"


@pytest.fixture
def held_background(monkeypatch):
    """The background part of a save waits for ``gate``: the caller's state can change meanwhile."""
    from jaxckpt.saving import pipeline

    gate = threading.Event()
    real = pipeline.write_and_publish

    def gated(prepared):
        assert gate.wait(60), "the test never released the background save"
        return real(prepared)

    monkeypatch.setattr(pipeline, "write_and_publish", gated)
    yield gate
    gate.set()
