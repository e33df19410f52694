"""What every format module of :mod:`jaxckpt.interop.formats` shares: the :class:`Entry` each reader lists,
Python values as records, and opening a checkpoint's file without blocking on a FIFO.

Here, not in the package's ``__init__``, so that the format modules import it and the package
imports them (when first needed), one way.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import Any, Literal

from jaxckpt._errors import CheckpointFormatError, CheckpointNotFoundError, StorageError
from jaxckpt.format.records import Leaf, ValueLeaf

EMPTY_DICT = "empty dict"

# The Python values that a foreign checkpoint holds as values (not arrays), by ValueLeaf type. bool
# comes before int: a bool is an int.
_PYTHON_VALUES: tuple[tuple[Literal["bool", "int", "float", "str"], type], ...] = (
    ("bool", bool),
    ("int", int),
    ("float", float),
    ("str", str),
)


def value_leaf(value: Any) -> ValueLeaf | None:
    """``value`` as a ValueLeaf if it is None, a bool, int, float or str (what JSON and msgpack
    decode to, and what a numpy scalar's ``item()`` gives); None for anything else."""
    if value is None:
        return ValueLeaf("none", None)
    for name, t in _PYTHON_VALUES:
        if isinstance(value, t):
            return ValueLeaf(name, value)
    return None


@dataclasses.dataclass(frozen=True)
class Entry:
    """One value of a foreign checkpoint: where it is in the tree, and its record.

    ``leaf`` is None for a value that has no numpy form; ``note`` then says what it holds
    (``"DT_VARIANT"``, ``"DT_STRING"``) and ``shape`` its shape, for listings. With ``note`` set to
    :data:`EMPTY_DICT` it is an empty container instead (restored as ``{}``).

    ``stands_for_empty``: the value (None) is also how the format stores a pytree node without
    leaves (Orbax stores optax's ``EmptyState()``, ``None`` and other leafless nodes alike as
    ``None``), so it restores into a template's leafless node there as that node.
    """

    edges: tuple[str, ...]
    leaf: Leaf | None
    note: str = ""
    shape: tuple[int, ...] = ()
    stands_for_empty: bool = False


def read_head(path: str, n: int) -> bytes | None:
    """The first ``n`` bytes of the regular file ``path`` (fewer if shorter), or None if it is not
    one: what ``detect`` looks at. Never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, n, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def open_regular(path: str, what: str) -> int:
    """A descriptor of the regular file ``path``, the one file of a ``what`` checkpoint
    ("Flax msgpack", "safetensors"); never blocks on a FIFO. Missing: CheckpointNotFoundError;
    refused by the storage: StorageError; not a regular file: CheckpointFormatError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"No {what} file at {path!r}.") from None
    except OSError as e:
        raise StorageError(f"Cannot open {path!r}: {e.strerror}.", e.errno) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointFormatError(f"{path!r} is not a regular file; a {what} checkpoint is one file.")
    return fd
