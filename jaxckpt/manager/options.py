"""What a :class:`CheckpointManager` is given, checked once: its options, and a save's metrics.

:meth:`ManagerOptions.check` refuses bad options before the manager touches its directory, and
the frozen :class:`ManagerOptions` it returns is what the manager, its start-up and its retention
read from then on: the ``<name>-N`` naming, the retention policy (one :class:`KeepAny`), and when to
save: TensorFlow's ``checkpoint_interval``, Orbax's ``save_interval_steps``, and the rules by the clock
(``save_interval_secs``, ``save_continuously``), which process 0 decides for every process.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxckpt._errors import UnsupportedValueError
from jaxckpt.manager.policies import KeepAny, KeepLatest, RetentionPolicy, positive_int, positive_number
from jaxckpt.saving import save_dtypes as _save_dtypes
from jaxckpt.saving.save_dtypes import SaveDtypes
from jaxckpt.storage.statefile import PREFIX, CheckpointInfo

StepCounter = str | Callable[[], Any]  # the name of a child of the checkpoint, or a callable returning the step


@dataclasses.dataclass(frozen=True)
class ManagerOptions:
    """A manager's options, validated (see :class:`CheckpointManager` for what each one means)."""

    name: str
    policy: KeepAny | None  # None: keep every checkpoint
    hours: float | None  # keep_checkpoint_every_n_hours
    step_counter: StepCounter | None
    interval: int | None  # checkpoint_interval
    every: int | None  # save_interval_steps
    init_fn: Callable[[], Any] | None
    async_save: bool
    save_on_preemption: bool
    read_only: bool
    clock: Callable[[], float]
    save_dtypes: SaveDtypes = None  # the dtypes of every save's copy (jaxckpt.saving.save_dtypes)
    interval_secs: float | None = None  # save_interval_secs
    continuous: bool = False  # save_continuously

    @classmethod
    def check(
        cls,
        *,
        max_to_keep: int | None,
        keep_checkpoint_every_n_hours: float | None,
        checkpoint_name: str,
        step_counter: StepCounter | None,
        checkpoint_interval: int | None,
        last_checkpoint_step: int | None = None,
        save_interval_steps: int | None,
        init_fn: Callable[[], Any] | None,
        policies: Sequence[RetentionPolicy],
        async_save: bool,
        save_on_preemption: bool,
        read_only: bool,
        clock: Callable[[], float],
        save_dtypes: SaveDtypes = None,
        save_interval_secs: float | None = None,
        save_continuously: bool = False,
    ) -> ManagerOptions:
        """The options, or the ValueError / TypeError of the first one that is wrong."""
        if not PREFIX.fullmatch(checkpoint_name) or checkpoint_name.startswith("."):
            raise ValueError(f"checkpoint_name {checkpoint_name!r} must be a plain file name, like 'ckpt'.")
        if checkpoint_interval is not None:
            if step_counter is None:
                raise ValueError("checkpoint_interval needs a step_counter to measure the interval with.")
            if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int):
                raise ValueError(f"checkpoint_interval must be an int, not {checkpoint_interval!r}.")
        if last_checkpoint_step is not None:
            if checkpoint_interval is None:
                raise ValueError(
                    "last_checkpoint_step is where checkpoint_interval counts from: it needs checkpoint_interval."
                )
            if isinstance(last_checkpoint_step, bool) or not isinstance(last_checkpoint_step, int):
                raise ValueError(f"last_checkpoint_step must be an int step, not {last_checkpoint_step!r}.")
        if save_interval_steps is not None:
            positive_int("save_interval_steps", save_interval_steps)
        if not isinstance(save_continuously, bool):
            raise TypeError(f"save_continuously must be True or False, not {save_continuously!r}.")
        if read_only and save_on_preemption:
            raise ValueError("save_on_preemption needs a manager that saves, not one with read_only=True.")
        if step_counter is not None and not (isinstance(step_counter, str) or callable(step_counter)):
            raise TypeError(f"step_counter must be a child name or a callable, not {step_counter!r}.")
        policy = KeepAny(*policies)  # refuses what is not a policy
        if max_to_keep is not None:
            policy = KeepAny(policy, KeepLatest(max_to_keep))
        hours = keep_checkpoint_every_n_hours
        return cls(
            name=checkpoint_name,
            policy=policy if policy.policies else None,
            hours=None if hours is None else positive_number("keep_checkpoint_every_n_hours", hours),
            step_counter=step_counter,
            interval=checkpoint_interval,
            every=save_interval_steps,
            init_fn=init_fn,
            async_save=async_save,
            save_on_preemption=save_on_preemption,
            read_only=read_only,
            clock=clock,
            save_dtypes=_save_dtypes.check(save_dtypes),
            interval_secs=None
            if save_interval_secs is None
            else positive_number("save_interval_secs", save_interval_secs),
            continuous=save_continuously,
        )

    def number(self, prefix: str) -> int | None:
        """N for a ``<name>-N`` folder name of this manager's ``checkpoint_name``; None for any other name."""
        match = re.fullmatch(rf"{re.escape(self.name)}-([0-9]+)", prefix)
        return None if match is None else int(match.group(1))

    def next_number(self, checkpoint_number: int | None, counter: int, infos: Sequence[CheckpointInfo]) -> int:
        """The number of the next checkpoint: ``checkpoint_number`` if given, else after ``counter`` (the
        checkpoint's ``save_counter``) and after every number ``infos`` lists, another ``checkpoint_name``'s
        included (a job that did not restore)."""
        if checkpoint_number is None:
            taken = [int(m.group(1)) for c in infos if (m := re.fullmatch(r".+-([0-9]+)", os.path.basename(c.path)))]
            return max(counter + 1, max(taken, default=0) + 1)
        number = operator.index(checkpoint_number)
        if number < 0:
            raise ValueError(f"checkpoint_number must be >= 0, not {number}.")
        return number

    def read_step(self, checkpoint: object) -> int | None:
        """The step counter's value now (None without a step counter)."""
        counter = self.step_counter
        if counter is None:
            return None
        value = getattr(checkpoint, counter) if isinstance(counter, str) else counter()
        try:
            return operator.index(value)
        except TypeError:
            raise TypeError(f"The step counter {counter!r} gave {value!r}, which is not an integer step.") from None

    @property
    def timed(self) -> bool:
        """Whether a rule by the clock takes part in the decision (``save_interval_secs``, ``save_continuously``)."""
        return self.interval_secs is not None or self.continuous

    def due(self, step: int | None, latest: int | None, preempted: bool = False) -> bool | None:
        """Orbax's rule by step: False where ``step`` is not past ``latest`` (the latest checkpoint's
        step); True at a preemption notice (``preempted``) or a step divisible by ``save_interval_steps``;
        otherwise, without a rule by the clock, whether there is no ``save_interval_steps``, and with
        one, None: :meth:`due_by_clock` decides (on process 0, for every process)."""
        if step is not None and latest is not None and step <= latest:
            return False
        if preempted or (self.every is not None and step is not None and step % self.every == 0):
            return True
        return None if self.timed else self.every is None

    def due_by_clock(self, since: float, saving: bool) -> bool:
        """The rules by the clock: ``save_continuously``, no save of this manager is being written
        (``saving``) any more; ``save_interval_secs``, that many seconds passed ``since`` (when the last
        save began, or the manager started)."""
        if self.continuous and saving:
            return False
        return self.interval_secs is None or self.clock() - since >= self.interval_secs

    def too_soon(self, step: int | None, last: int | None, check_interval: bool) -> bool:
        """TensorFlow's rule: ``step`` is the last saved or restored one, or (with ``check_interval``)
        fewer than ``checkpoint_interval`` steps after it. Never before a first save or restore."""
        if self.interval is None or last is None or step is None:
            return False
        return step == last or (check_interval and step < last + self.interval)


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """A save's metrics as the state file records them: numbers by name, a non-finite one as None."""
    out: dict[str, float | None] = {}
    for name, value in (metrics or {}).items():
        if not isinstance(name, str) or isinstance(value, (str, bytes)):
            raise UnsupportedValueError(f"Metric {name!r}={value!r}: metrics map str names to numbers.")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UnsupportedValueError(f"Metric {name!r}={value!r} is not a number.") from None
        out[name] = number if math.isfinite(number) else None  # JSON has no NaN; a NaN loss is never best
    return out
