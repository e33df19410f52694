"""Operations started but not finished, bounded by their bytes: array writes until they are durable,
array reads until they are copied out."""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

# Bytes of operations in flight at most (one operation more, if it alone is larger).
WRITE_AHEAD_BYTES = 256 << 20
READ_AHEAD_BYTES = 256 << 20


class Pending(Protocol):
    """An operation started: a TensorStore future, or a read (:class:`jaxckpt.arrays.store_read.PendingRead`)."""

    def result(self) -> Any: ...


class InFlight:
    """Operations started but not finished, and their bytes: :meth:`add` waits for the oldest while
    more than ``limit`` bytes are in flight. TensorStore holds each chunk's encoded bytes until a
    write is durable (or a read is copied out), so starting every operation at once would hold a
    checkpoint twice over."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._ops: deque[tuple[int, Pending]] = deque()
        self._bytes = 0

    def add(self, nbytes: int, op: Pending) -> None:
        self._ops.append((nbytes, op))
        self._bytes += nbytes
        while self._bytes > self._limit and len(self._ops) > 1:
            size, done = self._ops.popleft()
            self._bytes -= size
            done.result()

    def drain(self) -> None:
        """Wait for every operation still in flight."""
        while self._ops:
            self._ops.popleft()[1].result()

    def pending(self) -> list[Pending]:
        return [op for _, op in self._ops]
