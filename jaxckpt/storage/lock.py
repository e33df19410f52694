"""The lock that gives one CheckpointManager a directory: a kernel lock on ``checkpoint.lock``.

A manager opens ``checkpoint.lock`` and holds ``flock(LOCK_EX)`` on it for its whole life. The kernel
is the only judge of who holds it, and it drops the lock when the holder closes the file or dies
in any way (SIGKILL, a crash, a power cut), so there is no stale lock to detect and no pid to
trust. The file's contents, ``{"pid", "hostname", "time", "token"}``, only describe the holder for
error messages: a description left by a dead process means nothing.

Releasing removes the file first and then closes it. A rival that opened the file before it was
removed may then get the lock on a file that no longer has the name; so after locking, a manager
checks that the name still leads to the file it locked, and starts over if not.

Forks: a child inherits the open file and with it the lock (flock belongs to the open file, not to
a process). A child never releases its parent's lock: it closes its copy at fork, so that a long-lived
child (a data loader) does not keep the lock after its parent dies; closing a copy leaves the lock
with the parent.

NFS: Linux implements flock on NFS with whole-file POSIX locks (NLM, or NFSv4's own), which work
across hosts; a lock of a host that dies is released when the server's lease expires. POSIX locks
are dropped when a process closes *any* descriptor of the file, so this module opens the lock file
only once per directory and process. Without ``fcntl`` (Windows) the lock file is created
exclusively instead, which a crash leaves behind: the error says to remove it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from jaxckpt._errors import ManagerLockedError
from jaxckpt.storage import locations

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = "checkpoint.lock"
_DESCRIPTION_LIMIT = 4096  # a description is about 100 bytes; never read more than this
_ATTEMPTS = 100  # each retry means a rival released the lock while we took it: progress, not a spin

_lock = threading.Lock()
_held: dict[str, Lock] = {}  # real path of the lock file -> the lock this process holds there


def _fsync_dir(path: Path) -> None:
    try:
        locations.fsync_dir(path)
    except OSError:  # some filesystems cannot fsync a directory; the lock still works
        pass


def _describe(owner: dict[str, Any] | None) -> str:
    if not owner:
        return "a process that has not described itself yet"
    return f"process {owner.get('pid')} on host {owner.get('hostname')!r}"


def _read_description(fd: int) -> dict[str, Any] | None:
    """The holder's description from an open lock file, bounded; None if unreadable."""
    try:
        data = os.pread(fd, _DESCRIPTION_LIMIT, 0)
        doc = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class Lock:
    """A held lock on one directory. :meth:`release` is idempotent and safe to call from a fork."""

    def __init__(self, path: Path, fd: int | None, token: str) -> None:
        self.path = path
        self.token = token
        self._fd = fd
        self._pid = os.getpid()
        self._key = os.path.realpath(path)

    @property
    def pid(self) -> int:
        """The process that took the lock (a forked child has a copy of this object, not the lock)."""
        return self._pid

    @property
    def held(self) -> bool:
        return self._fd is not None and self._pid == os.getpid()

    def release(self) -> None:
        """Remove the lock file, then drop the lock. In a forked child: forget it, touch nothing."""
        with _lock:
            fd, self._fd = self._fd, None
            if _held.get(self._key) is self:
                del _held[self._key]
        if fd is None or self._pid != os.getpid():
            return  # the child's copy was closed at fork; the parent still holds the lock
        try:
            # Remove the name while still holding the lock, so that nobody can lock a file that we
            # then remove under them (see the module docstring).
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a lock file left behind is harmless: the next manager locks it
        finally:
            os.close(fd)  # drops the lock

    def _forget_in_child(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)  # the parent's lock stays: it has its own descriptor
            except OSError:
                pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork
    for held in list(_held.values()):
        held._forget_in_child()
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _not_a_file(path: Path, what: str) -> ManagerLockedError:
    return ManagerLockedError(
        f"The lock file {str(path)!r} of the CheckpointManager directory {str(path.parent)!r} is not a regular "
        f"file: it is {what}. jaxckpt will not lock or read it. Remove it, then start the manager again."
    )


def _unwritable(path: Path, e: OSError) -> ManagerLockedError:
    return ManagerLockedError(
        f"Cannot create the lock file {str(path)!r}: {e.strerror or e} ({e.filename or path}). A CheckpointManager "
        f"that saves must be able to write in {str(path.parent)!r}. To only restore from it (an evaluation job), "
        "pass read_only=True; otherwise give this process write access, or choose another directory."
    )


def _open(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_NONBLOCK", 0)  # a FIFO put there must not block the open
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and path.is_symlink():  # EMLINK: O_NOFOLLOW on BSDs
            try:
                target = repr(os.readlink(path))
            except OSError:
                target = "somewhere"
            raise _not_a_file(path, f"a symbolic link to {target}") from None
        if e.errno == errno.EISDIR:
            raise _not_a_file(path, "a folder") from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise _unwritable(path, e) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_a_file(path, "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket")
    return fd


def _refused(path: Path, owner: dict[str, Any] | None) -> ManagerLockedError:
    return ManagerLockedError(
        f"Another CheckpointManager ({_describe(owner)}) holds {str(path.parent)!r}: it has the lock on "
        f"{str(path)!r}. Two managers in one directory would delete each other's checkpoints. Close the other "
        "manager, or wait until it exits (the lock goes with its process)."
    )


def acquire(directory: Path) -> Lock:
    """Take the lock of ``directory``, or raise :class:`ManagerLockedError` naming its holder."""
    path = directory / LOCK_FILE
    key = os.path.realpath(path)
    token = uuid.uuid4().hex
    with _lock:
        mine = _held.get(key)
    if mine is not None:
        raise _refused(path, {"pid": os.getpid(), "hostname": socket.gethostname()})
    if fcntl is None:
        return _acquire_exclusive(path, key, token)
    for _ in range(_ATTEMPTS):
        fd = _open(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise _refused(path, _read_description(fd)) from None
            if not _same_file(fd, path):
                os.close(fd)  # its holder removed it while we waited: lock the file that has the name now
                continue
            record = {"pid": os.getpid(), "hostname": socket.gethostname(), "time": time.time(), "token": token}
            data = json.dumps(record).encode("utf-8")
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        _fsync_dir(directory)  # the lock file's name survives a power cut with the rest of the directory
        lock = Lock(path, fd, token)
        with _lock:
            _held[key] = lock
        return lock
    raise ManagerLockedError(f"Could not take the lock {str(path)!r}: other processes keep taking and releasing it.")


def _acquire_exclusive(path: Path, key: str, token: str) -> Lock:
    """Without flock: create the lock file exclusively (a crash leaves it, and a person removes it)."""
    record = {"pid": os.getpid(), "hostname": socket.gethostname(), "time": time.time(), "token": token}
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            owner = None
        else:
            owner = _read_description(fd)
            os.close(fd)
        raise ManagerLockedError(
            f"Another CheckpointManager ({_describe(owner)}) holds {str(path.parent)!r}: its lock file "
            f"{str(path)!r} exists. Close the other manager, or, if no job uses this directory any more, delete "
            "the lock file."
        ) from None
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise _unwritable(path, e) from None
        raise
    os.write(fd, json.dumps(record).encode("utf-8"))
    os.fsync(fd)
    _fsync_dir(path.parent)
    lock = Lock(path, fd, token)
    with _lock:
        _held[key] = lock
    return lock
