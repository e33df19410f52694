"""Peer copies of two tiers' local checkpoints, and restores after a host is replaced.

With two tiers and several processes, each process keeps a whole checkpoint of its own on its own
disk (:mod:`jaxckpt.manager.tiers`). A host that is replaced comes back with an empty disk, and
without more every process would fall back to the durable tier, older and further away. So each
process's local checkpoint is also kept by ``local_replicas`` peer processes (1 by default where
there are several): byte for byte, as a checkpoint folder under the peer's own local directory
(:mod:`jaxckpt.manager.peer_files`).

**Placement.** Processes are ordered by failure domain (``JAXCKPT_FAILURE_DOMAIN``, by default the
host name), gathered through ``jax.distributed``'s key-value store; each replica is that order
shifted by an offset, so every process sends one copy and receives one per replica (one collective
permutation). Offsets that put no copy in its origin's domain come first; where none does (every
process on one host, as in tests), a copy goes to another process, and a warning says so when
there are several domains.

**When.** A copy travels over JAX's collectives (:mod:`jaxckpt.runtime.exchange`), so it runs in
the caller's thread, at calls that every process makes in the same order: the next
:meth:`~jaxckpt.CheckpointManager.save` that is due (once the previous local save is done, which that
call waits for anyway; every process decides alike whether a save is due), :meth:`~jaxckpt.CheckpointManager.wait_until_finished` and
:meth:`~jaxckpt.CheckpointManager.close`. A background thread would be free of that wait, but its
collectives could interleave with the training step's own collectives in another order on another
process, and both would wait for ever. The newest local checkpoint is copied, once; its copies are
whole when each peer has checked every file's size and CRC-32C against what the origin sent, put it
in place and written its marker. Copies of checkpoints the local tier no longer keeps are removed.

**Restore after a host is replaced.** At :meth:`~jaxckpt.CheckpointManager.restore_or_initialize`
and :meth:`~jaxckpt.CheckpointManager.restore`, every process says which local checkpoints it has
(name and save id) and which whole copies it holds; every process then picks the same one: the
newest, not older than the durable tier's newest, that each process either has or can get from a
peer with a copy of the same save. A process without it receives it from that peer (collectives
again), checks every file against the CRC-32C values that the origin sent when the copy was made, and
lists it in its local tier; a damaged copy is named in a warning, and another copy (or an older
checkpoint, or the durable tier) is used. Then every process restores locally, which checks each
chunk against the checkpoint's own checksums as any read does. Where no local checkpoint can be
assembled, a warning says which process lacked which checkpoint, and the durable tier serves.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxckpt._errors import JaxckptError, caller_level
from jaxckpt.format.index_json import decode_index
from jaxckpt.format.records import INDEX_FILE
from jaxckpt.manager import peer_files
from jaxckpt.runtime import exchange, multihost
from jaxckpt.saving import pipeline
from jaxckpt.saving.staging import PARTIAL_MARK
from jaxckpt.storage import local_tree, locations, statefile
from jaxckpt.storage.statefile import CheckpointInfo

FAILURE_DOMAIN_ENV = "JAXCKPT_FAILURE_DOMAIN"
_calls = itertools.count()  # numbers the agreements alike on every process (every process makes the same calls)


def replicas_for(asked: int | None, processes: int) -> int:
    """How many peer copies each process's local checkpoints get: ``local_replicas`` (by default 1
    where there are several processes), at most one per other process."""
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 0):
        raise ValueError(f"local_replicas must be a whole number of copies, 0 or more, not {asked!r}.")
    if processes < 2:
        return 0
    wanted = 1 if asked is None else asked
    if wanted > processes - 1:
        warnings.warn(
            f"local_replicas={wanted}, but there are only {processes - 1} other processes to hold copies: "
            f"{processes - 1} copies are kept.",
            stacklevel=caller_level(),
        )
    return min(wanted, processes - 1)


def placement(domains: Sequence[str], replicas: int) -> tuple[list[int], list[int]]:
    """The processes in the order of their failure domains, and each replica's offset in that order
    (process ``order[i]``'s copy goes to ``order[(i + offset) % n]``): those that keep the most
    copies out of their origin's domain first (all of them, where the domains allow)."""
    n = len(domains)
    order = sorted(range(n), key=lambda p: (domains[p], p))
    same = {d: sum(domains[order[i]] == domains[order[(i + d) % n]] for i in range(n)) for d in range(1, n)}
    return order, sorted(same, key=lambda d: (same[d], d))[:replicas]


def _save_id(folder: Path) -> str:
    """The save id of the local checkpoint ``folder`` (its index's ``save``)."""
    where = str(folder / INDEX_FILE)
    return decode_index((folder / INDEX_FILE).read_bytes(), where).save or ""


class Peers:
    """The peer copies of one two-tier manager's local tier (see the module's description)."""

    def __init__(self, local_directory: str, replicas: int | None) -> None:
        self._local = Path(local_directory)
        self.replicas = replicas_for(replicas, multihost.process_count())
        self._order: list[int] | None = None
        self._offsets: list[int] = []
        self.copied: str | None = None  # the local checkpoint whose copies were last made (or tried)

    def _placed(self) -> tuple[list[int], list[int]]:
        if self._order is None:
            mine = os.environ.get(FAILURE_DOMAIN_ENV) or socket.gethostname()
            domains = multihost.gather(f"peers/{next(_calls)}/domains", mine)
            self._order, self._offsets = placement(domains, self.replicas)
            n = len(domains)
            shared = [
                (self._order[i], self._order[(i + d) % n])
                for d in self._offsets
                for i in range(n)
                if domains[self._order[i]] == domains[self._order[(i + d) % n]]
            ]
            if shared and len(set(domains)) > 1:
                warnings.warn(
                    f"The failure domains of the processes ({FAILURE_DOMAIN_ENV} or the host names: {domains}) allow "
                    f"no placement of {self.replicas} peer copies each outside their origin's domain: process "
                    + ", ".join(f"{a}'s copy is on process {b}" for a, b in shared[:8])
                    + ", in the same domain.",
                    stacklevel=caller_level(),
                )
        return self._order, self._offsets

    # --- making copies ------------------------------------------------------------------------------

    def copy(self, info: CheckpointInfo | None, keep: Sequence[str]) -> None:
        """Every process: copy the local checkpoint ``info`` (the newest) to the peers, unless done
        already (by this manager, or before a restart: a peer with a whole copy of the same save gets
        none); then drop the copies this process holds of checkpoints not in ``keep`` (names)."""
        if self.replicas == 0 or info is None or info.path == self.copied:
            return
        self.copied = info.path
        order, offsets = self._placed()
        n, me = len(order), multihost.process_index()
        folder, name = Path(info.path), os.path.basename(info.path)
        tag = f"peers/{next(_calls)}/copy"
        header: dict[str, Any] | None = None
        try:
            header = {
                "origin": me,
                "processes": n,
                "name": name,
                "step": info.step,
                "save": _save_id(folder),
                "time": info.time,
                "metrics": dict(info.metrics),
                "files": peer_files.checkpoint_files(folder),
            }
            mine = peer_files.held(self._local)
            origins = [order[(order.index(me) - d) % n] for d in offsets]  # whose copies this process holds
            has = {str(o): mine.get(o, {}).get(name, {}).get("header", {}).get("save") for o in origins}
            length = peer_files.Outgoing(folder, header).length
            said: dict[str, Any] = {"name": name, "save": header["save"], "length": length, "has": has}
        except (OSError, JaxckptError) as e:
            said = {"error": f"{type(e).__name__}: {e}"}
        answers = [json.loads(a) for a in multihost.gather(tag, json.dumps(said))]
        broken = [(p, a["error"]) for p, a in enumerate(answers) if "error" in a]
        if broken or len({(a["name"], a["save"]) for a in answers}) != 1:
            why = f"process {broken[0][0]} cannot read it ({broken[0][1]})" if broken else "the processes' differ"
            warnings.warn(f"No peer copies of the local checkpoint {name} are made: {why}.", stacklevel=caller_level())
            return
        assert header is not None
        lengths = [a["length"] for a in answers]
        failed: list[str] = []
        for d in offsets:
            routes = [(order[i], order[(i + d) % n]) for i in range(n)]
            routes = [(s, r) for s, r in routes if answers[r]["has"].get(str(s)) != answers[s]["save"]]
            if routes:
                origin = next((s for s, r in routes if r == me), None)
                problem = self._send_and_receive(folder, header, routes, lengths, origin, name)
                if problem:
                    failed.append(problem)
        told = multihost.gather(f"{tag}/done", "; ".join(failed))
        for p, text in enumerate(told):
            if text:
                warnings.warn(
                    f"A peer copy of the local checkpoint {name} failed on process {p}: {text}. That checkpoint "
                    "restores after a host is replaced only from the copies that were made.",
                    stacklevel=caller_level(),
                )
        try:
            peer_files.prune(self._local, {*keep, name})
        except OSError as e:
            warnings.warn(f"Could not remove older peer copies in {str(self._local)!r}: {e}", stacklevel=caller_level())

    def _send_and_receive(
        self,
        folder: Path,
        header: Mapping[str, Any],
        routes: list[tuple[int, int]],
        lengths: list[int],
        origin: int | None,
        name: str,
    ) -> str:
        """One replica: send this process's checkpoint (if a route starts here), receive ``origin``'s
        (if one ends here) and put it in place. What went wrong here, or ``""``."""
        me = multihost.process_index()
        incoming = staging = None
        if origin is not None:
            staging = peer_files.staging_folder(self._local, origin, name)
            incoming = peer_files.Incoming(staging, f"process {origin}'s {name}")
            try:
                staging.mkdir(parents=True)
            except OSError as e:
                incoming.error = e
        outgoing = peer_files.Outgoing(folder, header) if any(s == me for s, _ in routes) else None
        _transfer(routes, lengths, outgoing, incoming)
        sent = f"could not read its own {name}: {outgoing.error}; " if outgoing and outgoing.error else ""
        if incoming is None or staging is None or origin is None:
            return sent
        try:
            got, crcs = incoming.finish()
            if (got.get("origin"), got.get("name")) != (origin, name):
                raise JaxckptError(f"process {origin} sent {got.get('name')!r} of process {got.get('origin')}")
            peer_files.place(staging, self._local, origin, name, got, crcs)
        except (OSError, JaxckptError) as e:
            local_tree.remove_local(staging)
            return f"{sent}{type(e).__name__}: {e}"
        return sent

    # --- restoring after a host is replaced ---------------------------------------------------------

    def recover(
        self, tier: Any, step: int | None, durable: CheckpointInfo | None, read_only: bool = False
    ) -> CheckpointInfo | None:
        """Every process: the local checkpoint that every process can restore (fetched from a peer
        where this process lacks it, and then listed in ``tier``, the local tier), or None (the
        durable tier serves; a warning says what was missing, if anything was). ``step``: only that
        step; ``durable``: the durable tier's newest checkpoint (of ``step``), which a local one must
        not be older than. ``read_only``: no copy is fetched (a manager that never writes)."""
        tag = f"peers/{next(_calls)}/recover"
        own: dict[str, Any] = {}
        for c in tier.checkpoint_infos:
            if step is None or c.step == step:
                try:
                    own[os.path.basename(c.path)] = {"step": c.step, "save": _save_id(Path(c.path))}
                except (OSError, JaxckptError):
                    continue  # unreadable: a process without it
        count = multihost.process_count()
        held: dict[str, dict[str, Any]] = {}
        try:
            markers = {} if read_only else peer_files.held(self._local)
        except OSError:
            markers = {}
        for origin, copies in markers.items():
            for name, marker in copies.items():
                h = marker["header"]
                if h.get("processes") == count and (step is None or h.get("step") == step):
                    held.setdefault(str(origin), {})[name] = {"step": h["step"], "save": h["save"]}
        answers = [json.loads(a) for a in multihost.gather(tag, json.dumps({"own": own, "held": held}))]
        unusable: set[tuple[int, str, int]] = set()  # (origin, name, holder): copies that failed
        for attempt in itertools.count():
            plan, lacking = _plan(answers, count, durable.step if durable is not None else None, unusable)
            if plan is None:
                if lacking:
                    _warn_lost(lacking, durable)
                return None
            name, fetch = plan
            failed = self._fetch(tier, name, fetch, markers, f"{tag}/{attempt}")
            if not failed:
                return next((c for c in tier.checkpoint_infos if os.path.basename(c.path) == name), None)
            unusable |= failed
        return None  # unreachable: each attempt rules out a copy

    def _fetch(
        self, tier: Any, name: str, fetch: Mapping[int, int], markers: Mapping[int, Any], tag: str
    ) -> set[tuple[int, str, int]]:
        """Every process: each process in ``fetch`` receives ``name`` from the holder named there;
        the copies that failed, as ``(origin, name, holder)`` (empty: all arrived whole)."""
        me = multihost.process_index()
        rounds: list[list[tuple[int, int]]] = []
        for origin, holder in sorted(fetch.items()):
            for routes in rounds:
                if all(s != holder and r != origin for s, r in routes):
                    routes.append((holder, origin))
                    break
            else:
                rounds.append([(holder, origin)])
        problem = ""
        for i, routes in enumerate(rounds):
            outgoing = None
            sends = next((r for s, r in routes if s == me), None)
            if sends is not None:
                marker = markers[sends][name]
                folder = peer_files.origin_folder(self._local, sends) / name
                outgoing = peer_files.Outgoing(folder, marker["header"], marker["crcs"])
            lengths = [int(x) for x in multihost.gather(f"{tag}/{i}", str(outgoing.length if outgoing else 0))]
            source = next((s for s, r in routes if r == me), None)
            incoming = staging = None
            if source is not None:
                staging = (
                    self._local / f".{name}{PARTIAL_MARK}{uuid.uuid4().hex[:12]}"
                )  # a leftover that start-up removes
                incoming = peer_files.Incoming(staging, f"process {me}'s {name} from process {source}")
                try:
                    staging.mkdir(parents=True)
                except OSError as e:
                    incoming.error = e
            _transfer(routes, lengths, outgoing, incoming)
            if incoming is not None and staging is not None:
                try:
                    got, _ = incoming.finish()
                    _adopt(tier, staging, got)
                except (OSError, JaxckptError) as e:
                    local_tree.remove_local(staging)
                    problem = f"{type(e).__name__}: {e}"
        told = multihost.gather(f"{tag}/done", problem)
        failed = set()
        for p, text in enumerate(told):
            if text:
                holder = fetch[p]
                failed.add((p, name, holder))
                warnings.warn(
                    f"Process {p} could not restore its local checkpoint {name} from the copy that process {holder} "
                    f"holds: {text.rstrip('.')}. Another copy, an older checkpoint or the durable tier is used instead.",
                    stacklevel=caller_level(),
                )
        return failed


def _plan(
    answers: Sequence[Mapping[str, Any]], count: int, durable_step: int | None, unusable: set[tuple[int, str, int]]
) -> tuple[tuple[str, dict[int, int]] | None, list[tuple[str, list[int]]]]:
    """The newest local checkpoint that every process has or can get, and who gets it from whom; or
    None, with what the newest one lacked (its name, and the processes without it or a copy)."""
    saves: dict[str, dict[str, int]] = {}  # name: save id: how many processes have it
    steps: dict[str, int] = {}
    for a in answers:
        for name, c in a["own"].items():
            saves.setdefault(name, {}).setdefault(c["save"], 0)
            saves[name][c["save"]] += 1
            steps[name] = c["step"]
    lacking: list[tuple[str, list[int]]] = []
    for name in sorted(steps, key=lambda n: steps[n], reverse=True):
        if durable_step is not None and steps[name] < durable_step:
            break  # the durable tier's is newer: no fetch for an older one
        save = max(saves[name], key=lambda s: saves[name][s])
        fetch, missing = {}, []
        for p in range(count):
            if answers[p]["own"].get(name, {}).get("save") == save:
                continue
            holders = [
                h
                for h in range(count)
                if h != p
                and answers[h]["held"].get(str(p), {}).get(name, {}).get("save") == save
                and (p, name, h) not in unusable
            ]
            if holders:
                fetch[p] = holders[0]
            else:
                missing.append(p)
        if not missing:
            return (name, fetch), lacking
        if not lacking:
            lacking.append((name, missing))
    return None, lacking


def _warn_lost(lacking: list[tuple[str, list[int]]], durable: CheckpointInfo | None) -> None:
    name, missing = lacking[0]
    whose = " and ".join(f"process {p}'s" for p in missing)
    instead = f"restoring the durable tier's {durable.path!r} instead" if durable else "and the durable tier has none"
    warnings.warn(
        f"No local checkpoint can be restored on every process: {name} lacks {whose} part (not in its local "
        f"directory, and no surviving process holds a whole copy of it); {instead}.",
        stacklevel=caller_level(),
    )


def _adopt(tier: Any, staging: Path, header: Mapping[str, Any]) -> None:
    """Put a checkpoint received from a peer in place in the local tier ``tier``, and list it there."""
    name = str(header["name"])
    target = Path(tier.directory) / name
    local_tree.remove_local(target)
    os.replace(staging, target)
    locations.fsync_dir(target.parent)
    info = CheckpointInfo(
        os.path.join(tier.directory, name), int(header["step"]), float(header["time"]), dict(header["metrics"])
    )
    with tier._retention_lock:
        infos = sorted([c for c in tier._infos if c.step != info.step] + [info], key=lambda c: c.step)
        statefile.write_state(tier._path, infos, tier._last_preserved)
        tier._infos = infos


def _transfer(
    routes: Sequence[tuple[int, int]],
    lengths: Sequence[int],
    outgoing: peer_files.Outgoing | None,
    incoming: peer_files.Incoming | None,
) -> None:
    """This process's part of one exchange (every process calls it alike): its stream out, if it
    sends, and the one it receives, if it does; its files closed however the exchange ends."""
    try:
        exchange.transfer(
            routes,
            lengths,
            outgoing.read if outgoing else None,
            incoming.feed if incoming else None,
            pipeline.host_memory_budget(),
        )
    finally:
        if outgoing is not None:
            outgoing.close()
