"""Two tiers: frequent checkpoints on local disk, durable copies in a bucket, restore from the newest.

Large runs save to a bucket, which is slow and shared, so they save rarely and lose hours at each
preemption; hosts have fast local disks that are lost with the machine. With ``local_directory``,
a :class:`~jaxckpt.CheckpointManager` keeps both::

    manager = jaxckpt.CheckpointManager(
        ckpt, "s3://bucket/runs/exp1",              # durable tier: kept by max_to_keep / policies
        local_directory="/mnt/nvme/exp1",           # fast tier on this host
        local_policies=jaxckpt.KeepLatest(2),
        save_interval_steps=100,                    # every 100 steps to local disk
        durable_interval_steps=1000,                # every 1,000 steps also to the bucket
    )
    manager.restore_or_initialize()                 # the newest complete checkpoint in either tier

**Saving.** :meth:`~jaxckpt.CheckpointManager.save` of two tiers is a save of the local tier: it
returns as soon as a local save does. When the step is due for the durable tier, the finished local
checkpoint is then copied to the durable directory in the background, in a thread of its own
(:mod:`jaxckpt.manager.durable_copy`: the files the local save wrote, never device memory again; the index last, so
the copy is atomic in a bucket too), and recorded in the durable state file, whose retention then applies. Until its copy
is done, local retention keeps that checkpoint. A copy still running when the next one is due is
not waited for: the newest due checkpoint is copied next, those in between are skipped. A copy
that fails is reported by a warning at the next save, and raised by :meth:`wait_until_finished`
and :meth:`close`; local saves go on.

**Restoring.** :meth:`restore_or_initialize` and :meth:`restore` take the newest checkpoint listed
in either tier (the local one when both hold the step), so a restart on the same machine reads
local disk, and a new machine (no local tier) reads the bucket. A local checkpoint that fails to
restore (damaged, or gone) falls back to the newest durable one, with a warning; local checkpoints
newer than what was restored are then dropped, so that numbering continues from the restored step.

**Disk pressure.** Before a local save, if the local disk has less free space than the latest
local save wrote new (hard links aside), local checkpoints the durable tier holds are dropped,
oldest first (never the newest, nor one being copied).

**Several processes** (``jax.distributed``): each process keeps a whole copy of its own in its own
``local_directory`` (its regions, the packs and the index); each copies the data store it owns to
the durable tier, process 0 the index last, so the durable checkpoint is the one a save by all of
them there would have made. A restore uses the local step only if every process lists it and could
read its own copy; otherwise every process restores the newest durable checkpoint (which also
serves another mesh or process count). ``local_replicas`` peer processes (1 by default) also keep a
copy of each process's newest local checkpoint, so that a replaced host gets its part back from a
peer instead of the run falling back to the durable tier (:mod:`jaxckpt.manager.peers`).

**Listing.** Each directory holds a ``checkpoint.tiers`` file naming both: ``jaxckpt ls`` on either shows both.

**Preemption.** With ``save_on_preemption=True``, :meth:`save_if_preempted` saves to the local tier,
starts the durable copy of that checkpoint, and waits for it only as long as
``preemption_grace_s`` allows, then says on stderr what was copied and exits.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxckpt._errors import CheckpointFormatError, CheckpointNotFoundError, JaxckptError, caller_level
from jaxckpt.checkpoint.checkpoint import Checkpoint
from jaxckpt.checkpoint.restore import RestoreStatus
from jaxckpt.format.records import INDEX_FILE
from jaxckpt.incremental import copy_memory, memories, refs
from jaxckpt.manager import durable_copy
from jaxckpt.manager.one_tier import OneTier
from jaxckpt.manager.options import ManagerOptions
from jaxckpt.manager.peers import Peers
from jaxckpt.manager.policies import KeepAny, KeepLatest, RetentionPolicy, positive_int
from jaxckpt.reading.reader import AFTER_READ
from jaxckpt.runtime import multihost
from jaxckpt.runtime.background import Background
from jaxckpt.saving.save_dtypes import SaveDtypes
from jaxckpt.storage import local_tree, locations, statefile
from jaxckpt.storage.locations import PathLike
from jaxckpt.storage.statefile import CheckpointInfo

# How long save_if_preempted waits for the durable copy by default (the manager's default too).
PREEMPTION_GRACE_S = 30.0


class _HostTier(OneTier):
    """The local tier: in a multi-process run, every process keeps a whole checkpoint of its own in
    its own ``local_directory`` (its own disk), with the packs and every region it holds."""

    _own_copy = True
    _tiers: weakref.ref[TwoTiers] | None = None  # the manager of both (weak: no cycle keeps it alive)

    def _before_due_save(self) -> None:
        tiers = self._tiers() if self._tiers is not None else None
        if tiers is not None:
            tiers._copy_to_peers()  # every process alike: a due save's decision is the same on all
            tiers._make_room()


class TwoTiers(OneTier):
    """What :class:`~jaxckpt.CheckpointManager` does with ``local_directory`` (see the module's
    description): a :class:`~jaxckpt.manager.one_tier.OneTier` of the durable tier, which holds another of
    the local tier (``_local``) and copies from it."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: PathLike,
        options: ManagerOptions,
        *,
        local_directory: PathLike,
        local_policies: RetentionPolicy | Sequence[RetentionPolicy] = (),
        durable_interval_steps: int | None = None,
        preemption_grace_s: float = PREEMPTION_GRACE_S,
        last_checkpoint_step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        incremental: bool = True,
        local_replicas: int | None = None,
    ) -> None:
        peers = Peers(os.fspath(local_directory), local_replicas)  # checks local_replicas
        if durable_interval_steps is not None:
            positive_int("durable_interval_steps", durable_interval_steps)
        if not preemption_grace_s >= 0:
            raise ValueError(f"preemption_grace_s must be 0 or more seconds, not {preemption_grace_s!r}.")
        if locations.location(local_directory).local is None:
            raise ValueError(
                f"local_directory must be a folder on this host's disk, not {os.fspath(local_directory)!r}."
            )
        if os.path.abspath(os.fspath(local_directory)) == os.path.abspath(os.fspath(directory)):
            raise ValueError("local_directory and directory must be two different folders.")
        policies = [local_policies] if isinstance(local_policies, RetentionPolicy) else list(local_policies)
        local_policy = KeepAny(*policies) if policies else KeepAny(KeepLatest(2))  # refuses what is not a policy
        super().__init__(  # the durable tier
            checkpoint,
            directory,
            options,
            last_checkpoint_step=last_checkpoint_step,
            metadata=metadata,
            incremental=incremental,
        )
        try:
            # The local tier shares the naming, the step rules, async saves and the clock; retention is its own.
            local_options = dataclasses.replace(
                options, policy=local_policy, hours=None, init_fn=None, save_on_preemption=False
            )
            self._local = _HostTier(
                checkpoint,
                local_directory,
                local_options,
                last_checkpoint_step=last_checkpoint_step,
                incremental=incremental,
            )
            self._local._preemption = self._preemption  # its save(step) and should_save see a notice too
            self._local._tiers = weakref.ref(self)  # its saves make room on its disk (_make_room)
        except BaseException:
            self._close(report=False)
            raise
        # The durable tier's saves are copies, in a thread of their own (see jaxckpt.runtime.background).
        self._background = Background("durable copy", pool="copy")
        self._every = durable_interval_steps
        self._peers = peers
        self._grace = preemption_grace_s
        self._copy_lock = threading.Lock()
        self._copying = False  # a copy job runs (or is queued)
        self._wanted: list[CheckpointInfo] = []  # local checkpoints due for a copy, oldest first
        self._copies = itertools.count()  # numbers the copies alike on every process (the copy thread)
        self._restores = itertools.count()  # numbers the restores' agreements alike (the caller's thread)
        self.copied: list[str] = []  # durable paths copied by this manager, oldest first
        self._copy_memory = copy_memory.CopyMemory() if incremental else None  # what the last copy put where
        if not options.read_only:
            # Only process 0 writes in the durable directory, which it owns: its start-up removes the
            # temp files there that it finds, and the file would name each process's local tier in turn.
            statefile.write_tiers(self._local.directory, self._directory, in_durable=multihost.is_primary())

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
        """Save to the local tier (see :meth:`OneTier.save`); if the step is due for the
        durable tier (``durable_interval_steps``, or ``force``), copy it there in the background."""
        self._report_failed_copy()
        self._warn_failed_deletes()  # the durable tier's, which no save of its own reports
        # A save that is due, once the last local one is done, copies that one to the peers and makes
        # room (_before_due_save); one that is not due waits for nothing.
        path = self._local.save(
            checkpoint_number, check_interval, step=step, force=force, metrics=metrics, save_dtypes=save_dtypes
        )
        info = self._local._last_info
        if path is None or info is None:
            return None
        if force or self._every is None or info.step % self._every == 0:
            self._copy_later(info)
        return path

    def _copy_to_peers(self) -> None:
        """After a local save: its peer copies, in the caller's thread (see jaxckpt.manager.peers). Only
        of a save by this manager, which every process made: after a restore, what each process's
        local tier lists may differ (a replaced host's), and no process must wait for another."""
        last, infos = self._local._last_info, self._local.checkpoint_infos
        if not self._options.read_only and last is not None and any(c.path == last.path for c in infos):
            self._peers.copy(last, [os.path.basename(c.path) for c in infos])

    def _make_room(self) -> None:
        """Under disk pressure, drop local checkpoints the durable tier holds (see the module's
        docstring). Bytes are those of files with no other hard link: what a save wrote new, and
        what deleting a checkpoint frees."""
        local = self._local
        if len(local._infos) < 2:
            return
        need = _own_bytes(local._infos[-1].path)
        free = shutil.disk_usage(local.directory).free
        durable = {os.path.basename(c.path) for c in self._infos}
        for c in local._infos[:-1]:
            if free >= need:
                return
            if os.path.basename(c.path) in durable and c.path not in local._also_keep:
                free += _own_bytes(c.path)
                self._keep_local([k for k in local._infos if k is not c])
                local._deleter.wait()  # the space must be free before the save, not in the background

    def should_save(self, step: int) -> bool:
        return self._local.should_save(step)

    def _copy_later(self, info: CheckpointInfo) -> None:
        with self._copy_lock:
            # One process: only the newest due checkpoint waits; those it supersedes are skipped.
            # Several: every process copies the same checkpoints in the same order, so none is skipped.
            if self._wanted and multihost.process_count() == 1:
                self._local._also_keep.discard(self._wanted.pop().path)
            self._wanted.append(info)
            self._local._also_keep.add(info.path)
            if self._copying:
                return  # the running job takes it next
            self._copying = True
        self._background.submit(self._copy_wanted)

    def _copy_wanted(self) -> None:
        while True:
            with self._copy_lock:
                if not self._wanted:
                    self._copying = False
                    return
                info = self._wanted.pop(0)
            try:
                self._copy(info)
            except BaseException:
                with self._copy_lock:
                    self._copying = False
                    for skipped in self._wanted:
                        self._local._also_keep.discard(skipped.path)
                    self._wanted.clear()
                raise
            finally:
                self._local._also_keep.discard(info.path)
            self._apply_local_retention()

    def _apply_local_retention(self) -> None:
        """Local retention kept a checkpoint while it was copied: what it lets go now goes now, not
        only at the next local save (there may be none)."""
        try:
            self._local._reapply_retention()
        except (OSError, JaxckptError) as e:  # the next local save applies retention again
            warnings.warn(f"Could not apply the retention of {self._local.directory!r} after a copy: {e}", stacklevel=2)

    def _copy(self, info: CheckpointInfo) -> None:
        self._local._background.settle()  # the local write of this checkpoint is done (or failed)
        source = Path(info.path)
        name = source.name
        tag = f"copy/{name}/{next(self._copies)}"
        # Every process's local save of it must have finished: each copies its own part.
        if not all(multihost.gather(f"{tag}/ready", "1" if (source / INDEX_FILE).is_file() else "")):
            return  # a local save failed: the local manager reports that at the next call
        durable = dataclasses.replace(info, path=os.path.join(self._directory, name))
        if any(c.path == durable.path for c in self._infos):
            return  # already there (a restart that saved the same step again)
        if not locations.is_checkpoint(self._path / name):  # only what the durable tier lacks (copy_memory)
            uses = durable_copy.copy_checkpoint(source, self._path / name, tag=tag, memory=self._copy_memory)
        else:
            uses = refs.uses_of(self._path / name, lambda n: self._options.number(n) is not None)
        self._record(dataclasses.replace(durable, uses=uses), tag)
        self.copied.append(durable.path)

    def _report_failed_copy(self) -> None:
        if self._background.failed:
            try:
                self._background.wait()
            except Exception as e:
                warnings.warn(
                    f"A copy to the durable tier {self._directory!r} failed: {e}. Local checkpoints go on; the next "
                    "checkpoint due for the durable tier is copied again.",
                    stacklevel=caller_level(),
                )

    def wait_until_finished(self) -> None:
        """Block until the local save, the durable copy and the deletions in both tiers are done;
        raise an error of one of them."""
        try:
            self._local.wait_until_finished()
            self._copy_to_peers()
        finally:
            try:
                self._background.wait()
            finally:
                self._local._deleter.wait()  # what the copy's end let go in the local tier
                self._deleter.wait()
        self._local._raise_failed_deletes()
        self._raise_failed_deletes()

    # --- restoring ---------------------------------------------------------------------------------

    @property
    def local_directory(self) -> str:
        """The local tier's directory."""
        return self._local.directory

    @property
    def local_checkpoint_infos(self) -> list[CheckpointInfo]:
        """The local tier's kept checkpoints, oldest first (:attr:`checkpoint_infos` lists the durable tier's)."""
        return self._local.checkpoint_infos

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint in either tier (the local one when both hold its step); waits for a
        local save, never for a durable copy (which lists its checkpoint once it is whole)."""
        newest = self._newest(None)
        return newest[0].path if newest else None

    def latest_step(self) -> int | None:
        newest = self._newest(None)
        return newest[0].step if newest else None

    def all_steps(self) -> list[int]:
        """The steps of either tier, oldest first: those that :meth:`restore` takes by step."""
        local = self._local.all_steps()  # waits for a local save, as latest_step
        with self._retention_lock:
            durable = [c.step for c in self._infos]
        return sorted(set(local) | set(durable))

    def _newest(self, step: int | None, agree: bool = False) -> list[CheckpointInfo]:
        """The checkpoints to try, best first: the newest local one (if it is at least as new as the
        newest durable one), then the newest durable one; only those of ``step`` if given. With
        ``agree``, in a multi-process run, the local one only if every process has that step locally
        (each holds only its own regions there), after the running durable copy: every process then
        sees the same durable list. Without, it does not wait for a copy (a listing, not a restore)."""
        if agree:
            self._background.settle()
        local = [c for c in self._local.checkpoint_infos if step is None or c.step == step]
        durable = [c for c in self._infos if step is None or c.step == step]
        if agree and multihost.process_count() > 1:  # the newest that every process has or gets from a peer
            found = self._peers.recover(self._local, step, durable[-1] if durable else None, self._options.read_only)
            local = [found] if found is not None else []
        out = []
        if local and (not durable or local[-1].step >= durable[-1].step):
            out.append(local[-1])
        if durable:
            out.append(durable[-1])
        return out

    def restore_or_initialize(self) -> str | None:
        self._local.wait_until_finished()
        restored = self._restore_newest(None)
        if restored is not None:
            return restored[0]
        if self._options.init_fn is not None:
            self._options.init_fn()
        return None

    def restore(self, step: int | None = None) -> RestoreStatus:
        self._local.wait_until_finished()
        restored = self._restore_newest(step)
        if restored is None:
            raise CheckpointNotFoundError(
                f"Neither {self._local.directory!r} nor {self._directory!r} has a checkpoint"
                + ("" if step is None else f" of step {step}")
                + "."
            )
        return restored[1]

    def _restore_newest(self, step: int | None) -> tuple[str, RestoreStatus] | None:
        tried = self._newest(step, agree=True)
        for i, info in enumerate(tried):
            local = i + 1 < len(tried)
            try:
                with memories.restoring(self._local._memory):  # the local tier's saves link from it
                    status = self._restore_from(info, agree=local and multihost.process_count() > 1)
            except JaxckptError as error:  # damaged, gone or unreadable: the durable tier may still serve
                if not local:
                    raise
                warnings.warn(
                    f"The local checkpoint {info.path!r} cannot be restored ({error}); restoring the durable "
                    f"{tried[i + 1].path!r} instead.",
                    stacklevel=caller_level(),
                )
                continue
            if i > 0 or step is None:  # the local tier's newer checkpoints belong to a run that is not continued
                self._drop_local_after(info.step)
            self._restored()
            self._local._restored()
            return info.path, status
        return None

    def _restore_from(self, info: CheckpointInfo, *, agree: bool) -> RestoreStatus:
        """Restore ``info``; with ``agree`` (a local copy, several processes), every process reads its
        own copy first, and all of them go on to place the arrays (JAX's collectives take every
        process) only if every one could: otherwise all raise."""
        if not agree:
            return self._checkpoint.restore(info.path)
        name = f"tiers/{self._directory}/{next(self._restores)}"
        said = []

        def after_read(error: BaseException | None) -> None:
            said.append(True)
            failed = [p for p, ok in enumerate(multihost.gather(name, "" if error else "1")) if not ok]
            if failed and error is None:
                raise CheckpointFormatError(f"process {failed[0]} could not read its own local copy of this step")

        token = AFTER_READ.set(after_read)
        try:
            return self._checkpoint.restore(info.path)
        except Exception:
            if not said:  # failed before reading (its index, any error): still take part in the agreement
                multihost.gather(name, "")
            raise
        finally:
            AFTER_READ.reset(token)

    def delete(self, step: int) -> None:
        """Delete the checkpoints of ``step`` in both tiers (see :meth:`OneTier.delete`),
        after the local save and the durable copy under way: a step being copied is deleted once
        copied, in both tiers. Raises CheckpointNotFoundError if neither tier holds ``step``."""
        step = operator.index(step)
        self._check_writable("delete")
        self._local._check_writable("delete")
        self._local._background.wait()
        self._background.settle()  # the copy's error stays for the next save (see _report_failed_copy)
        # Both tiers, even when the first has none: the local tier may hold a step the durable one skipped.
        in_local = self._local._drop_step(step)
        self._local._forget_last_step(step)  # the local tier saves: its interval is the one that counts
        if not self._drop_step(step) and not in_local:
            raise CheckpointNotFoundError(
                f"There is no checkpoint of step {step} in either tier: the kept steps are "
                f"{[c.step for c in self._local._infos]} in {self._local.directory!r} and "
                f"{[c.step for c in self._infos]} in {self._directory!r}. Give one of those to delete."
            )

    def _drop_local_after(self, step: int) -> None:
        self._keep_local([c for c in self._local._infos if c.step <= step])

    def _keep_local(self, kept: list[CheckpointInfo]) -> None:
        """Keep only ``kept`` of the local tier: listed first, then the others deleted (as retention)."""
        self._local._keep_only(kept)

    # --- preemption and lifetime -------------------------------------------------------------------

    def save_if_preempted(
        self,
        step: int | None = None,
        *,
        checkpoint_number: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        exit_code: int = 0,
    ) -> None:
        """After a preemption notice: save to the local tier, copy that checkpoint to the durable
        tier while ``preemption_grace_s`` allows, say on stderr what was copied, and exit."""
        if not self.reached_preemption(step):
            return
        deadline = time.monotonic() + self._grace
        self._local.wait_until_finished()
        infos = self._local.checkpoint_infos
        if self._holds_current_step(infos):
            path: str | None = infos[-1].path
            self._copy_later(infos[-1])
        else:
            path = self.save(checkpoint_number, force=True, metrics=metrics)
        self._local.close()  # the local checkpoint is durable on this host
        done = self._background.settle(timeout=max(0.0, deadline - time.monotonic()))
        name = os.path.basename(path or "")
        where = os.path.join(self._directory, name)
        copied = done and where in self.copied
        print(
            f"jaxckpt: preempted: saved {path} locally; its durable copy {where} "
            + ("is complete." if copied else f"did not finish within {self._grace:g} s (the copy goes on until exit)."),
            file=sys.stderr,
        )
        if done:
            self.close()
        raise SystemExit(exit_code)

    def close(self) -> None:
        """Finish the local save and the durable copy, then release both directories."""
        try:
            self._copy_at_end()
            self._background.settle()  # the copy first: its end may apply the local tier's retention
        finally:
            try:
                self._local.close()
            finally:
                super().close()

    def _copy_at_end(self) -> None:
        """Closing: the peer copies of the last local save, if it succeeded (every process closes alike)."""
        local = self._local._background
        if local.settle() and not local.failed and self._local._release.alive:
            self._copy_to_peers()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None:  # leaving by an exception, another process may never come to copy
                self._copy_at_end()
            self._background.settle()
        finally:
            try:
                self._local._close(report=False)
            finally:
                super().__exit__(exc_type, *exc)

    def __repr__(self) -> str:
        return f"CheckpointManager({self._directory!r}, local_directory={self._local.directory!r})"


def _own_bytes(path: str) -> int:
    """Bytes of a local checkpoint's files that no other checkpoint shares (hard links)."""
    found = local_tree.usage(locations.location(path))
    return 0 if found is None else found.apparent - found.shared
