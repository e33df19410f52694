"""Background saves: one worker thread per process, and one queue slot per owner.

An owner (a Checkpoint, a manager, or the module-level ``jaxckpt.save``) has at most one save in
the background. A new save first waits for the previous one, so saves finish in order and host
memory holds one snapshot per owner; if the previous one failed, its error is raised then, before
anything new is written. ``wait()`` does the same on request. At interpreter exit, pending saves are
finished (the worker is a ``concurrent.futures`` thread, which Python joins at exit) and a failure
that nobody collected is printed to stderr rather than lost.

    owner state:  idle --submit--> running --done--> finished --wait()/next submit--> idle
                                                 \\-> failed  --wait()/next submit--> raises, then idle

An interrupted ``wait()`` (Ctrl-C) leaves the owner running: only a wait that collected the outcome
moves it on. ``settle()`` waits without collecting, for code that only looks.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxckpt.storage.locations import Location

_lock = threading.Lock()
# One worker thread per pool: "save" writes checkpoints; "copy" copies finished ones to a durable
# tier (jaxckpt.manager.tiers), so that a slow copy to a bucket never holds up the next save's write.
_executors: dict[str, ThreadPoolExecutor] = {}
_uncollected: set[Future[Any]] = set()  # failed or pending futures whose owner has not looked yet
_writing: dict[Future[Any], str] = {}  # saves not done yet -> the checkpoint each writes (see _place)


def _place(location: Location) -> str:
    """What :func:`settle_writes` matches a save's checkpoint by: its absolute local path, or its URL."""
    local = location.local
    return os.path.normpath(os.fspath(local)) if local is not None else location.text.rstrip("/")


def settle_writes(location: Location) -> list[BaseException]:
    """Wait until no save of this process writes the checkpoint at ``location`` or one inside it (a
    manager's directory), without collecting their outcomes (their owners raise them); returns the
    errors of those that failed."""
    place = _place(location)
    with _lock:
        futures = [f for f, dest in _writing.items() if dest == place or dest.startswith(place.rstrip("/") + "/")]
    concurrent.futures.wait(futures)
    return [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]


def _worker(pool: str) -> ThreadPoolExecutor:
    with _lock:
        if pool not in _executors:
            _executors[pool] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"jaxckpt-{pool}")
        return _executors[pool]


class Background:
    """The background save of one owner."""

    def __init__(self, what: str, pool: str = "save") -> None:
        self._what = what
        self._pool = pool
        self._future: Future[Any] | None = None

    @property
    def pending(self) -> bool:
        """A save is running or queued (not done yet)."""
        return self._future is not None and not self._future.done()

    @property
    def failed(self) -> bool:
        """The last save is done and failed, and its error has not been raised to anyone yet."""
        return self._future is not None and self._future.done() and self._future.exception() is not None

    def submit(self, fn: Callable[[], Any], writes: Location | None = None) -> None:
        """Run ``fn`` in the background, after the previous save of this owner (raising its error).
        ``writes``: the checkpoint it writes, which reads wait for (:func:`settle_writes`)."""
        self.wait()
        place = None if writes is None else _place(writes)
        future = _worker(self._pool).submit(fn)
        with _lock:
            _uncollected.add(future)
            if place is not None:
                _writing[future] = place
        if writes is not None:
            future.add_done_callback(_written)  # at once if it is done already: never left in _writing
        self._future = future

    def settle(self, timeout: float | None = None) -> bool:
        """Block until this owner's background save is done (at most ``timeout`` seconds), without
        raising or forgetting its error; returns whether it is done.

        For looking (``repr``, a manager's listing): the error stays for :meth:`wait` or the next
        :meth:`submit`, the calls whose job is to report it.
        """
        future = self._future
        if future is not None:
            concurrent.futures.wait([future], timeout=timeout)
            return future.done()
        return True

    def wait(self) -> None:
        """Block until this owner's background save is done; raise its error if it failed.

        The save is forgotten only once its outcome was collected: an interrupted wait (Ctrl-C)
        leaves it pending, so that the next wait, or the report at exit, still sees how it ended.
        """
        future = self._future
        if future is None:
            return
        try:
            future.result()
        except BaseException as e:
            if not (future.done() and not future.cancelled() and future.exception() is e):
                raise  # interrupted while it still runs (or as it ended): keep it for the next wait
            self._forget(future)
            raise
        self._forget(future)

    def _forget(self, future: Future[Any]) -> None:
        if self._future is future:
            self._future = None
        with _lock:
            _uncollected.discard(future)


def _written(future: Future[Any]) -> None:
    with _lock:
        _writing.pop(future, None)


@atexit.register
def _report_at_exit() -> None:
    # atexit handlers run after Python joined the worker, so every save here is finished.
    with _lock:
        futures = list(_uncollected)
    for future in futures:
        error = future.exception() if future.done() else None
        if error is not None:
            print(f"jaxckpt: a background save failed and nobody waited for it: {error!r}", file=sys.stderr)


# The background of the one-call ``jaxckpt.save``; ``restore`` and the next ``save`` wait for it.
SAVES = Background("jaxckpt.save")
