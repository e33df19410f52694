"""Which checkpoint a path names, and in which format: jaxckpt's own (a folder with an index), a
manager's directory (its latest), or another library's checkpoint or manager directory
(:mod:`jaxckpt.interop.formats`); opened for reading (:mod:`jaxckpt.reading.reader`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import numpy as np

from jaxckpt._errors import CheckpointNotFoundError, NotACheckpointError
from jaxckpt.format.keys import describe
from jaxckpt.format.records import INDEX_FILE, ArrayLeaf, Leaf
from jaxckpt.interop import formats
from jaxckpt.interop import formats as _formats
from jaxckpt.reading.read_plan import c_order_pieces
from jaxckpt.reading.reader import Opened
from jaxckpt.runtime import background as _async
from jaxckpt.storage import locations, statefile
from jaxckpt.storage.locations import PathLike

E = TypeVar("E", bound=Exception)


class Probe(NamedTuple):
    """What one look at a location found: a jaxckpt checkpoint (in a kvstore, with its index's bytes,
    read once and handed on), or else the bytes of the state file there (None if there is none)."""

    location: locations.Location
    checkpoint: bool
    index_bytes: bytes | None  # a kvstore's index, read (bounded) by the look itself; None for local folders
    state: bytes | None  # without an index: the state file's bytes, if there is one


def probe(location: locations.Location) -> Probe:
    """Look once at ``location``: is it a checkpoint, and if not, what does its state file say.

    In a kvstore every look is a request, so the index is read at once (not asked about, then read)
    and the state file only where there is no index. A local folder is asked with ``stat`` (cheap),
    and its index is read later by :class:`Opened`, from the folder held open (see ``PinnedFolder``).
    """
    if location.local is not None:
        if locations.is_checkpoint(location):
            return Probe(location, True, None, None)
        return Probe(location, False, None, statefile.read_state_file(location))
    index = locations.read_file(location, INDEX_FILE, locations.INDEX_READ_LIMIT)
    if index is not None:
        return Probe(location, True, index, None)
    return Probe(location, False, None, statefile.read_state_file(location))


def open_checkpoint(location: locations.Location, index: bytes | None = None, *, checkpoint: bool = False) -> Opened:
    """The checkpoint at ``location``, in whichever format is on disk: jaxckpt's own (a folder with an
    index), or a TensorFlow, Orbax, Flax msgpack or safetensors checkpoint (local paths). ``index``:
    the bytes of its index in a kvstore, already read; ``checkpoint``: a look found its index already."""
    if location.local is not None and not checkpoint and not locations.is_checkpoint(location):
        module = formats.detect(location.local)
        if module is not None:
            return ForeignOpened(formats.ForeignCheckpoint(module.open(str(location.local))), location)
    try:
        return Opened(location, index)
    except NotACheckpointError as e:
        if location.local is None:
            raise about(e, location) from None
        raise about(
            NotACheckpointError(
                f"{e} Nor is it a checkpoint of another library that jaxckpt reads: a TensorFlow prefix (with "
                "PREFIX.index beside it), an Orbax checkpoint folder, a Flax msgpack or a safetensors file."
            ),
            location,
        ) from None


def open_latest(location: locations.Location) -> Opened:
    """The checkpoint at ``location``; a manager's directory (a state file, no index) means its latest
    checkpoint, as TensorFlow's ``load_variable`` takes a directory. So does a directory that
    TensorFlow's, Orbax's or Flax's manager keeps.

    A save of this process still writing that checkpoint (or one in that directory) in the
    background is waited for first: the path that ``save(..., blocking=False)`` returned reads as
    that save, not as missing."""
    with after_saves_to(location):
        return open_found(probe(location))


@contextlib.contextmanager
def after_saves_to(location: locations.Location) -> Iterator[None]:
    """Wait for this process's saves in flight into ``location`` (see :func:`open_latest`); a
    :class:`CheckpointNotFoundError` in the block then names one of them that failed."""
    failed = _async.settle_writes(location)
    try:
        yield
    except CheckpointNotFoundError as e:
        if not failed:
            raise
        raise CheckpointNotFoundError(
            f"{e} A background save to it in this process failed: {failed[-1]!r} (its Checkpoint or manager "
            "raises it at its next save or wait_until_finished())."
        ) from failed[-1]


def is_manager_directory(found: Probe) -> bool:
    """Whether what :func:`probe` found is a jaxckpt manager's directory: a state file of jaxckpt's
    (not TensorFlow's, which has the same name) and no index."""
    return not found.checkpoint and found.state is not None and not statefile.is_tensorflow_state(found.state)


def open_found(found: Probe) -> Opened:
    """:func:`open_latest` of what :func:`probe` found (nothing there is read again)."""
    location, text = found.location, found.location.text
    if not found.checkpoint:
        state = statefile.parse_full_state(location, found.state, tensorflow_is_none=True)
        if state is not None:
            infos = state[0]
            if not infos:
                raise CheckpointNotFoundError(
                    f"{text!r} is a CheckpointManager's directory that lists no checkpoint yet."
                )
            return Opened(location / os.path.basename(infos[-1].path))
        foreign = _foreign_manager(location)
        if foreign is not None:
            module, latest = foreign
            if latest is None:
                raise CheckpointNotFoundError(
                    f"{text!r} is a {module.NAME} manager's directory with no complete checkpoint in it."
                )
            return open_checkpoint(locations.location(latest))  # a path that manager's state names
        statefile.parse_full_state(location, found.state)  # a `checkpoint` file that no reader takes: say why
    try:
        if not found.checkpoint and location.local is None:  # its index was looked for already
            raise about(locations.no_index(location), location)
        return open_checkpoint(location, found.index_bytes, checkpoint=found.checkpoint)
    except NotACheckpointError as e:
        raise not_a_checkpoint(location, e) from None


def _foreign_manager(location: locations.Location) -> tuple[Any, str | None] | None:
    """(format module, its latest checkpoint or None) if a foreign format's manager keeps the folder."""
    if location.local is None or formats.detect(location.local) is not None:
        return None  # an Orbax step folder is one checkpoint, not a manager's directory
    module = formats.manager_of(location.local)
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
    location = locations.location(directory)
    data = statefile.read_state_file(location)  # read once, asked twice
    state = statefile.parse_full_state(location, data, tensorflow_is_none=True)
    if state is not None:
        infos = state[0]
        return infos[-1].path if infos else None
    foreign = _foreign_manager(location)
    if foreign is None:
        statefile.parse_full_state(location, data)  # a `checkpoint` file that no reader takes: say why
        return None
    return foreign[1]


def not_a_checkpoint(folder: locations.Location, error: NotACheckpointError) -> NotACheckpointError:
    """The error, with the checkpoints the folder holds, if any: the usual slip is one level too high."""
    path = folder.text
    try:
        found = [name for name in locations.children(folder) if locations.is_checkpoint(folder / name)]
    except OSError:
        found = []
    if not found:
        return error
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return NotACheckpointError(f"{path!r} is not a checkpoint, but it holds checkpoints: {shown}. Pass one of them.")


_ABOUT = "jaxckpt_location"


def about(error: E, location: locations.Location) -> E:
    """``error``, marked as saying only that nothing jaxckpt reads is at ``location`` (no more specific
    diagnosis, such as an Orbax folder missing its metadata), for :func:`command_line_message`. Set on
    the error itself, so that its type stays the one users catch."""
    if isinstance(error, NotACheckpointError):
        setattr(error, _ABOUT, location)
    return error


def command_line_message(error: NotACheckpointError) -> str:
    """What the ``jaxckpt`` command says for ``error``. The library's message tells a caller to pass
    a manager's checkpoint; the command takes a manager's directory itself, so it lists all it takes."""
    where = getattr(error, _ABOUT, None)
    if not isinstance(where, locations.Location):
        return str(error)
    return (
        f"{where.text!r} is not a checkpoint that jaxckpt reads: it has no {INDEX_FILE} (a jaxckpt checkpoint), "
        f"no state file {statefile.STATE_FILE!r} (a CheckpointManager's directory), and is no other tool's "
        "checkpoint. jaxckpt commands take a checkpoint folder; a manager's directory (its latest checkpoint); "
        "or a checkpoint of TensorFlow (a prefix such as tf_ckpts/ckpt-5, with PREFIX.index beside it, or its "
        "manager's directory), Orbax (a checkpoint, an item, or a manager's directory), a Flax msgpack or a "
        "safetensors file" + (" (other tools' checkpoints from local paths only)." if where.local is None else ".")
    )


class ForeignOpened(Opened):
    """A checkpoint that another library wrote (``jaxckpt.interop.formats``), read through the same calls.

    Values are read whole, then placed as their templates want, as for jaxckpt's own checkpoints.
    """

    def __init__(self, checkpoint: _formats.ForeignCheckpoint, location: locations.Location) -> None:
        self.checkpoint = checkpoint
        self.format = checkpoint.name
        self.skipped = checkpoint.skipped
        self.empty_or_none = checkpoint.empty_or_none
        self.variable_nodes = checkpoint.variable_nodes
        self.path = checkpoint.path
        self.location = location
        self.index = checkpoint.index

    def exists(self) -> bool:
        path = self.checkpoint.path
        return os.path.exists(path) or os.path.exists(path + ".index")

    def _read(self, wanted: Mapping[str, Any], leaves: list[Leaf]) -> list[Any]:
        return [self.checkpoint.read(key) if isinstance(leaf, ArrayLeaf) else None for key, leaf in zip(wanted, leaves)]

    @property
    def stores_opened(self) -> list[str]:
        return []

    def read_regions(self, wanted: Mapping[str, list[tuple[slice, ...]]]) -> dict[str, list[np.ndarray]]:
        return {key: [self.checkpoint.read(key)[index] for index in regions] for key, regions in wanted.items()}

    def read_pieces(self, key: str, budget: int) -> Iterator[np.ndarray]:
        leaf = self.leaf(key)
        if not isinstance(leaf, ArrayLeaf):
            raise ValueError(f"{describe(key)} is not an array")
        data = self.checkpoint.read(key)  # foreign formats are read whole; then handed on in pieces
        for index in c_order_pieces(leaf.shape, leaf.dtype.itemsize, budget):
            yield data[index]
