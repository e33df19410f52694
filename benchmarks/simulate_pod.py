"""What a pod-scale multi-process checkpoint costs each process, without a pod.

    python benchmarks/simulate_pod.py --simulate-processes 1024 --arrays 2000
    python benchmarks/simulate_pod.py                   # N = 2 ... 4,096; table, JSON and PNG plot

No jax.distributed: the harness fakes the device-to-process map of N processes (``--devices-per-process``
devices each, one mesh axis ``x`` over all of them) and writes what a save by those N processes would
write, for one process's share of real data: the index that process 0 writes (the records and layouts
that ``_save.prepare`` makes for such arrays, encoded by jaxckpt's ``encode_index``; ``prepare`` itself
needs the real devices) and the data store of the measured process
(``--me``, default the last), holding its regions of every array. Each array is sharded by rows,
one region per process, as in issue 18. Then it measures:

- index size (bytes of ``index.json``), and the size the same save has in format version 2, which
  listed every region of every process;
- parse time: ``jaxckpt.list_variables`` of the checkpoint (best of ``--reps``);
- stores opened: the data stores that the measured process opens (or measures) to restore its own
  regions, as a restore onto the same mesh reads them (``Opened.read_regions``); the other processes'
  stores are never written, so opening one would fail.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxckpt
from jaxckpt.arrays import store_write
from jaxckpt.format import index_encode
from jaxckpt.format import records as _format
from jaxckpt.format.records import ArrayLeaf, InArray, Index, Layout, MeshRecord
from jaxckpt.reading import reader
from jaxckpt.storage import locations
from jaxckpt.tree.objects import flatten

HERE = Path(__file__).resolve().parent
DEFAULT_COUNTS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
ROWS, COLS = 2, 16  # each process's region of each array: 2 x 16 float32


def mesh_of(processes: int, devices_per_process: int = 1) -> MeshRecord:
    """One mesh axis ``x`` over every device; process p holds devices p*d ... p*d + d - 1."""
    count = processes * devices_per_process
    return MeshRecord(("x",), (count,), tuple(range(count)), tuple(d // devices_per_process for d in range(count)))


def value(i: int, shape: tuple[int, ...]) -> np.ndarray:
    """Array ``i`` of the simulated state: every process can make any region of it."""
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1000 * i).astype(np.float32)


def build(
    folder: Path,
    processes: int,
    arrays: int,
    me: int,
    *,
    devices_per_process: int = 1,
    explicit: bool = False,
    writers: list[int] | None = None,
) -> Index:
    """Write the checkpoint that N processes would save, with the data of processes ``writers``
    (default: only ``me``). ``explicit`` lists every region, as format version 2 did."""
    mesh = mesh_of(processes, devices_per_process)
    shape = (ROWS * processes * devices_per_process, COLS)
    layout = Layout(mesh, (("x",), ()))
    flat = flatten({f"layer{i:05d}": {"w": 0} for i in range(arrays)})
    chunks = tuple(store_write.chunk_shape(shape, [ROWS, COLS], 4))
    leaves = {}
    for i, key in enumerate(flat.leaves):
        at = InArray(f"a/{i}", "float32", None, chunks, layout)
        if explicit:
            at = InArray(at.path, at.stored, _format.regions(at, shape), chunks)
        leaves[key] = ArrayLeaf(
            np.dtype(np.float32),
            shape,
            "jax",
            at,
            None,
            f"NamedSharding(mesh={{'x': {shape[0] // ROWS}}}, spec=('x',))",
        )
    meta = {"writer": "benchmarks/simulate_pod.py"}
    index = Index(flat.nodes, leaves, [], meta, meshes=[] if explicit else [mesh], save="51a1")
    folder.mkdir(parents=True, exist_ok=True)
    location = locations.location(folder)
    for process in [me] if writers is None else writers:
        writer = store_write.Writer((location / _format.data_store(process)).spec())
        for i, leaf in enumerate(leaves.values()):
            data = value(i, shape)
            parts = [
                (
                    tuple(slice(lo, hi) for lo, hi in box),
                    np.ascontiguousarray(data[tuple(slice(lo, hi) for lo, hi in box)]),
                )
                for store, box in _format.pieces(leaf.at, shape, [(0, n) for n in shape])
                if store == _format.data_store(process)
            ]
            writer.add_array(leaf.at.path, shape, leaf.dtype, chunks, parts)
        writer.flush()
        writer.finish("51a1")  # the data store's checksums, for the save the index names
    (folder / _format.INDEX_FILE).write_bytes(index_encode.encode_index(index))
    return index


def own_regions(index: Index, me: int, devices_per_process: int = 1) -> dict[str, list[tuple[slice, ...]]]:
    """The regions that process ``me`` holds in a restore onto the same mesh: its devices' rows."""
    out = {}
    for key, leaf in index.leaves.items():
        cols = leaf.shape[1]
        first = me * devices_per_process * ROWS
        out[key] = [
            (slice(first + d * ROWS, first + (d + 1) * ROWS), slice(0, cols)) for d in range(devices_per_process)
        ]
    return out


