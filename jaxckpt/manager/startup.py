"""A manager taking over its directory at start: whose it is, what it adopts, what crashes left.

Checkpoints that the state file lists under another ``checkpoint_name`` (``Checkpoint.save`` under
another prefix, a manager of another name) stay listed: the manager finds them (``latest_checkpoint``),
numbers after them, and never deletes them (see :func:`jaxckpt.manager.retention.retain`), as TensorFlow's
managers leave alone what they did not record. Complete ``<name>-N`` checkpoints that it finds unlisted
(``Checkpoint.save`` of an older jaxckpt, ``Checkpoint.write``, a copy) it adopts into the state file. What a crash can leave behind (staging folders
``.ckpt-N.partial-<token>``, temp state files ``.checkpoint.tmp-<token>``, unlisted ``ckpt-N``
folders that are marked or an interrupted save's, renamed ones being deleted) it removes; names that only
look alike, and numbered folders that nothing proves its own, are never touched. A checkpoint symlinked here (another run's) is handled as the link
alone: adopted and read through it, but never marked, and removing it removes the link.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import NamedTuple

from jaxckpt._errors import CheckpointExistsError, JaxckptError, ManagerLockedError, caller_level
from jaxckpt.incremental import refs
from jaxckpt.manager import retention as _retention
from jaxckpt.manager.options import ManagerOptions
from jaxckpt.manager.run_metadata import METADATA_FILE
from jaxckpt.saving import staging as _staging
from jaxckpt.storage import locations, statefile
from jaxckpt.storage.statefile import CheckpointInfo


def make_directory(local: Path, directory: str) -> None:
    """Create the local ``directory`` (at ``local``) if it does not exist, with errors that say what to do."""
    try:
        local.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:  # a file where a folder must be
        raise CheckpointExistsError(
            f"A CheckpointManager keeps its checkpoints in a directory, and {directory!r} cannot be "
            f"one: {e.strerror} ({e.filename!r}). Choose another directory."
        ) from None
    except PermissionError as e:
        raise ManagerLockedError(
            f"Cannot create the CheckpointManager directory {directory!r}: {e.strerror} ({e.filename!r}). "
            "To only restore from it, pass read_only=True; otherwise give this process write access there."
        ) from None


def _unlisted_checkpoints(
    folder: locations.Location,
    directory: str,
    infos: list[CheckpointInfo],
    options: ManagerOptions,
    names: list[str] | None = None,
) -> list[CheckpointInfo]:
    """Complete ``<name>-N`` checkpoints that ``infos`` does not list and no interrupted save left.

    Checkpoint.save of an older jaxckpt, Checkpoint.write, or a copy: as TensorFlow's managers
    never delete what they do not track, a manager adopts them (by number, saved "now" unless the
    index says when) instead of refusing or deleting them. A save of jaxckpt's own that a crash
    interrupted before the state file listed it still has its mark (statefile.UNRECORDED).
    """
    listed = {os.path.basename(c.path) for c in infos}
    found = []
    for name in locations.children(folder) if names is None else names:
        number = options.number(name)
        if number is None or name in listed:
            continue
        checkpoint = folder / name
        if not locations.is_checkpoint(checkpoint):
            continue  # incomplete: remove_leftovers removes it
        if statefile.is_marked(checkpoint):
            continue  # an interrupted save, or a deletion by retention (in a bucket too): garbage
        when = options.clock()
        if checkpoint.local is not None:
            try:
                when = min(when, (checkpoint.local / locations.INDEX_FILE).stat().st_mtime)
            except OSError:
                pass
        # It may refer to the data of others (jaxckpt.incremental.refs: a bucket's, or one copied from a
        # bucket), which must stay while it is listed; only this manager's checkpoints, as its index proves.
        try:
            uses = refs.uses_of(checkpoint, lambda n: options.number(n) is not None)
        except JaxckptError as e:  # its references prove nothing: it holds no other's data for them
            warnings.warn(
                f"Adopting {checkpoint.text!r}, whose references to other checkpoints cannot be trusted ({e}); "
                "no other checkpoint's data is held for it, and what it refers to does not restore.",
                stacklevel=caller_level(),
            )
            uses = ()
        found.append(CheckpointInfo(os.path.join(directory, name), number, when, uses=uses))
    return sorted(found, key=lambda c: c.step)


def adopt_unlisted(
    folder: locations.Location,
    directory: str,
    infos: list[CheckpointInfo] | None,
    options: ManagerOptions,
    last_preserved: float,
    names: list[str] | None = None,
) -> list[CheckpointInfo]:
    """Add the unlisted complete checkpoints to the state file: older-numbered ones first, newer ones last.

    Without a state file (``infos`` None), one is written even if there is nothing to adopt, so that
    a crash during the first save leaves clear garbage.
    """
    adopted = _unlisted_checkpoints(folder, directory, infos or [], options, names)
    if infos is None:
        merged = adopted
    elif not adopted:
        return infos
    else:
        numbers = [n for c in infos if (n := options.number(os.path.basename(c.path))) is not None]
        top = max(numbers, default=-1)
        merged = [c for c in adopted if c.step <= top] + infos + [c for c in adopted if c.step > top]
    statefile.write_state(folder, merged, last_preserved)
    return merged


class TakenOver(NamedTuple):
    """What a manager starts with: the checkpoints listed (after adoption), and TF's ``last_preserved_time``."""

    infos: list[CheckpointInfo]
    last_preserved: float


