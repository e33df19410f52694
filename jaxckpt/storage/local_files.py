"""Local files as jaxckpt reads and writes them: the I/O threads, 64-byte-aligned buffers, buffers'
bytes and CRC-32C in place, fsync by path, and a checkpoint's folder held open while it is read."""

from __future__ import annotations

import errno
import math
import os
import queue
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import crc32c
import numpy as np

_ALIGN = 64
_THREADS = 4


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-order array whose data starts on a 64-byte boundary (on CPU,
    ``jax.device_put`` aliases such a buffer instead of copying it)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class _Pool:
    """A few daemon threads doing file I/O. Not concurrent.futures' executor: that one refuses work
    once the interpreter starts exiting, which is when a pending save is finished."""

    def __init__(self, threads: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"jaxckpt-io-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((fn, args, future))
        return future

    def _work(self) -> None:
        while True:
            fn, args, future = self._jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)
            del fn, args, future  # a finished job's buffers must not wait here for the next job


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


def io_pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _Pool(_THREADS)
        return _POOL


def crc32c_of(view: memoryview | bytes, value: int = 0) -> int:
    """The CRC-32C of a buffer, read in place (hardware instruction where the CPU has one); with
    ``value``, of the bytes whose CRC-32C that is followed by the buffer's. The interpreter lock is
    released for buffers of 32 KiB or more (the ``crc32c`` package's default)."""
    return int(crc32c.crc32c(view, value))


def crc_bytes(view: memoryview) -> bytes:
    return struct.pack("<I", crc32c_of(view))


def view_at(array: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    """``array[index]`` as a view, rank 0 included (there ``array[()]`` would be a scalar copy)."""
    return array[index] if index else array[...]


def bytes_of(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, in place (as uint8: ml_dtypes' types have no buffer format)."""
    return array.reshape(-1).view(np.uint8).data if array.size else memoryview(b"")


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PinnedFolder:
    """A local folder held open (``fd``), so that the files a reader opens under its path ``path`` are
    this folder's even after another folder is renamed to that path: an overwriting save swaps in a
    whole new checkpoint, and a reader must not mix the two. Closed once nothing refers to it (reads
    still in flight hold it through their arrays), so its number is never reused under them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._prefix = path.rstrip("/") + "/"
        # O_PATH (Linux): like opening files by their paths, it takes no read permission on the folder.
        self.fd = os.open(path, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
        self._close = weakref.finalize(self, os.close, self.fd)

    def close(self) -> None:
        """Close it now (once), where its holder knows that no read under it is in flight."""
        self._close()

    def replaced(self) -> bool:
        """Whether its path no longer names this folder (deleted, or another renamed there)."""
        try:
            now, pinned = os.stat(self.path), os.fstat(self.fd)
        except OSError:
            return True
        return (now.st_dev, now.st_ino) != (pinned.st_dev, pinned.st_ino)

    def open(self, file: str, flags: int) -> int:
        """Open ``file``, a path built from :attr:`path`, in this folder (whatever is at its path now),
        following no symbolic link on the way (see :func:`open_beneath`)."""
        relative = file[len(self._prefix) :] if file.startswith(self._prefix) else os.path.relpath(file, self.path)
        try:
            return open_beneath(self.fd, relative, flags)
        except OSError as e:  # named as the caller named it, not by its path relative to the folder
            raise OSError(e.errno, e.strerror, file) from None


# A folder on the way to a file: opened only to open what is in it, never through a symlink.
_ON_THE_WAY = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_beneath(folder: int, relative: str, flags: int) -> int:
    """Open ``relative`` (``/``-separated) in the folder open as ``folder``, one component at a time,
    none of them a symbolic link: a symlinked folder on the way fails with ENOTDIR, a symlinked file
    with ELOOP, so nothing outside the folder is ever opened. ``..`` is refused (EINVAL)."""
    *folders, name = relative.split("/")
    if any(part in ("", ".", "..") for part in folders) or name in ("", ".", ".."):
        raise OSError(errno.EINVAL, "not a plain relative path", relative)
    fd = folder
    try:
        for part in folders:
            inner = os.open(part, _ON_THE_WAY, dir_fd=fd)
            if fd != folder:
                os.close(fd)
            fd = inner
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        if fd != folder:
            os.close(fd)
