"""Reading the checkpoints that other libraries write: TensorFlow, Orbax, Flax msgpack, safetensors.

Read-only: nothing here writes TensorFlow or Orbax files (``safetensors.write`` is the one writer,
for ``jaxckpt convert``). Each format is a module of this package with the same surface, the
:class:`Format` protocol that mypy holds every module to (what they share is in :mod:`.common`):

    NAME: str                                   how ``ls`` and error messages name the format
    def detect(path: str) -> bool               is ``path`` one checkpoint of this format? (cheap:
                                                names and the first bytes of files, no parsing)
    def open(path: str) -> Foreign              parse the metadata; values are read on demand
    def manages(directory: str) -> bool         is it a folder that this format's manager keeps?
    def latest(directory: str) -> str | None    its newest complete checkpoint (for ``manages``)

A foreign checkpoint is presented as jaxckpt presents its own: keys are edges joined by ``/``
(``net/l1/kernel``), array values are :class:`~jaxckpt.format.records.ArrayLeaf` records whose ``at`` is
an :class:`~jaxckpt.format.records.InForeign` holding the reader's own locator, and Python values are
``ValueLeaf`` records. Values with no numpy form (TensorFlow's ``DT_VARIANT`` iterator state,
string tensors) are listed as skipped with what they hold.

A checkpoint is untrusted input: every size, shape and offset is checked against the file that
holds it before memory is allocated; a value whose checksum fails is a
:class:`~jaxckpt.CheckpointCorruptedError` naming its key; metadata that does not parse is a
:class:`~jaxckpt.CheckpointFormatError` naming the file.
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from jaxckpt._errors import CheckpointFormatError
from jaxckpt.format.keys import DICT, NodeInfo, escape_edge, join
from jaxckpt.format.records import ArrayLeaf, Index, Leaf
from jaxckpt.interop.common import EMPTY_DICT, Entry


class Foreign(Protocol):
    """An opened foreign checkpoint."""

    name: str  # the format as users know it: "TensorFlow (tf.train.Checkpoint)", "Orbax", ...
    path: str  # how messages name the checkpoint
    # Optional (read with getattr, default False): whether every value read is checked against a
    # checksum the format stores, so that ``jaxckpt verify`` can say so.
    # checksums: bool
    # Optional (read with getattr, default None): the edge under which the format stores the value of
    # a Flax NNX Variable (Orbax: "value"), see ForeignCheckpoint.variable_nodes.
    # variable_value_edge: str

    def entries(self) -> list[Entry]:
        """Every value, in the checkpoint's own order."""
        ...

    def read(self, key: str, leaf: ArrayLeaf) -> np.ndarray:
        """The whole value of ``leaf`` (an entry's record; ``key`` names it in errors), of exactly
        ``leaf.dtype`` and ``leaf.shape``, its checksum verified where the format has one."""
        ...


class Format(Protocol):
    """A format module of this package (the surface in this package's docstring). Every module is
    checked against it where :func:`_modules` lists them, and so is what its ``open`` returns."""

    @property
    def NAME(self) -> str: ...

    def detect(self, path: str, /) -> bool: ...

    def open(self, path: str, /) -> Foreign: ...

    def manages(self, directory: str, /) -> bool: ...

    def latest(self, directory: str, /) -> str | None: ...


def _modules() -> list[Format]:
    # Imported when first needed: reading a jaxckpt checkpoint never pays for these.
    from jaxckpt.interop import flax_msgpack, orbax, safetensors, tensorflow

    return [tensorflow, orbax, safetensors, flax_msgpack]


def detect(path: str | os.PathLike[str]) -> Format | None:
    """The module of the format of the checkpoint at ``path``, or None if it is none of them."""
    text = os.fspath(path)
    for module in _modules():
        if module.detect(text):
            return module
    return None


def manager_of(directory: str | os.PathLike[str]) -> Format | None:
    """The module of the format whose manager keeps ``directory``, or None."""
    text = os.fspath(directory)
    if not os.path.isdir(text):
        return None
    for module in _modules():
        if module.manages(text):
            return module
    return None


class ForeignCheckpoint:
    """A foreign checkpoint with a jaxckpt :class:`~jaxckpt.format.records.Index` of its values."""

    def __init__(self, reader: Foreign) -> None:
        self.reader = reader
        self.name = reader.name
        self.path = reader.path
        self.skipped: dict[str, Entry] = {}
        # Keys of None values that also stand for a leafless node (Entry.stands_for_empty).
        self.empty_or_none: set[str] = set()
        leaves: dict[str, Leaf] = {}
        children: dict[str, dict[str, None]] = {"": {}}  # node key -> its child edges, in order
        for entry in reader.entries():
            if not entry.edges:
                raise CheckpointFormatError(f"{self.path!r}: a value of this {self.name} checkpoint has an empty name")
            keys = [escape_edge(entry.edges[0])]
            for edge in entry.edges[1:]:
                keys.append(join(keys[-1], escape_edge(edge)))
            key = keys[-1]
            if key in leaves or key in self.skipped or key in children:
                raise CheckpointFormatError(
                    f"{self.path!r}: the key {key!r} appears twice in this {self.name} checkpoint"
                )
            empty = entry.leaf is None and entry.note == EMPTY_DICT
            if entry.leaf is None and not empty:  # listed, never part of the tree that restore builds
                self.skipped[key] = entry
                continue
            for parent, edge, below in zip(["", *keys], entry.edges, keys):
                if parent in leaves:
                    raise CheckpointFormatError(
                        f"{self.path!r}: {key!r} is below {parent!r}, which is itself a value in this {self.name} checkpoint"
                    )
                children[parent].setdefault(edge)
                if below != key or empty:
                    children.setdefault(below, {})
            if entry.leaf is not None:
                leaves[key] = entry.leaf
                if entry.stands_for_empty:
                    self.empty_or_none.add(key)
        nodes = {key: NodeInfo(DICT, "dict", tuple(edges)) for key, edges in children.items()}
        self.index = Index(nodes, leaves, [], {"format": self.name}, version=0)
        # Where the format stores a Flax NNX Variable as a node with one child, its value under this edge
        # (Orbax: ``linear/kernel/value``; ``getattr`` as the protocol leaves it optional), the keys of
        # such nodes: a template's Variable at one of them takes that child (never any other 'value' key).
        value_edge = getattr(reader, "variable_value_edge", None)
        self.variable_nodes: dict[str, str] = {}  # node key -> the key of its one child, the value
        if isinstance(value_edge, str):
            escaped = escape_edge(value_edge)
            for key, info in nodes.items():
                if key and info.keys == (value_edge,) and join(key, escaped) in leaves:
                    self.variable_nodes[key] = join(key, escaped)

    def read(self, key: str) -> np.ndarray:
        leaf = self.index.leaves[key]
        assert isinstance(leaf, ArrayLeaf)
        return self.reader.read(key, leaf)
