"""The progress bar of long reads (``jaxckpt verify``, ``show``, ``diff``, ``convert``): tqdm's.

It draws on stderr, and only when stderr is a terminal: piped or captured output never gets
carriage returns mixed into it. It stays hidden for the first half second, so quick commands never
flash a bar, shows the rate and the time left, and erases itself when done. ``JAXCKPT_NO_PROGRESS``
turns it off everywhere::

    with Progress(total_bytes, "verify ckpt-10") as bar:
        for chunk in chunks:
            ...
            bar.update(chunk.nbytes)
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from tqdm import tqdm


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, as ``ls -h`` and ``du -h`` print them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Progress of ``total`` bytes of work, drawn on ``stream`` (stderr) if it is a terminal.

    ``enabled`` forces drawing on or off (tests); by default it follows ``stream.isatty()`` and the
    ``JAXCKPT_NO_PROGRESS`` environment variable.
    """

    def __init__(
        self, total: int, label: str, *, stream: TextIO | None = None, enabled: bool | None = None, delay: float = 0.5
    ) -> None:
        stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(stream, "isatty", None)
            enabled = bool(isatty and isatty()) and not os.environ.get("JAXCKPT_NO_PROGRESS")
        self.enabled = enabled
        self.done = 0
        # No bar object at all when it does not draw: tqdm's constructor sets up locks (multiprocessing).
        self._bar = (
            None
            if not enabled
            else tqdm(
                total=max(0, int(total)),
                desc=label,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=stream,
                delay=delay,
                leave=False,  # erased when done: what the command prints next starts on a clean line
                mininterval=0.1,
                dynamic_ncols=True,
            )
        )

    def update(self, n: int) -> None:
        """Count ``n`` more bytes done; redraws if it is time to."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
