"""Two tiers (issue 16): how long the training loop blocks per save, local-only, durable-only, two-tier.

    python benchmarks/tiers.py                 # 1 GiB state, 5 timed saves per configuration (~3.5 min)
    python benchmarks/tiers.py --quick         # 64 MiB, 3 saves: a smoke test (~20 s)
    python benchmarks/tiers.py --jaxckpt-rev HEAD   # measure jaxckpt as committed, not the edited work tree

The state is a dict of float32 jax arrays on CPU (16 x 64 MiB = 1 GiB). A "training step" updates
every array (a jitted ``w * 0.999 + 0.001``: reads and writes the whole state) and waits for nothing
else; every ``--steps-per-save``-th step calls ``manager.save(step=s)`` (asynchronous, the default),
whose wall time is what the loop blocks for: the snapshot, plus waiting for the previous save if it
has not finished. Configurations, each in a fresh interpreter with memory pre-touched (3x the state
+ 512 MiB; see /work/shared/BENCHMARKING.md):

- ``local``: ``CheckpointManager(ckpt, <local folder>, max_to_keep=2)``
- ``durable``: ``CheckpointManager(ckpt, "s3://bench/...", max_to_keep=2)`` on a moto S3 server on
  127.0.0.1 (started by this script, one per configuration)
- ``tiered-every``: ``CheckpointManager(ckpt, "s3://...", local_directory=<local folder>,
  local_policies=KeepLatest(2), save_interval_steps=k, durable_interval_steps=k)``: every save is
  also due for the bucket (the worst case)
- ``tiered-4th``: the same with ``durable_interval_steps=4k``: every 4th save goes to the bucket

One untimed warm-up save (then ``wait_until_finished``), then ``--saves`` timed ones; reported: the
median and max blocking time of a save, how many saves found the previous local save still running,
and end to end (first timed save to ``wait_until_finished`` returning: everything durable), and
the ratio of two-tier to local-only blocking (the issue's target: at most 1.10). Writes
benchmarks/tiers.json (a full run) or benchmarks/.work/tiers.json (--quick).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tests"))  # moto_server: the tests' S3 server

MiB = 1 << 20
BUCKET = "bench"
CONFIGS = ("local", "durable", "tiered-every", "tiered-4th")
LABELS = {
    "local": "local-only (local folder)",
    "durable": "durable-only (S3, moto on loopback)",
    "tiered-every": "two-tier, every save also to S3",
    "tiered-4th": "two-tier, every 4th save to S3",
}


# --- the measured loop, in a fresh interpreter ------------------------------------------------------


def child(config: str, workdir: str, size: int, leaves: int, saves: int, steps_per_save: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from child import cpu_seconds, import_jaxckpt, pretouch

    jaxckpt = import_jaxckpt()  # $BENCH_JAXCKPT_SRC/jaxckpt with --jaxckpt-rev, else the installed one

    n = size // leaves // 4
    side = int(n**0.5)
    rng = np.random.default_rng(0)
    state = {f"w{i:02d}": jnp.asarray(rng.standard_normal((side, n // side), np.float32)) for i in range(leaves)}
    nbytes = sum(v.nbytes for v in state.values())

    @jax.jit
    def train_step(s: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {k: v * 0.999 + 0.001 for k, v in s.items()}

    state = jax.block_until_ready(train_step(state))  # compiled before anything is timed
    ckpt = jaxckpt.Checkpoint(state=state)
    local = os.path.join(workdir, f"{config}-local")
    durable = f"s3://{BUCKET}/{config}"
    k = steps_per_save
    if config == "local":
        manager = jaxckpt.CheckpointManager(ckpt, local, max_to_keep=2, save_interval_steps=k)
    elif config == "durable":
        manager = jaxckpt.CheckpointManager(ckpt, durable, max_to_keep=2, save_interval_steps=k)
    else:
        every = k if config == "tiered-every" else 4 * k
        manager = jaxckpt.CheckpointManager(
            ckpt,
            durable,
            max_to_keep=2,
            local_directory=local,
            local_policies=jaxckpt.KeepLatest(2),
            save_interval_steps=k,
            durable_interval_steps=every,
        )
    # The manager whose background save a new save waits for (the local tier's when there are two).
    part = manager._part  # the part doing the work: one tier, or two (then its local tier saves)
    writer = getattr(part, "_local", part)

    manager.save(step=0)  # warm-up: TensorStore's and the S3 client's first use
    manager.wait_until_finished()
    pretouch(3 * nbytes + 512 * MiB)

    blocked: list[float] = []
    pending: list[bool] = []
    step_s: list[float] = []
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    for step in range(1, saves * k + 1):
        t = time.perf_counter()
        state = jax.block_until_ready(train_step(state))
        step_s.append(time.perf_counter() - t)
        ckpt.state = state
        if step % k == 0:
            pending.append(writer._background.pending)
            t = time.perf_counter()
            manager.save(step=step)
            blocked.append(time.perf_counter() - t)
    t_loop = time.perf_counter() - t0
    t = time.perf_counter()
    manager.wait_until_finished()
    t_wait = time.perf_counter() - t
    cpu = cpu_seconds() - cpu0
    result: dict[str, Any] = {
        "config": config,
        "bytes": nbytes,
        "leaves": leaves,
        "saves": saves,
        "steps_per_save": k,
        "blocked_s": blocked,
        "previous_save_running": pending,
        "train_step_s": step_s,
        "loop_s": t_loop,
        "final_wait_s": t_wait,
        "end_to_end_s": t_loop + t_wait,
        "cpu_s": cpu,
        "durable_steps": manager.all_steps(),
    }
    if hasattr(manager, "copied"):
        result["copied"] = [os.path.basename(p) for p in manager.copied]
        result["local_steps"] = [c.step for c in manager.local_checkpoint_infos]
    manager.close()
    return result


# --- the driver -------------------------------------------------------------------------------------


def run_config(config: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    import moto_server
    from run import child_env

    env = child_env(1)
    moto = None
    if config != "local":
        moto, s3_env = moto_server.start(BUCKET)
        env.update(s3_env)
    result_path = os.path.join(workdir, f"result-{config}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--child", config, "--result", result_path]
    argv += ["--workdir", workdir, "--size-mib", str(args.size_mib), "--leaves", str(args.leaves)]
    argv += ["--saves", str(args.saves), "--steps-per-save", str(args.steps_per_save)]
    moto_cpu = None
    try:
        proc = subprocess.run(argv, env=env, stderr=subprocess.PIPE, text=True)
        # Without ~/.aws, the AWS SDK in TensorStore logs that it found no profile: not worth showing.
        noise = ("AuthCredentialsProvider", "] static: Failed to open file")
        sys.stderr.write("".join(line for line in proc.stderr.splitlines(True) if not any(n in line for n in noise)))
        proc.check_returncode()
        if moto is not None:
            moto_cpu = _proc_cpu_seconds(moto.pid)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=30)
        for name in os.listdir(workdir):
            if name.startswith(config + "-"):
                shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    with open(result_path) as f:
        result: dict[str, Any] = json.load(f)
    result["s3_server_cpu_s"] = moto_cpu  # from its start, warm-up included
    return result


def _proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config, r in results.items():
        out[config] = {
            "blocked_median_s": statistics.median(r["blocked_s"]),
            "blocked_max_s": max(r["blocked_s"]),
            "blocked_total_s": sum(r["blocked_s"]),
            "previous_save_running": sum(r["previous_save_running"]),
            "train_step_median_s": statistics.median(r["train_step_s"]),
            "end_to_end_s": r["end_to_end_s"],
            "final_wait_s": r["final_wait_s"],
            "cpu_s": r["cpu_s"],
            "s3_server_cpu_s": r.get("s3_server_cpu_s"),
        }
    if "local" in out:
        base, total = out["local"]["blocked_median_s"], out["local"]["blocked_total_s"]
        for s in out.values():
            s["x_local"] = s["blocked_median_s"] / base
            s["x_local_total"] = s["blocked_total_s"] / total
    return out


def table(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        "| configuration | blocks per save: median s | max s | total s | x local-only: median | total "
        "| saves that waited for the previous one | end to end s (all durable) | of which final wait s "
        "| CPU s: training process | S3 server |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config, s in summary.items():
        n = len(results[config]["blocked_s"])
        ratio = f"{s['x_local']:.2f} | {s['x_local_total']:.2f}" if "x_local" in s else " | "
        moto = "" if s["s3_server_cpu_s"] is None else f"{s['s3_server_cpu_s']:.0f}"
        lines.append(
            f"| {LABELS[config]} | {s['blocked_median_s']:.3f} | {s['blocked_max_s']:.3f} | {s['blocked_total_s']:.2f} "
            f"| {ratio} | {s['previous_save_running']} of {n} | {s['end_to_end_s']:.1f} | {s['final_wait_s']:.1f} "
            f"| {s['cpu_s']:.0f} | {moto} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="state size (default 1024: 1 GiB)")
    p.add_argument("--leaves", type=int, default=16, help="arrays in the state (default 16)")
    p.add_argument("--saves", type=int, default=5, help="timed saves per configuration (default 5)")
    p.add_argument("--steps-per-save", type=int, default=8, help="training steps between saves (default 8)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--quick", action="store_true", help="64 MiB, 3 saves: a smoke test")
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a fresh folder in /tmp)")
    p.add_argument(
        "--jaxckpt-rev",
        default=None,
        help="measure jaxckpt as committed at git revision REV (e.g. HEAD), not the work tree",
    )
    p.add_argument("--note", default="", help="a line recorded with the results (e.g. 'machine shared')")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        r = child(args.child, args.workdir, args.size_mib * MiB, args.leaves, args.saves, args.steps_per_save)
        with open(args.result, "w") as f:
            json.dump(r, f)
        return
    if args.quick:
        args.size_mib, args.saves = 64, 3
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    from run import _read, export_revision, machine_info, write_record

    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxckpt-tiers-", dir="/tmp")
    os.makedirs(workdir, exist_ok=True)
    if args.jaxckpt_rev:
        os.environ["BENCH_JAXCKPT_SRC"] = export_revision(args.jaxckpt_rev, workdir)
    info = machine_info(workdir)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    results = {}
    for config in configs:
        print(f"{LABELS[config]} ...", flush=True)
        results[config] = run_config(config, args, workdir)
        print(f"  blocked per save: {', '.join(f'{t:.3f}' for t in results[config]['blocked_s'])} s", flush=True)
    info["loadavg_after"] = _read("/proc/loadavg").split()[:3]
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(results)
    full = not args.quick and args.size_mib == 1024 and set(configs) == set(CONFIGS)
    path, record = write_record("tiers", argv, args.note, started, info, summary, results, full)
    first = next(iter(results.values()))
    print(
        f"\n{first['bytes'] / MiB:.0f} MiB in {first['leaves']} float32 arrays; {args.saves} timed saves, "
        f"one every {args.steps_per_save} training steps; load average before {' '.join(info['loadavg_before'])}, "
        f"after {' '.join(info['loadavg_after'])}; jaxckpt: {record['jaxckpt_measured']}\n"
    )
    print(table(results, summary))
    for config in ("tiered-every", "tiered-4th"):
        if config in summary and "x_local" in summary[config]:
            x = summary[config]["x_local"]
            print(
                f"\n{LABELS[config]} / local-only blocking (median): {x:.2f} (target <= 1.10: {'met' if x <= 1.10 else 'missed'})"
            )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