def restore_own(folder: Path, index: Index, me: int, devices_per_process: int = 1) -> list[str]:
    """Restore process ``me``'s regions, check them, and return the data stores it opened."""
    opened = reader.Opened(locations.location(folder))
    wanted = own_regions(index, me, devices_per_process)
    got = opened.read_regions(wanted)
    shape = next(iter(index.leaves.values())).shape
    for i, (key, regions) in enumerate(wanted.items()):
        expected = value(i, shape)
        for region, data in zip(regions, got[key]):
            np.testing.assert_array_equal(data, expected[region], err_msg=key)
    return opened.stores_opened


def measure(
    processes: int,
    arrays: int,
    *,
    me: int | None = None,
    devices_per_process: int = 1,
    reps: int = 3,
    legacy_limit: int = 256,
) -> dict:
    me = processes - 1 if me is None else me
    with tempfile.TemporaryDirectory(prefix="jaxckpt-pod-") as tmp:
        folder = Path(tmp) / "ckpt"
        index = build(folder, processes, arrays, me, devices_per_process=devices_per_process)
        size = (folder / _format.INDEX_FILE).stat().st_size
        parse = []
        for _ in range(reps):
            start = time.perf_counter()
            listed = jaxckpt.list_variables(folder)
            parse.append(time.perf_counter() - start)
        assert len(listed) == arrays
        stores = restore_own(folder, index, me, devices_per_process)
        row = {
            "processes": processes,
            "arrays": arrays,
            "devices_per_process": devices_per_process,
            "index_bytes": size,
            "parse_s": min(parse),
            "stores_opened": len(stores),
            "process": me,
        }
        if processes <= legacy_limit:  # format 2 listed every region: its index, for comparison
            shutil.rmtree(folder)
            build(folder, processes, arrays, me, devices_per_process=devices_per_process, explicit=True, writers=[])
            row["v2_index_bytes"] = (folder / _format.INDEX_FILE).stat().st_size
            start = time.perf_counter()
            jaxckpt.list_variables(folder)
            row["v2_parse_s"] = time.perf_counter() - start
        return row


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["processes"] for r in rows]
    legacy = [r for r in rows if "v2_index_bytes" in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.plot(n, [r["index_bytes"] / 2**20 for r in rows], "o-", label="version 3")
    ax.plot(
        [r["processes"] for r in legacy],
        [r["v2_index_bytes"] / 2**20 for r in legacy],
        "s--",
        label="regions listed, as in version 2",
    )
    ax.axhline(2, color="grey", lw=0.8, ls=":", label="target 2 MiB")
    ax.set(title="index size", ylabel="MiB", yscale="log")
    ax = axes[1]
    ax.plot(n, [r["parse_s"] for r in rows], "o-", label="version 3")
    ax.plot(
        [r["processes"] for r in legacy],
        [r["v2_parse_s"] for r in legacy],
        "s--",
        label="regions listed, as in version 2",
    )
    ax.axhline(0.5, color="grey", lw=0.8, ls=":", label="target 0.5 s")
    ax.set(title="jaxckpt.list_variables", ylabel="seconds", yscale="log")
    ax = axes[2]
    ax.plot(n, [r["stores_opened"] for r in rows], "o-")
    ax.set(
        title="data stores opened per restoring process",
        ylabel="stores",
        ylim=(0, max(2, max(r["stores_opened"] for r in rows)) + 1),
    )
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("processes")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    arrays = rows[0]["arrays"]
    fig.suptitle(
        f"Simulated multi-process checkpoint: {arrays:,} arrays, each sharded by rows over every process (same-mesh restore)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(rows: list[dict]) -> str:
    lines = [
        "| processes | index (v3) | index (v2) | `list_variables` (v3) | `list_variables` (v2) | stores opened per process |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        v2 = f"{r['v2_index_bytes'] / 2**20:.2f} MiB" if "v2_index_bytes" in r else "-"
        v2t = f"{r['v2_parse_s']:.3f} s" if "v2_parse_s" in r else "-"
        lines.append(
            f"| {r['processes']:,} | {r['index_bytes'] / 2**20:.2f} MiB | {v2} | {r['parse_s']:.3f} s | {v2t} | {r['stores_opened']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulate-processes", type=int, nargs="*", default=None, help="N (default: 2 ... 4,096)")
    parser.add_argument("--arrays", type=int, default=2000)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--legacy-limit", type=int, default=256, help="measure the version 2 index up to this N")
    parser.add_argument("--out", type=Path, default=HERE / "pod-scale", help="writes <out>.json and <out>.png")
    args = parser.parse_args(argv)
    counts = args.simulate_processes or DEFAULT_COUNTS
    rows = []
    for n in counts:
        row = measure(
            n, args.arrays, devices_per_process=args.devices_per_process, reps=args.reps, legacy_limit=args.legacy_limit
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows))
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    if len(rows) > 1:
        plot(rows, args.out.with_suffix(".png"))
        print("wrote", args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
