"""``CheckpointManager``: numbered checkpoints in one directory, retention, and the state file.

The directory belongs to its manager::

    ckpts/
      checkpoint          the state file: which checkpoints exist (below)
      checkpoint.lock     present while a manager works here: {"pid", "hostname", "time", "token"}
      ckpt-4/  ckpt-5/    the kept checkpoints, each a folder with index.json

The state file is the only source of truth for which checkpoints exist; no directory listing decides
it. It is JSON, format version 1, with prefixes relative to the directory, oldest first::

    {
      "format": "jaxckpt-manager-state",
      "version": 1,
      "latest": "ckpt-5",
      "checkpoints": [
        {"prefix": "ckpt-4", "step": 400, "time": 1718000000.0, "metrics": {"loss": 0.25}},
        {"prefix": "ckpt-5", "step": 500, "time": 1718000360.5, "metrics": {}}
      ]
    }

``step`` is the step counter's value at save (or the checkpoint number without one), ``time`` is Unix
seconds, ``metrics`` what ``save(metrics=...)`` got (a non-finite value is ``null``). Readers ignore
unknown fields; a newer ``version`` is refused.

Crash safety comes from the order of a save: the checkpoint is written and published (every byte
durable) first; then the state file is replaced atomically (temp file, fsync, rename, fsync of the
directory) to list it and drop what retention lets go; only then are dropped checkpoints deleted.
A crash at any instant therefore leaves every listed checkpoint whole. What a crash can leave behind
(staging folders ``.ckpt-N.partial-*``, temp state files, unlisted ``ckpt-N`` folders) is removed by
the next manager when it starts.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import shutil
import socket
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxckpt import _multihost, _save, _storage
from jaxckpt._async import Background
from jaxckpt._checkpoint import Checkpoint
from jaxckpt._errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    ManagerLockedError,
    UnsupportedValueError,
    UnsupportedVersionError,
)
from jaxckpt._policies import CheckpointInfo, KeepEvery, KeepLatest, RetentionPolicy
from jaxckpt._preemption import PreemptionHandler

PathLike = str | os.PathLike[str]
STATE_FILE = "checkpoint"
STATE_FORMAT = "jaxckpt-manager-state"
STATE_VERSION = 1
LOCK_FILE = "checkpoint.lock"
_PREFIX = re.compile(r"[^/\\\x00]+")  # one path component: a listed prefix can never point elsewhere


# --- the state file ----------------------------------------------------------------------------


def _bad_state(where: Path, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{str(where)!r} is not a valid jaxckpt manager state file: {why}. The checkpoints beside it are "
        "untouched; fix or remove the state file (removing it forgets every checkpoint it listed)."
    )


def _is_number(x: Any) -> bool:
    """A finite JSON number that fits a float (a 400-digit integer does not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _parse_entry(raw: Any, where: Path, directory: str) -> CheckpointInfo:
    if not isinstance(raw, dict):
        raise _bad_state(where, f"a checkpoint entry must be an object, not {raw!r}")
    prefix, step, when, metrics = (raw.get(k) for k in ("prefix", "step", "time", "metrics"))
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix) or prefix.startswith("."):
        raise _bad_state(where, f"prefix {prefix!r} is not the name of a folder in the directory")
    if isinstance(step, bool) or not isinstance(step, int):
        raise _bad_state(where, f"step of {prefix!r} must be an int, not {step!r}")
    if not _is_number(when):
        raise _bad_state(where, f"time of {prefix!r} must be a number, not {when!r}")
    if not isinstance(metrics, dict) or not all(v is None or _is_number(v) for v in metrics.values()):
        raise _bad_state(where, f"metrics of {prefix!r} must map names to numbers or null, not {metrics!r}")
    return CheckpointInfo(os.path.join(directory, prefix), step, float(when), dict(metrics))


