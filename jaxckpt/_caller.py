"""Where a warning points: the user's line, the first frame outside jaxckpt, however many of its
frames lie between (a manager passes each call on to its part, a two-tier part to its local tier)."""

from __future__ import annotations

import os
import sys
from types import FrameType

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
