"""Which checkpoint a path names, and in which format: jaxckpt's own (a folder with an index), a
manager's directory (its latest), or another library's checkpoint or manager directory
(:mod:`jaxckpt._formats`); opened for reading (:mod:`jaxckpt._reader`).
"""

from __future__ import annotations

import os
from typing import Any

from jaxckpt import _formats, _statefile, _storage
from jaxckpt._errors import CheckpointNotFoundError, NotACheckpointError
from jaxckpt._foreign_opened import ForeignOpened
from jaxckpt._reader import Opened
from jaxckpt._tree import PathLike


def open_checkpoint(path: PathLike) -> Opened:
    """The checkpoint at ``path``, in whichever format is on disk: jaxckpt's own (a folder with an
    index), or a TensorFlow, Orbax, Flax msgpack or safetensors checkpoint (local paths)."""
    location = _storage.location(path)
    if location.local is not None and not _storage.is_checkpoint(location):
        module = _formats.detect(location.local)
        if module is not None:
            return ForeignOpened(_formats.ForeignCheckpoint(module.open(str(location.local))))
    try:
        return Opened(path)
    except NotACheckpointError as e:
        if location.local is None:
            raise
        raise NotACheckpointError(
            f"{e} Nor is it a checkpoint of another library that jaxckpt reads: a TensorFlow prefix (with "
            "PREFIX.index beside it), an Orbax checkpoint folder, a Flax msgpack or a safetensors file."
        ) from None


def open_latest(path: PathLike) -> Opened:
    """The checkpoint at ``path``; a manager's directory (a state file, no index) means its latest
    checkpoint, as TensorFlow's ``load_variable`` takes a directory. So does a directory that
    TensorFlow's, Orbax's or Flax's manager keeps."""
    location = _storage.location(path)
    if not _storage.is_checkpoint(location):
        infos = _statefile.read_state(os.fspath(path))  # None: not a jaxckpt manager's directory
        if infos is not None:
            if not infos:
                raise CheckpointNotFoundError(
                    f"{os.fspath(path)!r} is a CheckpointManager's directory that lists no checkpoint yet."
                )
            return Opened(infos[-1].path)
        foreign = _foreign_manager(location)
        if foreign is not None:
            module, latest = foreign
            if latest is None:
                raise CheckpointNotFoundError(
                    f"{os.fspath(path)!r} is a {module.NAME} manager's directory with no complete checkpoint in it."
                )
            return open_checkpoint(latest)
        _statefile.read_full_state(os.fspath(path))  # a `checkpoint` file that no reader takes: say why
    try:
        return open_checkpoint(path)
    except NotACheckpointError as e:
        raise not_a_checkpoint(os.fspath(path), e) from None


def _foreign_manager(location: _storage.Location) -> tuple[Any, str | None] | None:
    """(format module, its latest checkpoint or None) if a foreign format's manager keeps the folder."""
    if location.local is None or _formats.detect(location.local) is not None:
        return None  # an Orbax step folder is one checkpoint, not a manager's directory
    module = _formats.manager_of(location.local)
    return None if module is None else (module, module.latest(str(location.local)))


def latest_checkpoint(directory: PathLike) -> str | None:
    """The latest checkpoint in ``directory``, or None if it holds none.

    For a :class:`~jaxckpt.CheckpointManager`'s directory it reads only the state file (no lock
    needed: it is replaced atomically)::

        path = jaxckpt.latest_checkpoint("ckpts")   # "ckpts/ckpt-10"
        if path is not None:
            ckpt.restore(path)

    It sees what is recorded on disk now: a manager's asynchronous ``save()`` records its checkpoint
    in the background, so right after ``save()`` returns this may still name the previous one. Call
    ``manager.wait_until_finished()`` first, or ask the manager (``manager.latest_checkpoint`` waits).

    It also reads the directories that other libraries' managers keep: TensorFlow's (its
    ``checkpoint`` file: ``".../tf_ckpts/ckpt-5"``), Orbax's (the newest finished step folder) and
    ``flax.training.checkpoints``' (the newest ``checkpoint_<step>`` file).
    """
    infos = _statefile.read_state(os.fspath(directory))
    if infos is not None:
        return infos[-1].path if infos else None
    foreign = _foreign_manager(_storage.location(directory))
    if foreign is None:
        _statefile.read_full_state(os.fspath(directory))  # a `checkpoint` file that no reader takes: say why
        return None
    return foreign[1]


def not_a_checkpoint(path: str, error: NotACheckpointError) -> NotACheckpointError:
    """The error, with the checkpoints the folder holds, if any: the usual slip is one level too high."""
    folder = _storage.location(path)
    try:
        found = [name for name in _storage.children(folder) if _storage.is_checkpoint(folder / name)]
    except OSError:
        found = []
    if not found:
        return error
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return NotACheckpointError(f"{path!r} is not a checkpoint, but it holds checkpoints: {shown}. Pass one of them.")
