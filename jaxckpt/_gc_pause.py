"""Pausing Python's cyclic garbage collector for the per-leaf work of a save or a restore.

Each leaf makes a few objects, and with 100,000 leaves the collections that these trigger scan ever
more of them: a save took 16x as long for 10x the leaves, 10x without. Pauses may overlap, in one
thread or several (a background save's recording, the caller's next snapshot or restore): the first
stops a running collector, and the last to end starts it again. A collector the user stopped stays
stopped.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_pauses = 0  # in progress
_stopped = False  # whether these pauses stopped the collector


def pause() -> Callable[[], None]:
    """Pause the collector now; returns the call that ends this pause (later calls do nothing)."""
    global _pauses, _stopped
    with _lock:
        if _pauses == 0:
            _stopped = gc.isenabled()
            gc.disable()
        _pauses += 1
    ended = False

    def end() -> None:
        global _pauses
        nonlocal ended
        with _lock:
            if ended:
                return
            ended = True
            _pauses -= 1
            if _pauses == 0 and _stopped:
                gc.enable()

    return end


def gc_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run with the collector paused."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        end = pause()
        try:
            return fn(*args, **kwargs)
        finally:
            end()

    return paused
