"""Checkpoints in buckets (issue 26): jaxckpt, the bucket's own client (the upload floor) and Orbax, side
by side in one run on an S3 server (moto) and a GCS emulator on loopback, with requests and objects
counted.

    python benchmarks/buckets.py                       # large and many, both servers, 3 reps (~20 min)
    python benchmarks/buckets.py --quick               # small sizes, 1 rep: a smoke test (~2 min)
    python benchmarks/buckets.py --servers s3 --workloads large --libs floor,jaxckpt --reps 5
    python benchmarks/buckets.py --jaxckpt-rev HEAD    # measure jaxckpt as committed, not the work tree

Workloads (benchmarks/workloads.py): ``large``, 1 GiB in 16 float32 arrays of 64 MiB; ``many``, 10,000
leaves (93 MB). Servers: ``s3``, moto (``tests/moto_server.py``); ``gs``, gcp-storage-emulator behind
the tests' wrapper (``tests/gcs_server.py``). Both keep objects in memory, in one Python process: they,
not the network, bound the bytes per second, so every library is compared with the floor on the same
server in the same run, never with the numbers of another machine.

Operations, each in a fresh interpreter with memory pre-touched (3x the data + 512 MiB; see
/work/shared/BENCHMARKING.md), repetitions interleaved:

- ``floor_upload`` / ``floor_download``: the same bytes as one object, by the bucket's own client:
  boto3 (``upload_fileobj`` / ``download_fileobj``, multipart in 64 MiB parts, 8 threads) on S3,
  google-cloud-storage (``upload_from_file`` / ``download_as_bytes``, resumable in 64 MiB chunks)
  on GCS;
- ``jaxckpt_save`` / ``jaxckpt_restore``: ``jaxckpt.save(url, tree)``, ``jaxckpt.restore(url, like=...)``;
- ``orbax_save`` / ``orbax_restore``: ``ocp.StandardCheckpointer().save(url, tree)`` then
  ``wait_until_finished()``, ``.restore(url, abstract)``; GCS only (Orbax reaches S3 through fsspec's
  s3fs, which these environments do not set up).

Then one more pass of every operation, untimed, through ``tests/bucket_proxy.py`` (started in the
child, cleared just before the operation), counts the HTTP requests the operation makes; after each
save the objects under its prefix are counted. Results: a table on
stdout and ``benchmarks/buckets.json`` (a full run) or ``benchmarks/.work/buckets.json``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, HERE)
sys.path.insert(1, TESTS)  # moto_server, gcs_server, bucket_proxy: the tests' servers and proxy

MiB = 1 << 20
BUCKET = "bench-bucket"
OPS = ("floor_upload", "floor_download", "jaxckpt_save", "jaxckpt_restore", "orbax_save", "orbax_restore")


# --- one operation, in a fresh interpreter ----------------------------------------------------------


def _url(server: str, key: str) -> str:
    return f"{server}://{BUCKET}/{key}"


def _s3_client() -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


def _gcs_bucket() -> Any:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project="bench",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": os.environ["STORAGE_EMULATOR_HOST"]},
    )
    return client.bucket(BUCKET)


def _objects(server: str, prefix: str) -> tuple[int, int]:
    """(objects, bytes) under ``prefix/`` in the bucket, by the bucket's own client."""
    if server == "s3":
        pages = _s3_client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
        sizes = [o["Size"] for page in pages for o in page.get("Contents", [])]
    else:
        sizes = [b.size for b in _gcs_bucket().client.list_blobs(BUCKET, prefix=prefix + "/")]
    return len(sizes), sum(sizes)


def _delete(server: str, prefix: str) -> None:
    if server == "s3":
        client = _s3_client()
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
    else:
        bucket = _gcs_bucket()
        for blob in list(bucket.client.list_blobs(BUCKET, prefix=prefix + "/")):
            blob.delete()


