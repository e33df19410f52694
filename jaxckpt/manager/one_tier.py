"""``OneTier``: the part of a :class:`~jaxckpt.CheckpointManager` that keeps numbered checkpoints in one
directory, with retention and the state file (the public class, in :mod:`jaxckpt.manager.checkpoint_manager`,
holds one, or a two-tier :class:`jaxckpt.manager.tiers.TwoTiers`, which is one too).

The directory belongs to its manager::

    ckpts/
      checkpoint          the state file: which checkpoints exist (see _statefile)
      checkpoint.lock     present while a manager works here, locked by it (see _lock)
      ckpt-4/  ckpt-5/    the kept checkpoints, each a folder with index.json

The state file is the only source of truth for which checkpoints exist. A manager deletes only
checkpoints that its state file lists under its own ``checkpoint_name`` (never one preserved by
``keep_checkpoint_every_n_hours``). At start it takes the directory over (:mod:`jaxckpt.manager.startup`:
keeping another name's, adopting unlisted checkpoints, removing what crashes left); after each save
it records the new checkpoint and applies retention in an order that a crash at any instant leaves
every listed checkpoint whole (:mod:`jaxckpt.manager.retention`).

In a multi-process run, process 0 decides: it holds the lock, writes the state file, applies
retention and deletes, and publishes the list it kept through jax.distributed's key-value store;
the other processes adopt that list. Every process reports at each save whether its part of the
snapshot went well, and all raise together if one did not, so that the next save starts in step.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from jaxckpt._errors import CheckpointExistsError, CheckpointNotFoundError
from jaxckpt.checkpoint.checkpoint import Checkpoint
from jaxckpt.checkpoint.restore import REREADS, RestoreStatus
from jaxckpt.incremental import bucket as _bucket_memory
from jaxckpt.incremental import memories
from jaxckpt.incremental.refs import deletions
from jaxckpt.manager import retention as _retention
from jaxckpt.manager import run_metadata, startup
from jaxckpt.manager.options import ManagerOptions, check_metrics
from jaxckpt.manager.orbax_calls import OrbaxCalls
from jaxckpt.manager.preemption import PreemptionHandler, PreemptionSaves
from jaxckpt.manager.retention import RetentionCalls
from jaxckpt.runtime import multihost
from jaxckpt.runtime.background import Background
from jaxckpt.saving import pipeline
from jaxckpt.saving import save_dtypes as _save_dtypes
from jaxckpt.saving import staging as _staging
from jaxckpt.saving.save_dtypes import SaveDtypes
from jaxckpt.storage import locations
from jaxckpt.storage import lock as _lock
from jaxckpt.storage.locations import PathLike
from jaxckpt.storage.lock import LOCK_FILE
from jaxckpt.storage.statefile import STATE_FILE, CheckpointInfo, latest_checkpoint

__all__ = ["LOCK_FILE", "STATE_FILE", "OneTier", "latest_checkpoint"]


class OneTier(PreemptionSaves, OrbaxCalls, RetentionCalls):
    """The checkpoints of one directory: what :class:`jaxckpt.CheckpointManager` does without
    ``local_directory`` (its documentation says what each option and call means), and each tier of
    one with it. Its public calls are the manager's, which passes them on."""

    # Every process keeps a directory of its own on its own disk (a two-tier manager's local tier).
    _own_copy = False

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: PathLike,
        options: ManagerOptions,
        *,
        last_checkpoint_step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        incremental: bool = True,
    ) -> None:
        """``options`` are checked (:meth:`ManagerOptions.check`, by :class:`~jaxckpt.CheckpointManager`),
        which documents the rest."""
        given = None if metadata is None else run_metadata.check(metadata)  # before the directory is touched
        self._options = options
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        # As TF's manager: the step of the last checkpoint this manager saved or restored (before
        # either, last_checkpoint_step, by default None), which checkpoint_interval counts from.
        self._last_checkpoint_step: int | None = last_checkpoint_step
        # What a save changed before every process agreed on it, to put back if they did not.
        self._last_before: int | None = None
        self._counter_before = 0
        self._pending_path: str | None = None
        self._last_info: CheckpointInfo | None = None  # the latest save's, for a durable copy of it
        self._since = options.clock()  # save_interval_secs counts from here, then from each save's start
        self._also_keep: set[str] = set()  # local checkpoints that retention keeps while they are copied
        self._background = Background("CheckpointManager")
        # Guards _infos and the state file between the save's thread and a durable copy's thread,
        # which re-applies a local tier's retention when a copy ends (jaxckpt.manager.tiers).
        self._retention_lock = threading.RLock()
        self._preemption: PreemptionHandler | None = None
        self._path = locations.location(directory)
        # What this process last saved or restored here, so that unchanged arrays are linked (local
        # disks) or referred to (buckets: jaxckpt.incremental.refs).
        self._memory = _bucket_memory.memory_for(self._path) if incremental else None
        # Dropped checkpoints are deleted in the background, after the state file lists the kept ones.
        self._deleter = _retention.Deleter(self._path)
        # In a multi-process run, only the primary owns the directory: it holds the lock, writes the
        # state file and deletes; the others keep the same list of checkpoints in memory.
        self._primary = self._own_copy or multihost.is_primary()
        self._lock: _lock.Lock | None = None
        # Object stores have no atomic create-if-absent that every S3-compatible store honours, so the
        # lock guards local directories only (see docs/buckets.md).
        local = self._path.local
        if local is not None and not options.read_only:
            startup.make_directory(local, self._directory)
            if self._primary:
                self._lock = _lock.acquire(local)
        # A finalizer, so that the lock goes when the manager is collected and at interpreter exit.
        self._release = weakref.finalize(self, self._lock.release if self._lock else lambda: None)
        try:
            # A manager that writes also checks whose directory it is, adopts and cleans up (see startup).
            self._infos, self._last_preserved = startup.take_over(self._path, self._directory, options, self._primary)
            # Read when asked for (one request fewer on a bucket), unless there is some to record now.
            self._given_metadata = given
            self._metadata: dict[str, Any] | None = None
            if given is not None and self._primary and not options.read_only:
                self._metadata = run_metadata.start(self._path, given, write=True)
            # Last, so that a manager that fails to start leaves SIGTERM alone (close() puts it back).
            if options.save_on_preemption:
                self._preemption = PreemptionHandler()
        except BaseException:
            self._close(report=False)
            raise

    # --- properties --------------------------------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint_interval(self) -> int | None:
        return self._options.interval

    @property
    def latest_checkpoint(self) -> str | None:
        """The prefix of the latest checkpoint (``"ckpts/ckpt-10"``), or None.

        Waits for a background save, so it includes a save that finished; a save that failed leaves
        its error to the next :meth:`save`, :meth:`wait_until_finished` or :meth:`close`.
        """
        self._background.settle()
        return self._infos[-1].path if self._infos else None

    @property
    def checkpoints(self) -> list[str]:
        """Prefixes of the kept checkpoints, oldest first; waits for a background save (as ``latest_checkpoint``)."""
        self._background.settle()
        return [c.path for c in self._infos]

    @property
    def checkpoint_infos(self) -> list[CheckpointInfo]:
        """The kept checkpoints with their step, time and metrics, oldest first; waits as ``latest_checkpoint``."""
        self._background.settle()
        return list(self._infos)

    @property
    def read_only(self) -> bool:
        return self._options.read_only

    # --- saving and restoring ----------------------------------------------------------------------

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its prefix; without one, call ``init_fn`` and return None."""
        self._background.wait()
        latest = self._infos[-1].path if self._infos else None
        if latest is not None:
            with memories.restoring(self._memory):
                self._checkpoint.restore(latest)
            self._restored()
            return latest
        if self._options.init_fn is not None:
            self._options.init_fn()
        return None

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
        """Write a new checkpoint, record it, and apply retention (see :meth:`jaxckpt.CheckpointManager.save`)."""
        if step is not None:
            step = operator.index(step)
            if checkpoint_number is not None and operator.index(checkpoint_number) != step:
                raise ValueError(f"save(checkpoint_number={checkpoint_number}, step={step}): give one of them.")
        self._check_writable("save")
        # Every process of a multi-process run goes through this save's agreement exactly once, even
        # when its part fails, so that no save after it waits for a process that is a save behind.
        taken = multihost.tokens_taken()
        try:
            ready = self._prepare(checkpoint_number, step, force, metrics, check_interval, save_dtypes)
        except Exception as e:
            token = multihost.abandon(taken, e)
            self._discard(token)
            raise
        if ready is None:
            return None
        prepared, info = ready
        self._last_info = info
        try:
            multihost.agree(prepared.token)
        except BaseException:
            self._checkpoint.save_counter = self._counter_before
            self._last_checkpoint_step = self._last_before
            self._discard(prepared.token)
            raise
        if self._options.async_save:
            self._background.submit(lambda: self._finish(prepared, info), prepared.dest)
        else:
            self._finish(prepared, info)
        return info.path

    def _prepare(
        self,
        checkpoint_number: int | None,
        explicit_step: int | None,
        force: bool,
        metrics: Mapping[str, Any] | None,
        check_interval: bool = True,
        save_dtypes: SaveDtypes = None,
    ) -> tuple[pipeline.Prepared, CheckpointInfo] | None:
        """Number the checkpoint and snapshot it; None when ``checkpoint_interval``, ``save_interval_steps``
        or a rule by the clock says not yet, decided without waiting for the save in the background."""
        self._pending_path = None
        step = self._options.read_step(self._checkpoint) if explicit_step is None else explicit_step
        if explicit_step is not None:
            checkpoint_number = explicit_step
        # Every process sees the same steps, so all skip a save alike.
        last = self._last_before = self._last_checkpoint_step
        if not force and self._options.too_soon(step, last, check_interval):
            return None
        options = self._options
        by_step = explicit_step is not None or options.every is not None  # Orbax's rule, not only TF's interval
        # Without a step counter, a number is the step it records: Orbax's ``save(step)``, positional.
        decided = step if step is not None or checkpoint_number is None else operator.index(checkpoint_number)
        if not force and (options.timed or (decided is not None and by_step)) and not self._due(decided):
            return None
        self._background.wait()  # the previous save is recorded (or its error raised) before numbering
        self._warn_failed_deletes()
        self._before_due_save()
        recorded = check_metrics(metrics)  # refuse bad metrics before anything is written
        counter = self._counter_before = self._checkpoint.save_counter
        number = self._options.next_number(checkpoint_number, counter, self._infos)
        path = os.path.join(self._directory, f"{self._options.name}-{number}")
        if any(c.path == path for c in self._infos):
            raise CheckpointExistsError(f"{path!r} is already a kept checkpoint; checkpoint numbers must be new.")
        if self._deleter.deleting(os.path.basename(path)):  # a number reused (checkpoint_number=n) too soon
            self._deleter.wait()
        self._checkpoint._settle(path)  # what earlier restores left unused, as Checkpoint.save says it
        # Like Checkpoint.save, the counter advances before the snapshot, so that the checkpoint holds it.
        self._checkpoint.save_counter = number if checkpoint_number is None else counter + 1
        self._pending_path = path
        try:
            prepared = pipeline.prepare(
                self._path / os.path.basename(path),
                self._checkpoint,
                own_copy=self._own_copy,
                memory=self._memory,
                save_dtypes=self._options.save_dtypes if save_dtypes is None else _save_dtypes.check(save_dtypes),
            )
        except BaseException:
            self._checkpoint.save_counter = counter
            raise
        if self._options.interval is not None:
            self._last_checkpoint_step = step
        self._since = self._options.clock()
        return prepared, CheckpointInfo(path, number if step is None else step, self._since, recorded)

    def _before_due_save(self) -> None:
        """Before a save that is due, once the previous one is done (every process alike): nothing
        here (two tiers' local tier copies that one to its peers, and under disk pressure drops what
        the durable tier holds)."""

    # --- the Orbax-style surface: checkpoints by step ---------------------------------------------

    def restore(self, step: int | None = None) -> RestoreStatus:
        """Restore the checkpoint of ``step`` (the latest without one) into :attr:`checkpoint`; returns
        the restore status, as :meth:`Checkpoint.restore` does. Raises CheckpointNotFoundError, naming
        the kept steps, if there is no such checkpoint."""
        self._background.wait()
        for retries_left in range(REREADS, -1, -1):
            path = self._kept(step).path
            try:
                with memories.restoring(self._memory):
                    status = self._checkpoint.restore(path)
                break
            except CheckpointNotFoundError:
                # An evaluator's latest, deleted by the trainer's retention while read (nothing of it
                # was restored): the state file and the latest again.
                if step is not None or not self._options.read_only or not retries_left:
                    raise
                self.reload()
        self._restored()
        return status

    def _kept(self, step: int | None) -> CheckpointInfo:
        """The kept checkpoint of ``step`` (the latest without one); a read-only manager that does
        not know it reads the state file again first (a trainer may have saved it since)."""
        matches = [c for c in self._infos if step is None or c.step == operator.index(step)]
        if not matches and self._options.read_only:
            self.reload()
            matches = [c for c in self._infos if step is None or c.step == operator.index(step)]
        if not matches:
            raise CheckpointNotFoundError(
                f"{self._directory!r} has no checkpoint"
                + ("" if step is None else f" of step {step}; its kept steps are {[c.step for c in self._infos]}")
                + ". Save one first, or restore from another directory."
            )
        return matches[-1]

    def _restored(self) -> None:
        """As TF's restore_or_initialize: the interval counts from the restored step."""
        if self._options.interval is not None:
            self._last_checkpoint_step = self._options.read_step(self._checkpoint)

    def _discard(self, token: str | None) -> None:
        """Primary: remove a staging folder that a save every process abandoned may have left."""
        path = self._pending_path
        if token is None or path is None or not self._primary or self._path.local is None:
            return
        _staging.discard_staging(locations.location(path), token)

    def _finish(self, prepared: pipeline.Prepared, info: CheckpointInfo) -> None:
        """Write the checkpoint, then list it, then delete what retention lets go (in this order: see
        _retention), the deletion in the background."""
        prepared.unlisted = self._primary  # until listed: see startup's adoption
        pipeline.write_and_publish(prepared)
        if prepared.uses:  # the state file says whose data it refers to (see _refs)
            info = dataclasses.replace(info, uses=prepared.uses)
        # Written and durable: now it may be listed. If recording fails, the unlisted folder is
        # garbage that the next manager removes.
        self._record(info, prepared.token)

    def _record(self, info: CheckpointInfo, token: str) -> None:
        """List the written checkpoint ``info`` and apply retention (every process, for ``token``)."""
        if self._primary:
            with self._retention_lock:
                candidates = [*self._infos, info]
                retained = self._retain(candidates)
                _retention.record(self._path, candidates, retained, token, publish=not self._own_copy)
                self._last_preserved = retained.last_preserved
                self._infos = retained.kept
            # Off the save's path: the next save may start while these are deleted (see _retention).
            self._deleter.delete(
                _retention.dropped_names(candidates, retained.kept), deletions(candidates, retained.kept, self._ours)
            )
        else:
            candidates = [*self._infos, info]
            published = multihost.kept(token, self._directory)
            self._infos = published if published is not None else self._retain(candidates).kept
        # No process is done with a save before the state file lists it: a process that reads the
        # state file next (latest_checkpoint) must not find the previous one, perhaps being deleted.
        multihost.barrier(f"{token}/recorded")
        if self._primary and not self._own_copy:
            multihost.forget_kept(token)  # every process has it: keep the key-value store small

    def wait_until_finished(self) -> None:
        """Block until the background save is done and recorded, and the checkpoints that retention
        dropped are deleted; raise the save's error if it failed, else a deletion's."""
        try:
            self._background.wait()
        finally:
            self._deleter.wait()
        self._raise_failed_deletes()

    # --- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the background save and the deletion of the checkpoints retention dropped, then
        release the directory's lock.

        Reading ``checkpoints`` still works afterwards; saving does not. Raises the background
        save's error, if any, after releasing the lock (else a failed deletion's: see :meth:`save`).
        If the wait is interrupted (Ctrl-C), the lock stays held while the save still writes, and the
        manager stays open: call ``close()`` again, or exit (Python finishes the save at exit first;
        the kernel drops the lock when the process ends).
        """
        self._close(report=True)

    def _close(self, *, report: bool) -> None:
        try:
            try:
                self._background.wait()
            finally:
                self._deleter.wait()  # the lock stays held while this manager deletes here
        finally:
            if not self._background.pending and not self._deleter.pending:
                with self._retention_lock:
                    self._release()
                if self._memory is not None:
                    self._memory.close()
                if self._preemption is not None:
                    self._preemption.close()
        if report:  # the end of training: what a restore left unused is said now at the latest
            self._checkpoint._settle(final=True)
            self._raise_failed_deletes()
        else:
            self._warn_failed_deletes()

    def __enter__(self) -> OneTier:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Leaving by an exception: that is the news, not an unused-values warning.
        self._close(report=exc_type is None)

    def __repr__(self) -> str:
        # Never waits and never raises: a debugger or a log line must not block on, or eat, a save.
        try:
            if self._background.pending:
                state = "saving"
            elif self._background.failed:
                state = "last save failed"
            else:
                state = "closed" if not self._release.alive else f"{len(self._infos)} kept"
            latest = self._infos[-1].path if self._infos else None
            return f"CheckpointManager({self._directory!r}, latest={latest!r}, {state})"
        except Exception:
            return f"<CheckpointManager at {id(self):#x}>"
