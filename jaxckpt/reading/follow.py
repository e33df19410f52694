"""Following a directory that another job saves into: :func:`checkpoints_iterator`, TensorFlow's
``tf.train.checkpoints_iterator`` (an evaluator beside a trainer). It reads what
:func:`~jaxckpt.latest_checkpoint` reads, the state file, so it takes the directories that takes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from jaxckpt.reading.open import latest_checkpoint
from jaxckpt.storage.locations import PathLike


def _seconds(name: str, value: float | None, *, positive: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, not {value!r}.")
    if positive and value == 0:
        raise ValueError(f"{name} must be above 0, not {value!r}.")


def checkpoints_iterator(
    directory: PathLike,
    *,
    min_interval_secs: float = 0,
    timeout: float | None = None,
    timeout_fn: Callable[[], bool] | None = None,
    poll_interval_secs: float = 1.0,
) -> Iterator[str]:
    """Yield the latest checkpoint of ``directory`` each time a new one appears, as TensorFlow's
    ``tf.train.checkpoints_iterator``: first the latest there now (if any), then each newer latest,
    for an evaluator that follows a trainer::

        for path in jaxckpt.checkpoints_iterator("ckpts", timeout=3600):
            evaluate(jaxckpt.restore(path, like=abstract_state))

    A checkpoint that retention deleted before it was seen is skipped: only the latest is yielded.

    Args:
        directory: a :class:`CheckpointManager`'s directory (or one that TensorFlow's, Orbax's or
            Flax's manager keeps, as :func:`latest_checkpoint` reads them). It need not exist yet.
        min_interval_secs: at least this long from one yield to the next (the time the caller spends
            between them counts).
        timeout: how long to wait for a new checkpoint (None: for ever). When it passes with none,
            ``timeout_fn`` is called: the iterator ends if it returns True (or there is none), else
            waits again (another ``timeout``).
        timeout_fn: see ``timeout``; say, whether the trainer is done.
        poll_interval_secs: how often the state file is read while waiting.
    """
    _seconds("min_interval_secs", min_interval_secs)
    _seconds("timeout", timeout)
    _seconds("poll_interval_secs", poll_interval_secs, positive=True)
    last: str | None = None
    while True:
        found = _wait_for_new(directory, last, timeout, poll_interval_secs)
        if found is None:
            if timeout_fn is None or timeout_fn():
                return
            continue
        start = time.monotonic()
        last = found
        yield found
        left = start + min_interval_secs - time.monotonic()
        if left > 0:
            time.sleep(left)


def _wait_for_new(directory: PathLike, last: str | None, timeout: float | None, poll: float) -> str | None:
    """The latest checkpoint once it is not ``last``, or None when ``timeout`` passes first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        path = latest_checkpoint(directory)
        if path is not None and path != last:
            return path
        if deadline is not None and time.monotonic() + poll > deadline:
            return None
        time.sleep(poll)  # polling the state file: nothing tells a reader that another process saved