def _read_state(directory: str) -> list[CheckpointInfo] | None:
    """The checkpoints the state file in ``directory`` lists, oldest first; None if it has none."""
    folder = _storage.location(directory)
    where = folder / STATE_FILE
    try:
        data = _storage.read_file(folder, STATE_FILE)
        if data is None:
            return None
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _bad_state(where, f"it cannot be read as UTF-8 text ({e})") from e
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, too deeply nested, or an integer of over 4300 digits
        hint = " (it looks like a TensorFlow state file)" if text.startswith("model_checkpoint_path") else ""
        raise _bad_state(where, f"it is not JSON{hint}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
        raise _bad_state(where, f'it has no "format": "{STATE_FORMAT}"')
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _bad_state(where, f"its version {version!r} is not a positive int")
    if version > STATE_VERSION:
        raise UnsupportedVersionError(
            f"{str(where)!r} has state file version {version}, written by a newer jaxckpt; this one reads "
            f"version {STATE_VERSION} at most. Upgrade jaxckpt to use this directory."
        )
    entries = doc.get("checkpoints")
    if not isinstance(entries, list):
        raise _bad_state(where, '"checkpoints" must be a list')
    infos = [_parse_entry(raw, where, directory) for raw in entries]
    names = [os.path.basename(c.path) for c in infos]
    if len(set(names)) != len(names):
        raise _bad_state(where, "a prefix is listed twice")
    latest = doc.get("latest")
    if latest != (names[-1] if names else None):
        raise _bad_state(where, f'"latest" is {latest!r}, but the last listed checkpoint is {names[-1:]}')
    return infos


def _write_state(directory: _storage.Location, infos: Sequence[CheckpointInfo]) -> None:
    """Replace the state file atomically: a crash leaves the old one or the new one, never a mix."""
    names = [os.path.basename(c.path) for c in infos]
    rows = [{"prefix": n, "step": c.step, "time": c.time, "metrics": dict(c.metrics)} for n, c in zip(names, infos)]
    # One checkpoint per line, so that the file reads well in a terminal and diffs well.
    body = ",\n".join(f"    {json.dumps(r, allow_nan=False)}" for r in rows)
    head = {"format": STATE_FORMAT, "version": STATE_VERSION, "latest": names[-1] if names else None}
    text = json.dumps(head, indent=2)[:-2] + ',\n  "checkpoints": [' + (f"\n{body}\n  ]" if rows else "]") + "\n}\n"
    _storage.write_file_atomic(directory, STATE_FILE, text.encode("utf-8"))


def latest_checkpoint(directory: PathLike) -> str | None:
    """The latest checkpoint a manager recorded in ``directory``, or None if there is none.

    Reads only the state file (no lock needed: it is replaced atomically)::

        path = jaxckpt.latest_checkpoint("ckpts")   # "ckpts/ckpt-10"
        if path is not None:
            ckpt.restore(path)
    """
    infos = _read_state(os.fspath(directory))
    return infos[-1].path if infos else None


# --- the lock ----------------------------------------------------------------------------------

_HELD: set[str] = set()  # tokens of the locks that managers in this process hold


def _read_lock(path: Path) -> dict[str, Any] | None:
    """The lock's record; None if there is no lock, {} if it cannot be parsed."""
    try:
        doc = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _create_lock(path: Path, record: dict[str, Any]) -> bool:
    """Create the lock holding ``record``; False if it exists. Atomic, on NFS too."""
    data = json.dumps(record).encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp-{record['token']}")
    _storage.write_durable(tmp, data)
    try:
        # A hard link appears whole or not at all, so nobody ever reads a half-written lock.
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _is_stale(owner: dict[str, Any]) -> bool:
    pid = owner.get("pid")
    if owner.get("hostname") != socket.gethostname() or isinstance(pid, bool) or not isinstance(pid, int):
        return False  # a process on another host: we cannot tell whether it lives
    if pid == os.getpid():
        # Our own pid, but no manager of ours holds it: a previous process with the same pid
        # (containers restart their job as pid 1 every time).
        return owner.get("token") not in _HELD
    return not _pid_alive(pid)


def _acquire_lock(path: Path) -> str:
    token = uuid.uuid4().hex
    record = {"pid": os.getpid(), "hostname": socket.gethostname(), "time": time.time(), "token": token}
    for _ in range(5):
        if _create_lock(path, record):
            _HELD.add(token)
            return token
        owner = _read_lock(path)
        if owner is None:
            continue  # released while we looked
        if not _is_stale(owner):
            who = f"process {owner.get('pid')} on host {owner.get('hostname')!r}" if owner else "an unknown writer"
            raise ManagerLockedError(
                f"Another CheckpointManager ({who}) holds {str(path.parent)!r}: its lock file {str(path)!r} "
                "exists. Two managers in one directory would delete each other's checkpoints. Close the other "
                "manager, or, if no job uses this directory any more, delete the lock file."
            )
        # Move the stale lock aside rather than delete it: if a rival took it over since we read it,
        # we see that in what we moved, and put its lock back.
        aside = path.with_name(f".{path.name}.stale-{token}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        if _read_lock(aside) != owner:
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)
    raise ManagerLockedError(f"Could not take the lock {str(path)!r}: other processes keep competing for it.")


def _release_lock(path: str, token: str) -> None:
    """Remove the lock if it is still ours. Runs on close, when the manager is collected, and at exit."""
    _HELD.discard(token)
    owner = _read_lock(Path(path))
    if owner and owner.get("token") == token:
        Path(path).unlink(missing_ok=True)


# --- the manager -------------------------------------------------------------------------------


def _remove_tree(path: _storage.Location) -> None:
    if path.local is not None:
        shutil.rmtree(path.local)  # raises, unlike the best-effort clean-ups: a failure is reported
    else:
        _storage.delete_tree(path)


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

    Retention: ``max_to_keep=n`` is ``KeepLatest(n)``, ``keep_checkpoint_every_n_hours=h`` is
    ``KeepEvery(hours=h)``, and ``policies`` adds any others; a checkpoint is kept if any of them keeps
    it, and the latest is always kept. With none of the three, every checkpoint is kept.

    ``step_counter`` says where the training step is, for ``checkpoint_interval`` and the state file:
    the name of a child of ``checkpoint`` (``"step"``; read at each save, so it follows restores and
    reassignments, which matters since JAX values are immutable and get replaced, not updated), or a
    callable returning it. Without ``checkpoint_number``, checkpoints are numbered by ``checkpoint``'s
    ``save_counter``, which each save advances and which is saved with the checkpoint; if it lags
    behind the numbers already listed (a new job that did not restore), numbering continues after them.

    Only one manager may work in a directory at a time (a lock file, released by :meth:`close`, at
    the end of a ``with`` block, and at interpreter exit; a lock left by a dead process on this host
    is taken over). ``clock`` (Unix seconds) is for tests.

    Saves are asynchronous unless ``async_save=False``: :meth:`save` returns once the values are
    snapshotted, and writing, the state file and retention run in the background. The next save,
    :meth:`restore_or_initialize`, :meth:`wait_until_finished` and :meth:`close` wait for it and raise
    its error if it failed; ``latest_checkpoint`` and ``checkpoints`` list finished saves only.

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
        init_fn: Callable[[], Any] | None = None,
        policies: Sequence[RetentionPolicy] = (),
        async_save: bool = True,
        save_on_preemption: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not _PREFIX.fullmatch(checkpoint_name) or checkpoint_name.startswith("."):
            raise ValueError(f"checkpoint_name {checkpoint_name!r} must be a plain file name, like 'ckpt'.")
        if checkpoint_interval is not None:
            if step_counter is None:
                raise ValueError("checkpoint_interval needs a step_counter to measure the interval with.")
            if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int):
                raise ValueError(f"checkpoint_interval must be an int, not {checkpoint_interval!r}.")
        if step_counter is not None and not (isinstance(step_counter, str) or callable(step_counter)):
            raise TypeError(f"step_counter must be a child name or a callable, not {step_counter!r}.")
        self._policies: list[RetentionPolicy] = list(policies)
        for p in self._policies:
            if not callable(getattr(p, "keep", None)):
                raise TypeError(f"{p!r} is not a retention policy: it has no keep(checkpoints) method.")
        if max_to_keep is not None:
            self._policies.append(KeepLatest(max_to_keep))
        if keep_checkpoint_every_n_hours is not None:
            self._policies.append(KeepEvery(hours=keep_checkpoint_every_n_hours))
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._name = checkpoint_name
        self._numbered = re.compile(rf"{re.escape(checkpoint_name)}-([0-9]+)")
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._clock = clock
        self._async = async_save
        self._background = Background("CheckpointManager")
        self._preemption: PreemptionHandler | None = None
        self._path = _storage.location(directory)
        if self._path.local is not None:
            try:
                self._path.local.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as e:  # a file where a folder must be
                raise CheckpointExistsError(
                    f"A CheckpointManager keeps its checkpoints in a directory, and {self._directory!r} cannot be "
                    f"one: {e.strerror} ({e.filename!r}). Choose another directory."
                ) from None
        # In a multi-process run, only the primary owns the directory: it holds the lock, writes the
        # state file and deletes; the others keep the same list of checkpoints in memory.
        self._primary = _multihost.is_primary()
        # Object stores have no atomic create-if-absent that every S3-compatible store honours, so the
        # lock guards local directories only (see the README).
        if self._primary and self._path.local is not None:
            lock = self._path.local / LOCK_FILE
            self._release = weakref.finalize(self, _release_lock, str(lock), _acquire_lock(lock))
        else:
            self._release = weakref.finalize(self, lambda: None)
        try:
            infos = _read_state(self._directory)
            if infos is None:
                if self._primary:
                    self._adopt_empty_directory()
                infos = []
            self._infos: list[CheckpointInfo] = infos
            if self._primary:
                self._remove_leftovers()
            # Last, so that a manager that fails to start leaves SIGTERM alone (close() puts it back).
            if save_on_preemption:
                self._preemption = PreemptionHandler()
        except BaseException:
            self.close()
            raise

    # --- start-up ----------------------------------------------------------------------------------

    def _adopt_empty_directory(self) -> None:
        """Record an empty state file, so that a crash during the first save leaves clear garbage."""
        found = [name for name in _storage.children(self._path) if self._numbered.fullmatch(name)]
        if found:
            # Checkpoints saved without a manager (Checkpoint.save names them the same way). A manager
            # deletes unlisted checkpoints, so it must not adopt a directory that holds some.
            raise CheckpointExistsError(
                f"{self._directory!r} holds checkpoints {found[:5]} but no state file {STATE_FILE!r}, so no "
                "manager recorded them and a manager would delete them. Move them elsewhere, or use another "
                "directory or checkpoint_name."
            )
        _write_state(self._path, [])

    def _remove_leftovers(self) -> None:
        """Remove what crashed saves and deletions left: never a listed checkpoint."""
        listed = {os.path.basename(c.path) for c in self._infos}
        marks = f"{re.escape(_storage.PARTIAL_MARK)}|{re.escape(_storage.REPLACED_MARK)}"  # see _storage.staging_folder and publish
        staging = re.compile(rf"\.{re.escape(self._name)}-[0-9]+({marks}).*")
        for name in _storage.children(self._path):
            if _storage.is_temp_file(name) and self._path.local is not None:
                (self._path.local / name).unlink(missing_ok=True)
            elif staging.fullmatch(name) or (self._numbered.fullmatch(name) and name not in listed):
                _storage.delete_tree(self._path / name)

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
        """The prefix of the latest checkpoint (``"ckpts/ckpt-10"``), or None; waits for a background save."""
        self._background.wait()
        return self._infos[-1].path if self._infos else None

    @property
    def checkpoints(self) -> list[str]:
        """Prefixes of the kept checkpoints, oldest first; waits for a background save."""
        self._background.wait()
        return [c.path for c in self._infos]

    @property
    def checkpoint_infos(self) -> list[CheckpointInfo]:
        """The kept checkpoints with their step, time and metrics, oldest first; waits for a background save."""
        self._background.wait()
        return list(self._infos)

    # --- saving and restoring ----------------------------------------------------------------------

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its prefix; without one, call ``init_fn`` and return None."""
        self._background.wait()
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
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
        self, checkpoint_number: int | None = None, *, force: bool = False, metrics: Mapping[str, Any] | None = None
    ) -> str | None:
        """Write a new checkpoint, record it, and apply retention; returns its prefix.

        Returns None without saving when ``checkpoint_interval`` steps have not passed since the latest
        checkpoint, unless ``force=True``. ``checkpoint_number`` names it (``save(checkpoint_number=step)``
        gives ``ckpt-<step>``); numbers already listed are refused. ``metrics`` are recorded for
        :class:`KeepBest` and :attr:`checkpoint_infos`.
        """
        if not self._release.alive:
            raise ManagerLockedError(f"This manager of {self._directory!r} is closed; create a new one to save.")
        self._background.wait()  # the previous save is recorded (or its error raised) before numbering
        step = self._current_step()
        if not force and self._interval is not None and self._infos and step < self._infos[-1].step + self._interval:
            return None
        recorded = _metrics(metrics)  # refuse bad metrics before anything is written
        counter = self._checkpoint.save_counter
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
        # Like Checkpoint.save, the counter advances before the snapshot, so that the checkpoint holds it.
        self._checkpoint.save_counter = number if checkpoint_number is None else counter + 1
        try:
            prepared = _save.prepare(path, self._checkpoint)
        except BaseException:
            self._checkpoint.save_counter = counter
            raise
        info = CheckpointInfo(path, number if step is None else step, self._clock(), recorded)
        if self._async:
            self._background.submit(lambda: self._finish(prepared, info))
        else:
            self._finish(prepared, info)
        return path

    def _finish(self, prepared: _save.Prepared, info: CheckpointInfo) -> None:
        """Write the checkpoint, then list it, then delete what retention lets go (in this order)."""
        _save.finish(prepared)
        # Written and durable: now it may be listed. If recording fails, the unlisted folder is
        # garbage that the next manager removes.
        candidates = [*self._infos, info]
        kept = self._retain(candidates)
        if self._primary:
            _write_state(self._path, kept)
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

    def _retain(self, candidates: list[CheckpointInfo]) -> list[CheckpointInfo]:
        if not self._policies:
            return candidates
        frozen = tuple(candidates)
        keep = {c.path for p in self._policies for c in p.keep(frozen)} | {candidates[-1].path}
        return [c for c in candidates if c.path in keep]

    # --- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the background save, then release the directory's lock.

        Reading ``checkpoints`` still works afterwards; saving does not. Raises the background
        save's error, if any, after releasing the lock.
        """
        try:
            self._background.wait()
        finally:
            self._release()
            if self._preemption is not None:
                self._preemption.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if not self._release.alive else f"{len(self._infos)} kept"
        return f"CheckpointManager({self._directory!r}, latest={self.latest_checkpoint!r}, {state})"
