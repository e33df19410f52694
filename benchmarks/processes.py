"""Several local ``jax.distributed`` worker processes started at once and waited for, each with its
own log file (never a pipe: a worker whose pipe filled would block, and the others would wait for it
in the next agreement). For ``pod_io.py`` and ``peers.py``, and the tests that run them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_and_wait(
    argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], timeout: float, what: str
) -> list[tuple[int, str]]:
    """Start one process per ``argvs[i]`` with ``envs[i]``; wait for all of them, at most ``timeout``
    seconds in all; returns each one's (exit status, output). On the timeout each is asked for its
    threads' stacks (SIGUSR1: the workers register faulthandler) and killed, and a RuntimeError shows
    the end of every log."""
    with tempfile.TemporaryDirectory(prefix="jaxckpt-procs-") as logs:
        files = [open(os.path.join(logs, f"{i}.log"), "w+") for i in range(len(argvs))]
        try:
            procs = [
                subprocess.Popen(list(argv), stdout=f, stderr=subprocess.STDOUT, text=True, env=dict(env))
                for argv, env, f in zip(argvs, envs, files, strict=True)
            ]
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _stop(procs)
                    raise RuntimeError(
                        f"{what}: the processes did not finish in {timeout} s:\n"
                        + "\n".join(f"--- process {i}:\n{_read(f)[-6000:]}" for i, f in enumerate(files))
                    ) from None
            return [(p.returncode, _read(f)) for p, f in zip(procs, files)]
        finally:
            for f in files:
                f.close()


def result_of(out: str) -> dict[str, Any]:
    """The ``result {json}`` line a worker printed last."""
    return dict(json.loads(out.rsplit("result ", 1)[1].splitlines()[0]))


def _stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Ask every process still running for its stacks, give it a few seconds to print them, then kill it."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    for p in procs:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _read(f: Any) -> str:
    f.flush()
    f.seek(0)
    return str(f.read())
