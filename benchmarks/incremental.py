"""Incremental checkpoints (issue 27): what a manager writes, and how long it takes, when most of the
state does not change between saves.

    python benchmarks/incremental.py                 # 1 GiB base, 20 steps per configuration (~5 min)
    python benchmarks/incremental.py --quick         # 64 MiB base, 5 steps: a smoke test (~1 min)
    python benchmarks/incremental.py --jaxckpt-rev HEAD   # measure jaxckpt as committed, not the work tree

**The LoRA-shaped run.** A frozen base of 16 float32 jax arrays of 4096 x 4096 (64 MiB each: 1 GiB),
and for each of them a rank-8 adapter (A: 4096 x 8, B: 8 x 4096) with its Adam state (mu and nu of
each): 12 MiB that a jitted step replaces at every step; the base arrays are the same objects
throughout. A ``CheckpointManager(..., max_to_keep=3)`` (or Orbax's, ``max_to_keep=3``) saves at
every step; a step's **save time** is ``save()`` plus ``wait_until_finished()`` (everything
durable); **bytes written** is the growth of the process's ``wchar`` (``/proc/self/io``: every byte
handed to write calls, by any thread) over that time; **on disk** at the end, the run's folder as
``du`` counts it (each hard-linked file once). Configurations, each in a fresh interpreter with
memory pre-touched (3x the state + 512 MiB; see /work/shared/BENCHMARKING.md):

- ``incremental``: ``jaxckpt.CheckpointManager(ckpt, dir, max_to_keep=3)`` (incremental by default)
- ``full``: the same with ``incremental=False``
- ``orbax``: ``ocp.CheckpointManager(dir, options=CheckpointManagerOptions(max_to_keep=3))``,
  ``save(step, args=StandardSave(state))``
- ``restart``: one save, then a new process restores the base through a new manager
  (``restore_or_initialize`` with templates) and saves ``--steps`` more steps: the first is the
  "right after a restart" row; ``restart-tf`` the same with TensorFlow's idiom,
  ``ckpt.restore(manager.latest_checkpoint)``
- ``all-changing`` and ``all-changing-full``: every array (base included) replaced at every step (a
  jitted ``w * 0.999 + 0.001``): what looking for unchanged arrays costs. Besides the save times of
  both, the time jaxckpt spends in :mod:`jaxckpt.incremental.local` itself (``Memory.link``, ``refs``,
  ``remember``) is measured directly, as a share of the save time.
- ``host`` and ``host-full``: the LoRA-shaped run with the base as numpy arrays (host data, compared
  by content), the same arrays throughout; ``host-copied``: the base replaced by equal copies at
  every step (content, not identity, decides)
- ``host-changing`` and ``host-changing-full``: the numpy base replaced at every step
  (``w * 0.999 + 0.001``, untimed): what comparing host arrays costs where every one has changed
  (about one inner chunk's CRC each)
- ``host-tail-changing``: the numpy base with only its last element changed at every step: the
  worst case, every chunk's CRC computed before the change is found

Writes benchmarks/incremental.json (a full run) or benchmarks/.work/incremental.json.
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

MiB = 1 << 20
CONFIGS = ("incremental", "full", "orbax", "restart", "all-changing", "all-changing-full")
MORE_CONFIGS = ("restart-tf",)
HOST_CONFIGS = ("host", "host-full", "host-copied", "host-changing", "host-changing-full", "host-tail-changing")
RANK = 8


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _du(path: str) -> int:
    """Bytes of the files under ``path``, each file (inode) once."""
    seen: dict[tuple[int, int], int] = {}
    for folder, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def child(config: str, workdir: str, side: int, leaves: int, steps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from child import cpu_seconds, import_jaxckpt, pretouch

    jaxckpt = import_jaxckpt()
    rng = np.random.default_rng(0)
    host = config.startswith("host")
    base = {f"w{i:02d}": rng.standard_normal((side, side), np.float32) for i in range(leaves)}
    if not host:
        base = {k: jnp.asarray(v) for k, v in base.items()}

    def lora(scale: float) -> dict[str, Any]:
        return {
            k: {"a": jnp.full((side, RANK), scale, jnp.float32), "b": jnp.full((RANK, side), scale, jnp.float32)}
            for k in base
        }

    state: dict[str, Any] = {"base": base, "adapter": lora(0.01), "mu": lora(0.0), "nu": lora(0.0), "step": 0}

    @jax.jit
    def adapter_step(s: dict[str, Any]) -> dict[str, Any]:
        update = lambda t: jax.tree.map(lambda x: x * 0.999 + 0.001, t)  # noqa: E731
        return {"adapter": update(s["adapter"]), "mu": update(s["mu"]), "nu": update(s["nu"])}

    @jax.jit
    def all_step(b: dict[str, Any]) -> dict[str, Any]:
        return jax.tree.map(lambda x: x * 0.999 + 0.001, b)

    def advance(s: dict[str, Any]) -> dict[str, Any]:
        s = {**s, **adapter_step({k: s[k] for k in ("adapter", "mu", "nu")}), "step": s["step"] + 1}
        if config.startswith("all-changing"):
            s["base"] = all_step(s["base"])
        elif config == "host-copied":
            s["base"] = {k: v.copy() for k, v in s["base"].items()}
        elif config.startswith("host-changing"):
            s["base"] = {k: v * np.float32(0.999) + np.float32(0.001) for k, v in s["base"].items()}
        elif config == "host-tail-changing":
            s["base"] = {k: v.copy() for k, v in s["base"].items()}
            for v in s["base"].values():
                v[-1, -1] += 1
        return jax.block_until_ready(s)

    state = advance(state)  # compiled before anything is timed
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
    folder = os.path.join(workdir, f"{config}-ckpts")

    # The time spent in jaxckpt.incremental.local itself (where this jaxckpt has it).
    looking: list[float] = []
    try:
        try:
            from jaxckpt.incremental import local
        except ImportError:  # a jaxckpt before the package was laid out by layers
            from jaxckpt import _incremental as local  # type: ignore[attr-defined,no-redef]

        for name in ("link", "remember"):
            real = getattr(local.Memory, name)

            def timed(self: Any, *a: Any, _real: Any = real, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _real(self, *a, **k)
                finally:
                    looking.append(time.perf_counter() - t)

            setattr(local.Memory, name, timed)
    except ImportError:
        pass

    if config == "orbax":
        from child import quiet_orbax

        ocp = quiet_orbax()
        manager = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(max_to_keep=3))

        def save(s: dict[str, Any]) -> None:
            manager.save(s["step"], args=ocp.args.StandardSave(s))

    else:
        ckpt = jaxckpt.Checkpoint(state=state)
        options = {"incremental": False} if config.endswith("-full") or config == "full" else {}
        manager = jaxckpt.CheckpointManager(ckpt, folder, max_to_keep=3, **options)

        def save(s: dict[str, Any]) -> None:
            ckpt.state = s
            manager.save(step=s["step"])

    if config.startswith("restart"):  # the first process: one save, then gone; the base is restored below
        save(state)
        manager.close()
        templates = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            state,
        )
        del state, base, ckpt
        ckpt = jaxckpt.Checkpoint(state=templates)
        manager = jaxckpt.CheckpointManager(ckpt, folder, max_to_keep=3)
        if config == "restart":
            manager.restore_or_initialize()
        else:  # TensorFlow's idiom: the Checkpoint restores, the manager only names the checkpoint
            ckpt.restore(manager.latest_checkpoint).assert_consumed()
        state = ckpt.state

    pretouch(3 * nbytes + 512 * MiB)
    save_s: list[float] = []
    written: list[int] = []
    looked: list[float] = []
    cpu0 = cpu_seconds()
    for _ in range(steps):
        state = advance(state)
        del looking[:]
        w, t = _wchar(), time.perf_counter()
        save(state)
        manager.wait_until_finished()
        save_s.append(time.perf_counter() - t)
        written.append(_wchar() - w)
        looked.append(sum(looking))
    cpu = cpu_seconds() - cpu0
    manager.close()
    return {
        "config": config,
        "state_bytes": nbytes,
        "steps": steps,
        "save_s": save_s,
        "written_bytes": written,
        "looking_s": looked,
        "disk_bytes": _du(folder),
        "cpu_s": cpu,
    }


def run_config(config: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    from run import child_env

    result_path = os.path.join(workdir, f"result-{config}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--child", config, "--result", result_path]
    argv += ["--workdir", workdir, "--side", str(args.side), "--leaves", str(args.leaves), "--steps", str(args.steps)]
    try:
        subprocess.run(argv, env=child_env(1), check=True)
    finally:
        shutil.rmtree(os.path.join(workdir, f"{config}-ckpts"), ignore_errors=True)
    with open(result_path) as f:
        result: dict[str, Any] = json.load(f)
    return result


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config, r in results.items():
        later = slice(1, None)  # the first step writes everything in every configuration
        out[config] = {
            "first_save_s": r["save_s"][0],
            "first_written_mib": r["written_bytes"][0] / MiB,
            "save_median_s": statistics.median(r["save_s"][later]),
            "written_median_mib": statistics.median(r["written_bytes"][later]) / MiB,
            "looking_median_s": statistics.median(r["looking_s"][later]),
            "disk_mib": r["disk_bytes"] / MiB,
            "cpu_s": r["cpu_s"],
        }
    for config, s in out.items():  # against the full save of the same state
        reference = "host-full" if config.startswith("host") else "full"
        if reference in out:
            full = out[reference]
            s["written_x_full"] = s["written_median_mib"] / full["written_median_mib"]
            s["time_x_full"] = s["save_median_s"] / full["save_median_s"]
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| configuration | first save: s | MiB written | later saves: median s | median MiB written "
        "| x full: bytes | x full: time | on disk at the end: MiB | in local: median ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config, s in summary.items():
        ratios = f"{s['written_x_full']:.4f} | {s['time_x_full']:.3f}" if "written_x_full" in s else " | "
        lines.append(
            f"| {config} | {s['first_save_s']:.3f} | {s['first_written_mib']:.1f} | {s['save_median_s']:.3f} "
            f"| {s['written_median_mib']:.2f} | {ratios} | {s['disk_mib']:.0f} | {1000 * s['looking_median_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", type=int, default=4096, help="each base array is side x side float32 (default 4096)")
    p.add_argument("--leaves", type=int, default=16, help="base arrays (default 16)")
    p.add_argument("--steps", type=int, default=20, help="saves per configuration (default 20)")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS + MORE_CONFIGS + HOST_CONFIGS)}",
    )
    p.add_argument("--quick", action="store_true", help="16 x 1024^2 (64 MiB), 5 steps: a smoke test")
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a fresh folder in /tmp)")
    p.add_argument("--jaxckpt-rev", default=None, help="measure jaxckpt as committed at git revision REV")
    p.add_argument("--note", default="", help="a line recorded with the results (e.g. 'machine shared')")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        r = child(args.child, args.workdir, args.side, args.leaves, args.steps)
        with open(args.result, "w") as f:
            json.dump(r, f)
        return
    if args.quick:
        args.side, args.steps = 1024, 5
    configs = [c for c in args.configs.split(",") if c]
    from run import _read, export_revision, machine_info, write_record

    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxckpt-incremental-", dir="/tmp")
    os.makedirs(workdir, exist_ok=True)
    if args.jaxckpt_rev:
        os.environ["BENCH_JAXCKPT_SRC"] = export_revision(args.jaxckpt_rev, workdir)
    info = machine_info(workdir)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    results = {}
    for config in configs:
        print(f"{config} ...", flush=True)
        results[config] = run_config(config, args, workdir)
        r = results[config]
        print(f"  save s: {', '.join(f'{t:.3f}' for t in r['save_s'])}", flush=True)
        print(f"  MiB written: {', '.join(f'{b / MiB:.1f}' for b in r['written_bytes'])}", flush=True)
    info["loadavg_after"] = _read("/proc/loadavg").split()[:3]
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(results)
    full = not args.quick and args.side == 4096 and set(configs) == set(CONFIGS)
    path, record = write_record("incremental", argv, args.note, started, info, summary, results, full)
    first = next(iter(results.values()))
    print(
        f"\n{first['state_bytes'] / MiB:.0f} MiB of state; {args.steps} saves per configuration; load average "
        f"before {' '.join(info['loadavg_before'])}, after {' '.join(info['loadavg_after'])}; "
        f"jaxckpt: {record['jaxckpt_measured']}\n"
    )
    print(table(summary))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
