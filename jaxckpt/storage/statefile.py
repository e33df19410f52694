"""The manager's state file ``checkpoint``: its format, a strict reader, and an atomic writer.

It is JSON, format version 1, with prefixes relative to the directory, oldest first::

    {
      "format": "jaxckpt-manager-state",
      "version": 1,
      "latest": "ckpt-5",
      "last_preserved_time": 1717990000.0,
      "checkpoints": [
        {"prefix": "ckpt-4", "step": 400, "time": 1718000000.0, "metrics": {"loss": 0.25}, "preserved": true},
        {"prefix": "ckpt-5", "step": 500, "time": 1718000360.5, "metrics": {}}
      ]
    }

``step`` is the step counter's value at save (or the checkpoint number without one), ``time`` is Unix
seconds (from 1970 to the end of year 9999, so that any tool can print it as a date), ``metrics``
what ``save(metrics=...)`` got (a non-finite value is ``null``). Two optional fields, added without
a version change since readers ignore unknown fields: ``"preserved": true`` on a checkpoint that
``keep_checkpoint_every_n_hours`` preserved (no manager deletes it), and ``last_preserved_time``, the
time that rule counts its hours from (TensorFlow's ``last_preserved_timestamp``). A third,
``"uses": ["ckpt-3", ...]``, names the checkpoints of the directory whose data a checkpoint refers
to (incremental saves on buckets, :mod:`jaxckpt.incremental.refs`): their data stays while it is listed;
only names of other checkpoints (``<name>-<number>``) are accepted there. A newer
``version`` is refused. The file is untrusted input: it is read as a regular file of bounded
size (``locations.read_file``) and every field is checked before use.

The writer replaces the file atomically through a temp file ``.checkpoint.tmp-<12 hex digits>``
beside it; ``locations.temp_file_pattern`` recognises exactly those names, so that a manager removing
what a crash left behind (:func:`jaxckpt.manager.startup.remove_leftovers`) never touches a user's file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from jaxckpt._errors import CheckpointFormatError, JaxckptError, UnsupportedVersionError
from jaxckpt.storage import kvstore, locations
from jaxckpt.storage.locations import PathLike

STATE_FILE = "checkpoint"
STATE_FORMAT = "jaxckpt-manager-state"
STATE_VERSION = 1
PREFIX = re.compile(r"[^/\\\x00]+")  # one path component: a listed prefix can never point elsewhere
# A file inside a checkpoint folder saved by a manager or Checkpoint.save, until the state file lists
# it: a folder that still has it and is not listed is a save that a crash interrupted (garbage the next
# manager removes), not a checkpoint someone put there (which a manager adopts).
# A checkpoint's name as managers number them ("ckpt-3", "model.ckpt-12"): what ``uses`` may name.
CHECKPOINT_NAME = re.compile(r"[^/\\\x00.][^/\\\x00]*-[0-9]+")
UNRECORDED = ".jaxckpt-unrecorded"
LATEST_TIME = 253402300800.0  # 10000-01-01T00:00:00Z: datetime cannot show a later time


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint a manager keeps, as its state file records it.

    ``path`` is the checkpoint's prefix (``"ckpts/ckpt-4"``), ``step`` the training step it was saved
    at, ``time`` when it was saved (Unix seconds), and ``metrics`` what was passed to
    ``save(metrics=...)``; a value that was not finite (NaN, inf) is recorded as ``None``.
    ``preserved`` marks a checkpoint that ``keep_checkpoint_every_n_hours`` preserved, as TensorFlow
    does: no manager deletes it any more, whatever its policies (they never see it). ``uses`` names
    the checkpoints of the same directory whose data it refers to (incremental saves on buckets).
    """

    path: str
    step: int
    time: float
    metrics: Mapping[str, float | None] = dataclasses.field(default_factory=dict)
    preserved: bool = False
    uses: tuple[str, ...] = ()


def _bad_state(where: locations.Location, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{str(where)!r} is not a valid jaxckpt manager state file: {why}. The checkpoints beside it are "
        "untouched; fix or remove the state file (removing it forgets every checkpoint it listed)."
    )


