"""After a manager's save: which checkpoints stay, recording that, and deleting the rest, in a crash-safe order.

The checkpoint is written and published (every byte durable) first, marked ``.jaxckpt-unrecorded``
inside (see :func:`jaxckpt.storage.statefile.mark_unrecorded`); then :func:`record` replaces the state file
atomically (temp file, fsync, rename, fsync of the directory) to list it and drop what retention
lets go, each dropped one marked first (in a bucket too: one small object); only then are marks
cleared and the dropped checkpoints deleted, by the manager's :class:`Deleter`, in the background:
a bucket deletes one object per request, and a large local folder takes a while too, so the save
(and the next one) does not wait for it. Each is made not a checkpoint in one step before the rest
goes: a local folder is renamed away, a bucket's ``index.json`` is deleted first. A crash at any
instant therefore leaves every listed checkpoint whole, and only garbage that the next manager
removes (see :mod:`jaxckpt.manager.startup`): a marked checkpoint, or a prefix without an index.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxckpt._errors import CheckpointNotFoundError, JaxckptError, ManagerLockedError, StorageError, caller_level
from jaxckpt.format.records import INDEX_FILE
from jaxckpt.incremental import refs
from jaxckpt.manager.policies import RetentionPolicy
from jaxckpt.runtime import multihost
from jaxckpt.runtime.background import Background
from jaxckpt.saving import staging
from jaxckpt.storage import kvstore, local_tree, locations, statefile
from jaxckpt.storage.statefile import CheckpointInfo

if TYPE_CHECKING:
    from jaxckpt.manager.options import ManagerOptions
    from jaxckpt.storage.lock import Lock

# Numbers the deletions' barriers alike on every process (each calls delete in the same order).
_deletions = itertools.count()


class Retained(NamedTuple):
    """What retention keeps, oldest first, and the new ``last_preserved_time``."""

    kept: list[CheckpointInfo]
    last_preserved: float


def retain(
    candidates: Sequence[CheckpointInfo],
    policy: RetentionPolicy | None,
    hours: float | None,
    last_preserved: float,
    also_keep: Collection[str] = (),
    foreign: Collection[str] = (),
) -> Retained:
    """What to keep of ``candidates`` (oldest first, the new checkpoint last).

    Preserved checkpoints, and the ``foreign`` ones (paths of another ``checkpoint_name``, which
    ``Checkpoint.save`` under another prefix or another manager listed), are out of every policy's
    sight and always kept. Of the others (TF's active set), ``policy`` keeps some and the latest is
    always kept; as in TensorFlow's manager, each one dropped is instead preserved, oldest first, if
    it was saved at least ``hours`` (``keep_checkpoint_every_n_hours``) after the last preserved one.
    Without a policy, all stay. The paths in ``also_keep`` stay this time whatever the policy (a
    local checkpoint that is still being copied to the durable tier).
    """
    if policy is None:
        return Retained(list(candidates), last_preserved)
    active = tuple(c for c in candidates if not c.preserved and c.path not in foreign)
    keep = {c.path for c in policy.keep(active)} | {candidates[-1].path} | set(also_keep) | set(foreign)
    out = []
    for c in candidates:
        if c.preserved or c.path in keep:
            out.append(c)
        elif hours is not None and c.time - hours * 3600.0 >= last_preserved:
            last_preserved = c.time
            out.append(dataclasses.replace(c, preserved=True))
    return Retained(out, last_preserved)


def record(
    folder: locations.Location,
    candidates: Sequence[CheckpointInfo],
    retained: Retained,
    token: str,
    *,
    publish: bool = True,
) -> None:
    """Primary: list what ``retained`` keeps in the state file of ``folder`` (the new checkpoint is
    ``candidates[-1]``), and publish that list to the other processes of the save ``token``."""
    # Marked before the state file stops listing them, so that a crash before they are gone
    # leaves garbage the next manager removes, not checkpoints it would adopt.
    kept_paths = {c.path for c in retained.kept}
    dropped = [folder / os.path.basename(c.path) for c in candidates[:-1] if c.path not in kept_paths]
    for checkpoint in dropped:
        mark_dropped(checkpoint)
    try:
        statefile.write_state(folder, retained.kept, retained.last_preserved)
    except BaseException as e:
        for checkpoint in dropped:  # still listed: a mark would make it garbage if the state file went
            _clear_mark(checkpoint)
        if publish:
            multihost.publish_kept(token, None, f"{type(e).__name__}: {e}")
        raise
    # The others follow process 0's decision, made with its clock and its metrics.
    if publish:
        multihost.publish_kept(token, retained.kept, None)
    statefile.clear_unrecorded(folder / os.path.basename(candidates[-1].path))


def mark_dropped(checkpoint: locations.Location) -> None:
    """Mark ``checkpoint`` as not listed, before the state file drops it: a local folder as
    :func:`jaxckpt.storage.statefile.mark_unrecorded` does, a prefix in a bucket with an object of that name
    (one request; a bucket checkpoint whose deletion a crash interrupted before its index went would
    otherwise be adopted again)."""
    if checkpoint.local is not None:
        statefile.mark_unrecorded(checkpoint)
    elif locations.is_checkpoint(checkpoint):
        kvstore.kv_write(checkpoint.spec(), statefile.UNRECORDED, b"dropped by retention; being deleted\n")


def _clear_mark(checkpoint: locations.Location) -> None:
    try:
        if checkpoint.local is not None:
            statefile.clear_unrecorded(checkpoint)
        else:
            kvstore.kv_delete(checkpoint.spec(), statefile.UNRECORDED)
    except (OSError, JaxckptError):
        pass  # best effort: the state file's failure is the news


class Deleter:
    """One manager's deletions of the checkpoints its retention dropped, in the background, in order.

    One batch (the checkpoints one save dropped) runs at a time; :meth:`delete` waits for the one
    before, so that a store slower than the saves holds the saves back instead of growing a backlog
    of garbage. A failure to delete one checkpoint does not stop the others; failures are kept for
    :meth:`failures` (the manager warns at the next save and raises from ``wait_until_finished`` and
    ``close``, as for a failed copy to a durable tier). Local folders and buckets have a worker
    thread each (see :mod:`jaxckpt.runtime.background`), so that a slow bucket never holds up a local tier.
    """

    def __init__(self, folder: locations.Location) -> None:
        self._folder = folder
        self._background = Background(f"deleting old checkpoints in {str(folder)!r}", pool=_pool(folder))
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # names queued or being deleted
        self._failures: list[tuple[str, Exception]] = []

    @property
    def pending(self) -> bool:
        return self._background.pending

    def deleting(self, name: str) -> bool:
        """Whether the checkpoint ``name`` is queued or being deleted."""
        with self._lock:
            return name in self._pending

    def delete(self, names: Iterable[str], users: Mapping[str, Sequence[str]] | None = None) -> None:
        """Delete the checkpoints ``names`` (in ``folder``, no longer listed), after the previous batch.

        A local one is renamed away here (one step: its name is free when this returns), and deleted
        in the background; a bucket's in the background, its index first. ``users``
        (:func:`jaxckpt.incremental.refs.deletions`): the kept checkpoints that use each of them, whose data stays
        held, and the held data of others to prune as well."""
        names = list(names)
        users = dict(users or {})
        # Held data that no dropped checkpoint is: deleted only where provably this manager's.
        names += [n for n in users if n not in names and provably_held(self._folder / n)]
        if not names:
            return
        self._background.wait()  # raises only what is no storage failure (those are kept: _run)
        hidden = []
        for name in names:
            try:
                target = _hide(self._folder / name, keep_name=bool(users.get(name)))
            except (OSError, JaxckptError) as e:
                self._failed(name, e)
                continue
            if target is not None:
                hidden.append((name, target))
        if not hidden:
            return
        with self._lock:
            self._pending.update(name for name, _ in hidden)
        self._background.submit(lambda: self._run(hidden, users))

    def _run(self, hidden: list[tuple[str, locations.Location]], users: Mapping[str, Sequence[str]]) -> None:
        for name, target in hidden:
            try:
                if users.get(name):  # kept checkpoints use some of its data: that stays (held)
                    _erase(target, [self._folder / u for u in users[name]])
                else:
                    _erase(target)
            except (OSError, JaxckptError) as e:  # not listed any more, so the next manager removes it
                self._failed(name, e)
            finally:
                with self._lock:
                    self._pending.discard(name)

    def _failed(self, name: str, error: Exception) -> None:
        with self._lock:
            self._failures.append((name, error))

    def wait(self) -> None:
        """Block until every queued deletion is done (its storage failures stay for :meth:`failures`)."""
        self._background.wait()

    def failures(self) -> StorageError | None:
        """The failures since the last call, as one error naming them (None if there were none)."""
        with self._lock:
            failed, self._failures = self._failures, []
        if not failed:
            return None
        names = [str(self._folder / name) for name, _ in failed]
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        first = failed[0][1]
        return StorageError(
            f"Could not delete the old checkpoints {shown}, which retention dropped: {first}. They are no "
            "longer listed, so they are not checkpoints of this manager any more; the next manager that starts "
            "in this directory removes them (or remove them yourself).",
            getattr(first, "errno", None),
        )


def _pool(folder: locations.Location) -> str:
    return "delete" if folder.local is not None else "delete-bucket"


def dropped_names(candidates: Sequence[CheckpointInfo], kept: Sequence[CheckpointInfo]) -> list[str]:
    """The names of the candidates not kept (to delete once the state file no longer lists them)."""
    kept_paths = {c.path for c in kept}
    return [os.path.basename(c.path) for c in candidates if c.path not in kept_paths]


def remove_checkpoint(path: locations.Location, users: Sequence[locations.Location] = ()) -> None:
    """Remove what is left of a checkpoint at ``path`` (a manager's start-up), so that a crash midway
    never leaves a half-deleted one that looks whole (see :func:`_remove_tree`); best effort locally,
    as :func:`jaxckpt.storage.locations.delete_tree`. In a bucket, what ``users`` refer to stays (held data)."""
    if path.local is not None and (locations.is_symlink(path) or not path.local.is_dir()):
        locations.delete_tree(path)
        return
    try:
        _remove_tree(path, users)
    except OSError:
        if path.local is None:
            raise


def provably_held(path: locations.Location) -> bool:
    """Whether ``path``, held data that no listed checkpoint uses any more, is provably this manager's
    to delete: retention marked it when it dropped the checkpoint (the mark stays with held data, see
    :func:`jaxckpt.incremental.refs.prune`). A name that only a state file's ``uses`` gives is no proof."""
    try:
        return not locations.is_symlink(path) and statefile.is_marked(path)
    except (OSError, JaxckptError):
        return False


def _remove_tree(path: locations.Location, users: Sequence[locations.Location] = ()) -> None:
    target = _hide(path, keep_name=bool(users))
    if target is not None:
        _erase(target, users) if users else _erase(target)


def _hide(path: locations.Location, keep_name: bool = False) -> locations.Location | None:
    """The quick first step of removing a checkpoint; returns what is left to :func:`_erase` (None:
    nothing). ``keep_name``: kept checkpoints refer to its data by its name (held data stays there)."""
    if locations.is_symlink(path):
        # Another run's checkpoint linked here (adopted, then dropped): the link goes, in one step;
        # what it points to is never this directory's to delete.
        assert path.local is not None
        path.local.unlink()
        return None
    if path.local is not None and keep_name:
        # No rename: its index goes first (then it is no checkpoint), the rest but what is held after.
        (path.local / INDEX_FILE).unlink(missing_ok=True)
        return path
    if path.local is not None:
        # Renamed out of the way first, atomically: a crash midway through rmtree leaves a hidden
        # leftover that the next manager removes, never a half-deleted folder under the checkpoint's
        # name (which, with its index still there, would look complete and be adopted).
        hidden = path.local.with_name(f".{path.local.name}{staging.REPLACED_MARK}{secrets.token_hex(6)}")
        os.rename(path.local, hidden)
        return locations.Location(str(hidden), local=hidden)
    return path  # a bucket has no rename: see _erase


def _erase(target: locations.Location, users: Sequence[locations.Location] = ()) -> None:
    """The slow rest of removing a checkpoint: a renamed local folder, or a bucket's prefix (but
    the data that ``users``, kept checkpoints, refer to: see :mod:`jaxckpt.incremental.refs`)."""
    if target.local is not None:
        if users:  # its index is gone already (see _hide)
            refs.prune(target, users)
        else:
            _delete_renamed(target.local)
        return
    # No rename in a bucket: its index goes first, in one request, so that from then on the prefix
    # is no checkpoint (a reader, or the next manager, finds no index); the objects left are garbage
    # that the next manager removes, since nothing lists this prefix any more.
    kvstore.kv_delete(target.spec(), INDEX_FILE)
    if users:
        refs.prune(target, users)
    else:
        _delete_rest(target)


def _delete_rest(path: locations.Location) -> None:
    """Every object of ``path`` (its index gone already), one request each, the marks last (retention's,
    an interrupted save's): an interrupted deletion leaves objects that a mark still proves this
    manager's to remove."""
    base = path.spec()
    keys = kvstore.kv_keys(base)
    proofs = (statefile.UNRECORDED, staging.SAVE_MARKER)
    for key in [k for k in keys if k not in proofs] + [k for k in proofs if k in keys]:
        kvstore.kv_delete(base, key)


def _delete_renamed(hidden: Path) -> None:
    local_tree.rmtree(hidden)  # raises, unlike the best-effort clean-ups: a failure is reported


class RetentionCalls:
    """:class:`~jaxckpt.CheckpointManager`'s retention after a save, :meth:`delete`, and the deletions' failures."""

    # What the manager has that these calls use.
    _options: ManagerOptions
    _infos: list[CheckpointInfo]
    _path: locations.Location
    _directory: str
    _last_preserved: float
    _also_keep: set[str]
    _retention_lock: threading.RLock
    _deleter: Deleter
    _release: weakref.finalize
    _background: Background
    _lock: Lock | None
    _primary: bool
    _own_copy: bool
    _last_checkpoint_step: int | None
    _memory: Any

    def delete(self, step: int) -> None:
        """Delete the checkpoint of ``step`` (see :meth:`jaxckpt.CheckpointManager.delete`)."""
        step = operator.index(step)
        self._check_writable("delete")
        self._background.wait()
        if self._drop_step(step):
            self._forget_last_step(step)
        else:
            others = [os.path.basename(c.path) for c in self._infos if c.step == step]
            raise CheckpointNotFoundError(
                f"{self._directory!r} has no checkpoint of step {step}"
                + (
                    f" of checkpoint_name={self._options.name!r} (only {others}, which this manager never deletes)"
                    if others
                    else ""
                )
                + f"; its kept steps are {[c.step for c in self._infos if self._own(c)]}. Give one of those to delete."
            )

    def _forget_last_step(self, step: int) -> None:
        """TF's checkpoint_interval counts from the last step saved: if its checkpoint was deleted, from
        the latest one left (so that the rolled-back steps save again)."""
        if self._last_checkpoint_step == step:
            left = [c.step for c in self._infos if self._own(c)]
            self._last_checkpoint_step = left[-1] if left else None

    def _drop_step(self, step: int) -> bool:
        """Stop listing the checkpoints of ``step``, then delete them (every process; the primary
        writes and deletes); False if none is listed."""
        with self._retention_lock:
            kept = [c for c in self._infos if c.step != step or not self._own(c)]
            if len(kept) == len(self._infos):
                return False
            for memory in (self._memory, getattr(self, "_copy_memory", None)):  # they may refer to it (buckets)
                forget = getattr(memory, "forget", None)
                if forget is not None:
                    forget()
            if self._primary:
                self._keep_only(kept)
            else:
                self._infos = kept
        if not self._own_copy:  # no process goes on before the state file no longer lists it
            multihost.barrier(f"delete/{next(_deletions)}")
        return True

    def _check_writable(self, doing: str) -> None:
        """Refuse to save or delete in a read-only or closed manager, or from a forked child of it."""
        if self._options.read_only:
            raise ManagerLockedError(
                f"This manager of {self._directory!r} was created with read_only=True: it restores, and never "
                f"saves or deletes. Create one without read_only to {doing}."
            )
        if not self._release.alive:
            raise ManagerLockedError(f"This manager of {self._directory!r} is closed; create a new one to {doing}.")
        if self._lock is not None and not self._lock.held:
            raise ManagerLockedError(
                f"This manager of {self._directory!r} was created in process {self._lock.pid}, and this is a forked "
                f"child of it, which does not hold its lock. {doing.capitalize()} from the parent, or create a "
                "manager here."
            )

    def _retain(self, candidates: list[CheckpointInfo]) -> Retained:
        opts = self._options
        foreign = [c.path for c in candidates if not self._own(c)]
        return retain(candidates, opts.policy, opts.hours, self._last_preserved, self._also_keep, foreign)

    def _ours(self, name: str) -> bool:
        """Whether ``name`` is a checkpoint name of this manager's ``checkpoint_name``."""
        return self._options.number(name) is not None

    def _own(self, checkpoint: CheckpointInfo) -> bool:
        """Whether ``checkpoint`` is of this manager's ``checkpoint_name``: the only ones it ever deletes."""
        return self._options.number(os.path.basename(checkpoint.path)) is not None

    def _keep_only(self, kept: list[CheckpointInfo]) -> None:
        """Primary: list only ``kept`` of the listed checkpoints, then delete the others (as retention);
        another ``checkpoint_name``'s stay listed whatever ``kept`` says."""
        with self._retention_lock:
            old = list(self._infos)
            kept = [c for c in old if c in kept or not self._own(c)]
            if kept == old or self._options.read_only or not self._release.alive:
                return
            dropped = dropped_names(old, kept)
            for name in dropped:
                mark_dropped(self._path / name)
            try:
                statefile.write_state(self._path, kept, self._last_preserved)
            except BaseException:
                for name in dropped:  # still listed: a mark would make it garbage (as in record)
                    _clear_mark(self._path / name)
                raise
            self._infos = kept
        self._deleter.delete(dropped, refs.deletions(old, kept, self._ours))

    def _reapply_retention(self) -> None:
        """Apply retention again to what is listed: ``_also_keep`` kept a checkpoint that it lets go now."""
        with self._retention_lock:
            if not self._infos:
                return
            kept = self._retain(list(self._infos)).kept
            # Only drops: a checkpoint that the hours rule would preserve now is left to the next save.
            self._keep_only([c for c in self._infos if any(k.path == c.path for k in kept)])

    def _warn_failed_deletes(self) -> None:
        """A deletion that failed is garbage the next manager removes: said, and saving goes on."""
        error = self._deleter.failures()
        if error is not None:
            warnings.warn(str(error), stacklevel=caller_level())

    def _raise_failed_deletes(self) -> None:
        error = self._deleter.failures()
        if error is not None:
            raise error
