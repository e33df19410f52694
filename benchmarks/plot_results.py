"""Draw a results JSON (written by run.py) as one figure: jaxckpt and Orbax against the hardware floor.

python benchmarks/plot_results.py                                   # results-cpu2-24gib.json -> .png beside it
python benchmarks/plot_results.py benchmarks/results-<machine>.json --out /tmp/results.png

Three panels (save, restore with the page cache hot, restore with it cold), one group of bars per
workload: the median time of jaxckpt and of Orbax divided by the median time of the floor it is
compared with in the tables (report.py): the durable write (``tofile`` + fsync) for saves, the read
into aligned buffers + one ``device_put`` for restores, hot or cold alike. 1 is the floor; below 1
is faster than it. The y axis is logarithmic (Orbax's 10,000-leaf save is near 100x).
Needs matplotlib (the bench extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402

PANELS = [  # (title, jaxckpt op, Orbax op, floor op)
    ("save\n(floor: tofile + fsync)", "jaxckpt_save", "orbax_save", "floor_write_fsync"),
    ("restore, page cache hot\n(floor: readinto + device_put)", "jaxckpt_restore", "orbax_restore", "floor_read_put"),
    (
        "restore, page cache cold\n(floor: the same, cold)",
        "jaxckpt_restore_cold",
        "orbax_restore_cold",
        "floor_read_put_cold",
    ),
]
LIBS = [("jaxckpt", 0, "#1f77b4"), ("Orbax", 1, "#ff7f0e")]


def ratios(results: dict[str, Any], workload: str, ops: tuple[str, str, str]) -> list[float | None]:
    """jaxckpt's and Orbax's median time / the floor's median time (None where one is missing)."""
    floor = report.median_of(results, workload, ops[2], "seconds")
    out: list[float | None] = []
    for op in ops[:2]:
        t = report.median_of(results, workload, op, "seconds")
        out.append(None if t is None or not floor else t / floor)
    return out


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in ("large", "many", "sharded", "train_state") if w in results["runs"]]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(13, 4.6), sharey=True)
    width = 0.38
    for ax, (title, *ops) in zip(axes, PANELS):
        for i, workload in enumerate(workloads):
            for (label, k, color), r in zip(LIBS, ratios(results, workload, (ops[0], ops[1], ops[2]))):
                if r is None:
                    continue
                x = i + (k - 0.5) * width
                ax.bar(x, r, width, color=color, label=label if i == 0 else None)
                ax.annotate(
                    f"{r:.2f}" if r < 10 else f"{r:.0f}",
                    (x, r),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 1),
                    textcoords="offset points",
                )
        ax.axhline(1.0, color="black", lw=0.9, ls="--", label="floor")
        ax.set_xticks(range(len(workloads)), [f"{w}\n{report_size(results, w)}" for w in workloads], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_yscale("log")
        ax.set_ylim(0.3, 250)
        ax.grid(axis="y", alpha=0.3, which="both")
    axes[0].set_ylabel("median time / floor's median time (lower is faster)")
    axes[0].legend(fontsize=8, loc="upper left")
    machine = results["machine"]
    fig.suptitle(
        f"{results['command']} at {results['git']}, {results['started'][:10]}: {machine['nproc']} CPUs "
        f"({machine['cpu']}), {machine['mem_gib']:.1f} GiB, {machine['disk']}; median of {results['reps']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def report_size(results: dict[str, Any], workload: str) -> str:
    info = results["workloads"][workload]
    return f"{info['leaves']:,} leaves\n{info['nbytes'] / 1e6:,.0f} MB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", type=Path, default=HERE / "results-cpu2-24gib.json")
    parser.add_argument("--out", type=Path, default=None, help="the PNG (default: the JSON's name, .png)")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    out = args.out or args.results.with_suffix(".png")
    plot(results, out)
    print("wrote", os.fspath(out))


if __name__ == "__main__":
    main()