def child(server: str, workdir: str, op: str, count: bool) -> dict[str, Any]:
    proxy = None
    if count:  # in this process, so that only the timed operation's requests are counted
        import bucket_proxy

        upstream = os.environ["AWS_ENDPOINT_URL" if server == "s3" else "STORAGE_EMULATOR_HOST"]
        proxy = bucket_proxy.BucketProxy(upstream)
        os.environ.update(endpoint_env(server, dict(os.environ), proxy.endpoint))
    import numpy as np
    import workloads as wl
    from child import cpu_seconds, import_jaxckpt, pretouch, quiet_orbax

    spec = wl.load_spec(workdir)
    data = os.path.join(workdir, "data.bin")
    lib, action = op.split("_", 1)
    prefix = f"{spec['workload']}/{lib}"
    url = _url(server, prefix)
    result: dict[str, Any] = {"op": op, "server": server, "workload": spec["workload"], "nbytes": spec["nbytes"]}

    # Untimed: imports, data, the library's objects, and the previous output deleted before a save.
    run: Any
    import jax

    if lib == "floor":
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_chunksize=64 * MiB, multipart_threshold=64 * MiB, max_concurrency=8)
        key = f"{prefix}/floor.bin"
        if action == "upload":
            payload = b"".join(x.tobytes() for x in wl.read_leaves(spec, data))
            if server == "s3":
                client = _s3_client()

                def run() -> None:
                    client.upload_fileobj(io.BytesIO(payload), BUCKET, key, Config=config)
            else:
                blob = _gcs_bucket().blob(key, chunk_size=64 * MiB)

                def run() -> None:
                    blob.upload_from_file(io.BytesIO(payload), size=len(payload))
        else:
            if server == "s3":
                client = _s3_client()

                def run() -> int:
                    out = io.BytesIO()
                    client.download_fileobj(BUCKET, key, out, Config=config)
                    return out.tell()
            else:
                blob = _gcs_bucket().blob(key, chunk_size=64 * MiB)

                def run() -> int:
                    return len(blob.download_as_bytes(checksum=None, raw_download=True))
    else:
        targets = [jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(leaf["dtype"])) for leaf in spec["leaves"]]
        abstract = wl.build_tree(spec, targets)
        if action == "save":
            tree = wl.build_tree(spec, [jax.device_put(x) for x in wl.read_leaves(spec, data)])
            jax.block_until_ready(tree)
        if lib == "jaxckpt":
            jaxckpt = import_jaxckpt()
            result["jaxckpt_file"] = jaxckpt.__file__
            if action == "save":

                def run() -> None:
                    jaxckpt.save(url, tree)
            else:

                def run() -> Any:
                    return jax.block_until_ready(jaxckpt.restore(url, like=abstract))
        else:
            ocp = quiet_orbax()
            checkpointer = ocp.StandardCheckpointer()
            if action == "save":

                def run() -> None:
                    checkpointer.save(url, tree)
                    checkpointer.wait_until_finished()
            else:

                def run() -> Any:
                    return jax.block_until_ready(checkpointer.restore(url, abstract))

    if action in ("save", "upload"):
        _delete(server, prefix)
    pretouch(3 * spec["nbytes"] + 512 * MiB)
    if proxy is not None:
        proxy.clear()

    cpu0 = cpu_seconds()
    t = time.perf_counter()
    out = run()
    result["seconds"] = time.perf_counter() - t
    result["cpu_s"] = cpu_seconds() - cpu0
    if proxy is not None:
        result["requests"] = _requests(proxy)

    # Untimed: what was written, and what was read is checked.
    if action in ("save", "upload"):
        result["objects"], result["stored_bytes"] = _objects(server, prefix)
    elif action == "download":
        assert out == spec["nbytes"], (out, spec["nbytes"])
    else:
        leaves = jax.tree_util.tree_leaves(out)
        for i in (0, len(leaves) // 2, len(leaves) - 1):
            np.testing.assert_array_equal(np.asarray(_leaf_at(spec, out, i)), wl.read_leaf(spec, data, i))
    if lib == "orbax":
        checkpointer.close()
    return result


def _leaf_at(spec: dict[str, Any], tree: Any, i: int) -> Any:
    node = tree
    for part in spec["leaves"][i]["key"].split("/"):
        node = node[part]
    return node


# --- servers ----------------------------------------------------------------------------------------


def start_server(server: str) -> tuple[Any, dict[str, str]]:
    """The server's process and the environment that points every client at its endpoint."""
    if server == "s3":
        import moto_server

        return moto_server.start(BUCKET)
    import gcs_server

    proc, env = gcs_server.start(BUCKET)
    # Orbax's TensorStore reads TENSORSTORE_GCS_HTTP_URL; its test token skips Google's auth.
    env = {**env, "TENSORSTORE_GCS_HTTP_URL": env["STORAGE_EMULATOR_HOST"], "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"}
    return proc, env


def endpoint_env(server: str, env: dict[str, str], endpoint: str) -> dict[str, str]:
    """``env`` with every client pointed at ``endpoint`` (the counting proxy) instead."""
    keys = ("AWS_ENDPOINT_URL",) if server == "s3" else ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")
    return {**env, **{k: endpoint for k in keys}}


def run_child(server: str, workdir: str, op: str, env: dict[str, str], timeout: float, count: bool) -> dict[str, Any]:
    from run import child_env

    result_path = os.path.join(workdir, f"result-{server}-{op}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--child", op, "--server", server]
    argv += ["--workdir", workdir, "--result", result_path] + (["--count"] if count else [])
    full_env = {**child_env(1), **env}
    proc = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"op": op, "server": server, "status": "error", "why": proc.stderr.strip().splitlines()[-1:]}
    with open(result_path) as f:
        result: dict[str, Any] = json.load(f)
    result["stderr_lines"] = len(proc.stderr.splitlines())
    result["status"] = "ok"
    return result


