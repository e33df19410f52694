"""Few objects on buckets (issue 26): on object stores small and mid-sized arrays share packs, so a
checkpoint has at most max(8, one per 64 MiB of data) objects (index.json, checksums.json, every
zarr.json and every shard or pack counted), and restores bit-exact, one value at a time too."""

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorstore as ts
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.arrays import store_write
from jaxckpt.storage import locations

MiB = 1 << 20


def _objects(path: str) -> list[str]:
    kv = ts.KvStore.open(locations.location(path).spec(), context=store_write._context()).result()
    return sorted(k.decode() for k in kv.list().result())


def _goal(nbytes: int) -> int:
    return max(8, nbytes // (64 * MiB))


@pytest.fixture(params=["memory", "s3"])
def bucket(request):
    if request.param == "memory":
        return f"memory://bucket-objects/{request.node.name}"
    return request.getfixturevalue("s3")


class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(784, 1024, rngs=rngs)
        self.l2 = nnx.Linear(1024, 1024, rngs=rngs)
        self.l3 = nnx.Linear(1024, 10, rngs=rngs)
        self.norm = nnx.BatchNorm(1024, rngs=rngs)


def _train_state(seed: int) -> jaxckpt.Checkpoint:
    net = _MLP(nnx.Rngs(seed))
    return jaxckpt.Checkpoint(step=seed, net=net, optimizer=nnx.Optimizer(net, optax.adam(1e-3), wrt=nnx.Param))


def _leaves(ckpt: jaxckpt.Checkpoint) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((nnx.state(ckpt.net), nnx.state(ckpt.optimizer)))]


def _same_bits(a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def test_an_nnx_train_state_is_a_few_objects(bucket):
    ckpt = _train_state(1)
    path = ckpt.save(f"{bucket}/ckpt")
    objects = _objects(path)
    nbytes = sum(x.nbytes for x in _leaves(ckpt))
    assert len(objects) <= _goal(nbytes), objects
    assert objects == ["data/p/0/c/0", "data/p/0/zarr.json", "index.json"]
    other = _train_state(2)
    other.restore(path)
    assert other.step == 1
    for a, b in zip(_leaves(other), _leaves(ckpt), strict=True):
        _same_bits(a, b)
    kernel = np.asarray(ckpt.net.l2.kernel[...])  # 4 MiB, packed: read alone
    _same_bits(jaxckpt.load_variable(path, "net/l2/kernel"), kernel)


def _mixed_tree(count: int) -> dict[str, np.ndarray]:
    """``count`` float32 arrays of 100 KB to 5 MB."""
    rng = np.random.default_rng(26)
    return {f"a{i}": rng.standard_normal(int(rng.integers(25_000, 1_250_000)), dtype=np.float32) for i in range(count)}


@pytest.mark.parametrize("count", [pytest.param(200, id="200 arrays"), pytest.param(40, id="40 arrays")])
def test_many_arrays_of_100kb_to_5mb_share_a_few_packs(bucket, count):
    if bucket.startswith("s3") and count == 200:
        pytest.skip("500 MB through moto: the memory:// run covers it")
    tree = _mixed_tree(count)
    path = jaxckpt.save(f"{bucket}/ckpt", tree)
    objects = _objects(path)
    nbytes = sum(x.nbytes for x in tree.values())
    assert len(objects) <= _goal(nbytes), objects
    assert not any(o.startswith("data/a/") for o in objects)  # no array of its own
    packs = {o.split("/")[2] for o in objects if o.startswith("data/p/")}
    if nbytes > 128 * MiB:
        assert len(packs) > 1  # several packs, written at once
    restored = jaxckpt.restore(path)
    for key, value in tree.items():
        _same_bits(restored[key], value)
    for key in ("a0", f"a{count // 2}", f"a{count - 1}"):
        _same_bits(jaxckpt.load_variable(path, key), tree[key])


def _mesh8() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))


def test_arrays_sharded_over_8_devices_of_one_process_are_packed(bucket):
    mesh = _mesh8()
    specs = [P("x", "y"), P("x", None), P(None, "y"), P()]
    tree = {}
    for i, rows in enumerate([64, 1024, 4096, 8192]):  # 32 KiB to 8 MiB of float32
        value = jnp.arange(rows * 128, dtype=jnp.float32).reshape(rows, 128) + i
        tree[f"w{i}"] = jax.device_put(value, NamedSharding(mesh, specs[i % len(specs)]))
    tree["bf16"] = jax.device_put(jnp.ones((512, 256), jnp.bfloat16), NamedSharding(mesh, P("y", "x")))
    path = jaxckpt.save(f"{bucket}/ckpt", tree)
    objects = _objects(path)
    assert objects == ["data/p/0/c/0", "data/p/0/zarr.json", "index.json"]
    template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    restored = jaxckpt.restore(path, template)
    for key, value in tree.items():
        assert restored[key].sharding == value.sharding
        _same_bits(restored[key], value)
    other = NamedSharding(mesh, P("y", "x"))  # onto another layout of the mesh
    moved = jaxckpt.restore(path, {"w3": jax.ShapeDtypeStruct((8192, 128), jnp.float32, sharding=other)}, partial=True)
    _same_bits(moved["w3"], tree["w3"])
    _same_bits(jaxckpt.load_variable(path, "w2"), tree["w2"])


