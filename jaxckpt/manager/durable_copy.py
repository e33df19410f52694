"""Copying a finished local checkpoint to another place (a durable folder or a bucket), atomically.

The copy is a save without device memory: it reuses the files that the local save wrote. It
follows the save's own protocol (:mod:`jaxckpt.saving.staging`): the destination is checked, data files
go into a staging folder (in an object store: under the destination, after the save marker), and
the index is written last, so a copy interrupted at any point leaves no checkpoint there, only
leftovers that the next save or copy removes.

A copy that runs in the background must not lose its source to the local tier's retention: the
manager keeps the source until its copy is done (:func:`jaxckpt.manager.retention.retain`'s ``also_keep``).

**Memory.** Several files are copied at once (bucket round trips overlap), as many as the host
memory budget of saves holds (:func:`jaxckpt.saving.pipeline.host_memory_budget`). To a local folder a file is
streamed in chunks. To a kvstore (a bucket) it cannot be: TensorStore's ``KvStore.write`` takes one
whole value, as ``bytes`` only (no memoryview or mmap), and makes two copies of it while taking it
(a 1 GiB file peaks at about 3 GiB, measured with TensorStore 0.1.86), its drivers offer no
streamed or multipart upload, and its ``experimental_copy_range_to`` (a copy that could stay in C++)
is not implemented by the s3 driver. So a file's cost there is counted as three times its size; a
file whose cost alone exceeds the budget is copied alone, the least memory the API allows.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from jaxckpt._errors import CheckpointCorruptedError
from jaxckpt.format import refs_json
from jaxckpt.format.index_encode import encode_index
from jaxckpt.format.index_json import decode_index
from jaxckpt.format.records import INDEX_FILE, data_store
from jaxckpt.incremental import copy_memory
from jaxckpt.incremental.copy_memory import Copied, CopyMemory, link
from jaxckpt.runtime import multihost
from jaxckpt.saving import pipeline, process_states
from jaxckpt.saving import staging as _staging
from jaxckpt.storage import kvstore as _kvstore
from jaxckpt.storage import local_tree, locations
from jaxckpt.storage.locations import Location


def data_files(source: Path) -> list[str]:
    """The files of the checkpoint at ``source`` but its index (relative, ``/``-separated), sorted:
    regular files only, reached through no symlink (a symlink in a local checkpoint is refused: the
    copy would carry what it names, from outside the checkpoint)."""
    out = []
    for entry in local_tree.walk_files(locations.location(source)):
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise CheckpointCorruptedError(
                f"Cannot copy the checkpoint {str(source)!r}: {entry.path!r} is not a regular file (a symbolic link, "
                "FIFO or device); a checkpoint holds only the files jaxckpt wrote."
            )
        rel = os.path.relpath(entry.path, source).replace(os.sep, "/")
        if rel != INDEX_FILE:
            out.append(rel)
    return sorted(out)


def copy_checkpoint(
    source: Path,
    dest: Location,
    *,
    overwrite: bool = False,
    on_file: Callable[[int], None] | None = None,
    tag: str | None = None,
    budget: int | None = None,
    memory: CopyMemory | None = None,
) -> tuple[str, ...]:
    """Copy the finished checkpoint at ``source`` (a local folder) to ``dest``; the index last.

    In a multi-process run every process calls it with the same ``tag`` (unique to this copy, alike
    on every process): each copies the data store it wrote (``data.p<n>``; process 0 ``data`` and the
    index), so that ``dest`` becomes the checkpoint that a save by all of them there would have made.
    ``on_file(nbytes)`` is called after each file is copied (progress, and tests that interrupt; one
    call at a time). Files are copied several at once within ``budget`` bytes of host memory (by
    default the saves' :func:`jaxckpt.saving.pipeline.host_memory_budget`; see the module's description).
    ``memory``: a two-tier manager's, so that what the last copy copied is not copied again
    (:mod:`jaxckpt.incremental.copy_memory`); returns the durable checkpoints the copy refers to (buckets).
    """
    me, many = multihost.process_index(), multihost.process_count() > 1
    mine = data_store(me)
    files = [f for f in data_files(source) if not many or f.split("/", 1)[0] == mine]
    name = tag if tag is not None else uuid.uuid4().hex
    token = hashlib.sha256(name.encode()).hexdigest()[:12]  # the same on every process, without a round trip
    if me == 0:  # first, so that a stale staging folder of the same token is gone before others write
        _staging.check_writable(dest, overwrite)
        _staging.clear_for_save(dest)
        staging = _staging.staging_folder(dest, token)
    multihost.barrier(f"{name}/staged")
    if me != 0:
        staging = _staging.staging_folder(dest, token)
    try:
        try:
            data = (source / INDEX_FILE).read_bytes()
            parsed = decode_index(data, str(source / INDEX_FILE)) if many or memory is not None else None
            save = parsed.save if parsed is not None else None
            refs = memory.refer(source, files, save) if memory is not None and dest.local is None and save else {}
            links = (
                memory.linkable(source, files, save) if memory is not None and dest.local is not None and save else {}
            )
            skipped = {
                f for store, arrays in refs.items() for a in arrays for f in files if f.startswith(f"{store}/{a}/")
            }
            copied = [f for f in files if f not in skipped]
            nbytes = sum(os.path.getsize(source / f) for f in copied)
            multihost.phase(f"copying {len(copied)} files ({multihost.size(nbytes)}) to {dest.text}")
            _copy_files(
                source, staging, copied, pipeline.host_memory_budget() if budget is None else budget, on_file, links
            )
            for store, arrays in refs.items():
                _kvstore.kv_write((staging / store).spec(), refs_json.REFS_FILE, refs_json.encode(save or "", arrays))
        except BaseException as e:
            multihost.written(name, e, 0)  # the others wait below for this one's part: come, and say why it failed
            raise
        # Every process's files are in place, or all raise (the deadline: this process's bytes, as its peers').
        multihost.written(name, None, nbytes)
        uses = copy_memory.uses(refs)
        if many and memory is not None:  # every process's references, for the index and the state file
            uses = sorted({n for text in multihost.gather(f"{name}/refs", json.dumps(uses)) for n in json.loads(text)})
        changed = process_states.gather(token, parsed) if many and parsed is not None else False  # their states
        if uses and parsed is not None and not parsed.refs:
            parsed.refs = changed = True  # version 6 (jaxckpt.incremental.refs)
        index = encode_index(parsed) if changed and parsed is not None else data
        if me == 0:
            _staging.publish(staging, dest, index, overwrite)
            if on_file is not None:
                on_file(len(index))
        multihost.barrier(f"{name}/published")
    except BaseException:
        if me == 0:
            _staging.discard(staging)
        if memory is not None:
            memory.forget()
        raise
    if memory is not None and save:
        memory.remember(source, files, dest, save, refs)
    return tuple(uses)


MAX_FILES_IN_FLIGHT = 8  # files copied at once, at most (within the byte budget)
KV_WRITE_COPIES = 3  # bytes held per byte of a value written to a kvstore, at the peak (measured)
CHUNK = 16 << 20  # a local copy streams in chunks of this size


def file_cost(size: int, dest: Location) -> int:
    """Bytes of host memory that copying a file of ``size`` bytes to ``dest`` holds at its peak."""
    if dest.local is not None:
        return min(size, CHUNK)
    return KV_WRITE_COPIES * size


class _Budget:
    """Bytes of host memory in use by the copies in flight; one taker (the caller's thread), first come first served."""

    def __init__(self, total: int) -> None:
        self._total = max(0, total)
        self._used = 0
        self._changed = threading.Condition()

    def take(self, cost: int, stop: Callable[[], bool]) -> None:
        """Wait until ``cost`` fits, or nothing is in flight (a file over the whole budget goes alone),
        or ``stop()`` (a copy failed)."""
        with self._changed:
            while self._used and self._used + cost > self._total and not stop():
                self._changed.wait()
            self._used += cost

    def give_back(self, cost: int) -> None:
        with self._changed:
            self._used -= cost
            self._changed.notify_all()


def _copy_files(
    source: Path,
    staging: Location,
    files: Sequence[str],
    budget: int,
    on_file: Callable[[int], None] | None,
    links: Mapping[str, Copied] | None = None,
) -> None:
    """Copy ``files`` of ``source`` into ``staging``, several at once while their cost fits ``budget``;
    those in ``links`` are hard-linked from the durable tier's copies instead where they still can be."""
    limit = _Budget(budget)
    said = threading.Lock()  # on_file is called once at a time
    failed: list[BaseException] = []

    def copy(rel: str, cost: int) -> None:
        try:
            # What the durable tier holds already is hard-linked there (jaxckpt.incremental.copy_memory), not copied.
            copied = links.get(rel) if links and staging.local is not None else None
            target = staging.local / rel if copied is not None and staging.local is not None else None
            if target is not None:
                target.parent.mkdir(parents=True, exist_ok=True)
            linked = target is not None and copied is not None and link(target, source / rel, copied)
            size = 0 if linked else _copy_file(source / rel, staging, rel)
            if on_file is not None:
                with said:
                    on_file(size)
        except BaseException as e:
            failed.append(e)
            raise
        finally:
            limit.give_back(cost)

    futures: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=MAX_FILES_IN_FLIGHT, thread_name_prefix="jaxckpt-copy-file") as pool:
        try:
            for rel in files:
                cost = file_cost((source / rel).stat().st_size, staging)
                limit.take(cost, lambda: bool(failed))
                if failed:
                    limit.give_back(cost)
                    break
                futures.append(pool.submit(copy, rel, cost))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # nothing of this copy runs on after it
            raise
    for future in futures:
        future.result()  # the first failure, in the order of the files


def _copy_file(path: Path, staging: Location, rel: str) -> int:
    if staging.local is not None:
        target = staging.local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        return _stream_durable(path, target)  # publish syncs the folders; each file is synced here
    data = path.read_bytes()
    _kvstore.kv_write(staging.spec(), rel, data)
    return len(data)


def _stream_durable(path: Path, target: Path) -> int:
    """Copy the file ``path`` to ``target`` in chunks of :data:`CHUNK`, and make it durable."""
    copied = 0
    with open(path, "rb", buffering=0) as src:
        try:
            with open(target, "wb") as dst:  # buffered: its write() writes the whole chunk
                while chunk := src.read(CHUNK):
                    dst.write(chunk)
                    copied += len(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except OSError as e:
            raise locations.storage_failure(f"Cannot write {str(target)!r}", e, "") from e
    return copied
