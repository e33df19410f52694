"""``CheckpointManager``: numbered checkpoints in one directory, retention, and the state file.

The directory belongs to its manager::

    ckpts/
      checkpoint          the state file: which checkpoints exist (see _statefile)
      checkpoint.lock     present while a manager works here, locked by it (see _lock)
      ckpt-4/  ckpt-5/    the kept checkpoints, each a folder with index.json

The state file is the only source of truth for which checkpoints exist. A manager deletes only
checkpoints that its state file lists under its own ``checkpoint_name`` (never one preserved by
``keep_checkpoint_every_n_hours``), and refuses a directory whose state file lists another name's
checkpoints. Complete ``ckpt-N`` checkpoints that it finds unlisted at start (``Checkpoint.save`` of
an older jaxckpt, ``Checkpoint.write``, a copy) it adopts into the state file, as TensorFlow's
managers leave alone what they did not record.

Crash safety comes from the order of a save: the checkpoint is written and published (every byte
durable) first, marked ``.jaxckpt-unrecorded`` inside; then the state file is replaced atomically
(temp file, fsync, rename, fsync of the directory) to list it and drop what retention lets go (each
dropped one marked first); only then are marks cleared and dropped checkpoints renamed away and
deleted. A crash at any instant therefore leaves every listed checkpoint whole. What a crash can
leave behind (staging folders ``.ckpt-N.partial-<token>``, temp state files
``.checkpoint.tmp-<token>``, unlisted ``ckpt-N`` folders that are incomplete or marked, renamed
ones being deleted) is removed by the next manager when it starts; names that only look alike are
never touched.

In a multi-process run, process 0 decides: it holds the lock, writes the state file, applies
retention and deletes, and publishes the list it kept through jax.distributed's key-value store;
the other processes adopt that list. Every process reports at each save whether its part of the
snapshot went well, and all raise together if one did not, so that the next save starts in step.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
import secrets
import shutil
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxckpt import _lock, _multihost, _save, _staging, _statefile, _storage
from jaxckpt._async import Background
from jaxckpt._checkpoint import Checkpoint
from jaxckpt._errors import CheckpointExistsError, CheckpointNotFoundError, ManagerLockedError, UnsupportedValueError
from jaxckpt._lock import LOCK_FILE
from jaxckpt._policies import CheckpointInfo, KeepLatest, RetentionPolicy
from jaxckpt._preemption import PreemptionHandler
from jaxckpt._restore import RestoreStatus
from jaxckpt._statefile import PREFIX as _PREFIX
from jaxckpt._statefile import STATE_FILE, TEMP_FILE, latest_checkpoint
from jaxckpt._statefile import read_full_state as _read_full_state
from jaxckpt._statefile import write_state as _write_state

__all__ = ["LOCK_FILE", "STATE_FILE", "CheckpointManager", "latest_checkpoint"]

PathLike = str | os.PathLike[str]


# --- the manager -------------------------------------------------------------------------------


def _remove_tree(path: _storage.Location) -> None:
    if path.local is not None:
        # Renamed out of the way first, atomically: a crash midway through rmtree leaves a hidden
        # leftover that the next manager removes, never a half-deleted folder under the checkpoint's
        # name (which, with its index still there, would look complete and be adopted).
        hidden = path.local.with_name(f".{path.local.name}{_staging.REPLACED_MARK}{secrets.token_hex(6)}")
        os.rename(path.local, hidden)
        _delete_renamed(hidden)
    else:
        _storage.delete_tree(path)


def _delete_renamed(hidden: Path) -> None:
    shutil.rmtree(hidden)  # raises, unlike the best-effort clean-ups: a failure is reported


def _metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, value in (metrics or {}).items():
        if not isinstance(name, str) or isinstance(value, (str, bytes)):
            raise UnsupportedValueError(f"Metric {name!r}={value!r}: metrics map str names to numbers.")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UnsupportedValueError(f"Metric {name!r}={value!r} is not a number.") from None
        out[name] = number if math.isfinite(number) else None  # JSON has no NaN; a NaN loss is never best
    return out


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
    file, no policy sees it, and no manager ever deletes it, whatever its options.
    (``KeepEvery(hours=h)`` is a different rule: one checkpoint per ``h``-hour window.)

    ``step_counter`` says where the training step is, for ``checkpoint_interval`` (counted, as in
    TensorFlow, from the step this manager last saved or restored; see :meth:`save`) and the state file:
    the name of a child of ``checkpoint`` (``"step"``; read at each save, so it follows restores and
    reassignments, which matters since JAX values are immutable and get replaced, not updated), or a
    callable returning it. Without ``checkpoint_number``, checkpoints are numbered by ``checkpoint``'s
    ``save_counter``, which each save advances and which is saved with the checkpoint; if it lags
    behind the numbers already listed (a new job that did not restore), numbering continues after them.

    Only one manager may work in a directory at a time: it holds a kernel lock on ``checkpoint.lock``
    (see :mod:`jaxckpt._lock`), released by :meth:`close`, at the end of a ``with`` block, at
    interpreter exit, and by the kernel when the process dies. A directory whose state file lists
    checkpoints of another ``checkpoint_name`` is refused: a manager deletes only its own.
    ``read_only=True`` restores without the lock, for a job that must not (or cannot) write there:
    it never saves, deletes or cleans up. ``clock`` (Unix seconds) is for tests.

    Saves are asynchronous unless ``async_save=False``: :meth:`save` returns once the values are
    snapshotted, and writing, the state file and retention run in the background. The next save,
    :meth:`restore_or_initialize`, :meth:`wait_until_finished` and :meth:`close` wait for it and raise
    its error if it failed. ``latest_checkpoint``, ``checkpoints`` and ``checkpoint_infos`` wait for it
    too, and list finished saves only, but leave its error to those calls; ``repr`` never waits.
    :meth:`close` releases the lock only once the background save is done: a Ctrl-C that interrupts
    it leaves the manager open and the directory locked until the save ends (at exit at the latest).

    Orbax's calls work beside TensorFlow's, on the same state file and retention: ``save(step=s)``
    (``ckpt-<s>``, saved when :meth:`should_save` says so: past the latest step and divisible by
    ``save_interval_steps``), :meth:`all_steps`, :meth:`latest_step`, and :meth:`restore` by step
    into :attr:`checkpoint`.

    ``save_on_preemption=True`` turns SIGTERM into a notice that the loop polls at step boundaries
    (:class:`PreemptionHandler`, put back by :meth:`close`): :meth:`save_if_preempted` then saves,
    waits until the checkpoint is durable, and exits; :meth:`reached_preemption` tells when, for a
    loop that does that itself. A multi-process run agrees on the step through JAX's preemption
    sync manager.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: PathLike,
        max_to_keep: int | None = None,
        *,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: str | Callable[[], Any] | None = None,
        checkpoint_interval: int | None = None,
        save_interval_steps: int | None = None,
        init_fn: Callable[[], Any] | None = None,
        policies: Sequence[RetentionPolicy] = (),
        async_save: bool = True,
        save_on_preemption: bool = False,
        read_only: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not _PREFIX.fullmatch(checkpoint_name) or checkpoint_name.startswith("."):
            raise ValueError(f"checkpoint_name {checkpoint_name!r} must be a plain file name, like 'ckpt'.")
        if checkpoint_interval is not None:
            if step_counter is None:
                raise ValueError("checkpoint_interval needs a step_counter to measure the interval with.")
            if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int):
                raise ValueError(f"checkpoint_interval must be an int, not {checkpoint_interval!r}.")
        if save_interval_steps is not None and (
            isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int) or save_interval_steps < 1
        ):
            raise ValueError(f"save_interval_steps must be a positive int, not {save_interval_steps!r}.")
        if read_only and save_on_preemption:
            raise ValueError("save_on_preemption needs a manager that saves, not one with read_only=True.")
        if step_counter is not None and not (isinstance(step_counter, str) or callable(step_counter)):
            raise TypeError(f"step_counter must be a child name or a callable, not {step_counter!r}.")
        self._policies: list[RetentionPolicy] = list(policies)
        for p in self._policies:
            if not callable(getattr(p, "keep", None)):
                raise TypeError(f"{p!r} is not a retention policy: it has no keep(checkpoints) method.")
        if max_to_keep is not None:
            self._policies.append(KeepLatest(max_to_keep))
        if keep_checkpoint_every_n_hours is not None:
            hours = keep_checkpoint_every_n_hours
            if isinstance(hours, bool) or not isinstance(hours, (int, float)) or not 0 < hours < math.inf:
                raise ValueError(f"keep_checkpoint_every_n_hours must be a positive number, not {hours!r}.")
        self._hours = keep_checkpoint_every_n_hours
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._name = checkpoint_name
        self._numbered = re.compile(rf"{re.escape(checkpoint_name)}-([0-9]+)")
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        # As TF's manager: the step of the last checkpoint this manager saved or restored (None
        # before either), which checkpoint_interval counts from.
        self._last_checkpoint_step: int | None = None
        self._every = save_interval_steps
        self._init_fn = init_fn
        self._clock = clock
        self._async = async_save
        self._background = Background("CheckpointManager")
        self._preemption: PreemptionHandler | None = None
        self._read_only = read_only
        self._path = _storage.location(directory)
        # In a multi-process run, only the primary owns the directory: it holds the lock, writes the
        # state file and deletes; the others keep the same list of checkpoints in memory.
        self._primary = _multihost.is_primary()
        self._lock: _lock.Lock | None = None
        if self._path.local is not None and not read_only:
            self._make_directory()
        # Object stores have no atomic create-if-absent that every S3-compatible store honours, so the
        # lock guards local directories only (see the README).
        if self._primary and self._path.local is not None and not read_only:
            self._lock = _lock.acquire(self._path.local)
        # A finalizer, so that the lock goes when the manager is collected and at interpreter exit.
        self._release = weakref.finalize(self, self._lock.release if self._lock else lambda: None)
        try:
            state = _read_full_state(self._directory)
            infos, last_preserved = state if state is not None else (None, None)
            # TF's rule counts hours from the last preserved checkpoint, at first from when the first
            # manager of the directory started (a second back, as TF does), never from the future.
            now = self._clock()
            self._last_preserved = min(now, last_preserved if last_preserved is not None else now - 1.0)
            if infos is None:
                infos = []
                if self._primary and not read_only:
                    infos = self._adopt_empty_directory()
            if not read_only:  # one that never deletes may read another name's checkpoints
                self._check_names(infos)
            if self._primary and not read_only and state is not None:
                infos = self._adopt_unlisted(infos)
            self._infos: list[CheckpointInfo] = infos
            if self._primary and not read_only:
                self._remove_leftovers()
            # Last, so that a manager that fails to start leaves SIGTERM alone (close() puts it back).
            if save_on_preemption:
                self._preemption = PreemptionHandler()
        except BaseException:
            self._close(report=False)
            raise

    # --- start-up ----------------------------------------------------------------------------------

    def _make_directory(self) -> None:
        try:
            self._path.local.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:  # a file where a folder must be
            raise CheckpointExistsError(
                f"A CheckpointManager keeps its checkpoints in a directory, and {self._directory!r} cannot be "
                f"one: {e.strerror} ({e.filename!r}). Choose another directory."
            ) from None
        except PermissionError as e:
            raise ManagerLockedError(
                f"Cannot create the CheckpointManager directory {self._directory!r}: {e.strerror} ({e.filename!r}). "
                "To only restore from it, pass read_only=True; otherwise give this process write access there."
            ) from None

    def _check_names(self, infos: list[CheckpointInfo]) -> None:
        """Refuse a directory whose state file lists another name's checkpoints: retention would delete them."""
        others = [name for c in infos if not self._numbered.fullmatch(name := os.path.basename(c.path))]
        if others:
            named = re.fullmatch(r"(.+)-[0-9]+", others[-1])
            other = f"checkpoint_name={named.group(1)!r}" if named else "another checkpoint_name"
            raise CheckpointExistsError(
                f"{self._directory!r} belongs to managers with {other}: its state file {STATE_FILE!r} lists "
                f"{others[-5:]}, which a manager with checkpoint_name={self._name!r} did not save and would delete. "
                f"Use {other} for this directory, or another directory for {self._name!r}."
            )

    def _unlisted_checkpoints(self, infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
        """Complete ``<name>-N`` checkpoints that ``infos`` does not list and no interrupted save left.

        Checkpoint.save of an older jaxckpt, Checkpoint.write, or a copy: as TensorFlow's managers
        never delete what they do not track, a manager adopts them (by number, saved "now" unless the
        index says when) instead of refusing or deleting them. A save of jaxckpt's own that a crash
        interrupted before the state file listed it still has its mark (_statefile.UNRECORDED).
        """
        listed = {os.path.basename(c.path) for c in infos}
        found = []
        for name in _storage.children(self._path):
            match = self._numbered.fullmatch(name)
            if match is None or name in listed:
                continue
            folder = self._path / name
            if not _storage.is_checkpoint(folder):
                continue  # incomplete: _remove_leftovers removes it
            if folder.local is not None and (folder.local / _statefile.UNRECORDED).exists():
                continue  # an interrupted save of a manager or of Checkpoint.save: garbage
            when = self._clock()
            if folder.local is not None:
                try:
                    when = min(when, (folder.local / _storage.INDEX_FILE).stat().st_mtime)
                except OSError:
                    pass
            found.append(CheckpointInfo(os.path.join(self._directory, name), int(match.group(1)), when))
        return sorted(found, key=lambda c: c.step)

    def _adopt_empty_directory(self) -> list[CheckpointInfo]:
        """Record a state file (listing what it adopts), so that a crash during the first save leaves clear garbage."""
        adopted = self._unlisted_checkpoints([])
        _write_state(self._path, adopted, self._last_preserved)
        return adopted

    def _adopt_unlisted(self, infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
        """Add the unlisted complete checkpoints to the state file: older-numbered ones first, newer ones last."""
        adopted = self._unlisted_checkpoints(infos)
        if not adopted:
            return infos
        numbers = [int(m.group(1)) for c in infos if (m := self._numbered.fullmatch(os.path.basename(c.path)))]
        top = max(numbers, default=-1)
        merged = [c for c in adopted if c.step <= top] + infos + [c for c in adopted if c.step > top]
        _write_state(self._path, merged, self._last_preserved)
        return merged

    def _remove_leftovers(self) -> None:
        """Remove what crashed saves and deletions left: never a listed checkpoint, never a user's file.

        Only names that jaxckpt makes, with its tokens: temp state files (regular files only), this
        name's staging and replaced folders, and this name's numbered folders that nothing lists.
        """
        listed = {os.path.basename(c.path) for c in self._infos}
        marks = f"{re.escape(_staging.PARTIAL_MARK)}|{re.escape(_staging.REPLACED_MARK)}"  # see _staging.staging_folder and publish
        staging = re.compile(rf"\.{re.escape(self._name)}-[0-9]+({marks})[0-9a-f]{{12}}")
        for name in _storage.children(self._path):
            if TEMP_FILE.fullmatch(name):
                if self._path.local is not None:
                    path = self._path.local / name
                    if path.is_file() and not path.is_symlink():
                        path.unlink(missing_ok=True)
            elif staging.fullmatch(name) or (self._numbered.fullmatch(name) and name not in listed):
                _storage.delete_tree(self._path / name)
            elif name in listed:  # listed, but a crash came before its mark was dropped
                _statefile.clear_unrecorded(self._path / name)

    # --- properties --------------------------------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint_interval(self) -> int | None:
        return self._interval

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
        return self._read_only

    # --- saving and restoring ----------------------------------------------------------------------

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its prefix; without one, call ``init_fn`` and return None."""
        self._background.wait()
        latest = self._infos[-1].path if self._infos else None
        if latest is not None:
            self._checkpoint.restore(latest)
            self._restored()
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def _current_step(self) -> int | None:
        counter = self._step_counter
        if counter is None:
            return None
        value = getattr(self._checkpoint, counter) if isinstance(counter, str) else counter()
        try:
            return operator.index(value)
        except TypeError:
            raise TypeError(f"The step counter {counter!r} gave {value!r}, which is not an integer step.") from None

    def save(
        self,
        checkpoint_number: int | None = None,
        check_interval: bool = True,
        *,
        step: int | None = None,
        force: bool = False,
        metrics: Mapping[str, Any] | None = None,
    ) -> str | None:
        """Write a new checkpoint, record it, and apply retention; returns its prefix.

        With ``checkpoint_interval``, returns None without saving, as TensorFlow's manager does, when
        the step is the one this manager last saved or restored (see :meth:`restore_or_initialize`),
        or, unless ``check_interval=False``, fewer than ``checkpoint_interval`` steps after it; a
        manager that has neither saved nor restored yet saves. It also returns None when
        :meth:`should_save` says no (``save_interval_steps``). ``force=True`` saves regardless.
        ``checkpoint_number`` names it (``save(checkpoint_number=n)`` gives ``ckpt-<n>``); numbers already
        listed are refused. ``step=s``, as Orbax's managers take it, names it ``ckpt-<s>`` and records
        ``s`` as its step (no ``step_counter`` needed). ``metrics`` are recorded for :class:`KeepBest`
        and :attr:`checkpoint_infos`.
        """
        if step is not None:
            step = operator.index(step)
            if checkpoint_number is not None and operator.index(checkpoint_number) != step:
                raise ValueError(f"save(checkpoint_number={checkpoint_number}, step={step}): give one of them.")
        if self._read_only:
            raise ManagerLockedError(
                f"This manager of {self._directory!r} was created with read_only=True: it restores, and never saves. "
                "Create one without read_only to save."
            )
        if not self._release.alive:
            raise ManagerLockedError(f"This manager of {self._directory!r} is closed; create a new one to save.")
        if self._lock is not None and not self._lock.held:
            raise ManagerLockedError(
                f"This manager of {self._directory!r} was created in process {self._lock._pid}, and this is a forked "
                "child of it, which does not hold its lock. Save from the parent, or create a manager here."
            )
        # Every process of a multi-process run goes through this save's agreement exactly once, even
        # when its part fails, so that no save after it waits for a process that is a save behind.
        taken = _multihost.tokens_taken()
        try:
            prepared = self._prepare(checkpoint_number, step, force, metrics, check_interval)
        except Exception as e:
            token = _multihost.abandon(taken, e)
            self._discard(token)
            raise
        if prepared is None:
            return None
        prepared, info = prepared
        try:
            _multihost.agree(prepared.token)
        except BaseException:
            self._checkpoint.save_counter = self._counter_before
            self._last_checkpoint_step = self._last_before
            self._discard(prepared.token)
            raise
        if self._async:
            self._background.submit(lambda: self._finish(prepared, info))
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
    ) -> tuple[_save.Prepared, CheckpointInfo] | None:
        """Number the checkpoint and snapshot it; None when ``checkpoint_interval`` or
        ``save_interval_steps`` says not yet."""
        self._pending_path = None
        self._background.wait()  # the previous save is recorded (or its error raised) before numbering
        step = self._current_step() if explicit_step is None else explicit_step
        if explicit_step is not None:
            checkpoint_number = explicit_step
        # Every process sees the same steps, so all skip a save alike.
        last = self._last_before = self._last_checkpoint_step
        if not force and self._interval is not None and last is not None:
            if step == last or (check_interval and step < last + self._interval):
                return None
        by_step = explicit_step is not None or self._every is not None  # Orbax's rule, not only TF's interval
        if not force and step is not None and by_step and not self._should_save(step):
            return None
        recorded = _metrics(metrics)  # refuse bad metrics before anything is written
        counter = self._counter_before = self._checkpoint.save_counter
        if checkpoint_number is None:
            taken = [int(m.group(1)) for c in self._infos if (m := self._numbered.fullmatch(os.path.basename(c.path)))]
            number = max(counter + 1, max(taken, default=0) + 1)
        else:
            number = operator.index(checkpoint_number)
            if number < 0:
                raise ValueError(f"checkpoint_number must be >= 0, not {number}.")
        path = os.path.join(self._directory, f"{self._name}-{number}")
        if any(c.path == path for c in self._infos):
            raise CheckpointExistsError(f"{path!r} is already a kept checkpoint; checkpoint numbers must be new.")
        self._checkpoint._settle(path)  # what earlier restores left unused, as Checkpoint.save says it
        # Like Checkpoint.save, the counter advances before the snapshot, so that the checkpoint holds it.
        self._checkpoint.save_counter = number if checkpoint_number is None else counter + 1
        self._pending_path = path
        try:
            prepared = _save.prepare(path, self._checkpoint)
        except BaseException:
            self._checkpoint.save_counter = counter
            raise
        if self._interval is not None:
            self._last_checkpoint_step = step
        return prepared, CheckpointInfo(path, number if step is None else step, self._clock(), recorded)

    # --- the Orbax-style surface: checkpoints by step ---------------------------------------------

    def _should_save(self, step: int) -> bool:
        latest = self._infos[-1].step if self._infos else None
        return (latest is None or step > latest) and step % (self._every or 1) == 0

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would save at ``step``, as Orbax's managers decide: ``step`` is past
        the latest checkpoint's step and divisible by ``save_interval_steps`` (any step without one),
        or a preemption notice asks for a save at this step."""
        self._background.settle()
        if self._preemption is not None and self._preemption.reached_preemption(step):
            return True
        return self._should_save(operator.index(step))

    def all_steps(self) -> list[int]:
        """The steps of the kept checkpoints, oldest first (waits as ``latest_checkpoint``)."""
        self._background.settle()
        return [c.step for c in self._infos]

    def latest_step(self) -> int | None:
        """The step of the latest checkpoint, or None (waits as ``latest_checkpoint``)."""
        self._background.settle()
        return self._infos[-1].step if self._infos else None

    def restore(self, step: int | None = None) -> RestoreStatus:
        """Restore the checkpoint of ``step`` (the latest without one) into :attr:`checkpoint`; returns
        the restore status, as :meth:`Checkpoint.restore` does. Raises CheckpointNotFoundError, naming
        the kept steps, if there is no such checkpoint."""
        self._background.wait()
        matches = [c for c in self._infos if step is None or c.step == operator.index(step)]
        if not matches:
            raise CheckpointNotFoundError(
                f"{self._directory!r} has no checkpoint"
                + ("" if step is None else f" of step {step}; its kept steps are {[c.step for c in self._infos]}")
                + ". Save one first, or restore from another directory."
            )
        status = self._checkpoint.restore(matches[-1].path)
        self._restored()
        return status

    def _restored(self) -> None:
        """As TF's restore_or_initialize: the interval counts from the restored step."""
        if self._interval is not None:
            self._last_checkpoint_step = self._current_step()

    def _discard(self, token: str | None) -> None:
        """Primary: remove a staging folder that a save every process abandoned may have left."""
        path = getattr(self, "_pending_path", None)
        if token is None or path is None or not self._primary or self._path.local is None:
            return
        _staging.discard_staging(_storage.location(path), token)

    def _finish(self, prepared: _save.Prepared, info: CheckpointInfo) -> None:
        """Write the checkpoint, then list it, then delete what retention lets go (in this order)."""
        if self._primary:
            _statefile.mark_unrecorded(prepared.staging)  # until listed: see _unlisted_checkpoints
        _save.finish(prepared)
        # Written and durable: now it may be listed. If recording fails, the unlisted folder is
        # garbage that the next manager removes.
        candidates = [*self._infos, info]
        if self._primary:
            kept, last_preserved = self._retain(candidates)
            # Marked before the state file stops listing them, so that a crash before they are gone
            # leaves garbage the next manager removes, not checkpoints it would adopt.
            kept_names = {c.path for c in kept}
            for c in candidates[:-1]:
                if c.path not in kept_names:
                    _statefile.mark_unrecorded(self._path / os.path.basename(c.path))
            try:
                _write_state(self._path, kept, last_preserved)
            except BaseException as e:
                _multihost.publish_kept(prepared.token, None, f"{type(e).__name__}: {e}")
                raise
            # The others follow process 0's decision, made with its clock and its metrics.
            _multihost.publish_kept(prepared.token, self._rows(kept), None)
            self._last_preserved = last_preserved
            _statefile.clear_unrecorded(self._path / os.path.basename(info.path))
        else:
            kept = self._adopt(_multihost.kept(prepared.token), candidates)
        self._infos = kept
        if self._primary:
            kept_paths = {c.path for c in kept}
            for c in candidates:
                if c.path not in kept_paths:
                    try:
                        _remove_tree(self._path / os.path.basename(c.path))
                    except OSError as e:  # not listed any more, so the next manager removes it
                        warnings.warn(f"Could not delete the old checkpoint {c.path!r}: {e}", stacklevel=2)
        # No process is done with a save before the state file lists it: a process that reads the
        # state file next (latest_checkpoint) must not find the previous one, perhaps being deleted.
        _multihost.barrier(f"{prepared.token}/recorded")
        if self._primary:
            _multihost.forget_kept(prepared.token)  # every process has it: keep the key-value store small

    @staticmethod
    def _rows(infos: list[CheckpointInfo]) -> list[dict[str, Any]]:
        return [
            {
                "prefix": os.path.basename(c.path),
                "step": c.step,
                "time": c.time,
                "metrics": c.metrics,
                "preserved": c.preserved,
            }
            for c in infos
        ]

    def _adopt(self, rows: list[dict[str, Any]] | None, candidates: list[CheckpointInfo]) -> list[CheckpointInfo]:
        if rows is None:  # one process: nothing was published
            return self._retain(candidates)[0]
        return [
            CheckpointInfo(
                os.path.join(self._directory, r["prefix"]),
                r["step"],
                r["time"],
                dict(r["metrics"]),
                bool(r.get("preserved", False)),
            )
            for r in rows
        ]

    def wait_until_finished(self) -> None:
        """Block until the background save is done and recorded; raise its error if it failed."""
        self._background.wait()

    # --- preemption --------------------------------------------------------------------------------

    def reached_preemption(self, step: int | None = None) -> bool:
        """Whether a preemption notice (SIGTERM) came and ``step`` is the step to save at.

        ``step`` defaults to the step counter's value. In a multi-process run every process must
        call this at every step with the same step numbers; it is True at the same step on all of
        them. Needs ``save_on_preemption=True``.
        """
        if self._preemption is None:
            raise ValueError("reached_preemption needs a manager created with save_on_preemption=True.")
        if step is None:
            step = self._current_step()
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
        """At a step boundary: after a preemption notice, save, wait until durable, close and exit.

        Returns at once (None) while there is no notice. Otherwise it saves (unless the latest
        checkpoint already holds this step), waits for the save, closes the manager and raises
        ``SystemExit(exit_code)``, so ``finally`` blocks and ``with`` statements still run.
        ``step`` is as for :meth:`reached_preemption`; ``checkpoint_number`` and ``metrics`` as
        for :meth:`save`.
        """
        if not self.reached_preemption(step):
            return
        self._background.wait()
        counted = self._step_counter is not None and self._infos  # steps in the state file are comparable
        if not (counted and self._infos[-1].step == self._current_step()):
            self.save(checkpoint_number, force=True, metrics=metrics)
        self.close()  # waits for the save; raises its error instead of exiting cleanly
        raise SystemExit(exit_code)

    def _retain(self, candidates: list[CheckpointInfo]) -> tuple[list[CheckpointInfo], float]:
        """What to keep, and the new ``last_preserved_time``.

        Preserved checkpoints are out of every policy's sight and always kept. Of the others (TF's
        active set), the policies keep some and the latest is always kept; as in TensorFlow's
        manager, each one dropped is instead preserved, oldest first, if it was saved at least
        ``keep_checkpoint_every_n_hours`` after the last preserved one.
        """
        last_preserved = self._last_preserved
        active = [c for c in candidates if not c.preserved]
        if not self._policies:
            return candidates, last_preserved
        frozen = tuple(active)
        keep = {c.path for p in self._policies for c in p.keep(frozen)} | {candidates[-1].path}
        out = []
        for c in candidates:
            if c.preserved or c.path in keep:
                out.append(c)
            elif self._hours is not None and c.time - self._hours * 3600.0 >= last_preserved:
                last_preserved = c.time
                out.append(dataclasses.replace(c, preserved=True))
        return out, last_preserved

    # --- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the background save, then release the directory's lock.

        Reading ``checkpoints`` still works afterwards; saving does not. Raises the background
        save's error, if any, after releasing the lock. If the wait is interrupted (Ctrl-C), the
        lock stays held while the save still writes, and the manager stays open: call ``close()``
        again, or exit (Python finishes the save at exit first; the kernel drops the lock when the
        process ends).
        """
        self._close(report=True)

    def _close(self, *, report: bool) -> None:
        try:
            self._background.wait()
        finally:
            if not self._background.pending:
                self._release()
                if self._preemption is not None:
                    self._preemption.close()
        if report:  # the end of training: what a restore left unused is said now at the latest
            self._checkpoint._settle(final=True)

    def __enter__(self) -> CheckpointManager:
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
