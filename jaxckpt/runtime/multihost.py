"""Several processes saving one checkpoint, on JAX's own multi-controller runtime.

Every process calls the same ``save`` / ``restore``. Coordination uses the key-value store and
barriers of ``jax.distributed``'s client: no collectives on devices (so it is safe from the
background save thread while training runs), and no RPC of our own. With one process everything
here is a no-op.

Who writes what is computed, not negotiated: a region of an array (one shard) is written by the
process of the first device that holds it in the sharding's device order, which every process sees
alike. Process 0 (the primary) creates the index, publishes the checkpoint, writes a manager's
state file and applies retention.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxckpt._errors import JaxckptError
from jaxckpt.storage.statefile import CheckpointInfo

PRIMARY = 0
# Every process calls saves in the same order, so counters agree, as long as every process takes
# exactly one token per save: a manager's failed save still takes its token (see abandon).
_sequence = itertools.count()


@dataclasses.dataclass
class _Taken:
    """The tokens this process has taken: how many, and the last one."""

    count: int = 0
    last: str = ""


_taken = _Taken()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    return process_index() == PRIMARY


def _client() -> Any:  # jax._src.distributed keeps the client untyped
    from jax._src import distributed  # the runtime's client; jax.distributed exposes no other handle

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.process_count() > 1 but jax.distributed is not initialized")
    return client


def timeout_ms(nbytes: int = 0) -> int:
    """How long a process waits for the others: a margin (``JAXCKPT_BARRIER_TIMEOUT_S``, default 10
    min) plus the time to move ``nbytes``, the most that any process has to write before it comes, at
    the least rate a healthy process keeps (``JAXCKPT_MIN_RATE_MIB_S``, default 16 MiB/s)."""
    margin = float(os.environ.get("JAXCKPT_BARRIER_TIMEOUT_S", "600"))
    rate = float(os.environ.get("JAXCKPT_MIN_RATE_MIB_S", "16")) * (1 << 20)
    return int((margin + (nbytes / rate if rate > 0 else 0.0)) * 1000)


def size(nbytes: int) -> str:
    """``nbytes`` for people: 5.3 MiB."""
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


def phase(what: str) -> None:
    """Say what this process is doing now (one key of the runtime's key-value store per process,
    overwritten): a process that waits too long for it names it, and this, in its error."""
    if process_count() > 1:
        try:
            _client().key_value_set(f"jaxckpt/phase/{process_index()}", json.dumps([what, time.time()]), True)
        except Exception:  # what this process does is news for others' errors only: never fail for it
            pass


def barrier(name: str, nbytes: int = 0) -> None:
    """Wait until every process has reached the barrier ``name``, at most :func:`timeout_ms` for
    ``nbytes`` (what the slowest process has to move before it comes)."""
    if process_count() > 1:
        waiting = f"waiting at barrier {name!r}"
        phase(waiting)
        timeout = timeout_ms(nbytes)
        try:
            _client().wait_at_barrier(f"jaxckpt/{name}", timeout)
        except Exception as e:
            raise _stuck(e, f"barrier {name!r}", None, timeout, waiting) from e


def _get(key: str, what: str, process: int) -> str:
    """The value of ``key``, which ``process`` sets: waited for at most :func:`timeout_ms`."""
    timeout = timeout_ms()
    try:
        return str(_client().blocking_key_value_get(key, timeout))
    except Exception as e:
        raise _stuck(e, what, process, timeout) from e


def _stuck(error: Exception, what: str, process: int | None, timeout: int, waiting: str = "") -> Exception:
    """A wait for other processes that timed out: a JaxckptError that names the processes that did
    not come (``process``, or for a barrier every process whose phase is not ``waiting``, the one
    it says there) and what each last said it was doing (:func:`phase`); any other error as it is."""
    if "DEADLINE_EXCEEDED" not in str(error):
        return error
    me, now = process_index(), time.time()
    said = _phases()
    if process is not None:
        late = [process]
    else:  # a barrier: those not waiting at it
        late = [p for p in range(process_count()) if p != me and said.get(p, ("", 0.0))[0] != waiting]
    news = "; ".join(
        f"process {p} last said it was {said[p][0]} ({now - said[p][1]:.0f} s ago)"
        if p in said
        else f"process {p} said nothing"
        for p in late
    )
    whom = ", ".join(str(p) for p in late) or "every other process"
    return JaxckptError(
        f"Process {me} waited {timeout / 1000:.1f} s at {what} for process{'es' if len(late) > 1 else ''} {whom}, which "
        f"never came: {news or 'none said what it was doing'}. A process that failed or stopped (see its own error and "
        "log) never comes, and every process must make the same calls in the same order. If they are only slow, set "
        "JAXCKPT_BARRIER_TIMEOUT_S (the margin, in seconds) or JAXCKPT_MIN_RATE_MIB_S (the least rate of writes) "
        "to wait longer."
    )


def _phases() -> dict[int, tuple[str, float]]:
    """What each process last said it was doing (:func:`phase`), by process; {} if unknown."""
    try:
        found = _client().key_value_dir_get("jaxckpt/phase/")
        out = {}
        for key, value in found:
            what, when = json.loads(value)
            out[int(key.rsplit("/", 1)[-1])] = (str(what), float(when))
        return out
    except Exception:
        return {}


def shared_token() -> str:
    """A random token chosen by the primary and known to every process (one per call, in call order)."""
    if process_count() == 1:
        token = uuid.uuid4().hex[:12]
    else:
        key = f"jaxckpt/token/{next(_sequence)}"
        client = _client()
        if is_primary():
            token = uuid.uuid4().hex[:12]
            client.key_value_set(key, token)
        else:
            token = _get(key, f"the token of save {key.rsplit('/', 1)[-1]}", PRIMARY)
    _taken.count, _taken.last = _taken.count + 1, token
    return token


def tokens_taken() -> int:
    """How many tokens this process has taken so far (to tell whether a failed save took its own)."""
    return _taken.count


def _said(error: BaseException) -> str:
    """What a process tells the others of its ``error`` (bounded: a value in the key-value store)."""
    return f"{type(error).__name__}: {error}"[:2000]


def _report(token: str, error: BaseException | None, stage: str = "prepared", nbytes: int = 0) -> None:
    """Every process says how its part of the save with ``token`` went up to ``stage``; raise if any
    process's failed. ``nbytes``: the most any process has to write before it comes (its deadline)."""
    client = _client()
    me = process_index()
    if error is not None:
        client.key_value_set(f"jaxckpt/failed/{token}/{stage}/{me}", _said(error))
    barrier(f"{token}/{stage}", nbytes)
    failures = sorted(client.key_value_dir_get(f"jaxckpt/failed/{token}/{stage}/"))
    if failures and error is None:
        key, why = failures[0]
        doing = "prepare this save" if stage == "prepared" else "write its part of this save"
        raise JaxckptError(
            f"Process {key.rsplit('/', 1)[-1]} failed to {doing} ({why}), so no process saves it; every process "
            "raises this error at the same call. Fix the cause there; the next save starts afresh."
        )


