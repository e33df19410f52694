"""Render a results JSON (written by run.py) as markdown.

python benchmarks/report.py benchmarks/results-<machine>.json [--write]

With --write, also rewrite the .md beside the JSON (and, for results in benchmarks/, the table in
benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

GIB = 1 << 30
WORKLOAD_TEXT = {
    "large": "16 float32 arrays (64 MiB each; 2 MiB with --quick), one device",
    "many": "small float32 leaves in transformer-like blocks of 10 (widths 32..72), one device",
    "huge": "100,000 small float32 leaves: `many` ten times over, one device",
    "sharded": "8 float32 arrays on 8 host devices, saved from a (4,2) mesh with 8 mixed PartitionSpecs, restored onto (2,4)",
    "train_state": "Flax linen decoder + optax adamw state + step (51.1M params; 0.66M with --quick), one device",
}

# (label, op, metric, floor (op, metric) it is compared with, Orbax (op, metric) it is compared with)
ROWS: list[tuple[str, str, str, tuple[str, str] | None, tuple[str, str] | None]] = [
    ("floor: write to page cache (`tofile`)", "floor_write", "seconds", None, None),
    ("floor: durable write (`tofile` + fsync)", "floor_write_fsync", "seconds", None, None),
    ("floor: read, page cache hot (`fromfile`)", "floor_read", "seconds", None, None),
    (
        "floor: read into aligned buffers (`readinto`) + one `device_put`, hot",
        "floor_read_put",
        "seconds",
        None,
        None,
    ),
    ("floor: the same, page cache cold", "floor_read_put_cold", "seconds", None, None),
    ("floor: memory copy (`np.copy`)", "floor_copy", "seconds", None, None),
    ("floor: hold each array against donation (a `memoryview` each)", "floor_hold", "seconds", None, None),
    ("**jaxckpt save**", "jaxckpt_save", "seconds", ("floor_write_fsync", "seconds"), ("orbax_save", "seconds")),
    ("Orbax save", "orbax_save", "seconds", ("floor_write_fsync", "seconds"), None),
    (
        "**jaxckpt restore**",
        "jaxckpt_restore",
        "seconds",
        ("floor_read_put", "seconds"),
        ("orbax_restore", "seconds"),
    ),
    ("Orbax restore", "orbax_restore", "seconds", ("floor_read_put", "seconds"), None),
    (
        "**jaxckpt restore, page cache cold**",
        "jaxckpt_restore_cold",
        "seconds",
        ("floor_read_put_cold", "seconds"),
        ("orbax_restore_cold", "seconds"),
    ),
    ("Orbax restore, page cache cold", "orbax_restore_cold", "seconds", ("floor_read_put_cold", "seconds"), None),
    (
        "**jaxckpt async save: blocks for**",
        "jaxckpt_async_save",
        "blocking",
        ("floor_copy", "seconds"),
        ("orbax_async_save", "blocking"),
    ),
    (
        "**jaxckpt async save: total**",
        "jaxckpt_async_save",
        "seconds",
        ("floor_write_fsync", "seconds"),
        ("orbax_async_save", "seconds"),
    ),
    ("Orbax async save: blocks for", "orbax_async_save", "blocking", ("floor_copy", "seconds"), None),
    ("Orbax async save: total", "orbax_async_save", "seconds", ("floor_write_fsync", "seconds"), None),
]


def _ok(runs: list[dict[str, Any]], metric: str) -> list[float]:
    return [r[metric] for r in runs if r.get("status") == "ok" and metric in r]


def median_of(results: dict[str, Any], workload: str, op: str, metric: str) -> float | None:
    values = _ok(results["runs"].get(workload, {}).get(op, []), metric)
    return statistics.median(values) if values else None


def _status(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "not run"
    na = [r for r in runs if r.get("status") == "n/a"]
    if na:
        why = na[0].get("why", "").split(" (")[0]  # e.g. "cannot drop caches"
        return f"n/a: {why}" if why and len(why) <= 40 else "n/a"
    return "error"


def _s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return ""
    r = a / b
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def _range(values: list[int]) -> str:
    return "" if not values else str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def workload_table(results: dict[str, Any], workload: str) -> str:
    info = results["workloads"][workload]
    size = info["nbytes"]
    runs = results["runs"].get(workload, {})
    lines = [
        f"### `{workload}`: {info['leaves']:,} leaves, {size / GIB:.3f} GiB ({size:,} bytes)",
        "",
        WORKLOAD_TEXT.get(workload, ""),
        "",
        "| operation | median s | min - max s | GB/s | x floor | x Orbax | peak RSS / size | +RSS / size | CPU s | files | disk / size |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, op, metric, floor, orbax in ROWS:
        op_runs = runs.get(op, [])
        values = _ok(op_runs, metric)
        if not values:
            lines.append(f"| {label} | {_status(op_runs)} | | | | | | | | | |")
            continue
        ok = [r for r in op_runs if r.get("status") == "ok"]
        med = statistics.median(values)
        floor_med = median_of(results, workload, *floor) if floor else None
        orbax_med = median_of(results, workload, *orbax) if orbax else None
        peak = statistics.median(r["rss_peak"] / size for r in ok)
        extra = statistics.median((r["rss_peak"] - r["rss_start"]) / size for r in ok)
        cpu = statistics.median(r["cpu_seconds"] for r in ok)
        files = [r["files"] for r in ok if "files" in r]
        disk = [r["disk_bytes"] / size for r in ok if "disk_bytes" in r]
        lines.append(
            f"| {label} | {_s(med)} | {_s(min(values))} - {_s(max(values))} "
            f"| {'' if metric == 'blocking' else f'{size / 1e9 / med:.2f}'} "
            f"| {_ratio(med, floor_med)} | {_ratio(med, orbax_med)} | {peak:.2f} | {extra:.2f} | {cpu:.2f} "
            f"| {_range(files)} | {f'{statistics.median(disk):.3f}' if disk else ''} |"
        )
    return "\n".join(lines)


def _extra_rss(results: dict[str, Any], workload: str, op: str) -> float | None:
    """Median (peak RSS - RSS at the start) / size of ``op``'s successful runs: the "+RSS / size" column."""
    size = results["workloads"][workload]["nbytes"]
    ok = [r for r in results["runs"].get(workload, {}).get(op, []) if r.get("status") == "ok" and "rss_peak" in r]
    return statistics.median((r["rss_peak"] - r["rss_start"]) / size for r in ok) if ok else None