def take_over(folder: locations.Location, directory: str, options: ManagerOptions, primary: bool) -> TakenOver:
    """Read the state file of ``folder``; unless read-only, on the primary adopt unlisted checkpoints
    and remove what crashes left."""
    state = statefile.read_full_state(folder)
    infos, recorded = state if state is not None else (None, None)
    # TF's rule counts hours from the last preserved checkpoint, at first from when the first
    # manager of the directory started (a second back, as TF does), never from the future.
    now = options.clock()
    last_preserved = min(now, recorded if recorded is not None else now - 1.0)
    if options.read_only:
        return TakenOver(infos or [], last_preserved)
    kept_all = infos is not None and recorded is not None and now < recorded and keep_all(directory, infos, options)
    if primary:
        # One listing for both (in an object store each is a request): what adoption writes, the
        # state file, is none of the names that remove_leftovers removes.
        names = locations.children(folder)
        adopted = adopt_unlisted(folder, directory, infos, options, last_preserved, names)
        if kept_all and adopted is infos:  # adoption wrote nothing: the preserved marks are written now
            statefile.write_state(folder, adopted, last_preserved)
        infos = adopted
        remove_leftovers(folder, infos, options, names)
    return TakenOver(infos or [], last_preserved)


def keep_all(directory: str, infos: list[CheckpointInfo], options: ManagerOptions) -> bool:
    """The clock is behind the last preserved time recorded (it went back): as TensorFlow's manager
    "errs on the side of keeping", since which checkpoints the hours rule would preserve cannot be
    told, mark every listed checkpoint of this name preserved, so that no manager deletes it (in
    place, in ``infos``); say so. Whether any was marked."""
    marked = [
        i for i, c in enumerate(infos) if not c.preserved and options.number(os.path.basename(c.path)) is not None
    ]
    for i in marked:
        infos[i] = dataclasses.replace(infos[i], preserved=True)
    if marked:
        warnings.warn(
            f"The clock ({options.clock():.0f}, Unix seconds) is behind the last preserved checkpoint time recorded "
            f"in {directory!r}'s state file: it went back. As TensorFlow's manager does, the checkpoints listed "
            f"there are kept for good ({[os.path.basename(infos[i].path) for i in marked][-5:]}, marked preserved), "
            "since which of them keep_checkpoint_every_n_hours would preserve cannot be told; delete(step) removes "
            "one. Check this host's clock.",
            stacklevel=caller_level(),
        )
    return bool(marked)


def remove_leftovers(
    folder: locations.Location, infos: list[CheckpointInfo], options: ManagerOptions, names: list[str] | None = None
) -> None:
    """Remove what crashed saves and deletions left: never a listed checkpoint, never a user's file.

    Only names that jaxckpt makes, with its tokens: temp files of the state, tiers and run metadata
    files (regular files only), this name's staging and replaced folders, and this name's numbered
    folders that nothing lists.
    """
    listed = {os.path.basename(c.path) for c in infos}
    marks = f"{re.escape(_staging.PARTIAL_MARK)}|{re.escape(_staging.REPLACED_MARK)}"  # see _staging.staging_folder and publish
    staging = re.compile(rf"\.{re.escape(options.name)}-[0-9]+({marks})[0-9a-f]{{12}}")
    # The temp files of the small files replaced whole beside the state file (see write_file_atomic).
    temps = [locations.temp_file_pattern(n) for n in (statefile.STATE_FILE, statefile.TIERS_FILE, METADATA_FILE)]
    for name in locations.children(folder) if names is None else names:
        if any(temp.fullmatch(name) for temp in temps):
            if folder.local is not None:
                path = folder.local / name
                if path.is_file() and not path.is_symlink():
                    path.unlink(missing_ok=True)
        elif staging.fullmatch(name):
            locations.delete_tree(folder / name)
        elif options.number(name) is not None and name not in listed:
            # As retention deletes: first made no checkpoint (renamed away, or its index deleted), so
            # that a crash in the middle of this never leaves a half-deleted one to adopt next time.
            # Only what is provably a leftover of this manager's: marked (a save not listed yet, or a
            # checkpoint retention dropped), an interrupted save's (a bucket's marker), or held data of
            # listed checkpoints (of which only what no listed one refers to goes). Else left alone.
            users = [folder / os.path.basename(c.path) for c in infos if name in c.uses]  # held data stays
            if users or _retention.provably_held(folder / name) or _staging.interrupted_save(folder / name):
                _retention.remove_checkpoint(folder / name, users)
        elif name in listed:  # listed, but a crash came before its mark was dropped
            statefile.clear_unrecorded(folder / name)
