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
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from jaxckpt.runtime import multihost

if TYPE_CHECKING:
    from jaxckpt.checkpoint.checkpoint import Checkpoint
    from jaxckpt.manager.options import ManagerOptions
    from jaxckpt.runtime.background import Background
    from jaxckpt.storage.statefile import CheckpointInfo


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
        self._multihost = multihost.process_count() > 1
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


class PreemptionSaves:
    """:class:`~jaxckpt.CheckpointManager`'s preemption calls (``save_on_preemption=True``)."""

    # What the manager has that these calls use.
    _preemption: PreemptionHandler | None
    _options: ManagerOptions
    _checkpoint: Checkpoint
    _background: Background
    _infos: list[CheckpointInfo]

    if TYPE_CHECKING:  # the manager's own
        save: Callable[..., str | None]
        close: Callable[[], None]

    def reached_preemption(self, step: int | None = None) -> bool:
        """Whether a preemption notice (SIGTERM) came and ``step`` is the step to save at.

        ``step`` defaults to the step counter's value. In a multi-process run every process must
        call this at every step with the same step numbers; it is True at the same step on all of
        them. Needs ``save_on_preemption=True``.
        """
        if self._preemption is None:
            raise ValueError("reached_preemption needs a manager created with save_on_preemption=True.")
        if step is None:
            step = self._options.read_step(self._checkpoint)
            if step is None:
                raise ValueError("reached_preemption needs the step: pass it, or give the manager a step_counter.")
        return self._preemption.reached_preemption(step)

    def save_if_preempted(
        self,
        step: int | None = None,
        *,
        checkpoint_number: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        exit_code: int = 0,
    ) -> None:
        """At a step boundary, after a preemption notice: save, wait, close, exit (see :meth:`jaxckpt.CheckpointManager.save_if_preempted`)."""
        if not self.reached_preemption(step):
            return
        self._background.wait()
        if not self._holds_current_step(self._infos):
            self.save(checkpoint_number, force=True, metrics=metrics)
        self.close()  # waits for the save; raises its error instead of exiting cleanly
        raise SystemExit(exit_code)

    def _holds_current_step(self, infos: list[CheckpointInfo]) -> bool:
        """Whether the latest of ``infos`` holds the step counter's step (a preemption save would
        repeat it). Only with a step counter are the steps in a state file comparable."""
        counted = self._options.step_counter is not None and bool(infos)
        return counted and infos[-1].step == self._options.read_step(self._checkpoint)
