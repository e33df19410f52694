"""The four workloads: what their leaves are, how their bytes are made, and how they become trees.

A workload is described by a *spec* (JSON: every leaf's key, shape, dtype, offset in the data file
and, for ``sharded``, its PartitionSpec) and a *data file* holding every leaf's bytes end to end.
Both are written once per workload (``prepare``) and reused by every measured subprocess, which reads
its leaves back with ``np.fromfile`` before timing starts. Content is random normal float32 (random
integers for int leaves): never zeros, so no format can win by compressing or skipping them.

Floor subprocesses need only numpy and the spec; library subprocesses rebuild the real tree
(nested dicts, or for ``train_state`` the Flax params and optax adamw state) from it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

# Bump when the generated data or the specs change, so cached data files are rebuilt.
GENERATOR_VERSION = 3
WORKLOADS = ("large", "many", "sharded", "train_state")
# Chosen by name only (--workloads huge), not part of a full run: 100,000 leaves (issue 14), and
# 10,000 / 300,000 / 1,000,000 leaves of 16 float32 each (issue 28: time per leaf as leaves grow).
TINY = {"tiny10k": 10_000, "tiny300k": 300_000, "tiny1m": 1_000_000}
EXTRA_WORKLOADS = ("huge", *TINY)
# A full run also measures time per leaf as leaves grow (issue 28's scaling goals), with jaxckpt only
# and only the operations those goals compare: a million-leaf save and restore against 10,000 leaves',
# and a 300,000-leaf restore against the naive floor (floor_write makes the file that floor reads).
SCALING = {
    "tiny10k": ("jaxckpt_save", "jaxckpt_restore"),
    "tiny300k": ("floor_write", "floor_read_put_each", "jaxckpt_save", "jaxckpt_restore"),
    "tiny1m": ("jaxckpt_save", "jaxckpt_restore"),
}

SAVE_MESH = (4, 2)
RESTORE_MESH = (2, 4)
MESH_AXES = ("x", "y")
# Mixed PartitionSpecs for the sharded workload, cycled over its arrays (None: not sharded on that dim).
SHARDED_SPECS: list[list[Any]] = [
    ["x", "y"],
    ["y", "x"],
    ["x", None],
    [None, "y"],
    [["x", "y"], None],
    [None, ["x", "y"]],
    ["y", None],
    [None, None],  # replicated
]


def _leaf(key: str, shape: tuple[int, ...], dtype: str = "float32", spec: list[Any] | None = None) -> dict[str, Any]:
    return {"key": key, "shape": list(shape), "dtype": dtype, "spec": spec}


def _large(quick: bool) -> list[dict[str, Any]]:
    shape = (512, 1024) if quick else (4096, 4096)  # 16 x 2 MiB, or 16 x 64 MiB = 1 GiB
    return [_leaf(f"layer_{i:02d}/kernel", shape) for i in range(16)]


def _huge(quick: bool) -> list[dict[str, Any]]:
    """100,000 leaves: ``many`` ten times over (a very deep model, or per-layer optimizer states)."""
    return _many(quick, blocks=1000 if quick else 10_000)


def _many(quick: bool, blocks: int | None = None) -> list[dict[str, Any]]:
    """10,000 leaves in 1,000 transformer-like blocks of 10; widths vary from block to block."""
    blocks = blocks or (100 if quick else 1000)
    widths = (32, 40, 48, 56, 64, 72)
    leaves = []
    for b in range(blocks):
        d = widths[(b * 7) % len(widths)]
        heads = 4
        hd = d // heads
        p = f"block_{b:04d}"
        leaves += [
            _leaf(f"{p}/attn/query", (d, heads, hd)),
            _leaf(f"{p}/attn/key", (d, heads, hd)),
            _leaf(f"{p}/attn/value", (d, heads, hd)),
            _leaf(f"{p}/attn/out", (heads, hd, d)),
            _leaf(f"{p}/mlp/up/kernel", (d, 2 * d)),
            _leaf(f"{p}/mlp/up/bias", (2 * d,)),
            _leaf(f"{p}/mlp/down/kernel", (2 * d, d)),
            _leaf(f"{p}/mlp/down/bias", (d,)),
            _leaf(f"{p}/norm/scale", (d,)),
            _leaf(f"{p}/norm/bias", (d,)),
        ]
    return leaves


def _tiny(count: int) -> list[dict[str, Any]]:
    """``count`` leaves of 16 float32 (64 bytes) in blocks of 10: per-array cost, nothing else."""
    return [_leaf(f"b{i // 10:06d}/w{i % 10}", (16,)) for i in range(count)]


def _sharded(quick: bool) -> list[dict[str, Any]]:
    shape = (512, 1024) if quick else (4096, 4096)  # 8 x 2 MiB, or 8 x 64 MiB = 512 MiB
    return [_leaf(f"w{i}", shape, spec=SHARDED_SPECS[i % len(SHARDED_SPECS)]) for i in range(8)]


def train_state_config(quick: bool) -> dict[str, int]:
    if quick:
        return {"vocab": 2048, "d": 128, "layers": 2, "heads": 4, "mlp": 512}
    return {"vocab": 32000, "d": 512, "layers": 11, "heads": 8, "mlp": 2048}  # 51M params


def train_state_abstract(quick: bool) -> Any:
    """{"step", "params", "opt_state"} of a Flax linen decoder stack and optax adamw, as ShapeDtypeStructs."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    cfg = train_state_config(quick)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=cfg["heads"])(h, h)
            h = nn.LayerNorm()(x)
            h = nn.Dense(cfg["d"])(nn.gelu(nn.Dense(cfg["mlp"])(h)))
            return x + h

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            embed = nn.Embed(cfg["vocab"], cfg["d"])
            x = embed(tokens)
            for _ in range(cfg["layers"]):
                x = Block()(x)
            return embed.attend(nn.LayerNorm()(x))

    variables = jax.eval_shape(LM().init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    params = variables["params"]
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": opt_state}


def _train_state(quick: bool) -> list[dict[str, Any]]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(train_state_abstract(quick))
    return [_leaf(jax.tree_util.keystr(path), tuple(x.shape), np.dtype(x.dtype).name) for path, x in flat]


def make_spec(name: str, quick: bool) -> dict[str, Any]:
    makers = {"large": _large, "many": _many, "huge": _huge, "sharded": _sharded, "train_state": _train_state}
    leaves = _tiny(TINY[name] // (100 if quick else 1)) if name in TINY else makers[name](quick)
    offset = 0
    for leaf in leaves:
        leaf["nbytes"] = int(np.prod(leaf["shape"], dtype=np.int64)) * np.dtype(leaf["dtype"]).itemsize
        leaf["offset"] = offset
        offset += leaf["nbytes"]
    return {
        "workload": name,
        "quick": quick,
        "generator": GENERATOR_VERSION,
        "nbytes": offset,
        "devices": 8 if name == "sharded" else 1,
        "leaves": leaves,
    }


def leaf_values(spec: dict[str, Any], i: int) -> np.ndarray:
    """The content of leaf ``i``, generated from its own seed (so any leaf can be regenerated alone)."""
    leaf = spec["leaves"][i]
    rng = np.random.default_rng([GENERATOR_VERSION, sum(map(ord, spec["workload"])), i])
    dtype = np.dtype(leaf["dtype"])
    if dtype.kind == "f":
        return rng.standard_normal(leaf["shape"], dtype=np.float32).astype(dtype, copy=False)
    return rng.integers(1, 1000, leaf["shape"], dtype=dtype)


def write_data(spec: dict[str, Any], path: str) -> None:
    tmp = path + ".tmp"
    if spec["workload"] in TINY:  # one generator for all: a million seeded ones take minutes
        rng = np.random.default_rng([GENERATOR_VERSION, len(spec["leaves"])])
        rng.standard_normal(len(spec["leaves"]) * 16, dtype=np.float32).tofile(tmp)
        os.replace(tmp, path)
        return
    with open(tmp, "wb") as f:
        for i in range(len(spec["leaves"])):
            leaf_values(spec, i).tofile(f)
    os.replace(tmp, path)


def load_spec(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, "spec.json")) as f:
        return json.load(f)


def read_leaves(spec: dict[str, Any], data_path: str) -> list[np.ndarray]:
    """Every leaf as its own numpy array (its own allocation), read from the data file."""
    if spec["workload"] in TINY:  # a million reads would take longer than the measured operation
        flat = np.fromfile(data_path, dtype=np.float32).reshape(len(spec["leaves"]), 16)
        return [row.copy() for row in flat]
    out = []
    with open(data_path, "rb") as f:
        for leaf in spec["leaves"]:
            count = leaf["nbytes"] // np.dtype(leaf["dtype"]).itemsize
            out.append(np.fromfile(f, dtype=leaf["dtype"], count=count).reshape(leaf["shape"]))
    return out


def read_leaf(spec: dict[str, Any], data_path: str, i: int) -> np.ndarray:
    leaf = spec["leaves"][i]
    count = leaf["nbytes"] // np.dtype(leaf["dtype"]).itemsize
    return np.fromfile(data_path, dtype=leaf["dtype"], count=count, offset=leaf["offset"]).reshape(leaf["shape"])


def build_tree(spec: dict[str, Any], leaves: list[Any]) -> Any:
    """The workload's tree with ``leaves`` (in spec order) at its leaves."""
    if spec["workload"] == "train_state":
        import jax

        treedef = jax.tree_util.tree_structure(train_state_abstract(spec["quick"]))
        return jax.tree_util.tree_unflatten(treedef, leaves)
    tree: dict[str, Any] = {}
    for leaf, value in zip(spec["leaves"], leaves, strict=True):
        *parents, last = leaf["key"].split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def shardings(spec: dict[str, Any], mesh_shape: tuple[int, int]) -> list[Any]:
    """One sharding per leaf: NamedShardings on a mesh of ``mesh_shape`` for ``sharded``, else device 0."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    if spec["devices"] == 1:
        one = SingleDeviceSharding(jax.devices()[0])
        return [one] * len(spec["leaves"])
    mesh = Mesh(np.array(jax.devices()[: mesh_shape[0] * mesh_shape[1]]).reshape(mesh_shape), MESH_AXES)

    def axis(a: Any) -> Any:
        return tuple(a) if isinstance(a, list) else a

    return [NamedSharding(mesh, PartitionSpec(*(axis(a) for a in leaf["spec"]))) for leaf in spec["leaves"]]
