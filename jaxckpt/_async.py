"""Background saves: one worker thread per process, and one queue slot per owner.

An owner (a Checkpoint, a manager, or the module-level ``jaxckpt.save``) has at most one save in
the background. A new save first waits for the previous one, so saves finish in order and host
memory holds one snapshot per owner; if the previous one failed, its error is raised then, before
anything new is written. ``wait()`` does the same on request. At interpreter exit, pending saves are
finished (the worker is a ``concurrent.futures`` thread, which Python joins at exit) and a failure
that nobody collected is printed to stderr rather than lost.

    owner state:  idle --submit--> running --done--> finished --wait()/next submit--> idle
                                                 \\-> failed  --wait()/next submit--> raises, then idle
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_uncollected: set[Future] = set()  # failed or pending futures whose owner has not looked yet


def _worker() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxckpt-save")
        return _executor


class Background:
    """The background save of one owner."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._future: Future | None = None

    @property
    def pending(self) -> bool:
        return self._future is not None and not self._future.done()

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in the background, after the previous save of this owner (raising its error)."""
        self.wait()
        future = _worker().submit(fn)
        with _lock:
            _uncollected.add(future)
        self._future = future

    def wait(self) -> None:
        """Block until this owner's background save is done; raise its error if it failed."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        finally:
            with _lock:
                _uncollected.discard(future)


@atexit.register
def _report_at_exit() -> None:
    # atexit handlers run after Python joined the worker, so every save here is finished.
    with _lock:
        futures = list(_uncollected)
    for future in futures:
        error = future.exception() if future.done() else None
        if error is not None:
            print(f"jaxckpt: a background save failed and nobody waited for it: {error!r}", file=sys.stderr)
