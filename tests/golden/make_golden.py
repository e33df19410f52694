"""Writes tests/golden/v<FORMAT_VERSION>: a small checkpoint that every later jaxckpt must still read.

Run once per format version (`.venv/bin/python tests/golden/make_golden.py`) and commit the folder;
never regenerate an existing version. `make_golden.py pod` writes tests/golden/pod-v<FORMAT_VERSION>
(pod-v3, pod-v4, pod-v5): what a save by 4 processes of 2 devices each writes (sharding layouts over a
device table, and one array with its regions listed), made without processes from jaxckpt's own
records.
"""

import sys
import typing
from pathlib import Path

import ml_dtypes
import numpy as np


class Pair(typing.NamedTuple):
    first: typing.Any
    second: typing.Any


def golden_tree():
    """The content of every golden checkpoint: a bit of each kind of leaf and node."""
    rng = np.random.default_rng(2026)
    return {
        "net": {
            "l1": {"kernel": rng.standard_normal((1, 5)).astype(np.float32), "bias": np.arange(5, dtype=np.float32)}
        },
        "big": rng.standard_normal((600, 600)).astype(np.float32),  # its own zarr3 array (over the pack limit)
        "bf16": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
        "f8": np.arange(4).astype(ml_dtypes.float8_e4m3fn),
        "ints": (np.int64(-3), np.uint8(200), np.zeros((0, 2), np.int32)),
        "pair": Pair([1, 2.5], {"s": "text/with~slash", 0: None, "0": True}),
        "step": 42,
    }


# name -> (shape, dtype, spec over mesh ("x": 2, "y": 4); None: regions listed instead)
POD_ARRAYS = {
    "xy": ((4, 8), np.float32, (("x",), ("y",))),
    "yx_rows": ((8, 3), np.int32, (("y", "x"), ())),
    "cols": ((2, 8), np.float32, ((), ("x",))),
    "listed": ((6, 2), np.int16, None),
}
# Device ids at the mesh positions (C order), and the process of each id: id // 2.
POD_DEVICES = (3, 1, 0, 2, 7, 5, 4, 6)


def pod_tree():
    """The content of tests/golden/pod-v3."""
    rng = np.random.default_rng(2027)
    return {name: (rng.standard_normal(shape) * 100).astype(dtype) for name, (shape, dtype, _) in POD_ARRAYS.items()}


def write_pod_golden(out):
    import jaxckpt
    from jaxckpt.arrays import store_write
    from jaxckpt.format import index_encode
    from jaxckpt.format import records as _format
    from jaxckpt.format.records import ArrayLeaf, InArray, Index, Layout, MeshRecord
    from jaxckpt.storage import locations
    from jaxckpt.tree.objects import flatten

    mesh = MeshRecord(("x", "y"), (2, 4), POD_DEVICES, tuple(d // 2 for d in POD_DEVICES))
    values = pod_tree()
    flat = flatten({name: 0 for name in values})
    leaves = {}
    for i, (name, (shape, dtype, spec)) in enumerate(POD_ARRAYS.items()):
        if spec is None:  # rows 0-2 by process 2, rows 3-5 by process 1
            at = InArray(
                f"a/{i}",
                _format.dtype_name(np.dtype(dtype)),
                {"data.p1": [[(3, 6), (0, 2)]], "data.p2": [[(0, 3), (0, 2)]]},
                (3, 2),
            )
        else:
            layout = Layout(mesh, spec)
            chunks = tuple(_format.shard_shape(layout, shape))
            at = InArray(f"a/{i}", _format.dtype_name(np.dtype(dtype)), None, chunks, layout)
        leaves[name] = ArrayLeaf(np.dtype(dtype), shape, "numpy", at)
    index = Index(flat.nodes, leaves, [], {"writer": "tests/golden/make_golden.py pod"}, meshes=[mesh])
    location = locations.location(out)
    for process in range(4):
        writer = store_write.Writer((location / _format.data_store(process)).spec())
        for name, leaf in leaves.items():
            full = [(0, n) for n in leaf.shape]
            boxes = [
                box for store, box in _format.pieces(leaf.at, leaf.shape, full) if store == _format.data_store(process)
            ]
            parts = [
                (tuple(slice(a, b) for a, b in box), values[name][tuple(slice(a, b) for a, b in box)]) for box in boxes
            ]
            writer.add_array(leaf.at.path, leaf.shape, leaf.dtype, leaf.at.chunks, parts)
        writer.flush()
        if jaxckpt.FORMAT_VERSION >= 5:
            writer.finish("5a7e")
    if jaxckpt.FORMAT_VERSION >= 5:
        index.save = "5a7e"
    (out / _format.INDEX_FILE).write_bytes(index_encode.encode_index(index))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jaxckpt

    if sys.argv[1:] == ["graph"]:  # an object graph: a shared Checkpoint and a cycle (aliases)
        out = Path(__file__).parent / "graph-v3"
        if out.exists():
            sys.exit(f"{out} exists; golden checkpoints are never regenerated.")
        shared = jaxckpt.Checkpoint(v=np.arange(3, dtype=np.float32))
        a, b = jaxckpt.Checkpoint(left=shared, step=5), jaxckpt.Checkpoint(right=shared)
        a.b, b.a = b, a
        a.write(out)
        sys.exit(print("wrote", out))
    if sys.argv[1:] == ["pod"]:
        out = Path(__file__).parent / f"pod-v{jaxckpt.FORMAT_VERSION}"
        if out.exists():
            sys.exit(f"{out} exists; golden checkpoints are never regenerated.")
        out.mkdir()
        write_pod_golden(out)
        sys.exit(print("wrote", out))
    out = Path(__file__).parent / f"v{jaxckpt.FORMAT_VERSION}"
    if out.exists():
        sys.exit(f"{out} exists; golden checkpoints are never regenerated.")
    jaxckpt.save(out, golden_tree())
    print("wrote", out)
