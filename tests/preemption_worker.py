"""A tiny training loop that saves on preemption (tests/test_preemption.py sends it SIGTERM).

    python preemption_worker.py DIRECTORY [PROCESS_ID NUM_PROCESSES PORT]

It resumes from DIRECTORY's latest checkpoint, prints ``running PROCESS_ID STEP`` once it is in its
loop, and calls ``manager.save_if_preempted()`` at every step boundary. The state ``w`` equals the
step at every boundary, so a checkpoint of another step's state is caught. On preemption it prints
``preempted STEP`` and exits 0 through the manager's SystemExit. With NUM_PROCESSES > 1 it joins a
``jax.distributed`` run on 127.0.0.1:PORT, and the processes agree on the step through JAX.
"""

import os
import sys
import time

directory = sys.argv[1]
pid, nproc, port = (int(a) for a in sys.argv[2:5]) if len(sys.argv) > 2 else (0, 1, 0)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

if nproc > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxckpt  # noqa: E402

ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(4, np.float32))
# checkpoint_interval: no regular saves, so the only checkpoint is the one preemption makes.
manager = jaxckpt.CheckpointManager(
    ckpt, directory, step_counter="step", checkpoint_interval=10**9, save_on_preemption=True
)
manager.restore_or_initialize()
step = int(ckpt.step)
deadline = time.monotonic() + 120  # never spin forever if the signal is lost
print("running", pid, step, flush=True)
while time.monotonic() < deadline:
    step += 1
    loss = jnp.sum(jnp.asarray(ckpt.w) ** 2).block_until_ready()  # a stand-in for a train step
    ckpt.w = ckpt.w + 1
    ckpt.step = step
    try:
        manager.save_if_preempted()
    except SystemExit:
        print("preempted", step, flush=True)
        raise
print("no preemption notice came", flush=True)
sys.exit(3)
