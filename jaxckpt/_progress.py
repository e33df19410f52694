"""A small progress bar for long reads (``jaxckpt verify``, ``show`` and ``diff`` of large arrays).

It draws on stderr, and only when stderr is a terminal: piped or captured output never gets
carriage returns mixed into it. It stays hidden for the first half second, so quick commands never
flash a bar, redraws at most ten times a second, and erases itself when done. No dependency::

    with Progress(total_bytes, "verify ckpt-10") as bar:
        for chunk in chunks:
            ...
            bar.update(chunk.nbytes)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

_WIDTH = 24  # characters of the bar itself


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, as ``ls -h`` and ``du -h`` print them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Progress of ``total`` units (bytes by default) of work, drawn on ``stream`` if it is a terminal.

    ``enabled`` forces drawing on or off (tests); by default it follows ``stream.isatty()``, and the
    ``JAXCKPT_NO_PROGRESS`` environment variable turns it off everywhere.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        delay: float = 0.5,
        interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(0, int(total))
        self.done = 0
        self.label = label
        self._stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self._stream, "isatty", None)
            enabled = bool(isatty and isatty()) and not os.environ.get("JAXCKPT_NO_PROGRESS")
        self.enabled = enabled
        self._clock = clock
        self._start = clock()
        self._delay = delay
        self._interval = interval
        self._last_draw: float | None = None
        self._drawn = False

    def update(self, n: int) -> None:
        """Count ``n`` more units done; redraws if it is time to."""
        self.done += n
        if not self.enabled:
            return
        now = self._clock()
        if now - self._start < self._delay:
            return
        if self._last_draw is not None and now - self._last_draw < self._interval and self.done < self.total:
            return
        self._last_draw = now
        self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The bar as one line: ``label [#######.....]  58% 1.2 GiB / 2.0 GiB  310.5 MiB/s``."""
        now = self._clock() if now is None else now
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(fraction * _WIDTH)
        elapsed = max(now - self._start, 1e-9)
        rate = f"  {human_bytes(self.done / elapsed)}/s" if self.done else ""
        return (
            f"{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {fraction:4.0%} "
            f"{human_bytes(self.done)} / {human_bytes(self.total)}{rate}"
        )

    def _draw(self, now: float) -> None:
        # \r returns to the start of the line and \x1b[K clears what a longer previous line left.
        self._stream.write(f"\r{self.line(now)}\x1b[K")
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the bar, so that what the command prints next starts on a clean line."""
        if self._drawn:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
