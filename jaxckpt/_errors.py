"""Every exception jaxckpt raises on purpose.

    JaxckptError
    ├── CheckpointNotFoundError      (also FileNotFoundError) nothing at that path
    │   └── NotACheckpointError      something is there, but not a finished checkpoint
    ├── CheckpointExistsError        (also FileExistsError) save would overwrite a checkpoint
    ├── ManagerLockedError           another live CheckpointManager holds the directory
    ├── CheckpointFormatError        (also ValueError) the index cannot be trusted
    │   ├── UnsupportedVersionError  written by a newer jaxckpt
    │   └── CheckpointCorruptedError damaged, truncated or missing data, checksum mismatch
    ├── StorageError                 (also OSError) the storage refused: permission, full disk, network
    ├── MismatchError                (also ValueError) checkpoint value does not fit its object
    ├── MissingKeyError              (also KeyError) a key is not in the checkpoint
    ├── UnsupportedValueError        (also TypeError) a value jaxckpt cannot save
    └── RestoreAssertionError        (also AssertionError) a restore status assertion failed

and one warning, UnusedValuesWarning (a UserWarning): a restore left checkpoint values unused.

Messages name the key, what was expected, what was found, and what to do. A warning points at the
user's line: :func:`caller_level`, the first frame outside jaxckpt however many of its frames lie
between (a manager passes each call on to its part, a two-tier part to its local tier).
"""

from __future__ import annotations

import os
import sys
from types import FrameType


class JaxckptError(Exception):
    """Root of every exception that jaxckpt raises on purpose."""


class CheckpointNotFoundError(JaxckptError, FileNotFoundError):
    """No checkpoint exists at the given path."""


class NotACheckpointError(CheckpointNotFoundError):
    """The path exists but holds no finished checkpoint (no valid index)."""


class CheckpointReplacedError(CheckpointNotFoundError):
    """The checkpoint was replaced by another save (``overwrite=True``) while it was being read, and
    the files of the one being read were deleted; nothing of either was returned.
    :func:`jaxckpt.restore` reads the new one by itself (up to three times more) before raising it."""


class CheckpointExistsError(JaxckptError, FileExistsError):
    """A save would replace an existing checkpoint without ``overwrite=True``."""


class ManagerLockedError(JaxckptError):
    """Another live CheckpointManager holds the directory (or this one was closed)."""


class CheckpointFormatError(JaxckptError, ValueError):
    """The checkpoint's index is malformed, unsafe, or inconsistent with its data."""


class UnsupportedVersionError(CheckpointFormatError):
    """The checkpoint was written in a format version this jaxckpt cannot read."""


class CheckpointCorruptedError(CheckpointFormatError):
    """Stored bytes are damaged: a checksum does not match, or data is truncated."""


class StorageError(JaxckptError, OSError):
    """The storage could not be read or written: permission denied, no space left, a network error.

    Not damage: the same call may work once the cause is fixed. ``errno`` is set where it is known
    (``errno.ENOSPC`` for a full disk, ``errno.EACCES`` for a permission error).
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno, self.strerror = errno, message

    def __str__(self) -> str:  # the message alone, not OSError's "[Errno N] ..."
        return str(self.args[0]) if self.args else ""


class MismatchError(JaxckptError, ValueError):
    """A checkpoint value does not fit the object it is restored into."""


class MissingKeyError(JaxckptError, KeyError):
    """A requested key is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class UnsupportedValueError(JaxckptError, TypeError):
    """A value of a type that jaxckpt cannot save or restore."""


class RestoreAssertionError(JaxckptError, AssertionError):
    """A restore status assertion (``assert_consumed`` and friends) failed."""


class UnusedValuesWarning(UserWarning):
    """A restore left checkpoint values unused and ``expect_partial()`` was not called."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def caller_level() -> int:
    """The ``stacklevel`` for ``warnings.warn``, called where it is called, of the first frame
    outside jaxckpt: ``warnings.warn(message, stacklevel=caller_level())``."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _inside(filename: str) -> bool:
    folder = os.path.dirname(os.path.abspath(filename))
    return folder == _PACKAGE or folder.startswith(_PACKAGE + os.sep)
