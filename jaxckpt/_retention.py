"""After a manager's save: which checkpoints stay, recording that, and deleting the rest, in a crash-safe order.

The checkpoint is written and published (every byte durable) first, marked ``.jaxckpt-unrecorded``
inside (see :func:`jaxckpt._statefile.mark_unrecorded`); then :func:`record` replaces the state file
atomically (temp file, fsync, rename, fsync of the directory) to list it and drop what retention
lets go, each dropped one marked first; only then are marks cleared and :func:`delete_dropped`
renames the dropped checkpoints away and deletes them. A crash at any instant therefore leaves every
listed checkpoint whole, and only garbage that the next manager removes (see :mod:`jaxckpt._startup`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import warnings
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NamedTuple

from jaxckpt import _local_tree, _multihost, _staging, _statefile, _storage
from jaxckpt._policies import CheckpointInfo, RetentionPolicy


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
) -> Retained:
    """What to keep of ``candidates`` (oldest first, the new checkpoint last).

    Preserved checkpoints are out of every policy's sight and always kept. Of the others (TF's
    active set), ``policy`` keeps some and the latest is always kept; as in TensorFlow's manager,
    each one dropped is instead preserved, oldest first, if it was saved at least ``hours``
    (``keep_checkpoint_every_n_hours``) after the last preserved one. Without a policy, all stay.
    The paths in ``also_keep`` stay this time whatever the policy (a local checkpoint that is still
    being copied to the durable tier).
    """
    if policy is None:
        return Retained(list(candidates), last_preserved)
    active = tuple(c for c in candidates if not c.preserved)
    keep = {c.path for c in policy.keep(active)} | {candidates[-1].path} | set(also_keep)
    out = []
    for c in candidates:
        if c.preserved or c.path in keep:
            out.append(c)
        elif hours is not None and c.time - hours * 3600.0 >= last_preserved:
            last_preserved = c.time
            out.append(dataclasses.replace(c, preserved=True))
    return Retained(out, last_preserved)


def record(
    folder: _storage.Location,
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
    for c in candidates[:-1]:
        if c.path not in kept_paths:
            _statefile.mark_unrecorded(folder / os.path.basename(c.path))
    try:
        _statefile.write_state(folder, retained.kept, retained.last_preserved)
    except BaseException as e:
        if publish:
            _multihost.publish_kept(token, None, f"{type(e).__name__}: {e}")
        raise
    # The others follow process 0's decision, made with its clock and its metrics.
    if publish:
        _multihost.publish_kept(token, retained.kept, None)
    _statefile.clear_unrecorded(folder / os.path.basename(candidates[-1].path))


def delete_dropped(
    folder: _storage.Location, candidates: Sequence[CheckpointInfo], kept: Sequence[CheckpointInfo]
) -> None:
    """Primary, once the state file no longer lists them: delete the candidates not kept."""
    kept_paths = {c.path for c in kept}
    for c in candidates:
        if c.path not in kept_paths:
            try:
                _remove_tree(folder / os.path.basename(c.path))
            except OSError as e:  # not listed any more, so the next manager removes it
                warnings.warn(f"Could not delete the old checkpoint {c.path!r}: {e}", stacklevel=3)


def _remove_tree(path: _storage.Location) -> None:
    if _storage.is_symlink(path):
        # Another run's checkpoint linked here (adopted, then dropped): the link goes, in one step;
        # what it points to is never this directory's to delete.
        assert path.local is not None
        path.local.unlink()
    elif path.local is not None:
        # Renamed out of the way first, atomically: a crash midway through rmtree leaves a hidden
        # leftover that the next manager removes, never a half-deleted folder under the checkpoint's
        # name (which, with its index still there, would look complete and be adopted).
        hidden = path.local.with_name(f".{path.local.name}{_staging.REPLACED_MARK}{secrets.token_hex(6)}")
        os.rename(path.local, hidden)
        _delete_renamed(hidden)
    else:
        _storage.delete_tree(path)


def _delete_renamed(hidden: Path) -> None:
    _local_tree.rmtree(hidden)  # raises, unlike the best-effort clean-ups: a failure is reported
