"""An S3-compatible server (moto) on loopback, with a bucket made: for the tests' ``s3_server``
fixture and for ``benchmarks/tiers.py`` (which puts this folder on its path)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_answering(proc: subprocess.Popen[Any], url: str, failure: str) -> None:
    """Poll ``url`` until the server ``proc`` answers it (a readiness check, not a sleep to wait for
    work); kill it and raise RuntimeError(``failure``) if it exits or a minute passes first."""
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(failure) from None


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
    wait_until_answering(proc, f"{endpoint}/moto-api/", "the moto S3 server did not start")
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=10)
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    return proc, env
