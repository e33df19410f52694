"""Incremental checkpoints on a bucket (issue 27): the LoRA-shaped run against an S3 server (moto on
127.0.0.1), a manager with incremental saves (unchanged arrays stored by reference, jaxckpt.incremental.refs)
against one without.

    python benchmarks/incremental_bucket.py              # 16 x 2048^2 float32 base (256 MiB), 10 steps
    python benchmarks/incremental_bucket.py --quick      # 8 x 2048^2 (128 MiB), 5 steps

A frozen base of ``--leaves`` float32 arrays of ``--side`` x ``--side`` (over 8 MiB each, so that an
incremental manager's saves store them as arrays of their own, see
``_tensorstore.INCREMENTAL_BUCKET_PACK_LEAF_LIMIT``), and for each a rank-8 adapter (A, B) with its
Adam state (mu, nu of each), replaced at every step; a ``CheckpointManager(max_to_keep=3,
async_save=False)`` saves at every step. Per step: the **save time** (``save()`` then
``wait_until_finished()``), the **bytes uploaded** (the bytes of the objects under the new
checkpoint's prefix: references are not objects of it), and at the end the **bytes in the bucket**
under the run's prefix (held data included). Then a **restart**: a new manager over a ``Checkpoint``
of ``ShapeDtypeStruct`` templates restores the latest checkpoint and saves once more (the save right
after a restart, which refers to the restored base). moto keeps objects in memory, on the same machine: the
times are those of a loopback server, not of a cloud bucket. Writes benchmarks/incremental_bucket.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
MiB = 1 << 20
RANK = 8


def objects_bytes(path: str) -> int:
    from jaxckpt.storage import kvstore, locations

    base = locations.location(path).spec()
    return sum(len(kvstore.kv_read(base, key) or b"") for key in kvstore.kv_keys(base))


def run(directory: str, *, incremental: bool, side: int, leaves: int, steps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import jaxckpt

    base = {f"w{i}": jnp.full((side, side), float(i), jnp.float32) for i in range(leaves)}

    def lora(step: float) -> dict[str, Any]:
        one = {"a": jnp.full((side, RANK), step, jnp.float32), "b": jnp.full((RANK, side), step, jnp.float32)}
        return {f"w{i}": {"p": one, "mu": one, "nu": one} for i in range(leaves)}

    ckpt = jaxckpt.Checkpoint(step=0, base=base, lora=lora(0.0))
    times, uploaded = [], []
    options = {"max_to_keep": 3, "step_counter": "step", "async_save": False, "incremental": incremental}
    with jaxckpt.CheckpointManager(ckpt, directory, **options) as manager:
        for step in range(1, steps + 1):
            ckpt.step, ckpt.lora = step, jax.block_until_ready(lora(float(step)))
            start = time.perf_counter()
            manager.save()
            manager.wait_until_finished()
            times.append(time.perf_counter() - start)
            uploaded.append(objects_bytes(f"{directory}/ckpt-{step}"))
    out = {
        "save_s": times,
        "uploaded_bytes": uploaded,
        "bucket_bytes": objects_bytes(directory),
        "base_bytes": leaves * side * side * 4,
    }
    if incremental:  # a restart: a new manager restores the base (templates) and saves once more
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), {"base": base, "lora": lora(0.0)})
        fresh = jaxckpt.Checkpoint(step=0, base=like["base"], lora=like["lora"])
        with jaxckpt.CheckpointManager(fresh, directory, **options) as manager:
            manager.restore_or_initialize()
            fresh.step, fresh.lora = steps + 1, jax.block_until_ready(lora(float(steps + 1)))
            start = time.perf_counter()
            manager.save()
            manager.wait_until_finished()
            out["restart_save_s"] = time.perf_counter() - start
            out["restart_uploaded_bytes"] = objects_bytes(f"{directory}/ckpt-{steps + 1}")
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", type=int, default=2048)
    p.add_argument("--leaves", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.leaves, args.steps = 8, 5
    import moto_server

    proc, env = moto_server.start("bench")
    os.environ.update(env)
    try:
        results = {
            name: run(f"s3://bench/{name}", incremental=inc, side=args.side, leaves=args.leaves, steps=args.steps)
            for name, inc in (("incremental", True), ("full", False))
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    summary = {}
    for name, r in results.items():
        later_t, later_b = r["save_s"][1:], r["uploaded_bytes"][1:]
        summary[name] = {
            "first_save_s": round(r["save_s"][0], 3),
            "save_s_median_later": round(statistics.median(later_t), 3),
            "uploaded_MiB_first": round(r["uploaded_bytes"][0] / MiB, 1),
            "uploaded_MiB_median_later": round(statistics.median(later_b) / MiB, 2),
            "bucket_MiB_at_end": round(r["bucket_bytes"] / MiB, 1),
        }
        if "restart_save_s" in r:
            summary[name]["restart_save_s"] = round(r["restart_save_s"], 3)
            summary[name]["restart_uploaded_MiB"] = round(r["restart_uploaded_bytes"] / MiB, 2)
    inc, full = summary["incremental"], summary["full"]
    summary["ratios"] = {
        "uploaded_later_vs_full": round(inc["uploaded_MiB_median_later"] / full["uploaded_MiB_median_later"], 4),
        "save_time_later_vs_full": round(inc["save_s_median_later"] / full["save_s_median_later"], 4),
    }
    out = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "args": vars(args),
        "summary": summary,
        "results": results,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
    }
    with open(os.path.join(HERE, "incremental_bucket.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
