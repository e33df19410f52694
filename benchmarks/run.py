"""Benchmarks: jaxckpt, Orbax and the machine's floor, side by side, in one run, on the same data and disk.

    python benchmarks/run.py                              # all workloads and the scaling runs, 3 repetitions (make bench)
    python benchmarks/run.py --quick                      # small sizes, 1 repetition: a smoke test (~1 min)
    python benchmarks/run.py --workloads large,many --reps 5 --libs floor,jaxckpt

Every operation runs in its own subprocess (benchmarks/child.py) with memory pre-touched first; see
benchmarks/README.md for what is measured and how. A full run (all workloads and libraries, not
--quick, 3 or more repetitions) writes benchmarks/results-<machine>.md and .json and updates the table
in benchmarks/README.md; any other run writes them under the work folder (benchmarks/.work/).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # noqa: E402
import workloads as wl  # noqa: E402
from child import OPS  # noqa: E402

MiB = 1 << 20
README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"
PACKAGES = ("jax", "jaxlib", "tensorstore", "orbax-checkpoint", "numpy", "flax", "optax", "jaxckpt")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cmd(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine_info(workdir: str) -> dict[str, Any]:
    mem_kib = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")), 0
    )
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines() if "model name" in line), "?"
    )
    source, fstype = (_cmd("findmnt", "-no", "SOURCE,FSTYPE", "-T", workdir).split() + ["?", "?"])[:2]
    total = shutil.disk_usage(workdir).total
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "mem_gib": mem_kib / (1 << 20),
        "kernel": platform.release(),
        "disk": f"{source} ({fstype}, {total / (1 << 30):.0f} GiB)",
        "loadavg_before": _read("/proc/loadavg").split()[:3],
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def jaxckpt_source() -> str:
    """Which jaxckpt the children import: a --jaxckpt-src folder, or this checkout (and whether it is edited)."""
    src = os.environ.get("BENCH_JAXCKPT_SRC")
    if src:
        name = os.path.basename(src)
        return f"git revision {name[4:]} (exported)" if name.startswith("src-") else f"{src} (--jaxckpt-src)"
    repo = os.path.dirname(HERE)
    edited = _cmd("git", "-C", repo, "status", "--porcelain", "--", "jaxckpt")
    head = _cmd("git", "-C", repo, "rev-parse", "--short", "HEAD")
    return f"this checkout at {head}" + (" with uncommitted changes in jaxckpt/" if edited and edited != "?" else "")


def write_record(
    script: str,
    argv: list[str],
    note: str | None,
    started: str,
    info: dict[str, Any],
    summary: Any,
    runs: Any,
    full: bool,
) -> tuple[str, dict[str, Any]]:
    """Write a side benchmark's results (``benchmarks/<script>.json``) with the machine, versions and
    command; here for a full run, under ``benchmarks/.work/`` otherwise. Returns the path and record."""
    out_dir = HERE if full else os.path.join(HERE, ".work")
    os.makedirs(out_dir, exist_ok=True)
    record = {
        "started": started,
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(["python", f"benchmarks/{script}.py", *argv]),
        "note": note,
        "git": _cmd("git", "-C", HERE, "describe", "--always", "--dirty"),
        "jaxckpt_measured": jaxckpt_source(),
        "machine": info,
        "versions": versions(),
        "summary": summary,
        "runs": runs,
    }
    path = os.path.join(out_dir, f"{script}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path, record


def export_revision(rev: str, work: str) -> str:
    """A folder holding jaxckpt/ as committed at ``rev`` (git archive; the checkout is not touched)."""
    repo = os.path.dirname(HERE)
    sha = subprocess.run(["git", "-C", repo, "rev-parse", "--short", rev], capture_output=True, text=True, check=True)
    dest = os.path.join(work, f"src-{sha.stdout.strip()}")
    if not os.path.isdir(os.path.join(dest, "jaxckpt")):
        os.makedirs(dest, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", repo, "archive", sha.stdout.strip(), "jaxckpt"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def child_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def prepare(workdir: str, workload: str, quick: bool) -> dict[str, Any]:
    """The workload's spec, generating its data file unless an identical one is there."""
    try:
        spec = wl.load_spec(workdir)
        if (
            spec["generator"] == wl.GENERATOR_VERSION
            and spec["quick"] == quick
            and os.path.exists(os.path.join(workdir, "data.bin"))
        ):
            return spec
    except (OSError, ValueError, KeyError):
        pass
    t = time.perf_counter()
    argv = [sys.executable, os.path.join(HERE, "child.py"), "prepare", workdir, workload] + (
        ["--quick"] if quick else []
    )
    subprocess.run(argv, check=True, env=child_env(1))
    spec = wl.load_spec(workdir)
    print(
        f"  generated {workload} data ({spec['nbytes'] / MiB:,.0f} MiB) in {time.perf_counter() - t:.1f} s", flush=True
    )
    return spec