def written(token: str, error: BaseException | None, nbytes: int) -> None:
    """After a process wrote its part of the save ``token`` (or failed to: ``error``, which the caller
    raises): wait for every process's, at most :func:`timeout_ms` for ``nbytes``, and raise if any
    failed, so that none publishes a checkpoint that lacks a part and all raise at the same call.
    A process that failed only tells the others: its own error says more than any from this wait."""
    if process_count() > 1:
        try:
            _report(token, error, "written", nbytes)
        except Exception:
            if error is None:
                raise


def agree(token: str) -> None:
    """After a process's part of a save is prepared: wait for every process's outcome, and raise if any
    failed, so that all processes raise at the same call. Nothing with one process."""
    if process_count() > 1:
        _report(token, None)


def abandon(taken_before: int, error: BaseException) -> str | None:
    """A process whose part of a save failed: still take the save's token if it had not (so that the
    next save's token is the same on every process), and tell the others, who then raise too.

    Returns the save's token (None with one process). ``error`` is the caller's to raise.
    """
    if process_count() == 1:
        return None
    token = shared_token() if tokens_taken() == taken_before else _taken.last
    try:
        _report(token, error)
    except Exception:  # the caller raises its own error, which says more
        pass
    return token


def publish_kept(token: str, kept: Sequence[CheckpointInfo] | None, error: str | None) -> None:
    """Primary: the checkpoints it kept after the save ``token`` (the others adopt them), or its error."""
    if process_count() > 1:
        rows = None if kept is None else [_row(c) for c in kept]
        _client().key_value_set(f"jaxckpt/kept/{token}", json.dumps({"kept": rows, "error": error}))


def _row(c: CheckpointInfo) -> dict[str, Any]:
    # The prefix only: every process joins it to its own spelling of the directory.
    return {
        "prefix": os.path.basename(c.path),
        "step": c.step,
        "time": c.time,
        "metrics": dict(c.metrics),
        "preserved": c.preserved,
        "uses": list(c.uses),
    }


def forget_kept(token: str) -> None:
    """Primary, once every process adopted the list published for ``token``."""
    if process_count() > 1:
        _client().key_value_delete(f"jaxckpt/kept/{token}")