# The targets, each a ratio of medians: (workloads, what, how the figure is made, the figure's two
# inputs as (op, metric) or an RSS op, ">=" or "<=", the bound). "a/b" is median(a) / median(b).
# `large` and `many` carry issue 28's goals; `sharded` and `train_state` keep issue 14's.
Target = tuple[tuple[str, ...] | None, str, str, tuple[Any, ...], str, float]
TARGETS: list[Target] = [
    (
        ("large",),
        "save speed: durable-write floor / jaxckpt save",
        "ratio",
        ("floor_write_fsync", "jaxckpt_save"),
        ">=",
        1.0,
    ),
    (
        ("sharded",),
        "save speed: durable-write floor / jaxckpt save",
        "ratio",
        ("floor_write_fsync", "jaxckpt_save"),
        ">=",
        0.8,
    ),
    (
        ("large",),
        "cold restore speed: cold floor / jaxckpt cold restore",
        "ratio",
        ("floor_read_put_cold", "jaxckpt_restore_cold"),
        ">=",
        0.95,
    ),
    (
        ("sharded",),
        "cold restore speed: cold floor / jaxckpt cold restore",
        "ratio",
        ("floor_read_put_cold", "jaxckpt_restore_cold"),
        ">=",
        0.9,
    ),
    (
        ("large",),
        "hot restore speed: read + `device_put` floor / jaxckpt restore",
        "ratio",
        ("floor_read_put", "jaxckpt_restore"),
        ">=",
        0.8,
    ),
    (
        ("sharded",),
        "hot restore speed: read + `device_put` floor / jaxckpt restore",
        "ratio",
        ("floor_read_put", "jaxckpt_restore"),
        ">=",
        0.5,
    ),
    (
        ("large",),
        "async save blocks / synchronous save",
        "ratio",
        (("jaxckpt_async_save", "blocking"), "jaxckpt_save"),
        "<=",
        0.02,
    ),
    (("many",), "save: Orbax save / jaxckpt save", "ratio", ("orbax_save", "jaxckpt_save"), ">=", 30),
    (("many",), "restore: Orbax restore / jaxckpt restore", "ratio", ("orbax_restore", "jaxckpt_restore"), ">=", 20),
    (
        ("many",),
        "restore: jaxckpt restore / read + batched `device_put` floor",
        "ratio",
        ("jaxckpt_restore", "floor_read_put"),
        "<=",
        1.25,
    ),
    (
        ("many",),
        "restore: jaxckpt restore / read + one `device_put` per array (naive floor)",
        "ratio",
        ("jaxckpt_restore", "floor_read_put_each"),
        "<=",
        1.0,
    ),
    (
        ("many",),
        "async save blocks / synchronous save",
        "ratio",
        (("jaxckpt_async_save", "blocking"), "jaxckpt_save"),
        "<=",
        0.05,
    ),
    (
        ("train_state",),
        "save: jaxckpt save / durable-write floor",
        "ratio",
        ("jaxckpt_save", "floor_write_fsync"),
        "<=",
        1.25,
    ),
    (
        ("train_state",),
        "restore: jaxckpt restore / read + `device_put` floor",
        "ratio",
        ("jaxckpt_restore", "floor_read_put"),
        "<=",
        1.25,
    ),
    (None, "save memory: +RSS / size", "rss", ("jaxckpt_save",), "<=", 0.5),
    (("large",), "restore memory: +RSS / size", "rss", ("jaxckpt_restore",), "<=", 1.05),
    (("many", "sharded", "train_state"), "restore memory: +RSS / size", "rss", ("jaxckpt_restore",), "<=", 1.2),
    (None, "cold restore memory: +RSS / size", "rss", ("jaxckpt_restore_cold",), "<=", 1.2),
]