def run_op(workdir: str, op: str, devices: int, touch_extra: int, timeout: float) -> dict[str, Any]:
    result_path = os.path.join(workdir, f"result-{op}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    argv = [sys.executable, os.path.join(HERE, "child.py"), "run", workdir, op, result_path, str(touch_extra)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=child_env(devices), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"op": op, "status": "error", "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(result_path):
        return {"op": op, "status": "error", "error": (proc.stderr or proc.stdout)[-4000:]}
    with open(result_path) as f:
        return json.load(f)


def _line(workload: str, rep: int, reps: int, r: dict[str, Any]) -> str:
    head = f"  {workload:<11} rep {rep + 1}/{reps} {r['op']:<21}"
    if r["status"] != "ok":
        last = r.get("why") or (r.get("error", "").strip().splitlines() or ["?"])[-1]
        return f"{head} {r['status']}: {last}"
    extra = f" (blocks {r['blocking']:.3f} s)" if "blocking" in r else ""
    return (
        f"{head} {r['seconds']:8.3f} s{extra}  {r['nbytes'] / 1e9 / r['seconds']:6.2f} GB/s  "
        f"peak RSS {r['rss_peak'] / r['nbytes']:.2f}x  files {r.get('files', '-')}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workloads", default=",".join(wl.WORKLOADS), help="comma-separated: " + ",".join(wl.WORKLOADS)
    )
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the harness")
    parser.add_argument("--libs", default="floor,jaxckpt,orbax", help="comma-separated subset of floor,jaxckpt,orbax")
    parser.add_argument(
        "--work", default=os.path.join(HERE, ".work"), help="data and checkpoints (default benchmarks/.work)"
    )
    parser.add_argument("--machine", default=None, help="name in results-<machine>.md (default from CPUs and memory)")
    parser.add_argument("--note", default="", help="a line printed at the top of the results (e.g. 'preliminary')")
    parser.add_argument(
        "--jaxckpt-src", default=None, help="measure the jaxckpt package in DIR/jaxckpt instead of the installed one"
    )
    parser.add_argument(
        "--jaxckpt-rev",
        default=None,
        help="measure jaxckpt as committed at git revision REV (e.g. HEAD), not the work tree",
    )
    parser.add_argument(
        "--no-scaling",
        action="store_true",
        help="skip the time-per-leaf runs (" + ", ".join(wl.SCALING) + ": jaxckpt only, about 10 minutes)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed to one operation")
    args = parser.parse_args()

    names = [w for w in args.workloads.split(",") if w]
    libs = {x for x in args.libs.split(",") if x}
    for w in names:
        if w not in wl.WORKLOADS + wl.EXTRA_WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(wl.WORKLOADS + wl.EXTRA_WORKLOADS)}")
    reps = args.reps or (1 if args.quick else 3)
    ops = [op for op in OPS if op.split("_")[0] in libs]
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    # The pre-touch: 3x the size plus 512 MiB (BENCHMARKING.md); less slack at smoke-test sizes.
    touch_extra = (64 if args.quick else 512) * MiB

    if args.jaxckpt_rev:
        args.jaxckpt_src = export_revision(args.jaxckpt_rev, work)
    if args.jaxckpt_src:
        os.environ["BENCH_JAXCKPT_SRC"] = os.path.abspath(args.jaxckpt_src)
    info = machine_info(work)
    machine = args.machine or f"cpu{info['nproc']}-{round(info['mem_gib'])}gib"
    # The scaling runs come with the default workloads (not with a chosen subset), when jaxckpt is measured.
    scaling = [] if args.no_scaling or set(names) != set(wl.WORKLOADS) or "jaxckpt" not in libs else list(wl.SCALING)
    full = (
        not args.quick
        and reps >= 3
        and set(names) == set(wl.WORKLOADS)
        and libs >= {"floor", "jaxckpt", "orbax"}
        and bool(scaling)
    )
    out_dir = HERE if full else work
    results: dict[str, Any] = {
        "machine_name": machine,
        "note": args.note,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/run.py", *sys.argv[1:]]),
        "git": _cmd("git", "-C", HERE, "describe", "--always", "--dirty"),
        "jaxckpt_source": jaxckpt_source(),
        "quick": args.quick,
        "reps": reps,
        "machine": info,
        "versions": versions(),
        "workloads": {},
        "runs": {},
    }
    print(
        f"jaxckpt benchmarks on {machine}: {', '.join(names + scaling)}; {reps} repetition(s); work folder {work}",
        flush=True,
    )
    for name in names + scaling:
        workdir = os.path.join(work, name + ("-quick" if args.quick else ""))
        spec = prepare(workdir, name, args.quick)
        results["workloads"][name] = {
            "nbytes": spec["nbytes"],
            "leaves": len(spec["leaves"]),
            "devices": spec["devices"],
            **({"scaling": True} if name in scaling else {}),
        }
        wanted = [op for op in ops if op in wl.SCALING[name]] if name in scaling else ops
        runs: dict[str, list[dict[str, Any]]] = {op: [] for op in wanted}
        results["runs"][name] = runs
        for rep in range(reps):
            for op in wanted:
                if rep > 0 and runs[op] and runs[op][0]["status"] == "n/a":
                    continue
                r = run_op(workdir, op, spec["devices"], touch_extra, args.timeout)
                r["rep"] = rep
                runs[op].append(r)
                print(_line(name, rep, reps, r), flush=True)
        shutil.rmtree(os.path.join(workdir, "out"), ignore_errors=True)
    results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    info["loadavg_after"] = _read("/proc/loadavg").split()[:3]

    text = report.render(results)
    print()
    print(text)
    suffix = "-quick" if args.quick else ""
    md = os.path.join(out_dir, f"results-{machine}{suffix}.md")
    with open(md, "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, f"results-{machine}{suffix}.json"), "w") as f:
        json.dump(results, f, indent=1)
    if full:
        update_readme(text, machine)
    print(f"\nwrote {md} and .json" + ("" if full else " (not a full run: benchmarks/README.md left as it is)"))
    failed = [r for runs in results["runs"].values() for rs in runs.values() for r in rs if r["status"] == "error"]
    return 1 if failed else 0


def update_readme(text: str, machine: str) -> None:
    """Put the results between the markers in benchmarks/README.md (headings two levels down)."""
    path = os.path.join(HERE, "README.md")
    readme = _read(path)
    if README_START not in readme or README_END not in readme:
        return
    body = "\n".join(("##" + line if line.startswith("#") else line) for line in text.splitlines())
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    with open(path, "w") as f:
        f.write(
            f"{head}{README_START}\n<!-- written by benchmarks/run.py from results-{machine}.json -->\n{body}\n{README_END}{tail}"
        )


if __name__ == "__main__":
    sys.exit(main())
