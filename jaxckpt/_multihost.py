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

import itertools
import os
import uuid

import jax

PRIMARY = 0
_sequence = itertools.count()  # every process calls saves in the same order, so counters agree


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    return process_index() == PRIMARY


def _client():
    from jax._src import distributed  # the runtime's client; jax.distributed exposes no other handle

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.process_count() > 1 but jax.distributed is not initialized")
    return client


def timeout_ms() -> int:
    """How long a process waits for the others at a barrier (``JAXCKPT_BARRIER_TIMEOUT_S``, default 30 min)."""
    return int(float(os.environ.get("JAXCKPT_BARRIER_TIMEOUT_S", "1800")) * 1000)


def barrier(name: str) -> None:
    """Wait until every process has reached the barrier ``name``."""
    if process_count() > 1:
        _client().wait_at_barrier(f"jaxckpt/{name}", timeout_ms())


def shared_token() -> str:
    """A random token chosen by the primary and known to every process (one per call, in call order)."""
    if process_count() == 1:
        return uuid.uuid4().hex[:12]
    key = f"jaxckpt/token/{next(_sequence)}"
    client = _client()
    if is_primary():
        token = uuid.uuid4().hex[:12]
        client.key_value_set(key, token)
        return token
    return client.blocking_key_value_get(key, timeout_ms())
