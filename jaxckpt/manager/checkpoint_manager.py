"""``jaxckpt.CheckpointManager``: the public manager, one class with one signature for one tier or two.

The manager holds the part that does the work, chosen once by ``local_directory``: a
:class:`jaxckpt.manager.one_tier.OneTier` (numbered checkpoints in ``directory``) or a
:class:`jaxckpt.manager.tiers.TwoTiers` (a local tier beside it, with durable copies). Every public call is
written out here with its documentation (what ``help()`` and the API reference show) and passes on
to the part; the parts know nothing of this class, so imports run one way: this module imports
``_tiers``, which imports ``_manager``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxckpt.checkpoint.checkpoint import Checkpoint
from jaxckpt.checkpoint.restore import RestoreStatus
from jaxckpt.manager.one_tier import OneTier
from jaxckpt.manager.options import ManagerOptions, StepCounter
from jaxckpt.manager.policies import RetentionPolicy
from jaxckpt.manager.tiers import PREEMPTION_GRACE_S, TwoTiers
from jaxckpt.runtime import multihost
from jaxckpt.saving.save_dtypes import SaveDtypes
from jaxckpt.storage.locations import PathLike
from jaxckpt.storage.statefile import CheckpointInfo

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Numbered checkpoints of one :class:`Checkpoint` in ``directory``, with retention and a state file.

    ::

        ckpt = jaxckpt.Checkpoint(step=0, params=params)
        with jaxckpt.CheckpointManager(ckpt, "ckpts", max_to_keep=3, step_counter="step") as manager:
            manager.restore_or_initialize()        # resumes from the latest checkpoint, if any
            for ...:
                ckpt.step += 1
                manager.save(metrics={"loss": loss})   # "ckpts/ckpt-1", "ckpts/ckpt-2", ...

    Retention: ``max_to_keep=n`` is ``KeepLatest(n)``, and ``policies`` adds any others; a checkpoint
    is kept if any of them keeps it, and the latest is always kept. With neither, every checkpoint is
    kept. ``keep_checkpoint_every_n_hours=h`` is TensorFlow's rule: a checkpoint that retention drops
    is preserved instead if it was saved at least ``h`` hours after the last preserved one (at first,
    after the directory's first manager started). A preserved checkpoint is marked so in the state
    file, no policy sees it, and no manager's retention ever deletes it, whatever its options (only
    :meth:`delete` of its step does).
    (``KeepEvery(hours=h)`` is a different rule: one checkpoint per ``h``-hour window.)

    ``step_counter`` says where the training step is, for ``checkpoint_interval`` (counted, as in
    TensorFlow, from the step this manager last saved or restored, at first from ``last_checkpoint_step``
    if given; see :meth:`save`) and the state file:
    the name of a child of ``checkpoint`` (``"step"``; read at each save, so it follows restores and
    reassignments, which matters since JAX values are immutable and get replaced, not updated), or a
    callable returning it. Without ``checkpoint_number``, checkpoints are numbered by ``checkpoint``'s
    ``save_counter``, which each save advances and which is saved with the checkpoint; if it lags
    behind the numbers already listed (a new job that did not restore), numbering continues after them.

    Only one manager may work in a directory at a time: it holds a kernel lock on ``checkpoint.lock``
    (see :mod:`jaxckpt.storage.lock`), released by :meth:`close`, at the end of a ``with`` block, at
    interpreter exit, and by the kernel when the process dies. Checkpoints that the state file lists
    under another ``checkpoint_name`` (``Checkpoint.save`` under another prefix, another manager) stay
    listed, as TensorFlow's: numbering continues after them, and a manager deletes only its own.
    ``read_only=True`` restores without the lock, for a job that must not (or cannot) write there:
    it never saves, deletes or cleans up. ``clock`` (Unix seconds) is for tests.

    Saves are asynchronous unless ``async_save=False``: :meth:`save` returns once the values are
    snapshotted, and writing, the state file and retention run in the background. The next save that
    is due, :meth:`restore_or_initialize`, :meth:`wait_until_finished` and :meth:`close` wait for it and
    raise its error if it failed. ``latest_checkpoint``, ``checkpoints`` and ``checkpoint_infos`` wait for it
    too, and list finished saves only, but leave its error to those calls; ``repr`` never waits.
    :meth:`close` releases the lock only once the background save is done: a Ctrl-C that interrupts
    it leaves the manager open and the directory locked until the save ends (at exit at the latest).

    Orbax's calls work beside TensorFlow's, on the same state file and retention: ``save(step=s)``
    (``ckpt-<s>``, saved exactly when :meth:`should_save` says so: past the latest step, and divisible
    by ``save_interval_steps`` or at a preemption notice), :meth:`all_steps`, :meth:`latest_step`,
    :meth:`restore` by step into :attr:`checkpoint`, and :meth:`delete` of a step (a rollback).
    Saves by time: ``save_interval_secs=t`` saves once ``t`` seconds passed since the last save began;
    ``save_continuously=True`` saves again as soon as the last save is written (Orbax's
    ``ContinuousCheckpointingPolicy``; with ``save_interval_secs``, its ``minimum_interval_secs``). With
    several rules, a step is due if any says so. In a multi-process run, process 0 decides by its own
    clock and every process follows (so every process must call :meth:`should_save` and :meth:`save`
    alike, as it must anyway); rules by step need no such agreement.
    ``metadata={...}`` records the run's configuration (JSON) once for the directory, in
    ``checkpoint.metadata``, and :meth:`metadata` reads it back.

    **Two tiers.** With ``local_directory`` (a fast disk of this host: NVMe, ``/dev/shm``), saves go
    there, kept by ``local_policies`` (default: the latest 2), and the checkpoint of every
    ``durable_interval_steps``-th step is then copied to ``directory`` (a bucket, say) in the
    background, kept by ``max_to_keep`` and ``policies``; restores take the newest checkpoint in
    either tier, falling back to the durable one if the local one is damaged (:mod:`jaxckpt.manager.tiers`).
    With several processes, each one's newest local checkpoint is also copied to ``local_replicas``
    peers, from which a replaced host restores it (:mod:`jaxckpt.manager.peers`). Without
    ``local_directory``, ``local_policies``, ``durable_interval_steps``, ``preemption_grace_s`` and
    ``local_replicas`` have nothing to apply to: giving one raises ValueError.

    ``save_on_preemption=True`` turns SIGTERM into a notice that the loop polls at step boundaries
    (:class:`PreemptionHandler`, put back by :meth:`close`): :meth:`save_if_preempted` then saves,
    waits until the checkpoint is durable, and exits; :meth:`reached_preemption` tells when, for a
    loop that does that itself. A multi-process run agrees on the step through JAX's preemption
    sync manager.

    Args:
        checkpoint: the :class:`Checkpoint` that each save writes and each restore fills.
        directory: the folder (or ``s3://``, ``gs://`` prefix) of the checkpoints; with two tiers,
            the durable one.
        max_to_keep: keep the latest ``n`` checkpoints (with ``policies``: also those they keep).
        keep_checkpoint_every_n_hours: TensorFlow's rule: preserve, for good, one dropped checkpoint
            every ``h`` hours.
        checkpoint_name: the checkpoints' names are ``<checkpoint_name>-<number>``.
        step_counter: the child of ``checkpoint`` that holds the step (``"step"``), or a callable
            returning it.
        checkpoint_interval: TensorFlow's: save only every ``n`` steps of the step counter.
        last_checkpoint_step: where ``checkpoint_interval`` counts from before the first save or restore.
        save_interval_steps: Orbax's: save only at steps divisible by ``n`` (and at a preemption notice).
        save_interval_secs: save when ``t`` seconds (by ``clock``) passed since this manager's last save
            began, or since it started (as well as at the steps ``save_interval_steps`` names, if given).
        save_continuously: Orbax's continuous checkpointing: save as soon as this manager's last save is
            written (the decision never waits for it), at most every ``save_interval_secs``.
        init_fn: called by :meth:`restore_or_initialize` when there is no checkpoint to restore.
        policies: retention policies (:class:`KeepLatest`, :class:`KeepEvery`, :class:`KeepBest`, ...).
        async_save: write in the background (``False``: :meth:`save` returns once written).
        save_on_preemption: turn SIGTERM into a notice for :meth:`save_if_preempted`.
        read_only: restore only: never save, delete, clean up or take the lock.
        clock: the time in Unix seconds, recorded with each checkpoint and read by the rules by time (for tests).
        local_directory: a folder on this host's fast disk: the local tier (two tiers).
        local_policies: the local tier's retention (default: ``KeepLatest(2)``).
        durable_interval_steps: copy the checkpoints of every ``n``-th step to ``directory``
            (default: every checkpoint).
        preemption_grace_s: how long :meth:`save_if_preempted` waits for the durable copy (30 s by default).
        local_replicas: with several processes, how many peer processes keep a copy of each one's
            newest local checkpoint, for a host that is replaced (default 1; :mod:`jaxckpt.manager.peers`).
        metadata: the run's configuration (JSON), recorded once for the directory.
        incremental: on a local disk, hard-link the files of every large ``jax.Array`` that is the very
            object this manager last saved or that a restore of one of its checkpoints returned, and
            of every large numpy array whose bytes it last saved, instead of writing it again
            (``False``: write every save in full). See "Incremental checkpoints" in the training
            loops guide.
        save_dtypes: the dtype of every save's copy of some float arrays (bfloat16 weights from float32
            parameters; Orbax's ``SaveArgs(dtype=...)``): as :func:`jaxckpt.save` takes it, with keys
            below the Checkpoint's children (``{"model": jnp.bfloat16}``). :meth:`save` may give its own.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: PathLike,
        max_to_keep: int | None = None,
        *,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: StepCounter | None = None,
        checkpoint_interval: int | None = None,
        last_checkpoint_step: int | None = None,
        save_interval_steps: int | None = None,
        save_interval_secs: float | None = None,
        save_continuously: bool = False,
        init_fn: Callable[[], Any] | None = None,
        policies: Sequence[RetentionPolicy] = (),
        async_save: bool = True,
        save_on_preemption: bool = False,
        read_only: bool = False,
        clock: Callable[[], float] = time.time,
        local_directory: PathLike | None = None,
        local_policies: RetentionPolicy | Sequence[RetentionPolicy] = (),
        durable_interval_steps: int | None = None,
        preemption_grace_s: float = PREEMPTION_GRACE_S,
        metadata: Mapping[str, Any] | None = None,
        incremental: bool = True,
        save_dtypes: SaveDtypes = None,
        local_replicas: int | None = None,
    ) -> None:
        options = ManagerOptions.check(  # before any directory is touched
            max_to_keep=max_to_keep,
            keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours,
            checkpoint_name=checkpoint_name,
            step_counter=step_counter,
            checkpoint_interval=checkpoint_interval,
            last_checkpoint_step=last_checkpoint_step,
            save_interval_steps=save_interval_steps,
            init_fn=init_fn,
            policies=policies,
            async_save=async_save,
            save_on_preemption=save_on_preemption,
            read_only=read_only,
            clock=clock,
            save_dtypes=save_dtypes,
            save_interval_secs=save_interval_secs,
            save_continuously=save_continuously,
        )
        rest: dict[str, Any] = dict(
            last_checkpoint_step=last_checkpoint_step, metadata=metadata, incremental=incremental
        )
        self._part: OneTier
        # In a multi-process run every process starts its manager together; a manager that only
        # reads may be opened by one process alone (to list or restore), so it agrees on nothing.
        agree = not read_only
        try:
            if local_directory is None:
                given = {
                    "local_policies": local_policies != (),
                    "durable_interval_steps": durable_interval_steps is not None,
                    "preemption_grace_s": preemption_grace_s != PREEMPTION_GRACE_S,
                    "local_replicas": local_replicas is not None,
                }
                for name, was_given in given.items():
                    if was_given:
                        raise ValueError(
                            f"{name} is an option of two tiers, and this manager has one: pass local_directory "
                            "(a folder on this host's fast disk) too, or leave it out."
                        )
                self._part = OneTier(checkpoint, directory, options, **rest)
            else:
                self._part = TwoTiers(
                    checkpoint,
                    directory,
                    options,
                    local_directory=local_directory,
                    local_policies=local_policies,
                    durable_interval_steps=durable_interval_steps,
                    preemption_grace_s=preemption_grace_s,
                    local_replicas=local_replicas,
                    **rest,
                )
        except BaseException as e:
            if agree:
                with contextlib.suppress(Exception):  # its own error is the news, not a wait that failed
                    multihost.started(f"manager of {os.fspath(directory)!r}", e)
            raise
        if agree:
            try:
                multihost.started(f"manager of {os.fspath(directory)!r}", None)
            except BaseException as e:
                self._part.__exit__(type(e), e, e.__traceback__)
                raise

    # --- what the manager keeps --------------------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint:
        """The :class:`Checkpoint` that each save writes and each restore fills."""
        return self._part.checkpoint

    @property
    def directory(self) -> str:
        """The directory of the checkpoints, as given (with two tiers, the durable one)."""
        return self._part.directory

    @property
    def local_directory(self) -> str | None:
        """The local tier's directory, as given; None for a manager of one tier."""
        return self._part.local_directory if isinstance(self._part, TwoTiers) else None

    @property
    def checkpoint_interval(self) -> int | None:
        """TensorFlow's ``checkpoint_interval``: the steps between saves, or None (no interval)."""
        return self._part.checkpoint_interval

    @property
    def read_only(self) -> bool:
        """Whether this manager only restores (``read_only=True``): it never saves or deletes."""
        return self._part.read_only

    @property
    def latest_checkpoint(self) -> str | None:
        """The prefix of the latest checkpoint (``"ckpts/ckpt-10"``), or None.

        Waits for a background save, so it includes a save that finished; a save that failed leaves
        its error to the next :meth:`save`, :meth:`wait_until_finished` or :meth:`close`. With two
        tiers, the newest checkpoint in either (the local one when both hold its step); it waits for
        a local save, never for a durable copy, which lists its checkpoint once it is whole.
        """
        return self._part.latest_checkpoint

    @property
    def checkpoints(self) -> list[str]:
        """Prefixes of the kept checkpoints, oldest first; waits for a background save (as
        :attr:`latest_checkpoint`). With two tiers, the durable tier's."""
        return self._part.checkpoints

    @property
    def checkpoint_infos(self) -> list[CheckpointInfo]:
        """The kept checkpoints with their step, time and metrics, oldest first; waits as
        :attr:`latest_checkpoint`. With two tiers, the durable tier's (see :attr:`local_checkpoint_infos`)."""
        return self._part.checkpoint_infos

    @property
    def local_checkpoint_infos(self) -> list[CheckpointInfo]:
        """The local tier's kept checkpoints, oldest first, once its save under way is done; ``[]``
        for a manager of one tier, which has no local tier."""
        return self._part.local_checkpoint_infos if isinstance(self._part, TwoTiers) else []

    @property
    def copied(self) -> list[str]:
        """The durable prefixes that this manager copied from its local tier, oldest first; ``[]`` for
        a manager of one tier, which copies nothing."""
        return list(self._part.copied) if isinstance(self._part, TwoTiers) else []

    # --- saving ------------------------------------------------------------------------------------

    def save(
        self,
        checkpoint_number: int | None = None,
        check_interval: bool = True,
        *,
        step: int | None = None,
        force: bool = False,
        metrics: Mapping[str, Any] | None = None,
        save_dtypes: SaveDtypes = None,
    ) -> str | None:
        """Write a new checkpoint, record it, and apply retention; returns its prefix.

        With ``checkpoint_interval``, returns None without saving, as TensorFlow's manager does, when
        the step is the one this manager last saved or restored (see :meth:`restore_or_initialize`),
        or, unless ``check_interval=False``, fewer than ``checkpoint_interval`` steps after it; a
        manager that has neither saved nor restored yet saves. It also returns None when
        :meth:`should_save` says no (``save_interval_steps``; a preemption notice says yes), for the
        step counter's step, ``step``, or without a step counter ``checkpoint_number`` (so that Orbax's
        positional ``save(step)`` keeps to the interval), and when ``save_interval_secs`` or
        ``save_continuously`` says not yet. A save that is not due returns at once, without
        waiting for the save in the background (nor raising its error: the next save that is due does).
        ``force=True`` saves regardless.
        ``checkpoint_number`` names it (``save(checkpoint_number=n)`` gives ``ckpt-<n>``); numbers already
        listed are refused. ``step=s``, as Orbax's managers take it, names it ``ckpt-<s>`` and records
        ``s`` as its step (no ``step_counter`` needed). ``metrics`` are recorded for :class:`KeepBest`
        and :attr:`checkpoint_infos`. ``save_dtypes`` stores some float arrays of this save in another
        dtype, in place of the manager's ``save_dtypes`` (see :func:`jaxckpt.save`).

        The checkpoints that retention drops are deleted in the background once the state file no
        longer lists them, one manager's in order; :meth:`wait_until_finished` and :meth:`close` wait
        for that. A deletion that fails leaves garbage that the next manager removes: the next save
        warns, and :meth:`wait_until_finished` and :meth:`close` raise it.

        With two tiers, it saves to the local tier and returns the local prefix; if the step is due for
        the durable tier (``durable_interval_steps``, or ``force``), the checkpoint is then copied there
        in the background. A copy that fails is said by a warning at the next save.
        """
        return self._part.save(
            checkpoint_number, check_interval, step=step, force=force, metrics=metrics, save_dtypes=save_dtypes
        )

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would save at ``step``, as Orbax's managers decide: ``step`` is past
        the latest checkpoint's step (the one being saved in the background included), and divisible by
        ``save_interval_steps`` (any step without it, or a rule by time), or a preemption notice asks for
        a save at this step, or ``save_interval_secs`` / ``save_continuously`` say it is time (process 0's
        clock decides, for every process). A step already saved is never due, notice or not. Never waits
        for the save in the background."""
        return self._part.should_save(step)

    def wait_until_finished(self) -> None:
        """Block until the background save is done and recorded, and the checkpoints that retention
        dropped are deleted; raise the save's error if it failed, else a deletion's. With two tiers,
        also the durable copy under way, and the deletions in both tiers."""
        self._part.wait_until_finished()

    def delete(self, step: int) -> None:
        """Delete the checkpoint of ``step`` (Orbax's ``delete``): to roll back after a loss spike,
        ``restore(300)``, ``delete(400)``, ``delete(500)``, then train on and ``save(400)`` again.

        A save in the background is finished first (its error raised, as the next :meth:`save` would),
        so a step being written is deleted once it is whole, never midway. The state file stops listing
        the step first, atomically, under the manager's lock, then its folder (or objects) is deleted in
        the background, as retention deletes (a crash at any instant leaves garbage that the next
        manager removes, never a listed checkpoint that is not whole). A checkpoint that
        ``keep_checkpoint_every_n_hours`` preserved is deleted too when asked for by its step.
        Raises CheckpointNotFoundError, naming the kept steps, if no kept checkpoint has that step,
        and ManagerLockedError in a ``read_only`` or closed manager.

        With two tiers, the step goes from both, after the local save and the durable copy under way
        (a step being copied is deleted once copied); CheckpointNotFoundError if neither holds it.
        """
        self._part.delete(step)

    # --- restoring ---------------------------------------------------------------------------------

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its prefix; without one, call ``init_fn`` and return None.

        As TensorFlow's, a ``checkpoint_interval`` then counts from the restored step. With two tiers,
        the newest checkpoint in either tier (see :meth:`restore`)."""
        return self._part.restore_or_initialize()

    def restore(self, step: int | None = None) -> RestoreStatus:
        """Restore the checkpoint of ``step`` (the latest without one) into :attr:`checkpoint`; returns
        the restore status, as :meth:`Checkpoint.restore` does. Raises CheckpointNotFoundError, naming
        the kept steps, if there is no such checkpoint. A ``read_only`` manager of one tier first reads
        the state file again (:meth:`reload`) if it does not know the step: a trainer may have saved it since.
        Restoring its latest (no ``step``), it reads the state file and the latest again where the
        trainer's retention deletes the checkpoint being read (up to three times).

        With two tiers, the local checkpoint of the step when the local tier holds it, else the durable
        one; a local checkpoint that fails to restore (damaged, or gone) falls back to the durable one,
        with a warning, and the local checkpoints newer than it are then dropped."""
        return self._part.restore(step)

    def all_steps(self) -> list[int]:
        """The steps of the kept checkpoints, oldest first (waits as :attr:`latest_checkpoint`). With
        two tiers, the steps of either tier: those that :meth:`restore` takes by step."""
        return self._part.all_steps()

    def latest_step(self) -> int | None:
        """The step of the latest checkpoint, or None (waits as :attr:`latest_checkpoint`). With two
        tiers, the newest in either."""
        return self._part.latest_step()

    def best_step(self) -> int | None:
        """Orbax's ``best_step()``: the step of the best kept checkpoint by the metric and mode of the
        manager's :class:`KeepBest` policy (the first, where it has several; ties: the older), or None
        if no kept checkpoint has that metric. Without a ``KeepBest``, the latest step, as Orbax's
        without ``best_fn``. Waits as :attr:`latest_checkpoint`."""
        return self._part.best_step()

    def reload(self) -> None:
        """Read the state file (and the run metadata) again, as Orbax's ``reload``: for a manager that
        follows another one's directory, an evaluator's ``read_only=True`` manager beside a live
        trainer, :meth:`all_steps`, :meth:`latest_step` and the checkpoint lists then include the
        steps saved since, and drop those deleted since. :meth:`restore` of a step this read-only
        manager does not know reloads by itself. A manager that writes lists what it wrote: for it,
        this only waits for its background save."""
        self._part.reload()

    def metadata(self) -> dict[str, Any]:
        """The run's metadata: what the directory's first manager given ``metadata={...}`` recorded
        (Orbax's rule: written once; see :mod:`jaxckpt.manager.run_metadata`), else what this manager was
        given (a read-only one never writes), else ``{}``. A copy: changing it changes nothing."""
        return self._part.metadata()

    # --- preemption --------------------------------------------------------------------------------

    def reached_preemption(self, step: int | None = None) -> bool:
        """Whether a preemption notice (SIGTERM) came and ``step`` is the step to save at.

        ``step`` defaults to the step counter's value. In a multi-process run every process must
        call this at every step with the same step numbers; it is True at the same step on all of
        them. Needs ``save_on_preemption=True``.
        """
        return self._part.reached_preemption(step)

    def save_if_preempted(
        self,
        step: int | None = None,
        *,
        checkpoint_number: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        exit_code: int = 0,
    ) -> None:
        """At a step boundary: after a preemption notice, save, wait until durable, close and exit.

        Returns at once (None) while there is no notice. Otherwise it saves (unless the latest
        checkpoint already holds this step), waits for the save, closes the manager and raises
        ``SystemExit(exit_code)``, so ``finally`` blocks and ``with`` statements still run.
        ``step`` is as for :meth:`reached_preemption`; ``checkpoint_number`` and ``metrics`` as
        for :meth:`save`.

        With two tiers, it saves to the local tier, copies that checkpoint to the durable tier while
        ``preemption_grace_s`` allows, and says on stderr what was copied before it exits.
        """
        self._part.save_if_preempted(step, checkpoint_number=checkpoint_number, metrics=metrics, exit_code=exit_code)

    # --- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the background save and the deletion of the checkpoints retention dropped, then
        release the directory's lock (with two tiers: the durable copy too, and both directories).

        Reading ``checkpoints`` still works afterwards; saving does not. Raises the background
        save's error, if any, after releasing the lock (else a failed deletion's: see :meth:`save`).
        If the wait is interrupted (Ctrl-C), the lock stays held while the save still writes, and the
        manager stays open: call ``close()`` again, or exit (Python finishes the save at exit first;
        the kernel drops the lock when the process ends).
        """
        self._part.close()

    def __enter__(self) -> CheckpointManager:
        """The manager itself; leaving the ``with`` block closes it (see :meth:`close`)."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Close the manager. Leaving by an exception, that exception is the news: what a restore
        left unused is not warned about, and a failed deletion only warns."""
        self._part.__exit__(exc_type, *exc)

    def __repr__(self) -> str:
        """The directory, the latest checkpoint and the state (``saving``, ``closed``, ...); never
        waits for a save and never raises."""
        return repr(self._part)