def kept(token: str, directory: str) -> list[CheckpointInfo] | None:
    """Non-primary: the checkpoints the primary kept after the save ``token``, in ``directory``;
    None with one process."""
    if process_count() == 1:
        return None
    doc = json.loads(_get(f"jaxckpt/kept/{token}", f"the list of checkpoints kept after save {token}", PRIMARY))
    if doc["error"] is not None:
        raise JaxckptError(
            f"Process {PRIMARY} could not record the checkpoint it saved ({doc['error']}), so the state file does "
            "not list it; every process raises this error."
        )
    return [
        CheckpointInfo(
            os.path.join(directory, r["prefix"]),
            r["step"],
            r["time"],
            dict(r["metrics"]),
            bool(r.get("preserved")),
            tuple(r.get("uses", ())),
        )
        for r in doc["kept"]
    ]


def gather(name: str, value: str) -> list[str]:
    """Every process's ``value`` for ``name``, in process order (``[value]`` with one process).
    Each process calls it once per ``name``; names are never reused."""
    if process_count() == 1:
        return [value]
    client = _client()
    client.key_value_set(f"jaxckpt/gather/{name}/{process_index()}", value)
    return [_get(f"jaxckpt/gather/{name}/{p}", f"the agreement {name!r}", p) for p in range(process_count())]


_outcomes: dict[str, itertools.count[int]] = {}  # numbers each kind of agreement alike on every process (in call order)


def outcome(kind: str, what: str, error: BaseException | None) -> None:
    """Every process says whether its ``what`` succeeded: ``error`` is its own failure, which its
    caller raises after this returns. A process whose part succeeded raises a JaxckptError naming
    the first process whose part failed, and its error, at once: without this it would go on and wait
    for that process in the next agreement (or collective) until :func:`timeout_ms`. With one process,
    nothing to do. Agreements of one ``kind`` are numbered in call order, alike on every process."""
    if process_count() == 1:
        return
    said = "" if error is None else _said(error)
    answers = gather(f"{kind}/{next(_outcomes.setdefault(kind, itertools.count()))}", said)
    failed = [(p, answer) for p, answer in enumerate(answers) if answer]
    if error is None and failed:
        p, answer = failed[0]
        raise JaxckptError(
            f"Process {p} failed in {what}, so this one cannot go on with it either: {answer} "
            f"(every process raises at the same call; see process {p}'s log)."
        )


def started(what: str, error: BaseException | None) -> None:
    """Every process says whether its ``what`` (a manager) started (see :func:`outcome`)."""
    outcome("start", f"starting its {what}", error)


def to_primary(name: str, value: str) -> list[str] | None:
    """The primary: every process's ``value`` for ``name``, in process order; the others: None. Each
    process calls it once per ``name``; names are never reused. Unlike :func:`gather` the values are
    deleted once read: one call per save must not pile up in the store over a long run."""
    if process_count() == 1:
        return [value]
    client = _client()
    if not is_primary():
        client.key_value_set(f"jaxckpt/to-primary/{name}/{process_index()}", value)
        return None
    values = [value]
    for p in range(1, process_count()):
        key = f"jaxckpt/to-primary/{name}/{p}"
        values.append(_get(key, f"the report {name!r}", p))
        client.key_value_delete(key)
    return values


_decisions = itertools.count()  # numbers the primary's decisions alike on every process (in call order)


def primary_decides(what: str, decide: Callable[[], bool]) -> bool:
    """The primary's ``decide()``, on every process; the others never call theirs. For a decision that
    every process must take alike but that each would take otherwise: one by its own clock (a manager
    saving every so many seconds), where processes that disagreed would wait for each other's save
    forever. Every process calls it at the same points in the same order (the calls are numbered);
    the value is deleted once every other process read it, so that one call per training step does
    not pile up in the store over a long run. With one process, ``decide()``."""
    if process_count() == 1:
        return decide()
    key = f"jaxckpt/decision/{next(_decisions)}"
    client = _client()
    if is_primary():
        try:
            answer = decide()
        except BaseException as e:  # the others raise too, rather than wait for an answer
            client.key_value_set(key, "!" + _said(e))
            raise
        client.key_value_set(key, "1" if answer else "0")
        return answer
    said = _get(key, f"process {PRIMARY}'s {what}", PRIMARY)
    # The last process to have read it deletes it, with the marks below it (a directory of keys).
    client.key_value_set(f"{key}/read/{process_index()}", "1")
    if len(client.key_value_dir_get(f"{key}/read/")) == process_count() - 1:
        try:
            client.key_value_delete(key)
        except Exception:  # another process that read it last too deleted it first
            pass
    if said.startswith("!"):
        raise JaxckptError(f"Process {PRIMARY} failed to take the {what} for every process: {said[1:]}")
    return said == "1"