def _is_number(x: object) -> TypeGuard[int | float]:
    """A finite JSON number that fits a float (a 400-digit integer does not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _parse_entry(raw: object, where: locations.Location, directory: str) -> CheckpointInfo:
    if not isinstance(raw, dict):
        raise _bad_state(where, f"a checkpoint entry must be an object, not {raw!r}")
    prefix, step, when, metrics, preserved = (raw.get(k) for k in ("prefix", "step", "time", "metrics", "preserved"))
    if not isinstance(prefix, str) or not PREFIX.fullmatch(prefix) or prefix.startswith("."):
        raise _bad_state(where, f"prefix {prefix!r} is not the name of a folder in the directory")
    if isinstance(step, bool) or not isinstance(step, int):
        raise _bad_state(where, f"step of {prefix!r} must be an int, not {step!r}")
    if not _is_number(when) or not 0 <= when < LATEST_TIME:
        raise _bad_state(
            where, f"time of {prefix!r} must be Unix seconds from 1970 to the end of year 9999, not {when!r}"
        )
    if not isinstance(metrics, dict) or not all(v is None or _is_number(v) for v in metrics.values()):
        raise _bad_state(where, f"metrics of {prefix!r} must map names to numbers or null, not {metrics!r}")
    if preserved is not None and not isinstance(preserved, bool):
        raise _bad_state(where, f"preserved of {prefix!r} must be true or false, not {preserved!r}")
    uses = raw.get("uses", [])
    if not isinstance(uses, list) or not all(isinstance(u, str) and PREFIX.fullmatch(u) and u[0] != "." for u in uses):
        raise _bad_state(where, f"uses of {prefix!r} must list names of folders in the directory, not {uses!r}")
    for name in uses:  # retention keeps, then deletes, what these name: never anything but a checkpoint
        if not CHECKPOINT_NAME.fullmatch(name) or name == prefix:
            raise _bad_state(
                where,
                f"uses of {prefix!r} names {name!r}, which is no other checkpoint of the directory (a checkpoint "
                "is named <name>-<number>, as ckpt-3); a manager deletes what uses names once nothing uses it, "
                "so nothing was deleted",
            )
    path = os.path.join(directory, prefix)
    return CheckpointInfo(path, step, float(when), dict(metrics), bool(preserved), tuple(uses))


def read_state(directory: str | locations.Location) -> list[CheckpointInfo] | None:
    """The checkpoints the state file in ``directory`` lists, oldest first; None if it has none, or
    if its ``checkpoint`` file is TensorFlow's (for readers: not a jaxckpt manager's directory)."""
    state = read_full_state(directory, tensorflow_is_none=True)
    return None if state is None else state[0]


def read_state_file(folder: locations.Location) -> bytes | None:
    """The bytes of the state file in ``folder`` (one bounded read), or None if there is none; for
    :func:`parse_full_state`, so that one read serves every question asked of it."""
    try:
        return locations.read_file(folder, STATE_FILE)
    except OSError as e:
        raise _bad_state(folder / STATE_FILE, f"it cannot be read as UTF-8 text ({e})") from e


def read_full_state(
    directory: str | locations.Location, *, tensorflow_is_none: bool = False
) -> tuple[list[CheckpointInfo], float | None] | None:
    """The listed checkpoints and the recorded ``last_preserved_time``; None without a state file.

    TensorFlow's state file has the same name: it is refused (a manager never writes over it), or
    with ``tensorflow_is_none`` taken for no state file (what a reader of the folder wants)."""
    folder = locations.location(directory)
    return parse_full_state(folder, read_state_file(folder), tensorflow_is_none=tensorflow_is_none)


def parse_full_state(
    folder: locations.Location, data: bytes | None, *, tensorflow_is_none: bool = False
) -> tuple[list[CheckpointInfo], float | None] | None:
    """:func:`read_full_state` of the state file's bytes ``data`` (None: there is none), read from ``folder``."""
    directory = folder.text  # as the caller wrote it: the listed checkpoints are named under it
    where = folder / STATE_FILE
    try:
        if data is None or (tensorflow_is_none and is_tensorflow_state(data)):
            return None
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad_state(where, f"it cannot be read as UTF-8 text ({e})") from e
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, too deeply nested, or an integer of over 4300 digits
        hint = " (it looks like a TensorFlow state file)" if is_tensorflow_state(data) else ""
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
    last_preserved = doc.get("last_preserved_time")
    if last_preserved is not None and (not _is_number(last_preserved) or not 0 <= last_preserved < LATEST_TIME):
        raise _bad_state(where, f"last_preserved_time must be Unix seconds, not {last_preserved!r}")
    return infos, None if last_preserved is None else float(last_preserved)


def write_state(
    directory: locations.Location, infos: Sequence[CheckpointInfo], last_preserved_time: float | None = None
) -> None:
    """Replace the state file atomically: a crash leaves the old one or the new one, never a mix."""
    names = [os.path.basename(c.path) for c in infos]
    rows = [
        {"prefix": n, "step": c.step, "time": c.time, "metrics": dict(c.metrics)}
        | ({"preserved": True} if c.preserved else {})
        | ({"uses": list(c.uses)} if c.uses else {})
        for n, c in zip(names, infos)
    ]
    # One checkpoint per line, so that the file reads well in a terminal and diffs well.
    body = ",\n".join(f"    {json.dumps(r, allow_nan=False)}" for r in rows)
    head: dict[str, Any] = {"format": STATE_FORMAT, "version": STATE_VERSION, "latest": names[-1] if names else None}
    if last_preserved_time is not None:
        head["last_preserved_time"] = last_preserved_time
    text = json.dumps(head, indent=2)[:-2] + ',\n  "checkpoints": [' + (f"\n{body}\n  ]" if rows else "]") + "\n}\n"
    locations.write_file_atomic(directory, STATE_FILE, text.encode("utf-8"))