def test_a_leaf_over_the_bucket_limit_is_an_array_of_its_own(monkeypatch):
    monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", 1 * MiB)
    tree = {"small": np.arange(1000, dtype=np.float32), "large": np.arange(1 << 19, dtype=np.float64)}
    path = jaxckpt.save("memory://bucket-objects/over-the-limit", tree)
    assert _objects(path) == [
        "data/a/0/c/0",
        "data/a/0/zarr.json",
        "data/checksums.json",
        "data/p/0/c/0",
        "data/p/0/zarr.json",
        "index.json",
    ]
    restored = jaxckpt.restore(path)
    for key, value in tree.items():
        _same_bits(restored[key], value)


def test_local_disks_keep_their_layout(tmp_path):
    """Files are cheap on a local disk: leaves over 1 MiB keep an array of their own there."""
    tree = {"small": np.arange(1000, dtype=np.float32), "large": np.arange(1 << 19, dtype=np.float32)}
    path = jaxckpt.save(tmp_path / "ckpt", tree)
    files = sorted(str(p.relative_to(path)) for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    assert "data/a/0/zarr.json" in files and "data/p/0/zarr.json" in files


def test_pack_buffers_are_made_as_they_are_written(monkeypatch, s3):
    """A pack's buffer on an object store exists only while it is written: a save of 8 packs holds
    about the bytes in flight, not a copy of every pack at once. (On s3://: a memory:// store keeps
    the buffers written as its values.)"""
    monkeypatch.setattr(store_write, "WRITE_AHEAD_BYTES", 16 * MiB)
    monkeypatch.setattr(store_write, "BUCKET_PACK_MIN_BYTES", 16 * MiB)
    monkeypatch.setattr(store_write, "PACK_TARGET_BYTES", 16 * MiB)
    # jax arrays on the CPU device: the snapshot takes views of their buffers, no copies.
    tree = {f"x{i}": jnp.full((4 * MiB,), i, jnp.float32) for i in range(8)}  # 8 x 16 MiB
    jax.block_until_ready(tree)
    tracemalloc.start()
    try:
        path = jaxckpt.save(f"{s3}/ckpt", tree)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len([o for o in _objects(path) if o.endswith("/c/0")]) == 8
    # In flight: 16 MiB and one pack more, one being made, and one whose upload lets go of it late.
    assert peak <= 64 * MiB, f"{peak / MiB:.0f} MiB held at once (of 128)"
    restored = jaxckpt.restore(path)
    for key, value in tree.items():
        _same_bits(restored[key], value)


def test_large_arrays_sharded_over_8_devices_are_written_in_a_few_shards(bucket, monkeypatch):
    """Over the pack limit, an array that one process holds on 8 devices is written in blocks of
    several device shards of about 64 MiB (scaled down here: 1 MiB), not one object per device."""
    monkeypatch.setattr(store_write, "BUCKET_PACK_LEAF_LIMIT", 256 << 10)
    monkeypatch.setattr(store_write, "BUCKET_PACK_MIN_BYTES", 1 * MiB)
    mesh = _mesh8()
    tree = {
        "xy": jax.device_put(
            jnp.arange(1024 * 512, dtype=jnp.float32).reshape(1024, 512), NamedSharding(mesh, P("x", "y"))
        ),
        "cols": jax.device_put(jnp.ones((256, 1000), jnp.bfloat16), NamedSharding(mesh, P(None, ("x", "y")))),
        "rows": jax.device_put(
            jnp.arange(12 * 40000, dtype=jnp.float32).reshape(12, 40000), NamedSharding(mesh, P("x"))
        ),
    }
    path = jaxckpt.save(f"{bucket}/ckpt", tree)
    shards = [o for o in _objects(path) if o.startswith("data/a/") and "/c/" in o]
    assert len(shards) == 2 + 1 + 1, shards  # 2 MiB in 2 shards of 1 MiB; 500 KB whole; 1.9 MB in 1
    template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    restored = jaxckpt.restore(path, template)
    for key, value in tree.items():
        assert restored[key].sharding == value.sharding
        _same_bits(restored[key], value)
    _same_bits(jaxckpt.load_variable(path, "rows"), tree["rows"])