# --- the driver -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--servers", default="s3,gs")
    parser.add_argument("--workloads", default="large,many")
    parser.add_argument("--libs", default="floor,jaxckpt,orbax")
    parser.add_argument("--jaxckpt-rev", default=None)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--child")
    parser.add_argument("--server")
    parser.add_argument("--workdir")
    parser.add_argument("--result")
    parser.add_argument("--count", action="store_true")
    args = parser.parse_args()
    if args.child:
        result = child(args.server, args.workdir, args.child, args.count)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0

    import run as bench_run
    import workloads as wl

    reps = args.reps or (1 if args.quick else 3)
    work = os.path.join(HERE, ".work", "buckets")
    os.makedirs(work, exist_ok=True)
    if args.jaxckpt_rev:
        os.environ["BENCH_JAXCKPT_SRC"] = bench_run.export_revision(args.jaxckpt_rev, work)
    libs = args.libs.split(",")
    servers = args.servers.split(",")
    workloads = args.workloads.split(",")
    dirs = {}
    for workload in workloads:
        dirs[workload] = os.path.join(work, workload + ("-quick" if args.quick else ""))
        if not os.path.exists(os.path.join(dirs[workload], "spec.json")):
            spec = wl.make_spec(workload, args.quick)
            os.makedirs(dirs[workload], exist_ok=True)
            wl.write_data(spec, os.path.join(dirs[workload], "data.bin"))
            with open(os.path.join(dirs[workload], "spec.json"), "w") as f:
                json.dump(spec, f)

    results: list[dict[str, Any]] = []
    for server in servers:
        ops = [op for op in OPS if op.split("_")[0] in libs and not (op.startswith("orbax") and server == "s3")]
        proc, env = start_server(server)
        try:
            for rep in range(reps):
                for workload in workloads:
                    for op in ops:
                        r = run_child(server, dirs[workload], op, env, args.timeout, count=False)
                        r["rep"] = rep
                        results.append(r)
                        print(_line(r), flush=True)
            for workload in workloads:
                for op in ops:
                    r = run_child(server, dirs[workload], op, env, args.timeout, count=True)
                    r["rep"] = "counted"
                    results.append(r)
                    print(_line(r), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    summary = summarize(results)
    text = render(summary, args)
    print(text)
    full = not args.quick and reps >= 3
    out = os.path.join(HERE, "buckets.json") if full else os.path.join(work, "buckets.json")
    with open(out, "w") as f:
        json.dump(
            {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                "machine": bench_run.machine_info(work),
                "versions": bench_run.versions(),
                "summary": summary,
                "table": text,
                "results": results,
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")
    return 0


def _requests(proxy: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for method, path in proxy.requests:
        what = "LIST" if method == "GET" and ("list-type=" in path or path.rstrip("/").endswith("/o")) else method
        counts[what] = counts.get(what, 0) + 1
    counts["total"] = len(proxy.requests)
    return counts


def _line(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r['server']:3} {r['op']:16} rep {r.get('rep')}: {r.get('status')} {r.get('why')}"
    extra = f" requests {r['requests']}" if "requests" in r else ""
    objects = f" objects {r['objects']}" if "objects" in r else ""
    return f"{r['server']:3} {r['workload']:6} {r['op']:16} rep {r['rep']}: {r['seconds']:7.2f} s{objects}{extra}"


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        if r.get("status") != "ok":
            continue
        row = out.setdefault(f"{r['server']}/{r['workload']}/{r['op']}", {"seconds": [], "nbytes": r["nbytes"]})
        if r["rep"] == "counted":
            row["requests"] = r["requests"]
            if "objects" in r:
                row["objects"] = r["objects"]
        else:
            row["seconds"].append(r["seconds"])
    for row in out.values():
        if row["seconds"]:
            row["median_s"] = statistics.median(row["seconds"])
    return out


def render(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "| server | workload | operation | median s (min-max) | GB/s | vs floor | vs Orbax | requests | objects |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in summary.items():
        server, workload, op = key.split("/")
        if "median_s" not in row:
            continue
        lib, action = op.split("_", 1)
        writes = action in ("save", "upload")
        floor = summary.get(f"{server}/{workload}/floor_{'upload' if writes else 'download'}", {})
        orbax = summary.get(f"{server}/{workload}/orbax_{'save' if writes else 'restore'}", {})
        med = row["median_s"]
        vs_floor = f"{med / floor['median_s']:.2f}x" if lib != "floor" and "median_s" in floor else ""
        vs_orbax = f"{med / orbax['median_s']:.2f}x" if lib == "jaxckpt" and "median_s" in orbax else ""
        spread = f"{min(row['seconds']):.2f}-{max(row['seconds']):.2f}"
        requests = row.get("requests", {})
        req = ", ".join(f"{k} {v}" for k, v in requests.items() if k != "total")
        req = f"{requests.get('total', '')} ({req})" if requests else ""
        gbps = row["nbytes"] / med / 1e9
        lines.append(
            f"| {server} | {workload} | {op} | {med:.2f} ({spread}) | {gbps:.2f} | {vs_floor} | {vs_orbax} | "
            f"{req} | {row.get('objects', '')} |"
        )
    lines.append("")
    lines.append("vs floor / vs Orbax: time over the floor's (or Orbax's) time for the same bytes; below 1 is faster.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