def mark_unrecorded(staging: locations.Location) -> None:
    """Mark a save's staging folder (local only) as not yet listed: see :data:`UNRECORDED`.

    Nothing is written through a symlink: a symlinked folder (another run's checkpoint linked into
    this directory) is not marked, since the mark would land in the other run's directory, whose
    manager would then delete that checkpoint as garbage; a symlink named like the mark is replaced,
    never written through (it could point at any file).
    """
    if staging.local is None or locations.is_symlink(staging) or not staging.local.is_dir():
        return
    mark = staging.local / UNRECORDED
    if is_marked(staging):
        if not mark.is_symlink():
            return  # marked already: only the name counts
        mark.unlink()  # the link alone
    try:
        # O_EXCL creates a new file, and fails rather than follow a symlink that appeared meanwhile.
        fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise locations.storage_failure(
            f"Cannot save the checkpoint: marking its staging folder {str(staging)!r} as not yet listed failed",
            e,
            "The save is undone; the checkpoints already there are untouched.",
        ) from e


def is_marked(checkpoint: locations.Location) -> bool:
    """Whether ``checkpoint`` holds the mark :data:`UNRECORDED`: locally any entry of that name, a
    symlink included, whatever it points to; in a bucket an object of that name (one request, at most
    one byte fetched)."""
    if checkpoint.local is not None:
        return os.path.lexists(checkpoint.local / UNRECORDED)
    return kvstore.kv_exceeds(checkpoint.spec(), UNRECORDED, 0) is not None


def clear_unrecorded(checkpoint: locations.Location) -> None:
    """The state file lists ``checkpoint`` now: drop its mark (a mark that survives a crash is harmless).

    Never through a symlinked folder: a mark there is another run's."""
    if checkpoint.local is not None and not locations.is_symlink(checkpoint):
        (checkpoint.local / UNRECORDED).unlink(missing_ok=True)


def record(directory: str, path: str, step: int, when: float) -> None:
    """Add the checkpoint ``path`` (in ``directory``) to the state file there, as its latest.

    What ``Checkpoint.save`` does, as TensorFlow's updates the ``checkpoint`` file: the entries already
    listed stay (with their ``preserved`` marks), an entry of the same name is replaced.
    """
    folder = locations.location(directory)
    state = read_full_state(directory)
    infos, last_preserved = state if state is not None else ([], None)
    name = os.path.basename(path)
    infos = [c for c in infos if os.path.basename(c.path) != name]
    infos.append(CheckpointInfo(os.path.join(directory, name), step, when, {}))
    write_state(folder, infos, last_preserved)


def is_manager_directory(path: PathLike | locations.Location) -> bool:
    """A folder with a manager's state file and no index of its own."""
    folder = locations.location(path)
    data = locations.read_file(folder, STATE_FILE)
    return data is not None and not is_tensorflow_state(data) and not locations.is_checkpoint(folder)


def is_tensorflow_state(data: bytes) -> bool:
    """Whether a ``checkpoint`` file is TensorFlow's text state file (same name as jaxckpt's), which
    the TensorFlow reader reads (jaxckpt.interop.tensorflow) and a manager never writes over."""
    return data.lstrip().startswith(b"model_checkpoint_path")


def latest_checkpoint(directory: PathLike | locations.Location) -> str | None:
    """The latest checkpoint a manager recorded in ``directory`` (its state file alone), or None;
    :func:`jaxckpt.latest_checkpoint` (``_open``) reads other libraries' directories too."""
    infos = read_state(directory if isinstance(directory, locations.Location) else os.fspath(directory))
    return infos[-1].path if infos else None


# --- two tiers (jaxckpt.manager.tiers): each tier's directory names both -------------------------------

TIERS_FILE = "checkpoint.tiers"
TIERS_FORMAT = "jaxckpt-tiers"


def write_tiers(local: str, durable: str, *, in_durable: bool = True) -> None:
    """Name both tiers in each tier's directory (``checkpoint.tiers``), for ``jaxckpt ls``; in the
    local one only unless ``in_durable`` (a process that does not own the durable directory)."""
    # Absolute where local: ``jaxckpt ls`` reads the file from any working directory.
    where = locations.location(durable).local
    durable = str(where) if where is not None else durable
    body = json.dumps({"format": TIERS_FORMAT, "local": os.path.abspath(local), "durable": durable}).encode()
    for directory in (local, durable) if in_durable else (local,):
        folder = locations.location(directory)
        if locations.read_file(folder, TIERS_FILE) != body:
            locations.write_file_atomic(folder, TIERS_FILE, body)


def read_tiers(directory: PathLike | locations.Location) -> dict[str, str] | None:
    """``{"local": ..., "durable": ...}`` from a tier's ``checkpoint.tiers``; None without one (or
    with one that does not parse: it only guides listings)."""
    try:
        data = locations.read_file(locations.location(directory), TIERS_FILE)
        doc = json.loads(data) if data is not None else None
    except (JaxckptError, OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != TIERS_FORMAT:
        return None
    tiers = {k: v for k in ("local", "durable") if isinstance(v := doc.get(k), str)}
    return tiers if len(tiers) == 2 else None