def _target_inputs(results: dict[str, Any], workload: str, kind: str, inputs: tuple[Any, ...]) -> tuple[Any, str]:
    """(the figure or None, why it is missing)."""
    if kind == "rss":
        op = inputs[0]
        value = _extra_rss(results, workload, op)
        return value, "" if value is not None else f"`{op}` {_status(results['runs'][workload].get(op, []))}"
    meds = []
    for x in inputs:
        op, metric = x if isinstance(x, tuple) else (x, "seconds")
        m = median_of(results, workload, op, metric)
        if m is None or m <= 0:
            return None, f"`{op}` {_status(results['runs'][workload].get(op, []))}"
        meds.append(m)
    return meds[0] / meds[1], ""


def _main(results: dict[str, Any]) -> list[str]:
    """The workloads of the main tables: all but the scaling runs (see :func:`scaling_section`)."""
    return [w for w, info in results["workloads"].items() if not info.get("scaling")]


def targets_table(results: dict[str, Any]) -> str:
    lines = ["| workload | target | wanted | measured | |", "|---|---|---:|---:|---|"]
    for w in _main(results):
        for workloads, what, kind, inputs, cmp, bound in TARGETS:
            if workloads is not None and w not in workloads:
                continue
            value, why = _target_inputs(results, w, kind, inputs)
            unit = "" if kind == "rss" else "x"
            wanted = f"{cmp} {bound:g}{unit}"
            if value is None:
                lines.append(f"| `{w}` | {what} | {wanted} | | n/a ({why}) |")
                continue
            met = value >= bound if cmp == ">=" else value <= bound
            lines.append(f"| `{w}` | {what} | {wanted} | {value:.2f}{unit} | {'met' if met else '**missed**'} |")
    return "\n".join(lines)


