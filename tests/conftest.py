"""Every test runs on CPU with 8 host devices, so meshes and sharded arrays are real."""

import os
import socket
import subprocess
import sys
import time
import urllib.request

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import pytest

jax.config.update("jax_enable_x64", False)


@pytest.fixture
def small_packs(monkeypatch):
    """Store every array leaf as its own zarr3 array, so tests cover that path as well as packing."""
    from jaxckpt import _tensorstore

    monkeypatch.setattr(_tensorstore, "PACK_LEAF_LIMIT", -1)


# --- an S3-compatible server on loopback, for the s3:// tests ------------------------------------

BUCKET = "jaxckpt-tests"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server on loopback (moto), started once per test process, stopped at the end."""
    pytest.importorskip("moto")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # poll until it answers (a readiness check, not a sleep to wait for work)
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the moto S3 server did not start") from None
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    req = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")
    urllib.request.urlopen(req, timeout=10)
    yield env
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    return f"s3://{BUCKET}/{request.node.name}"
