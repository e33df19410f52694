"""Where jaxckpt's time goes: profile its save and restore on a workload, set up as run.py does.

    python benchmarks/profile_jaxckpt.py --workload many               # cProfile of the timed part only
    python benchmarks/profile_jaxckpt.py --workload large --py-spy     # also sample every thread with py-spy
    python benchmarks/profile_jaxckpt.py --workload many --quick --ops jaxckpt_save

cProfile sees Python only: time that TensorStore spends in its own threads shows up as waiting in
``.result()``. py-spy (``pip install py-spy``; not a dependency) samples all threads, with
``--native`` C/C++ frames too. Profiles are written under benchmarks/.work/profile/.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pstats
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402


def cprofile(workdir: str, op: str, devices: int, out: str, top: int) -> None:
    stats_path = os.path.join(out, f"{os.path.basename(workdir)}-{op}.prof")
    env = run.child_env(devices)
    env["BENCH_CPROFILE"] = stats_path
    result_path = os.path.join(out, "result.json")
    argv = [sys.executable, os.path.join(HERE, "child.py"), "run", workdir, op, result_path]
    subprocess.run(argv, check=True, env=env)
    with open(result_path) as f:
        print(f"== {os.path.basename(workdir)} {op}: {f.read()}")
    for order in ("cumulative", "tottime"):
        buf = io.StringIO()
        stats = pstats.Stats(stats_path, stream=buf)
        stats.sort_stats(order).print_stats(top)
        text = buf.getvalue()
        print(f"-- top {top} by {order} (the timed part only; {stats_path})")
        print(text[text.index("   ncalls") :] if "   ncalls" in text else text)


def pyspy(workdir: str, op: str, devices: int, out: str, top: int, native: bool) -> None:
    raw = os.path.join(out, f"{os.path.basename(workdir)}-{op}.pyspy.txt")
    result_path = os.path.join(out, "result.json")
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    argv = [
        exe if os.path.exists(exe) else "py-spy",
        "record",
        "--rate",
        "500",
        "--threads",
        "--idle",
        "--format",
        "raw",
        "--output",
        raw,
    ]
    argv += ["--native"] if native else []
    argv += ["--", sys.executable, os.path.join(HERE, "child.py"), "run", workdir, op, result_path]
    subprocess.run(argv, check=True, env=run.child_env(devices), stdout=subprocess.DEVNULL)
    with open(result_path) as f:
        print(f"== {os.path.basename(workdir)} {op} under py-spy: {f.read()}")
    # Keep the samples inside the timed operation, and those of jaxckpt's own threads (async saves).
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            timed = any(fr.startswith("timed_operation (") for fr in frames)
            behind = "MainThread" not in frames[0] and any("jaxckpt/" in fr for fr in frames)
            if not (timed or behind) or any("importlib" in fr for fr in frames):
                continue
            n = int(count)
            total += n
            leaf[frames[-1]] += n
            for fr in set(frames):
                inclusive[fr] += n
    print(f"-- py-spy: {total} samples in the operation (idle included; {raw})")
    print("   inclusive:")
    for fr, n in inclusive.most_common(top):
        print(f"   {100 * n / total:5.1f}%  {fr}")
    print("   self:")
    for fr, n in leaf.most_common(top):
        print(f"   {100 * n / total:5.1f}%  {fr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="many", choices=run.wl.WORKLOADS)
    parser.add_argument("--ops", default="jaxckpt_save,jaxckpt_restore", help="comma-separated child ops, in order")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--py-spy", action="store_true", help="also sample with py-spy")
    parser.add_argument("--native", action="store_true", help="py-spy: include native frames")
    parser.add_argument("--work", default=os.path.join(HERE, ".work"))
    parser.add_argument("--jaxckpt-src", default=None, help="profile the jaxckpt package in DIR/jaxckpt")
    parser.add_argument("--jaxckpt-rev", default=None, help="profile jaxckpt as committed at git revision REV")
    args = parser.parse_args()
    if args.jaxckpt_rev:
        args.jaxckpt_src = run.export_revision(args.jaxckpt_rev, os.path.abspath(args.work))
    if args.jaxckpt_src:
        os.environ["BENCH_JAXCKPT_SRC"] = os.path.abspath(args.jaxckpt_src)

    workdir = os.path.join(os.path.abspath(args.work), args.workload + ("-quick" if args.quick else ""))
    out = os.path.join(os.path.abspath(args.work), "profile")
    os.makedirs(out, exist_ok=True)
    spec = run.prepare(workdir, args.workload, args.quick)
    for op in args.ops.split(","):
        cprofile(workdir, op, spec["devices"], out, args.top)
        if args.py_spy:
            pyspy(workdir, op, spec["devices"], out, args.top, args.native)
    shutil.rmtree(os.path.join(workdir, "out"), ignore_errors=True)  # the checkpoints; profiles stay in out


if __name__ == "__main__":
    main()
