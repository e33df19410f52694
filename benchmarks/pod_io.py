"""A pod's reads and writes as a bucket sees them: 4 ``jax.distributed`` CPU processes save and
restore a checkpoint on ``s3://`` (moto on loopback), each through its own counting proxy
(``tests/bucket_proxy.py``), for a data-parallel state (every array replicated), an FSDP state
(sharded over all processes) and a 2 x 2 mix. Reported per process and in total: bytes read from
and written to the bucket, requests, and the wall time of the call (the slowest process's).

    python benchmarks/pod_io.py                              # this work tree
    python benchmarks/pod_io.py --jaxckpt-rev 181863f        # jaxckpt as committed at a revision
    python benchmarks/pod_io.py --rows 4096 --json out.json  # 16 MiB kernels (64 MiB a state)

``tests/test_pod_io.py`` runs the same processes and asserts the byte counts (never the times).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # moto_server, bucket_proxy

import bucket_proxy  # noqa: E402
import moto_server  # noqa: E402
import processes  # noqa: E402

WORKER = os.path.join(HERE, "pod_worker.py")
BUCKET = "jaxckpt-pod"


def run(
    action: str,
    layout: str,
    url: str,
    moto_env: dict[str, str],
    *,
    nproc: int = 4,
    share: str = "auto",
    rows: int = 1024,
    timeout: float = 300,
    faults: dict[int, Any] | None = None,
    failing: bool = False,
) -> list[dict[str, Any]]:
    """Start ``nproc`` workers, each through its own counting proxy to the bucket server; returns each
    process's result: its wall time, and the bytes and requests its proxy saw. ``faults``: a process's
    proxy's fault rule (see ``tests/bucket_proxy.py``). ``failing``: return each process's exit status
    and output instead of raising when one fails."""
    proxies = [bucket_proxy.BucketProxy(moto_env["AWS_ENDPOINT_URL"], (faults or {}).get(i)) for i in range(nproc)]
    port = processes.free_port()
    try:
        envs = []
        for i in range(nproc):
            env = {**os.environ, **moto_env, "AWS_ENDPOINT_URL": proxies[i].endpoint, "POD_ROWS": str(rows)}
            env.pop("XLA_FLAGS", None)
            envs.append(env)
        argvs = [
            [sys.executable, WORKER, action, layout, str(i), str(nproc), str(port), url, share] for i in range(nproc)
        ]
        done = processes.start_and_wait(argvs, envs, timeout, f"{action} {layout}")
        if failing:
            return [{"returncode": code, "output": out} for code, out in done]
        results = []
        for i, (code, out) in enumerate(done):
            if code != 0 or "result " not in out:
                raise RuntimeError(f"{action} {layout}: process {i} failed (exit {code}):\n{out[-4000:]}")
            result = processes.result_of(out)
            proxy = proxies[i]
            result.update(
                bytes_read=proxy.bytes_read,
                bytes_written=proxy.bytes_written,
                requests=len(proxy.requests),
                gets=proxy.count("GET"),
                puts=proxy.count("PUT") + proxy.count("POST"),
            )
            results.append(result)
        return results
    finally:
        for proxy in proxies:
            proxy.close()


def stored_bytes(results: list[dict[str, Any]]) -> int:
    """The checkpoint's bytes: what the processes of its save wrote to the bucket."""
    return sum(r["bytes_written"] for r in results)


def measure(moto_env: dict[str, str], layout: str, share: str, rows: int) -> dict[str, Any]:
    url = f"s3://{BUCKET}/{layout}-{uuid.uuid4().hex[:8]}"
    saved = run("save", layout, url, moto_env, rows=rows)
    restored = run("restore", layout, url, moto_env, share=share, rows=rows)
    total = stored_bytes(saved)
    written = [r["bytes_written"] for r in saved]
    read = [r["bytes_read"] for r in restored]
    return {
        "layout": layout,
        "share": share,
        "checkpoint_bytes": total,
        "save": {
            "seconds": max(r["seconds"] for r in saved),
            "bytes_written": written,
            "max_over_mean": max(written) / (sum(written) / len(written)),
            "requests": [r["requests"] for r in saved],
        },
        "restore": {
            "seconds": max(r["seconds"] for r in restored),
            "bytes_read": read,
            "read_over_checkpoint": sum(read) / total,
            "each_over_checkpoint": [b / total for b in read],
            "requests": [r["requests"] for r in restored],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="dp,fsdp,mix")
    parser.add_argument("--share", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--rows", type=int, default=1024, help="rows of 1,024 float32 in each of four kernels")
    parser.add_argument("--jaxckpt-rev", default=None, help="measure jaxckpt as committed at git revision REV")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    proc, moto_env = moto_server.start(BUCKET)
    try:
        with tempfile.TemporaryDirectory(prefix="jaxckpt-pod-src-") as work:
            if args.jaxckpt_rev:
                from run import export_revision

                os.environ["BENCH_JAXCKPT_SRC"] = export_revision(args.jaxckpt_rev, work)
            out = [measure(moto_env, layout, args.share, args.rows) for layout in args.layouts.split(",")]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for m in out:
        s, r = m["save"], m["restore"]
        mib = m["checkpoint_bytes"] / 2**20
        print(
            f"{m['layout']:5} checkpoint {mib:7.1f} MiB | save {s['seconds']:6.2f} s, written per process (MiB) "
            f"{[round(b / 2**20, 1) for b in s['bytes_written']]}, max/mean {s['max_over_mean']:.2f} | restore "
            f"{r['seconds']:6.2f} s, read {r['read_over_checkpoint']:.2f}x the checkpoint, per process "
            f"{[round(x, 2) for x in r['each_over_checkpoint']]}, requests {r['requests']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rev": args.jaxckpt_rev or "worktree", "rows": args.rows, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
