"""An S3-compatible server (moto) on loopback, with a bucket made: for the tests' ``s3_server``
fixture and for ``benchmarks/tiers.py`` (which puts this folder on its path)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(bucket: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """Start a moto server on 127.0.0.1 with ``bucket`` made; returns the process and the environment
    (credentials, region, endpoint) that points TensorStore's s3 driver at it."""
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
                proc.kill()
                raise RuntimeError("the moto S3 server did not start") from None
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=10)
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    return proc, env
