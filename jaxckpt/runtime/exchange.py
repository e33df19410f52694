"""Moving bytes from process to process over JAX's own collectives (peer copies of two tiers).

Each process that sends has a stream of bytes; each that receives gets one sender's stream whole.
The bytes travel as a global ``uint8`` array of shape ``(processes, width)``, one row per process
on one device of that process, moved by a ``ppermute`` along the row axis (a jitted
``shard_map``): each receiver's row is its sender's. A stream longer than ``width`` goes in rounds,
``width`` bytes of every stream at a time; the next round is read while the last one moves, so that
the host memory two rounds hold (rows read, on the device, received) stays within a budget.

There is no socket of jaxckpt's own: the bytes go where the run's collectives go (gloo between CPU
processes, NCCL between GPUs, ICI/DCN between TPUs), on ``jax.distributed``.

**Every process calls** :func:`transfer` alike, with the same routes and lengths (agreed first
through the key-value store), in the caller's thread: device collectives from a background thread
could interleave with the training loop's own collectives in another order on another process, and
both would wait for ever. A process that cannot read its stream still takes part (zeros go instead:
the receiver's checksums find them), so that no process waits in a collective for another that left.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxckpt.runtime import multihost

MIN_WIDTH = 4 << 10  # bytes of a row at least (rows are a power of two: few compiled shapes)
MAX_WIDTH = 4 << 20  # bytes of a row at most: more rounds of buffers reused (measured faster on CPU than 16 or 128 MiB)
HELD_PER_BYTE = 6  # host bytes held per byte of a row at most: two rounds in flight (read, sent, received)


def width_for(longest: int, budget: int) -> int:
    """The bytes of a row: a power of two, enough for ``longest`` in one round if the budget allows,
    within ``budget`` (:data:`HELD_PER_BYTE` per byte), between :data:`MIN_WIDTH` and :data:`MAX_WIDTH`."""
    cap = max(MIN_WIDTH, min(MAX_WIDTH, budget // HELD_PER_BYTE))
    width = MIN_WIDTH
    while width < longest and width * 2 <= cap:
        width *= 2
    return width


def transfer(
    routes: Sequence[tuple[int, int]],
    lengths: Sequence[int],
    read: Callable[[int, int], bytes | memoryview] | None,
    write: Callable[[memoryview], None] | None,
    budget: int,
) -> None:
    """Send each sender's stream to its receiver: ``routes`` are ``(sender, receiver)`` pairs, a process
    sending at most once and receiving at most once; ``lengths[p]`` the bytes process ``p`` sends (0
    if none). ``read(offset, size)`` gives this process's bytes (called in order, if it sends);
    ``write(bytes)`` takes the bytes it receives, in order (if it receives). Every process calls it
    alike (see the module's description); ``budget``: host bytes a round may hold."""
    senders = [s for s, _ in routes]
    receivers = [r for _, r in routes]
    if len(set(senders)) != len(senders) or len(set(receivers)) != len(receivers):
        raise ValueError(f"Each process sends at most once and receives at most once in a transfer, not {routes!r}.")
    longest = max((lengths[s] for s in senders), default=0)
    if longest == 0:
        return
    me = multihost.process_index()
    sends = me in senders and lengths[me] > 0
    source = dict((r, s) for s, r in routes).get(me)
    width = width_for(longest, budget)
    device, sharding = _row_place()
    move = _mover(tuple(sorted(routes)), width)
    count = len(lengths)
    pending: tuple[Any, int] | None = None  # the round in flight: the next one is read meanwhile

    def deliver(moved: Any, offset: int) -> None:
        if source is not None and write is not None and offset < lengths[source]:
            got = np.asarray(moved.addressable_shards[0].data)
            write(got[0, : min(width, lengths[source] - offset)].data)
        else:
            moved.block_until_ready()

    for offset in range(0, longest, width):
        row = np.zeros((1, width), np.uint8)
        if sends and read is not None and offset < lengths[me]:
            piece = read(offset, min(width, lengths[me] - offset))
            row[0, : len(piece)] = np.frombuffer(piece, np.uint8)
        moved = move(jax.make_array_from_single_device_arrays((count, width), sharding, [jax.device_put(row, device)]))
        del row
        if pending is not None:
            deliver(*pending)
        pending = (moved, offset)
    if pending is not None:
        deliver(*pending)


def _row_place() -> tuple[Any, Any]:
    """This process's device that holds its row, and the sharding of the rows (one per process)."""
    mesh = _mesh()
    return mesh.devices[multihost.process_index()], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))


@functools.lru_cache(maxsize=1)
def _mesh_of(count: int) -> Any:
    firsts = []
    for p in range(count):
        mine = [d for d in jax.devices() if d.process_index == p]
        if not mine:
            raise RuntimeError(f"Process {p} has no device: a peer copy travels on one device of each process.")
        firsts.append(min(mine, key=lambda d: d.id))
    return jax.sharding.Mesh(np.array(firsts), ("p",))


def _mesh() -> Any:
    return _mesh_of(multihost.process_count())


@functools.lru_cache(maxsize=16)
def _mover(routes: tuple[tuple[int, int], ...], width: int) -> Callable[[Any], Any]:
    """The jitted permutation of the rows along ``routes`` (rows of ``width`` bytes); a row that no
    route reaches comes back as zeros."""
    del width  # a key of the cache: jit compiles each width once anyway
    mesh = _mesh()
    spec = jax.sharding.PartitionSpec("p")

    def permute(rows: Any) -> Any:
        return jax.lax.ppermute(rows, "p", perm=list(routes))

    mapped = jax.shard_map(permute, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(mapped, out_shardings=jax.sharding.NamedSharding(mesh, spec))
