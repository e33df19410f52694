"""Recovery after a host is replaced: from the peers' copies against from the bucket, for the same state.

Four ``jax.distributed`` CPU processes (gloo) save steps 1 to 3 with two tiers: each process's
local directory, and ``s3://`` (moto on loopback) as the durable tier, every step copied there, so
that both tiers hold step 3. Then, for the same checkpoint:

- **peers**: process 1's local directory is wiped (its host was replaced); all four restart, and
  process 1 gets its part from the peer holding its copy, over JAX's collectives;
- **bucket**: every local directory is wiped; all four restore from the bucket.

Reported: the time of ``restore_or_initialize`` (the slowest process's), and the requests each
process's proxy (``tests/bucket_proxy.py``) forwarded to the bucket during it, and the bytes read.
Moto on loopback answers as fast as memory; ``--bucket-mib-s`` caps each process's proxy at a rate
closer to a host's share of a real bucket.

    python benchmarks/peers.py                       # 1,024 rows: 4 MiB sharded + 1 MiB replicated
    python benchmarks/peers.py --rows 4096,32768,65536 --bucket-mib-s 0,200 --json benchmarks/peers.json

``tests/test_peers.py`` runs the same processes and asserts what they restore and the requests (never the times).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # moto_server, bucket_proxy
import bucket_proxy  # noqa: E402
import moto_server  # noqa: E402
import processes  # noqa: E402

WORKER = os.path.join(HERE, "peers_worker.py")
BUCKET = "jaxckpt-peers"
MARK = "/jaxckpt-peers-mark/restore"  # fetched by each worker just before its restore


def run(
    mode: str,
    path: str,
    durable: str,
    *,
    nproc: int = 4,
    env: Mapping[str, str] | None = None,
    each: Sequence[Mapping[str, str]] | None = None,
    moto_env: Mapping[str, str] | None = None,
    rate: float | None = None,
    timeout: float = 240,
) -> list[dict[str, Any]]:
    """Start ``nproc`` workers (``env`` for all, ``each[i]`` for process ``i``); with ``moto_env``,
    each through its own counting proxy to the bucket (serving GETs at ``rate`` bytes/s at most). Returns each process's result, with
    ``requests``: what its proxy forwarded after the restore's mark (if a proxy)."""
    proxies = (
        [bucket_proxy.BucketProxy(moto_env["AWS_ENDPOINT_URL"], rate=rate) for _ in range(nproc)]
        if moto_env is not None
        else []
    )
    port = processes.free_port()
    try:
        envs, argvs = [], []
        for i in range(nproc):
            e = {**os.environ, **(moto_env or {}), **(env or {}), **(each[i] if each else {})}
            e.pop("XLA_FLAGS", None)
            if proxies:
                e["AWS_ENDPOINT_URL"] = proxies[i].endpoint
                e["PEERS_MARK"] = proxies[i].endpoint + MARK
            envs.append(e)
            argvs.append([sys.executable, WORKER, mode, str(i), str(nproc), str(port), path, durable])
        done = processes.start_and_wait(argvs, envs, timeout, mode)
        results = []
        for i, (code, out) in enumerate(done):
            if code != 0 or "result " not in out:
                raise RuntimeError(f"{mode}: process {i} failed (exit {code}):\n{out[-4000:]}")
            result = processes.result_of(out)
            if proxies:
                seen = proxies[i].requests
                after = [r for r in seen[[r[1] for r in seen].index(MARK) + 1 :]] if mode == "restore" else seen
                result["requests"] = len(after)
                result["bytes_read"] = proxies[i].bytes_read
            results.append(result)
        return results
    finally:
        for proxy in proxies:
            proxy.close()


def measure(moto_env: Mapping[str, str], rows: int, rate: float | None = None) -> dict[str, Any]:
    env = {"PEERS_ROWS": str(rows), "PEERS_DURABLE_EVERY": "1"}
    durable = f"s3://{BUCKET}/peers-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {"rows": rows, "bucket_bytes_per_s": rate}
    with tempfile.TemporaryDirectory(prefix="jaxckpt-peers-run-") as path:
        run("save", path, durable, env=env, moto_env=moto_env)
        checkpoint = sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(os.path.join(path, "local-1", "ckpt-3"))
            for f in fs
        )
        out["process_checkpoint_bytes"] = checkpoint
        shutil.rmtree(os.path.join(path, "local-1"))
        peers = run("restore", path, durable, env=env, moto_env=moto_env, rate=rate)
        for i in range(4):
            shutil.rmtree(os.path.join(path, f"local-{i}"))
        bucket = run("restore", path, durable, env=env, moto_env=moto_env, rate=rate)
    for key, results in (("peers", peers), ("bucket", bucket)):
        assert all(r["step"] == 3 for r in results), results
        out[key] = {
            "seconds": max(r["seconds"] for r in results),
            "requests": [r["requests"] for r in results],
            "bucket_bytes_read": sum(r["bytes_read"] for r in results),
            "restored": results[1]["restored"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1024", help="rows of 1,024 float32 in the sharded array (commas: several)")
    parser.add_argument(
        "--bucket-mib-s", default="0", help="GETs at most this fast per process (0: loopback speed; commas: several)"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    proc, moto_env = moto_server.start(BUCKET)
    try:
        rates = [float(m) * 2**20 or None for m in args.bucket_mib_s.split(",")]
        results = [measure(moto_env, int(r), rate) for rate in rates for r in args.rows.split(",")]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for m in results:
        p, b = m["peers"], m["bucket"]
        rate = m["bucket_bytes_per_s"]
        print(
            f"bucket {'loopback' if rate is None else f'{rate / 2**20:g} MiB/s':>10} | "
            f"rows {m['rows']:6} ({m['process_checkpoint_bytes'] / 2**20:6.1f} MiB per process) | from peers "
            f"{p['seconds']:6.2f} s, bucket requests {p['requests']} | from the bucket {b['seconds']:6.2f} s, "
            f"requests {b['requests']}, {b['bucket_bytes_read'] / 2**20:.1f} MiB read"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=1)


if __name__ == "__main__":
    main()
