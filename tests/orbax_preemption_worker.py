"""Orbax's preemption loop, as Orbax's preemption guide writes it (tests/test_preemption.py sends SIGTERM).

    python orbax_preemption_worker.py DIRECTORY LAST_STEP SIGNAL_STEP

``manager.save(step)`` at every step, with ``save_interval_steps=4`` and ``save_on_preemption=True``,
then ``break`` when ``manager.reached_preemption(step)``. It resumes after the latest step (Orbax's
``restore(latest_step())``), prints ``resumed STEP KEPT_STEPS...`` (-1 for none), and trains up to LAST_STEP. At
SIGNAL_STEP (-1: never) it prints ``in step STEP`` and reads a line of stdin before saving: the test
sends SIGTERM, then writes that line, so the notice arrives during that step (no sleeps). ``w``
counts the steps trained, so a checkpoint of another step's state is caught. It prints
``preempted STEP`` when it stops on a notice, ``done STEP`` when it reaches LAST_STEP.
"""

import os
import sys

directory = sys.argv[1]
last_step, signal_step = int(sys.argv[2]), int(sys.argv[3])
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

import jaxckpt  # noqa: E402

ckpt = jaxckpt.Checkpoint(w=np.zeros(4, np.float32))
with jaxckpt.CheckpointManager(ckpt, directory, save_interval_steps=4, save_on_preemption=True) as mngr:
    latest = mngr.latest_step()
    if latest is not None:
        mngr.restore(latest).assert_consumed()
    start = 0 if latest is None else latest + 1
    print("resumed", -1 if latest is None else latest, *mngr.all_steps(), flush=True)
    for step in range(start, last_step + 1):
        ckpt.w = ckpt.w + 1  # a stand-in for a train step
        if step == signal_step:
            print("in step", step, flush=True)
            sys.stdin.readline()  # the test sends SIGTERM, then this line
        mngr.save(step)
        if mngr.reached_preemption(step):
            mngr.wait_until_finished()
            print("preempted", step, flush=True)
            break
    else:
        print("done", last_step, flush=True)
