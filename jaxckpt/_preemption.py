"""Preemption: SIGTERM becomes "save at the next step boundary, wait for it, then exit cleanly".

Schedulers (Kubernetes, Slurm, cloud TPU and GPU VMs) announce an eviction with SIGTERM and kill
the job a grace period later. By default SIGTERM ends a Python process at once, losing every step
since the last checkpoint. A :class:`PreemptionHandler` turns the signal into a notice that the
training loop polls at step boundaries, where the state is consistent::

    manager = jaxckpt.CheckpointManager(ckpt, "ckpts", step_counter="step", save_on_preemption=True)
    for batch in data:
        train_step(batch)
        ckpt.step += 1
        manager.save_if_preempted()  # on notice: save, wait until durable, close, sys.exit(0)

which is, spelled out::

        if manager.reached_preemption(step):
            manager.save(force=True)
            manager.wait_until_finished()
            sys.exit(0)

**One process:** a Python signal handler sets a flag, and every step from then on has reached the
preemption point. **Several processes** (``jax.distributed``) must save the same step, but the
notice reaches them at different steps, or reaches one of them only. JAX's own preemption sync
manager (started by ``jax.distributed.initialize``) solves this: it catches SIGTERM itself, tells
every process, and picks the first step after the largest that any process had reached; each
process's ``reached_preemption(step)`` is True at that step only. Every process must therefore
call it at every step, with the same step numbers. No Python handler is installed then, since one
would replace JAX's.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from jaxckpt import _multihost


def _sync_manager() -> Any:
    """JAX's preemption sync manager, or None (jax.distributed not initialized, or the service disabled)."""
    from jax._src import distributed  # jax.distributed exposes no handle on it

    return distributed.global_state.preemption_sync_manager


class PreemptionHandler:
    """Turns a preemption notice (SIGTERM) into ``reached_preemption(step) == True`` at a step boundary.

    ::

        with jaxckpt.PreemptionHandler() as preemption:
            for step in range(start, steps):
                train_step()
                if preemption.reached_preemption(step):
                    ckpt.write(f"ckpts/preempted-{step}")
                    sys.exit(0)

    In a single process it installs a handler for ``signals`` (SIGTERM by default; it must be
    created in the main thread, where Python runs signal handlers) and :meth:`close` puts the
    previous handlers back. The previous handler is not called: the signal now means "save and
    exit", which the training loop does. In a multi-process run it uses JAX's preemption sync
    manager instead (see the module's documentation), which listens to SIGTERM only.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self._signals = tuple(signal.Signals(s) for s in signals)
        self._notice = threading.Event()
        self._previous: dict[signal.Signals, Any] = {}
        self._multihost = _multihost.process_count() > 1
        if self._multihost:
            if _sync_manager() is None:
                raise RuntimeError(
                    "A multi-process run needs JAX's preemption sync manager to agree on the step to save, and "
                    "there is none: call jax.distributed.initialize() first, and leave the "
                    "jax_enable_preemption_service option on."
                )
            if self._signals != (signal.SIGTERM,):
                raise ValueError(
                    f"In a multi-process run, JAX's preemption service listens to SIGTERM only, not {signals}."
                )
            return
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "Create the PreemptionHandler (or the manager with save_on_preemption=True) in the main thread: "
                "Python runs signal handlers there only."
            )
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the loop saves at the next step boundary, where the state is consistent.
        self._notice.set()

    @property
    def notified(self) -> bool:
        """Whether this process received a notice (single process; in a multi-process run, JAX keeps it)."""
        return self._notice.is_set()

    def reached_preemption(self, step: int) -> bool:
        """Whether to save now and exit: True at the step that every process agreed on after a notice.

        In a single process, True at every step once a signal arrived. In a multi-process run, call it
        at every step on every process, with the same step numbers.
        """
        if self._multihost:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(int(step))
        return self._notice.is_set()

    def close(self) -> None:
        """Put the previous signal handlers back (unless someone replaced ours since). Idempotent."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if signal.getsignal(sig) == self._on_signal:
                # None: the previous handler was not installed from Python and cannot be put back.
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        how = "JAX preemption sync" if self._multihost else ", ".join(s.name for s in self._signals)
        return f"PreemptionHandler({how}, notified={self.notified})"
