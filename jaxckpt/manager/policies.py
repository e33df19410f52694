"""Retention policies: which of a manager's checkpoints to keep.

A policy is any object with ``keep(checkpoints) -> Iterable[CheckpointInfo]``: given every checkpoint
the manager holds, oldest first, it returns the ones it wants kept. A manager keeps a checkpoint if
any of its policies keeps it, and always keeps the latest (a restarted job must find something to
resume from). Policies are stateless: their answer depends only on the list they are given, which
the state file records, so a restarted job decides exactly as the job before it::

    policy = KeepLatest(3) | KeepEvery(hours=2) | KeepBest(2, metric="loss")
    manager = jaxckpt.CheckpointManager(ckpt, "ckpts", policies=[policy])
    manager.save(metrics={"loss": 0.31})
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol, runtime_checkable

from jaxckpt.storage.statefile import CheckpointInfo


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which checkpoints to keep. ``checkpoints`` is oldest first; return a subset of them."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Iterable[CheckpointInfo]:
        """The checkpoints to keep, of ``checkpoints`` (every one the manager holds, oldest first)."""
        ...


class _Combinable:
    """``a | b`` keeps what either keeps."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Iterable[CheckpointInfo]:
        """The checkpoints to keep, of ``checkpoints`` (every one the manager holds, oldest first)."""
        raise NotImplementedError  # each policy says what it keeps

    def __or__(self, other: RetentionPolicy) -> KeepAny:
        return KeepAny(self, other)

    def __ror__(self, other: RetentionPolicy) -> KeepAny:
        return KeepAny(other, self)


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int of at least 1 (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}.")
    return value


def positive_number(name: str, value: object) -> float:
    """``value`` if it is a finite number above 0 (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number, not {value!r}.")
    return value


def check_policy(policy: object) -> RetentionPolicy:
    """``policy`` if it has a ``keep`` method, else a TypeError saying so."""
    if not isinstance(policy, RetentionPolicy) or not callable(policy.keep):
        raise TypeError(f"{policy!r} is not a retention policy: it has no keep(checkpoints) method.")
    return policy


@dataclasses.dataclass(frozen=True)
class KeepLatest(_Combinable):
    """Keep the ``n`` most recent checkpoints: ``KeepLatest(3)``."""

    n: int

    def __post_init__(self) -> None:
        positive_int("KeepLatest(n)", self.n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Iterable[CheckpointInfo]:
        return checkpoints[-self.n :]


@dataclasses.dataclass(frozen=True, init=False)
class KeepEvery(_Combinable):
    """Keep one checkpoint per window of ``steps`` training steps or of ``hours`` of wall-clock time.

    ``KeepEvery(steps=1000)`` keeps, for each window ``[k*1000, (k+1)*1000)``, the checkpoint of lowest
    step in it; ``KeepEvery(hours=2)`` keeps the earliest checkpoint of each two-hour window (windows
    are aligned to the Unix epoch). Windows rather than "every multiple of 1000" so that saving every
    300 steps still keeps one per thousand; the earliest of a window so that the choice never changes
    as later checkpoints arrive, or when others are deleted.
    """

    steps: int | None
    hours: float | None

    def __init__(self, *, steps: int | None = None, hours: float | None = None) -> None:
        if (steps is None) == (hours is None):
            raise ValueError("KeepEvery takes exactly one of steps= or hours=, e.g. KeepEvery(hours=2).")
        if steps is not None:
            positive_int("KeepEvery(steps=)", steps)
        else:
            positive_number("KeepEvery(hours=)", hours)
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "hours", hours)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Iterable[CheckpointInfo]:
        first: dict[int, CheckpointInfo] = {}
        for c in checkpoints:
            window, order = self._place(c)
            held = first.get(window)
            if held is None or order < self._place(held)[1]:
                first[window] = c
        return first.values()

    def _place(self, c: CheckpointInfo) -> tuple[int, float]:
        """The window ``c`` falls in, and its order within it."""
        if self.steps is not None:
            return c.step // self.steps, c.step
        if self.hours is not None:
            return math.floor(c.time / (self.hours * 3600)), c.time
        raise AssertionError("KeepEvery holds steps or hours")  # __init__ sees to it


@dataclasses.dataclass(frozen=True)
class KeepMultiplesOf(_Combinable):
    """Keep every checkpoint whose step is a multiple of ``steps`` (``step % steps == 0``, step 0
    included): Orbax's ``keep_period=steps`` and ``EveryNSteps(steps)``.

    Unlike :class:`KeepEvery` (the first checkpoint of each window), a run that never saves at a
    multiple keeps none: saving at steps 1000, 4000, 7000, 8192, 10000 keeps 8192 alone, as Orbax does.
    """

    steps: int

    def __post_init__(self) -> None:
        positive_int("KeepMultiplesOf(steps)", self.steps)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Iterable[CheckpointInfo]:
        return [c for c in checkpoints if c.step % self.steps == 0]


@dataclasses.dataclass(frozen=True)
class KeepSpaced(_Combinable):
    """Keep the oldest checkpoint, then each one at least ``steps`` steps after the last one kept:
    Orbax's ``EveryNSteps(steps, exact_interval=False)``.

    The spacing counts from checkpoints this policy keeps, which stay, so later saves never change
    which of the earlier ones it keeps.
    """

    steps: int

    def __post_init__(self) -> None:
        positive_int("KeepSpaced(steps)", self.steps)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Iterable[CheckpointInfo]:
        kept: list[CheckpointInfo] = []
        for c in sorted(checkpoints, key=lambda c: c.step):
            if not kept or c.step >= kept[-1].step + self.steps:
                kept.append(c)
        return kept


@dataclasses.dataclass(frozen=True)
class KeepBest(_Combinable):
    """Keep the ``n`` checkpoints with the best ``metric`` (``mode="min"``: lowest is best).

    The metric comes from ``manager.save(metrics={"loss": ...})``. Checkpoints saved without it, or
    with a value that was not finite, are never among the best. Ties keep the older checkpoint::

        KeepBest(3, metric="loss", mode="min")
    """

    n: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        positive_int("KeepBest(n)", self.n)
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest(mode=) must be 'min' or 'max', not {self.mode!r}.")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Iterable[CheckpointInfo]:
        scored = [(value, c) for c in checkpoints if isinstance(value := c.metrics.get(self.metric), (int, float))]
        sign = 1.0 if self.mode == "min" else -1.0
        # sorted is stable: of equal values, the older checkpoint comes first.
        return [c for _, c in sorted(scored, key=lambda scored_c: sign * scored_c[0])][: self.n]


class KeepAny(_Combinable):
    """Keep a checkpoint if any of ``policies`` keeps it: ``KeepAny(KeepLatest(3), KeepEvery(hours=2))``."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        for p in policies:
            check_policy(p)
        # Flatten nested KeepAny so that a | b | c reads back as one flat list.
        self.policies: tuple[RetentionPolicy, ...] = tuple(
            q for p in policies for q in (p.policies if isinstance(p, KeepAny) else (p,))
        )

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Iterable[CheckpointInfo]:
        kept = {c.path for p in self.policies for c in p.keep(checkpoints)}
        return [c for c in checkpoints if c.path in kept]

    def __repr__(self) -> str:
        return f"KeepAny({', '.join(map(repr, self.policies))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepAny) and self.policies == other.policies

    def __hash__(self) -> int:
        return hash(self.policies)
