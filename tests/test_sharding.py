"""Sharded jax.Arrays: chunks follow the shards; restore onto any mesh, device count, or the host."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.arrays import zarr_meta


def mesh(shape, names=("x", "y"), devices=None):
    devices = jax.devices()[: int(np.prod(shape))] if devices is None else devices
    return jax.sharding.Mesh(np.array(devices).reshape(shape), names)


def sharded(x, m, spec):
    return jax.device_put(x, NamedSharding(m, spec))


@pytest.fixture
def state():
    m = mesh((4, 2))
    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
    return {
        "xy": sharded(x, m, P("x", "y")),
        "x_only": sharded(x + 1, m, P("x", None)),
        "y_only": sharded(x + 2, m, P(None, "y")),
        "replicated": sharded(x + 3, m, P()),
        "single": jax.device_put(x + 4, jax.devices()[5]),
        "bf16": sharded(x.astype(jnp.bfloat16), m, P("y", "x")),
    }


def test_chunks_follow_the_shards(tmp_path, state, small_packs):
    """Format version 4: each array's zarr3 outer chunk is its shard (one file per shard, as the index's
    ``chunks`` records); the inner chunks of the sharding codec follow from it (inner_chunk_shape)."""
    path = Path(jaxckpt.save(tmp_path / "c", state))
    index = json.loads((path / "index.json").read_text())
    shards, inner = {}, {}
    for key, leaf in index["leaves"].items():
        folder = path / "data" / leaf["at"]["array"]
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{folder}/"}}
        store = ts.open(spec).result()
        shards[key] = store.chunk_layout.write_chunk.shape
        inner[key] = store.chunk_layout.read_chunk.shape
        assert list(shards[key]) == leaf["at"]["chunks"], key
        itemsize = zarr_meta.numpy_dtype(leaf["at"]["stored"]).itemsize
        assert inner[key] == zarr_meta.inner_chunk_shape(shards[key], itemsize), key
        files = sorted(str(p.relative_to(folder)) for p in (folder / "c").rglob("*") if p.is_file())
        grid = [64 // shards[key][0], 32 // shards[key][1]]
        assert files == [f"c/{i}/{j}" for i in range(grid[0]) for j in range(grid[1])], (key, files)
        np.testing.assert_array_equal(store.read().result().astype(np.float32), np.asarray(state[key], np.float32))
    assert shards["xy"] == (16, 16) and shards["x_only"] == (16, 32) and shards["y_only"] == (64, 16)
    assert shards["replicated"] == (64, 32) and shards["single"] == (64, 32) and shards["bf16"] == (32, 8)
    assert inner == shards  # shards of at most 8 KiB: one inner chunk each
    assert index["leaves"]["xy"]["sharding"] == "NamedSharding(mesh={'x': 4, 'y': 2}, spec=('x', 'y'))"


@pytest.mark.parametrize("layout", ["packed", "own-array"])
def test_restore_keeps_the_templates_shardings(tmp_path, state, layout, request):
    if layout == "own-array":
        request.getfixturevalue("small_packs")
    path = jaxckpt.save(tmp_path / "c", state)
    template = jax.tree.map(jnp.zeros_like, state)
    restored = jaxckpt.restore(path, like=template)
    for k, v in state.items():
        assert restored[k].sharding == template[k].sharding, k
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v))


@pytest.mark.parametrize(
    "target",
    [
        lambda: NamedSharding(mesh((2, 4)), P("x", "y")),
        lambda: NamedSharding(mesh((2, 4)), P("y", None)),
        lambda: NamedSharding(mesh((4,), ("d",)), P(None, "d")),
        lambda: NamedSharding(mesh((2, 2), devices=jax.devices()[4:]), P("y", "x")),
        lambda: SingleDeviceSharding(jax.devices()[7]),
    ],
    ids=["(2,4)", "(2,4)-rows", "4-devices", "other-4-devices", "1-device"],
)
def test_restore_onto_another_mesh_from_abstract_templates(tmp_path, state, small_packs, target):
    path = jaxckpt.save(tmp_path / "c", state)
    sharding = target()
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()}
    restored = jaxckpt.restore(path, like=like)
    for k, v in state.items():
        assert isinstance(restored[k], jax.Array) and restored[k].sharding == sharding, k
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v))


def test_restore_to_host_and_inspect(tmp_path, state):
    path = jaxckpt.save(tmp_path / "c", state)
    host = jaxckpt.restore(path)
    assert all(type(v) is np.ndarray for v in host.values())
    assert dict(jaxckpt.list_variables(path))["xy"] == (64, 32)
    np.testing.assert_array_equal(jaxckpt.load_variable(path, "y_only"), np.asarray(state["y_only"]))


def test_sharded_prng_keys(tmp_path):
    m = mesh((8,), ("d",))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 16), NamedSharding(m, P("d")))
    path = jaxckpt.save(tmp_path / "c", {"k": keys})
    restored = jaxckpt.restore(path, like={"k": keys})["k"]
    assert restored.sharding == keys.sharding
    np.testing.assert_array_equal(jax.random.key_data(restored), jax.random.key_data(keys))
