"""``Checkpoint``, its restore status, and the one-call ``save`` / ``restore`` functions."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

from jaxckpt._errors import (
    JaxckptError,
    ManagerLockedError,
    StorageError,
    UnusedValuesWarning,
    caller_level,
)
from jaxckpt._gc_pause import gc_paused
from jaxckpt.checkpoint.restore import KeyMap, RestoreStatus, mapped, summarize
from jaxckpt.checkpoint.restore_graph import SAVE_COUNTER, Restore
from jaxckpt.reading.open import open_checkpoint
from jaxckpt.runtime import background as _async
from jaxckpt.runtime import multihost
from jaxckpt.runtime.background import Background
from jaxckpt.saving import pipeline
from jaxckpt.saving import staging as _staging
from jaxckpt.saving.save_dtypes import SaveDtypes
from jaxckpt.storage import locations, statefile
from jaxckpt.storage import lock as _lock
from jaxckpt.storage.locations import PathLike


def _graph(root: Checkpoint) -> list[Checkpoint]:
    """``root`` and every Checkpoint nested in its children, each once."""
    found: dict[int, Checkpoint] = {}
    todo = [root]
    while todo:
        ckpt = todo.pop()
        if id(ckpt) not in found:
            found[id(ckpt)] = ckpt
            todo.extend(c for c in ckpt._children.values() if isinstance(c, Checkpoint))
    return list(found.values())


class _Recorder:
    """What ``Checkpoint.save`` adds to a save: the directory's lock, and an entry in its state file.

    The lock is the one a CheckpointManager holds for its life (see _lock): taking it for the save
    means a live manager's directory is refused (its state file is the manager's to write), and a
    manager cannot start there while the entry is written.
    """

    def __init__(self, prefix: str) -> None:
        self.directory = os.path.dirname(prefix) or "."
        self.folder = locations.location(self.directory)
        self.lock: _lock.Lock | None = None
        self.primary = multihost.is_primary()  # one process records, as one process commits
        if self.primary and self.folder.local is not None:
            try:
                self.folder.local.mkdir(parents=True, exist_ok=True)
            except OSError:
                return  # not a folder there: the save itself says so, naming the path
            try:
                self.lock = _lock.acquire(self.folder.local)
            except ManagerLockedError as e:
                raise ManagerLockedError(
                    f"Checkpoint.save({prefix!r}) records its checkpoint in the state file of {self.directory!r}, "
                    f"which a CheckpointManager holds: {e} Save through that manager's manager.save(), close it "
                    "first, or save into another directory (Checkpoint.write records nothing)."
                ) from None

    def record(self, path: str, step: int) -> None:
        if not self.primary:
            return
        name = os.path.basename(path)
        try:
            statefile.record(self.directory, path, step, time.time())
        except StorageError:  # a full disk: an error, as anywhere else in the save (the folder stays unlisted)
            raise
        except JaxckptError as e:  # e.g. a TensorFlow state file there: the checkpoint itself is whole
            warnings.warn(
                f"Saved {path!r}, but could not list it in the state file of {self.directory!r}: {e}",
                stacklevel=caller_level(),
            )
        statefile.clear_unrecorded(self.folder / name)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _write(
    background: Background,
    path: PathLike,
    root: Any,
    *,
    overwrite: bool,
    blocking: bool,
    recorder: _Recorder | None = None,
    step: int = 0,
    save_dtypes: SaveDtypes = None,
) -> str:
    """Save ``root`` after ``background``'s previous save (raising its error); in the background if asked.

    With ``recorder``, the written checkpoint is then listed in its directory's state file (as ``step``),
    and the recorder's lock released, whether the save succeeds or not.
    """
    background.wait()
    # Every process of a multi-process run goes through this save's token and agreement once, even
    # when its part fails, so that all raise at the same call and the next save's token agrees.
    taken = multihost.tokens_taken()
    try:
        prepared = pipeline.prepare(locations.location(path), root, overwrite=overwrite, save_dtypes=save_dtypes)
    except Exception as e:
        multihost.abandon(taken, e)  # the primary's own prepare removed its staging folder if it failed
        raise
    try:
        multihost.agree(prepared.token)
    except BaseException:
        if multihost.is_primary():
            _staging.discard(prepared.staging)
        raise
    if recorder is None:
        if blocking:
            return pipeline.write_and_publish(prepared)
        background.submit(lambda: pipeline.write_and_publish(prepared), prepared.dest)
        return os.fspath(path)
    prepared.unlisted = recorder.primary

    def publish_and_record() -> str:
        try:
            out = pipeline.write_and_publish(prepared)
            recorder.record(out, step)
            return out
        finally:
            recorder.close()

    if blocking:
        return publish_and_record()
    background.submit(publish_and_record, prepared.dest)
    return os.fspath(path)


class Checkpoint:
    """A graph of named children, saved and restored together.

    Children are keyword arguments or attributes: pytrees of arrays and Python values, Flax NNX
    modules and optimizers (restored in place), objects with ``get_state()`` / ``set_state()``
    (a data iterator's position), and nested Checkpoints. Their edges name the checkpoint's keys::

        ckpt = jaxckpt.Checkpoint(step=0, net=net, optimizer=optimizer)
        path = ckpt.save("ckpts/ckpt")          # "ckpts/ckpt-1"
        ckpt.restore(path).assert_consumed()
    """

    def __init__(self, **children: Any) -> None:
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_pending", {})  # name -> [(restore, key)] waiting for that child
        object.__setattr__(self, "_restored_by", {})  # name -> the uid of the restore that set it
        object.__setattr__(self, "_statuses", [])  # restores not reported yet (see RestoreStatus)
        object.__setattr__(self, "_background", Background("Checkpoint"))
        object.__setattr__(self, SAVE_COUNTER, 0)
        for name, value in children.items():
            setattr(self, name, value)

    # --- children ------------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name == SAVE_COUNTER:
            if name == SAVE_COUNTER and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise TypeError(f"save_counter must be a non-negative int, not {value!r}.")
            object.__setattr__(self, name, value)
            return
        if hasattr(type(self), name):
            raise AttributeError(f"A Checkpoint child cannot be named {name!r}: that is a Checkpoint method.")
        pending = self._pending.pop(name, [])
        self._restored_by.pop(name, None)  # the user's own value: any restore may fill it
        self._children[name] = value
        # Oldest restore() call first, so that the most recent one's values are the ones that stay;
        # each status counts its own values as used.
        for restore, key in sorted(pending, key=lambda p: p[0].uid):
            self._children[name] = restore.deferred(self, name, self._children[name], key)

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"This Checkpoint has no child {name!r}; its children are {sorted(children)}.")

    def __delattr__(self, name: str) -> None:
        if name not in self._children:
            raise AttributeError(f"This Checkpoint has no child {name!r}.")
        del self._children[name]

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._children))

    def __repr__(self) -> str:
        kids = ", ".join(f"{k}={type(v).__name__}" for k, v in self._children.items())
        return f"Checkpoint({kids})"

    def _jaxckpt_children(self) -> dict[str, Any]:
        return {**self._children, SAVE_COUNTER: self.save_counter}

    def _jaxckpt_set(self, name: str, value: Any) -> None:
        if name == SAVE_COUNTER:
            object.__setattr__(self, SAVE_COUNTER, int(value))
        else:
            self._children[name] = value

    # --- saving and restoring ------------------------------------------------------------------

    def save(self, file_prefix: PathLike, *, blocking: bool = True, save_dtypes: SaveDtypes = None) -> str:
        """Write a new numbered checkpoint ``<file_prefix>-<n>``; returns its path.

        ``n`` is ``save_counter`` after incrementing it; the counter is saved too, so numbering
        continues after a restore. ``blocking=False`` returns once the values are snapshotted and
        writes in the background; ``save_dtypes`` stores some float arrays in another dtype (see :meth:`write`).

        As in TensorFlow, the checkpoint is then listed in the state file of its directory, so that
        :func:`jaxckpt.latest_checkpoint` finds it and a CheckpointManager opened there adopts it. The
        save takes the directory's lock meanwhile: a directory that a live CheckpointManager holds is
        refused (:class:`ManagerLockedError`; save through the manager). :meth:`write` records nothing.
        """
        prefix = os.fspath(file_prefix)
        self._background.wait()  # the previous save released the directory's lock
        recorder = _Recorder(prefix)
        self.save_counter += 1
        try:
            path = f"{prefix}-{self.save_counter}"
            self._settle(path)
            return _write(
                self._background,
                path,
                self,
                overwrite=False,
                blocking=blocking,
                recorder=recorder,
                step=self.save_counter,
                save_dtypes=save_dtypes,
            )
        except BaseException:
            self.save_counter -= 1
            recorder.close()  # released by the background save otherwise
            raise

    def write(
        self, path: PathLike, *, overwrite: bool = False, blocking: bool = True, save_dtypes: SaveDtypes = None
    ) -> str:
        """Write a checkpoint at exactly ``path`` (no numbering); returns ``path``.

        With ``blocking=False`` the call returns once every value is snapshotted (on an accelerator,
        the device-to-host copy; on CPU, no copy), and the checkpoint appears at ``path`` when the
        background write is done. Children may change, and the train step may donate their buffers,
        as soon as the call returns. The next save, :meth:`wait_until_finished` and :meth:`restore`
        wait for it first and raise its error if it failed.

        ``save_dtypes`` stores float arrays in another dtype (Orbax's ``SaveArgs(dtype=...)``): a dtype for
        every float array (``jnp.bfloat16``), a tree of dtypes shaped like the children or a part of them
        (``{"model": jnp.bfloat16}``), or a callable ``(key, leaf) -> dtype | None``; see :func:`jaxckpt.save`.
        """
        self._settle(path)
        return _write(self._background, path, self, overwrite=overwrite, blocking=blocking, save_dtypes=save_dtypes)

    def _settle(self, path: PathLike | None = None, *, final: bool = False) -> None:
        """Report what earlier restores into this graph left unused, once each (see :class:`RestoreStatus`).

        Called at the start of every save, write and restore. A restore's values that found no place
        are named once, at the first call after it. Values that still wait for a child to be assigned
        may yet be used: each save that leaves them out names them (``path``), and ``final`` (the end
        of a manager's life) names them as unused.
        """
        saved_without: dict[str, RestoreStatus] = {}  # key -> the status whose value a save leaves out
        waiting: dict[int, set[str]] = {}  # id(status) -> its keys still waiting for a child
        unsettled: dict[int, RestoreStatus] = {}
        for ckpt in _graph(self):
            for status in ckpt._statuses:
                unsettled[id(status)] = status
            ckpt._statuses.clear()
            for entries in ckpt._pending.values():
                for restore, key in entries:
                    keys = restore.opened.index.keys_under(key)
                    waiting.setdefault(id(restore.status), set()).update(keys)
                    if not restore.status._settled:
                        unsettled[id(restore.status)] = restore.status
                # The most recent restore() call's values are the ones an assignment would keep.
                restore, key = max(entries, key=lambda e: e[0].uid)
                if not restore.status._partial_ok:
                    saved_without.update(dict.fromkeys(restore.opened.index.keys_under(key), restore.status))
        for status in unsettled.values():
            status._settled = not (waiting.get(id(status)) and not final)  # asked again until nothing waits
            if status._partial_ok:
                continue
            held = set() if final else waiting.get(id(status), set())
            unused = [k for k in status.unused_keys if k not in held and k not in status._reported]
            status._reported.update(unused)
            if unused:
                warnings.warn(
                    f"{len(unused)} value(s) in {status.source!r} were never restored into an object:\n"
                    f"{summarize(unused, 5)}\nCall status.expect_partial() (ckpt.restore(path).expect_partial()) "
                    "if this is intended.",
                    UnusedValuesWarning,
                    stacklevel=caller_level(),
                )
        # Still waiting: asked again at the next call (after an assignment, its unused values are known).
        self._statuses.extend(s for s in unsettled.values() if not s._settled)
        if saved_without and path is not None:
            sources = ", ".join(sorted({repr(s.source) for s in saved_without.values()}))
            warnings.warn(
                f"Saving {os.fspath(path)!r} without {len(saved_without)} value(s) that a restore from {sources} still "
                f"holds for children not assigned yet:\n{summarize(saved_without, 5)}\nAssign those children before "
                "saving to include them, or call status.expect_partial() if they are not wanted.",
                UnusedValuesWarning,
                stacklevel=caller_level(),
            )

    def wait_until_finished(self) -> None:
        """Block until a background save of this Checkpoint is done; raise its error if it failed."""
        self._background.wait()

    @gc_paused
    def restore(self, save_path: PathLike | None, *, key_map: KeyMap | None = None) -> RestoreStatus:
        """Restore values from ``save_path`` into the children; ``None`` restores nothing.

        Children are matched by edge name. Values whose edge has no child yet wait, and are restored
        when the child is assigned. The returned status says what matched. ``save_path`` may also be
        a TensorFlow, Orbax, Flax msgpack or safetensors checkpoint; ``key_map`` renames or changes
        its values first (see :func:`jaxckpt.restore`), and the status reports what it mapped and
        dropped.
        """
        self._settle()
        if save_path is None:
            return RestoreStatus(None)
        self._background.wait()
        opened = open_checkpoint(locations.location(save_path))
        if key_map is not None:
            opened = mapped(opened, key_map)
        status = RestoreStatus(opened)
        restore = Restore(opened, status)
        try:
            restore.gather(self, "")
            restore.run()
        except BaseException:
            restore.abandon()
            opened.close()
            raise
        if not restore.waiting:  # no value waits for a child assigned later: nothing more to read
            opened.close()
        self._statuses.append(status)  # reported at the next call (see RestoreStatus)
        return status

    def read(self, save_path: PathLike) -> RestoreStatus:
        """Same as :meth:`restore`, for a checkpoint written by :meth:`write`."""
        return self.restore(save_path)


# Its public name, which the index records (for information) for every Checkpoint node of a save.
Checkpoint.__module__ = "jaxckpt"


def save(
    path: PathLike, tree: Any, *, overwrite: bool = False, blocking: bool = True, save_dtypes: SaveDtypes = None
) -> str:
    """Save a pytree, a Flax NNX module, or any supported object as a checkpoint at ``path``.

    Refuses to replace an existing checkpoint unless ``overwrite=True``. Returns ``path``. With
    ``blocking=False``, returns once the values are snapshotted and writes in the background; call
    :func:`wait_until_finished` (``restore`` and the next ``save`` do) before relying on it.

    ``save_dtypes`` stores floating-point arrays in another floating-point dtype, as Orbax's
    ``SaveArgs(dtype=...)`` does (bfloat16 weights from float32 parameters): a dtype (every float
    array), a tree shaped like ``tree`` or like a part of it whose leaves are dtypes or None
    (``{"params": jnp.bfloat16}``: the float arrays under ``params``; an Orbax ``save_args`` tree works
    too), or a callable ``(key, leaf) -> dtype | None``. The cast is a copy, on the arrays' devices and
    in their sharding; ``tree`` is unchanged. The index records the dtype stored, and a restore into a
    template of the original dtype casts back. A key the tree lacks, a dtype that is not floating-point,
    or one given for a leaf that is not a float array raises ValueError naming the key.
    """
    return _write(_async.SAVES, path, tree, overwrite=overwrite, blocking=blocking, save_dtypes=save_dtypes)


def wait_until_finished() -> None:
    """Block until a background :func:`save` is done; raise its error if it failed."""
    _async.SAVES.wait()
