"""One process of a two-tier run with peer copies (benchmarks/peers.py starts several; tests/test_peers.py too).

    python peers_worker.py MODE PROCESS_ID NUM_PROCESSES PORT PATH DURABLE

MODE: save (steps 1 to 3, every step durable if PEERS_DURABLE_EVERY=1, else every 2nd) | restore
(restore_or_initialize, each process checks its shards and its data iterator's position bit for
bit). PATH holds each process's local directory (``local-<i>``); DURABLE is the durable tier (a
folder or an ``s3://`` prefix). Environment: PEERS_REPLICAS (local_replicas), PEERS_ROWS (rows of
1,024 float32 of the sharded array), PEERS_MARK (a URL fetched just before the restore, so that
a counting proxy can tell the restore's requests from the start-up's). Prints ``result {json}``.
"""

import faulthandler
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
import warnings

faulthandler.register(signal.SIGUSR1, all_threads=True)  # benchmarks/peers.py asks for the stacks of a hang
mode, pid, nproc, port, path, durable = sys.argv[1:7]
pid, nproc = int(pid), int(nproc)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
sys.path.insert(0, os.environ.get("BENCH_JAXCKPT_SRC", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

rows = int(os.environ.get("PEERS_ROWS", "256"))
mesh = Mesh(np.array(jax.devices()).reshape(2, nproc // 2), ("x", "y"))
rng = np.random.default_rng(11)
VALUES = {
    "sharded": rng.standard_normal((rows, 1024)).astype(np.float32),  # a quarter per process
    "replicated": rng.standard_normal((max(8, rows // 4), 1024)).astype(np.float32),
    "small": np.arange(10, dtype=np.int32),
}
SPECS = {"sharded": P(("x", "y")), "replicated": P(), "small": P()}


class Shard:
    """A data iterator over this process's shard: its position differs per process."""

    def __init__(self):
        self.position = 0

    def get_state(self):
        return {"position": self.position, "seed": [pid, 1234567891011]}

    def set_state(self, state):
        assert state["seed"] == [pid, 1234567891011], state
        self.position = state["position"]


def state(step):
    arrays = {
        k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, SPECS[k]), lambda i, v=v: v[i] * step)
        for k, v in VALUES.items()
    }
    return {**arrays, "step": step}


data = Shard()
every = int(os.environ.get("PEERS_DURABLE_EVERY", "2"))
replicas = os.environ.get("PEERS_REPLICAS")
options = dict(
    local_directory=os.path.join(path, f"local-{pid}"),
    durable_interval_steps=every,
    max_to_keep=2,
    local_replicas=None if replicas is None else int(replicas),
)
result = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if mode == "save":
        ckpt = jaxckpt.Checkpoint(state=state(0), data=data)
        with jaxckpt.CheckpointManager(ckpt, durable, **options) as manager:
            for step in (1, 2, 3):
                ckpt.state, data.position = state(step), 10 * (pid + 1) + step
                manager.save(step=step)
            manager.wait_until_finished()
            result["local"] = [c.step for c in manager.local_checkpoint_infos]
            result["durable"] = [c.step for c in manager.checkpoint_infos]
    else:
        template = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, SPECS[k])) for k, v in VALUES.items()
        }
        ckpt = jaxckpt.Checkpoint(state={**template, "step": 0}, data=data)
        with jaxckpt.CheckpointManager(ckpt, durable, **options) as manager:
            if os.environ.get("PEERS_MARK"):
                try:
                    urllib.request.urlopen(os.environ["PEERS_MARK"], timeout=30).close()
                except urllib.error.HTTPError:
                    pass  # the proxy counted it: that is all it is for
            start = time.perf_counter()
            restored = manager.restore_or_initialize()
            result["seconds"] = time.perf_counter() - start
            result["local"] = [c.step for c in manager.local_checkpoint_infos]
        step = ckpt.state["step"]
        for name, value in VALUES.items():
            for shard in ckpt.state[name].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index] * step, err_msg=name)
        assert data.position == 10 * (pid + 1) + step, (data.position, step)
        result.update(restored=restored, step=step)
result["warnings"] = [str(w.message) for w in caught]
print("result " + json.dumps(result), flush=True)
jax.distributed.shutdown()
