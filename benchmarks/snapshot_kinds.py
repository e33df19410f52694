"""How long an async save's caller waits, by the kind of tree a training loop saves (issue 28).

    python benchmarks/snapshot_kinds.py                          # this checkout
    python benchmarks/snapshot_kinds.py --revs 9335e2f~3 HEAD    # revisions interleaved, each its own process

The ``many`` workload's 10,000 leaves (1,000 transformer-like blocks of 10 arrays, 93 MB in float32)
as a dict of float32 arrays, the same in bfloat16 (arrays that export no Python buffer), inside a
flax ``TrainState`` (a flax.struct dataclass, with SGD's empty state), and as a ``FrozenDict`` of
FrozenDicts; and ``nnx``: the docs' ``jaxckpt.Checkpoint(model=..., optimizer=...)`` of a Flax NNX
model of 300 ``nnx.Linear(64, 64)`` and its ``nnx.Optimizer`` (adam), 1,803 leaves, 15 MB. Each kind is saved with ``blocking=False`` ``--saves`` times in one process, after one
untimed save (a training loop's steady state), each save waited for and deleted before the next;
reported: the median time the caller waited and the median total, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("float32", "bfloat16", "TrainState", "FrozenDict", "nnx")


def _tree(dtype: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    tree = {}
    for b in range(1000):
        d = (32, 40, 48, 56, 64, 72)[b % 6]
        shapes = [(d, 4, d // 4), (4, d // 4, d)] * 2 + [(d, 2 * d), (2 * d,), (2 * d, d), (d,), (d,), (d,)]
        tree[f"b{b}"] = {
            f"w{i}": jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype) for i, s in enumerate(shapes)
        }
    return jax.block_until_ready(tree)


def measure(kind: str, saves: int) -> dict[str, float]:
    """In this process: ``saves`` async saves of ``kind`` after one untimed one."""
    import optax
    from flax.core import freeze
    from flax.training import train_state

    import jaxckpt

    if kind == "nnx":
        from flax import nnx

        model = nnx.List([nnx.Linear(64, 64, rngs=nnx.Rngs(0)) for _ in range(300)])
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        tree = jaxckpt.Checkpoint(model=model, optimizer=optimizer)
    else:
        tree = _tree("bfloat16" if kind == "bfloat16" else "float32")
    if kind == "TrainState":
        tree = train_state.TrainState.create(apply_fn=None, params=tree, tx=optax.sgd(0.1))
    elif kind == "FrozenDict":
        tree = freeze(tree)
    blocks, totals = [], []
    with tempfile.TemporaryDirectory(dir=os.path.join(HERE, ".work")) as work:
        for i in range(saves + 1):
            path = os.path.join(work, str(i))
            t0 = time.perf_counter()
            jaxckpt.save(path, tree, blocking=False)
            t1 = time.perf_counter()
            jaxckpt.wait_until_finished()
            t2 = time.perf_counter()
            shutil.rmtree(path)
            if i:
                blocks.append(t1 - t0)
                totals.append(t2 - t0)
    return {"blocks_ms": 1e3 * statistics.median(blocks), "total_ms": 1e3 * statistics.median(totals)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revs", nargs="*", default=[], help="git revisions to compare (default: this checkout)")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--reps", type=int, default=1, help="processes per kind and revision, interleaved")
    p.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    p.add_argument("--child", nargs=2, metavar=("KIND", "SAVES"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import jaxckpt

        print(json.dumps({**measure(args.child[0], int(args.child[1])), "jaxckpt": jaxckpt.__file__}))
        return
    sys.path.insert(0, HERE)
    import run

    os.makedirs(os.path.join(HERE, ".work"), exist_ok=True)
    sources = {rev: run.export_revision(rev, os.path.join(HERE, ".work")) for rev in args.revs} or {"checkout": None}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rep in range(args.reps):
        for kind in args.kinds:
            for name, src in sources.items() if rep % 2 == 0 else reversed(list(sources.items())):
                env = run.child_env(1)
                if src is not None:
                    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--child", kind, str(args.saves)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=src or os.path.dirname(HERE),
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                assert src is None or result["jaxckpt"].startswith(src), result["jaxckpt"]  # the revision asked for
                results.setdefault((kind, name), []).append(result)
    print(
        f"async save (10,000 leaves; nnx: 1,803): median of {args.saves} saves a process, {args.reps} process(es); load {os.getloadavg()[0]:.2f}"
    )
    print("| tree | " + " | ".join(f"{name}: blocks / total ms" for name in sources) + " |")
    print("|---|" + "---:|" * len(sources))
    for kind in args.kinds:
        cells = []
        for name in sources:
            rows = results[(kind, name)]
            cells.append(
                f"{statistics.median(r['blocks_ms'] for r in rows):.1f} / {statistics.median(r['total_ms'] for r in rows):.0f}"
            )
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
