"""Two committed revisions of jaxckpt, interleaved, on one workload: before/after numbers from one run.

    python benchmarks/ab.py --workload many --reps 5 main HEAD
    python benchmarks/ab.py --workload large --reps 7 --cold --no-async main HEAD

Each repetition runs the floor (durable write, then read + one batched ``device_put``; with
``--cold`` the same again after dropping the page cache), then for each revision (the order
alternating from one repetition to the next) its save, its restore of that save (``--cold``: and
again from a cold page cache), and an async save (not with ``--no-async``), each operation in a
fresh interpreter with memory pre-touched (``benchmarks/child.py``, as ``run.py`` does). Prints
every repetition with the load average and the CPU seconds that the rest of the machine used
during each restore ("others": the machine is shared), then the medians (with each restore's own
CPU seconds, which depend less on what else runs), and each revision's
restore time over the floor of the same repetition (floor / restore, the speed, in brackets) and
its async caller's time over its save's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revs", nargs=2, help="two git revisions of jaxckpt (e.g. main HEAD)")
    parser.add_argument("--workload", default="many", choices=run.wl.WORKLOADS + run.wl.EXTRA_WORKLOADS)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--naive-floor", action="store_true", help="also the naive floor: one device_put per array")
    parser.add_argument("--work", default=os.path.join(HERE, ".work"))
    parser.add_argument("--cold", action="store_true", help="also restore (and read the floor) from a cold page cache")
    parser.add_argument("--no-async", action="store_true", help="leave out the async save")
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    srcs = {rev: run.export_revision(rev, work) for rev in args.revs}
    workdir = os.path.join(work, args.workload)
    spec = run.prepare(workdir, args.workload, False)
    out = os.path.join(work, "ab-result.json")

    def child(op: str, src: str | None = None) -> dict[str, float]:
        env = run.child_env(spec["devices"])
        if src:
            env["BENCH_JAXCKPT_SRC"] = src
        subprocess.run([sys.executable, os.path.join(HERE, "child.py"), "run", workdir, op, out], check=True, env=env)
        with open(out) as f:
            return json.load(f)

    rows: dict[str, list[float]] = {}
    colds = ("", " cold") if args.cold else ("",)
    for rep in range(args.reps):
        row = {"load": os.getloadavg()[0]}
        others: dict[str, float] = {}

        def restore(name: str, op: str, src: str | None = None, row: dict = row, others: dict = others) -> None:
            done = child(op, src)
            row[name] = done["seconds"]
            row[f"{name} CPU s"] = done["cpu_seconds"]
            row[f"{name} MiB"] = (done["rss_peak"] - done["rss_start"]) / 2**20  # extra peak memory
            others[name] = round(done.get("others_cpu_seconds", float("nan")), 2)

        child("floor_write_fsync")
        for cold in colds:
            restore(f"floor{cold}", "floor_read_put" + cold.replace(" ", "_"))
        if args.naive_floor:
            row["naive floor"] = child("floor_read_put_each")["seconds"]
        for rev in args.revs if rep % 2 == 0 else args.revs[::-1]:
            row[f"{rev} save"] = child("jaxckpt_save", srcs[rev])["seconds"]
            for cold in colds:
                restore(f"{rev} restore{cold}", "jaxckpt_restore" + cold.replace(" ", "_"), srcs[rev])
            if not args.no_async:
                done = child("jaxckpt_async_save", srcs[rev])
                row[f"{rev} async blocks"], row[f"{rev} async total"] = done["blocking"], done["seconds"]
        print(json.dumps({k: round(v, 4) for k, v in row.items()}), "others:", json.dumps(others), flush=True)
        for k, v in row.items():
            rows.setdefault(k, []).append(v)
    print("medians:", json.dumps({k: round(statistics.median(v), 4) for k, v in rows.items()}))
    leaves = len(spec["leaves"])
    per_leaf = {
        k: round(statistics.median(v) / leaves * 1e6, 2)
        for k, v in rows.items()
        if k != "load" and not k.endswith("MiB")
    }
    print(f"median us per leaf ({leaves:,} leaves):", json.dumps(per_leaf))
    for rev in args.revs:
        said = []
        for cold in colds:
            ratio = statistics.median(a / b for a, b in zip(rows[f"{rev} restore{cold}"], rows[f"floor{cold}"]))
            said.append(f"restore{cold} / floor{cold} {ratio:.3f} ({1 / ratio:.2f}x)")
        if not args.no_async:
            blocks = statistics.median(a / b for a, b in zip(rows[f"{rev} async blocks"], rows[f"{rev} save"]))
            said.append(f"async blocks / save {blocks:.3f}")
        print(f"{rev}: " + "; ".join(said))


if __name__ == "__main__":
    main()