def summary_table(results: dict[str, Any]) -> str:
    def cell(workload: str, op: str, metric: str = "seconds") -> str:
        m = median_of(results, workload, op, metric)
        if m is None:
            return _status(results["runs"].get(workload, {}).get(op, []))
        return _s(m)

    lines = [
        "| workload | size | jaxckpt save | Orbax save | durable write floor | jaxckpt restore | Orbax restore "
        "| read + put floor | jaxckpt / Orbax / floor restore, cold | jaxckpt async blocks / total "
        "| Orbax async blocks / total |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in _main(results):
        info = results["workloads"][w]
        lines.append(
            f"| `{w}` | {info['nbytes'] / 1e6:,.0f} MB | {cell(w, 'jaxckpt_save')} | {cell(w, 'orbax_save')} "
            f"| {cell(w, 'floor_write_fsync')} | {cell(w, 'jaxckpt_restore')} | {cell(w, 'orbax_restore')} "
            f"| {cell(w, 'floor_read_put')} | {cell(w, 'jaxckpt_restore_cold')} / {cell(w, 'orbax_restore_cold')} "
            f"/ {cell(w, 'floor_read_put_cold')} "
            f"| {cell(w, 'jaxckpt_async_save', 'blocking')} / {cell(w, 'jaxckpt_async_save')} "
            f"| {cell(w, 'orbax_async_save', 'blocking')} / {cell(w, 'orbax_async_save')} |"
        )
    return "\n".join(lines)


# Issue 28's goals across sizes: (the row's workload, what, (workload, op) over (workload, op) as median
# seconds per leaf, "<=" or "<", the bound).
SCALING_TARGETS = [
    ("tiny1m", "save time per leaf / `tiny10k`'s", ("tiny1m", "jaxckpt_save"), ("tiny10k", "jaxckpt_save"), "<=", 1.5),
    (
        "tiny1m",
        "restore time per leaf / `tiny10k`'s",
        ("tiny1m", "jaxckpt_restore"),
        ("tiny10k", "jaxckpt_restore"),
        "<=",
        1.5,
    ),
    (
        "tiny300k",
        "restore / read + one `device_put` per array (naive floor)",
        ("tiny300k", "jaxckpt_restore"),
        ("tiny300k", "floor_read_put_each"),
        "<",
        1.0,
    ),
]


def _per_leaf(results: dict[str, Any], workload: str, op: str) -> float | None:
    """Median seconds of ``op`` per leaf of ``workload``; None where it did not run."""
    info = results["workloads"].get(workload)
    m = median_of(results, workload, op, "seconds") if info else None
    return None if m is None or info is None else m / info["leaves"]


def scaling_section(results: dict[str, Any]) -> list[str]:
    """Time per leaf as leaves grow: the scaling runs' table and issue 28's goals for them."""
    names = [w for w, info in results["workloads"].items() if info.get("scaling")]
    if not names:
        return []
    lines = [
        "## Time per leaf as leaves grow (issue 28)",
        "",
        "Leaves of 16 float32 (64 bytes) in blocks of 10, one device: the cost per array and nothing "
        "else; jaxckpt only (Orbax would take hours at a million). Median seconds, and microseconds per "
        "leaf; **+RSS / leaf**: the restore's extra peak memory per leaf. The naive floor reads every leaf "
        "into its own buffer and calls `jax.device_put` once per array.",
        "",
        "| workload | leaves | jaxckpt save | jaxckpt restore | naive floor | restore +RSS / leaf |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def cell(w: str, op: str) -> str:
        runs = results["runs"][w].get(op)
        per = _per_leaf(results, w, op)
        if per is None:
            return _status(runs) if runs is not None else ""
        return f"{_s(per * results['workloads'][w]['leaves'])} s ({per * 1e6:.1f} us)"

    for w in names:
        info = results["workloads"][w]
        extra = _extra_rss(results, w, "jaxckpt_restore")
        per_leaf = "" if extra is None else f"{extra * info['nbytes'] / info['leaves'] / 1024:.1f} KiB"
        lines.append(
            f"| `{w}` | {info['leaves']:,} | {cell(w, 'jaxckpt_save')} | {cell(w, 'jaxckpt_restore')} "
            f"| {cell(w, 'floor_read_put_each')} "
            f"| {per_leaf} |"
        )
    lines += ["", "| workload | target | wanted | measured | |", "|---|---|---:|---:|---|"]
    for w, what, (wa, opa), (wb, opb), cmp, bound in SCALING_TARGETS:
        a, b = _per_leaf(results, wa, opa), _per_leaf(results, wb, opb)
        wanted = f"{cmp} {bound:g}x"
        if a is None or b is None:
            missing = ", ".join(f"`{x}` `{op}`" for x, op, v in ((wa, opa, a), (wb, opb, b)) if v is None)
            lines.append(f"| `{w}` | {what} | {wanted} | | n/a ({missing} not measured) |")
            continue
        met = a / b <= bound if cmp == "<=" else a / b < bound
        lines.append(f"| `{w}` | {what} | {wanted} | {a / b:.2f}x | {'met' if met else '**missed**'} |")
    return [*lines, ""]


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    v = results["versions"]
    parts = [f"# jaxckpt benchmarks: {results['machine_name']}", ""]
    if results.get("note"):
        parts += [f"**{results['note']}**", ""]
    parts += [
        f"- Run: {results['started']} to {results['finished']}, git {results['git']}, "
        f"{results['reps']} repetition(s){' (quick sizes)' if results['quick'] else ''}; "
        f"load average (1, 5, 15 min) before {' '.join(m['loadavg_before'])}, after {' '.join(m['loadavg_after'])}.",
        f"- Command: `{results['command']}`; jaxckpt measured: {results.get('jaxckpt_source', '?')}.",
        f"- Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']:.1f} GiB memory, kernel {m['kernel']}, "
        f"disk {m['disk']}.",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "## Summary (median seconds)",
        "",
        summary_table(results),
        "",
        "## Targets (issues 28 and 14)",
        "",
        "Ratios of the medians below: issue 28's goals for `large` and `many`, issue 14's for `sharded` "
        "and `train_state` (kept). Speed targets as the issues word them: for `large` and `sharded`, "
        "floor time / jaxckpt time (1 is the floor; cold restores against the cold floor, hot ones against "
        "the read + `device_put` floor); for `many`, Orbax time / jaxckpt time, and jaxckpt's restore and "
        "async blocking against its floor and its own synchronous save; for `train_state`, jaxckpt time / "
        "floor time. Memory: the **+RSS / size** column, for every workload. n/a: an input is missing "
        "(not run, failed, or not measurable here)."
        + (
            " At --quick sizes fixed costs dominate: these verdicts only mean something on a full run."
            if results["quick"]
            else ""
        ),
        "",
        targets_table(results),
        "",
        "## Per workload",
        "",
        "Each figure is the median over the repetitions, each repetition a fresh subprocess with memory "
        "pre-touched (3x the size + 512 MiB); a hot read (restore, floor read) first reads every file it "
        "will read once, untimed, so that the page cache holds all of it. "
        "Rows marked cold ran after `sync` and `echo 3 > /proc/sys/vm/drop_caches` (as root; n/a where "
        "that is not allowed), following the pre-touch. "
        "**x floor**: time / floor time (save and async total against the durable write, restore against "
        "reading into 64-byte-aligned buffers plus one batched `jax.device_put` onto the restore's "
        "shardings, cold against cold; async blocking against `np.copy`; 1.00x is the floor). **x Orbax**: jaxckpt time / "
        "Orbax time (below 1 is faster). **peak RSS / size**: VmHWM during the operation (reset by "
        "`clear_refs` just before it) / checkpoint size; **+RSS / size**: the same less the RSS at the start "
        "(for a save the tree is already resident; for a restore nothing is). **CPU s**: user + system CPU "
        "of the process (all threads) during the operation. **files** and **disk / size**: files in the "
        "checkpoint and their bytes / logical size.",
        "",
    ]
    for w in _main(results):
        parts += [workload_table(results, w), ""]
    parts += scaling_section(results)
    errors = [
        f"- `{w}` `{op}`: {r.get('error', '').strip().splitlines()[-1] if r.get('error') else '?'}"
        for w, ops in results["runs"].items()
        for op, runs in ops.items()
        for r in runs
        if r.get("status") == "error"
    ]
    if errors:
        parts += ["## Errors", "", *sorted(set(errors)), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        text = render(json.load(f))
    if "--write" in sys.argv[2:]:  # rewrite the .md beside the JSON, and the README's table for a full run
        import run

        with open(sys.argv[1].removesuffix(".json") + ".md", "w") as f:
            f.write(text)
        if os.path.dirname(os.path.abspath(sys.argv[1])) == run.HERE:
            run.update_readme(text, os.path.basename(sys.argv[1])[len("results-") : -len(".json")])
    print(text)
