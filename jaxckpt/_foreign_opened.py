"""A checkpoint that another library wrote, opened for reading through :class:`jaxckpt._reader.Opened`'s calls."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jaxckpt import _formats, _storage
from jaxckpt._format import ArrayLeaf, Leaf
from jaxckpt._read_plan import c_order_pieces
from jaxckpt._reader import Opened
from jaxckpt._tree import describe


class ForeignOpened(Opened):
    """A checkpoint that another library wrote (``jaxckpt._formats``), read through the same calls.

    Values are read whole, then placed as their templates want, as for jaxckpt's own checkpoints.
    """

    def __init__(self, checkpoint: _formats.ForeignCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.format = checkpoint.name
        self.skipped = checkpoint.skipped
        self.path = checkpoint.path
        self.location = _storage.location(checkpoint.path)
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
