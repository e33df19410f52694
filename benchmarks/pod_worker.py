"""One process of a pod-like save or restore (``benchmarks/pod_io.py`` and ``tests/test_pod_io.py``
start several, on ``jax.distributed`` with gloo collectives, one CPU device each).

    python pod_worker.py ACTION LAYOUT PROCESS_ID NUM_PROCESSES PORT PATH SHARE

ACTION: save | restore. LAYOUT: dp (every array replicated over all processes), fsdp (every array
sharded over all of them), mix (two data-parallel groups of two FSDP shards: each array sharded over
``fsdp`` and replicated over ``data``; four processes). SHARE (restore): auto | on | off.
``POD_ROWS`` sets the size (rows of 1,024 float32 in each of the four kernels; default 1,024: 4 MiB each);
``POD_RESTORE_LAYOUT`` restores onto another layout than the one saved.

Every process builds the same values from a seed; a restore checks its own shards bit for bit. The
last line printed is ``result {json}``: the process, the wall time of the call, and the values' bytes.
"""

import json
import os
import sys
import time

action, layout, pid, nproc, port, path, share = sys.argv[1:8]
pid, nproc = int(pid), int(nproc)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from child import import_jaxckpt  # noqa: E402  (BENCH_JAXCKPT_SRC: another revision's jaxckpt)

jaxckpt = import_jaxckpt()

ROWS = int(os.environ.get("POD_ROWS", "1024"))
devices = np.array(jax.devices())
if action == "restore":
    layout = os.environ.get("POD_RESTORE_LAYOUT") or layout
if layout == "dp":
    mesh, spec = Mesh(devices.reshape(nproc), ("data",)), P()
elif layout == "fsdp":
    mesh, spec = Mesh(devices.reshape(nproc), ("fsdp",)), P("fsdp")
elif layout == "mix":
    mesh, spec = Mesh(devices.reshape(2, nproc // 2), ("data", "fsdp")), P("fsdp")
else:
    raise SystemExit(f"unknown layout {layout!r}")
sharding = NamedSharding(mesh, spec)

rng = np.random.default_rng(43)
VALUES = {}
for i in range(4):
    VALUES[f"params/layer{i}/kernel"] = rng.standard_normal((ROWS, 1024)).astype(np.float32)
    VALUES[f"params/layer{i}/bias"] = rng.standard_normal((1024,)).astype(np.float32)


def nested(flat):
    out = {}
    for key, value in flat.items():
        node = out
        *parents, name = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = value
    return out


start = time.perf_counter()
if action == "save":
    arrays = {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for k, v in VALUES.items()}
    jaxckpt.save(path, {**nested(arrays), "step": 3})
elif action == "restore":
    like = nested({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in VALUES.items()})
    kwargs = {} if share == "auto" else {"share_reads": share == "on"}
    restored = jaxckpt.restore(path, like={**like, "step": 0}, **kwargs)
    seconds = time.perf_counter() - start
    assert restored["step"] == 3
    for key, value in VALUES.items():
        node = restored
        for part in key.split("/"):
            node = node[part]
        assert node.sharding == sharding, (key, node.sharding)
        for shard in node.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index], err_msg=key)
else:
    raise SystemExit(f"unknown action {action!r}")
seconds = time.perf_counter() - start if action == "save" else seconds
nbytes = sum(v.nbytes for v in VALUES.values())
print("result " + json.dumps({"process": pid, "seconds": seconds, "values_bytes": nbytes}), flush=True)
jax.distributed.shutdown()
