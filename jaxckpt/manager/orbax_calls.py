"""The calls that Orbax's ``CheckpointManager`` users write, on :class:`~jaxckpt.CheckpointManager`:
``should_save``, ``all_steps``, ``latest_step``, ``best_step``, ``metadata`` (the run's, see
:mod:`jaxckpt.manager.run_metadata`) and ``reload`` (an evaluator following a trainer)."""

from __future__ import annotations

import copy
import operator
from typing import Any

from jaxckpt.manager import run_metadata
from jaxckpt.manager.options import ManagerOptions
from jaxckpt.manager.policies import KeepAny, KeepBest, RetentionPolicy
from jaxckpt.manager.preemption import PreemptionHandler
from jaxckpt.runtime import multihost
from jaxckpt.runtime.background import Background
from jaxckpt.storage import locations, statefile
from jaxckpt.storage.statefile import CheckpointInfo


def best_policy(policy: RetentionPolicy | None) -> KeepBest | None:
    """The manager's first :class:`KeepBest`, the one whose metric and mode say which checkpoint is best."""
    if isinstance(policy, KeepBest):
        return policy
    if isinstance(policy, KeepAny):
        for p in policy.policies:
            found = best_policy(p)
            if found is not None:
                return found
    return None


class OrbaxCalls:
    """:class:`~jaxckpt.CheckpointManager`'s Orbax-named calls."""

    # What the manager has that these calls use.
    _preemption: PreemptionHandler | None
    _options: ManagerOptions
    _background: Background
    _infos: list[CheckpointInfo]
    _path: locations.Location
    _directory: str
    _metadata: dict[str, Any] | None
    _given_metadata: dict[str, Any] | None
    _last_info: CheckpointInfo | None
    _since: float  # when this manager's last save began, or it started (save_interval_secs counts from it)

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would save at ``step`` (see :meth:`jaxckpt.CheckpointManager.should_save`);
        never waits for a save in the background."""
        return self._due(operator.index(step))

    def _due(self, step: int | None) -> bool:
        """:meth:`should_save`'s answer, which :meth:`save` follows (a preemption notice included). A
        rule by the clock is process 0's decision, shared (every process calls this alike); the rules
        by step are the same on every process, and need no agreement."""
        preempted = step is not None and self._preemption is not None and self._preemption.reached_preemption(step)
        by_step = self._options.due(step, self._latest_step(), preempted)
        if by_step is not None:
            return by_step
        return multihost.primary_decides(
            "save decision", lambda: self._options.due_by_clock(self._since, self._background.pending)
        )

    def _latest_step(self) -> int | None:
        """The step of the latest checkpoint, the one being saved in the background included (it is
        the latest once written), without waiting for it."""
        last = self._last_info
        if last is not None and self._background.pending:
            return last.step
        infos = self._infos
        return infos[-1].step if infos else None

    def metadata(self) -> dict[str, Any]:
        """The run's metadata: what the directory's first manager given ``metadata={...}`` recorded
        (Orbax's rule: written once; see :mod:`jaxckpt.manager.run_metadata`), else what this manager was
        given (a read-only one never writes), else ``{}``. A copy: changing it changes nothing."""
        if self._metadata is None:
            self._metadata = run_metadata.start(self._path, self._given_metadata, write=False)
        return copy.deepcopy(self._metadata)

    def all_steps(self) -> list[int]:
        """The steps of the kept checkpoints, oldest first (waits as ``latest_checkpoint``)."""
        self._background.settle()
        return [c.step for c in self._infos]

    def latest_step(self) -> int | None:
        """The step of the latest checkpoint, or None (waits as ``latest_checkpoint``)."""
        self._background.settle()
        return self._infos[-1].step if self._infos else None

    def best_step(self) -> int | None:
        """The step of the best kept checkpoint (see :meth:`jaxckpt.CheckpointManager.best_step`)."""
        self._background.settle()
        best = best_policy(self._options.policy)
        if best is None:  # as Orbax without best_fn: the latest (with two tiers, the newest in either)
            return self.latest_step()
        ranked = list(best.keep(self._infos))  # best first
        return ranked[0].step if ranked else None

    def reload(self) -> None:
        """Read the state file and the run metadata again (see :meth:`jaxckpt.CheckpointManager.reload`)."""
        self._background.wait()
        if self._options.read_only:
            state = statefile.read_full_state(self._directory)
            self._infos = state[0] if state is not None else []
        if self._metadata is not None:
            recorded = run_metadata.read(self._path)
            if recorded is not None:
                self._metadata = recorded
