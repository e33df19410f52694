"""The files of a peer copy (:mod:`jaxckpt.manager.peers`): one process's local checkpoint as a stream
of bytes, the folder a peer writes it into, and the marker that says the copy is whole.

**A stream** is one local checkpoint folder (every file of it, the index included)::

    <8 bytes: the header's length, little-endian> <header: JSON> <each file's bytes, in order>
    <4 bytes per file: its CRC-32C, little-endian>

The header names the origin process, the step, the checkpoint's save id (its index's ``save``),
what the origin's local state file records for it (time, metrics), and each file's relative path and
size. The CRC-32C values come last, so that a copy reads each file once: the sender computes them as
it reads. A peer sending a copy it holds sends those of its marker instead, the origin's: bytes
damaged on the holder's disk then differ from them where they arrive, as do bytes damaged on the way.

**A peer copy** lies at ``<local_directory>/peer-copies/p<origin>/<name>``, a checkpoint folder as
the origin's, and is whole once ``<name>.json`` beside it (the marker: the header and the CRC-32C
values, checksummed JSON) exists: it is written last, after the files are checked and renamed into
place, and removed first.
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxckpt._errors import CheckpointCorruptedError, JaxckptError
from jaxckpt.format.checked_json import check_checksum, checksummed_json
from jaxckpt.format.records import INDEX_FILE
from jaxckpt.manager import durable_copy
from jaxckpt.storage import local_tree, locations
from jaxckpt.storage.local_files import crc32c_of

PEERS = "peer-copies"  # in a local directory: the copies this process holds of other processes' checkpoints
_HEAD = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_ORIGIN = re.compile(r"^p(0|[1-9][0-9]{0,6})$")
MAX_HEADER = 64 << 20  # bytes of a header at most (a file list): what a broken stream claims beyond is refused


def checkpoint_files(folder: Path) -> list[tuple[str, int]]:
    """Every file of the local checkpoint ``folder`` (relative, ``/``-separated) with its size, the index last."""
    files = [*durable_copy.data_files(folder), INDEX_FILE]
    return [(rel, (folder / rel).stat().st_size) for rel in files]


class Outgoing:
    """A checkpoint folder as a stream (see the module's description), read in order by
    :func:`jaxckpt.runtime.exchange.transfer`. ``crcs``: the CRC-32C values to send (a held copy's
    marker); by default those of the bytes read. A file that cannot be read is sent as zeros with a
    CRC-32C that does not match them, so that the receiver refuses it, and its error is kept in
    :attr:`error`: the sender still takes part in every round."""

    def __init__(self, folder: Path, header: Mapping[str, Any], crcs: Sequence[int] | None = None) -> None:
        self._folder = folder
        body = json.dumps(dict(header), sort_keys=True).encode()
        self._head = _HEAD.pack(len(body)) + body
        self._files: list[tuple[str, int]] = [(str(f), int(n)) for f, n in header["files"]]
        self._given = list(crcs) if crcs is not None else None
        self._crcs: list[int] = []
        self._trailer_at = len(self._head) + sum(n for _, n in self._files)
        self.length = self._trailer_at + _CRC.size * len(self._files)
        self.error: BaseException | None = None
        self._at = 0  # the stream's offset read so far
        self._file = 0  # the file being read: its handle, its bytes read and their CRC-32C
        self._handle: Any = None
        self._done = 0
        self._crc = 0
        self._poisoned: set[int] = (
            set()
        )  # files sent as zeros: their CRC-32C is sent wrong, so the receiver refuses them

    def read(self, offset: int, size: int) -> bytes:
        if offset != self._at:
            raise ValueError(f"A stream is read in order: {offset} asked, {self._at} next.")
        out = bytearray()
        while len(out) < size and self._at < self.length:
            want = size - len(out)
            if self._at < len(self._head):
                piece = self._head[self._at : self._at + want]
            elif self._file < len(self._files):
                piece = self._read_file(want)
            else:
                crcs = self._given if self._given is not None else self._crcs
                trailer = b"".join(_CRC.pack(c ^ 0xFFFFFFFF if i in self._poisoned else c) for i, c in enumerate(crcs))
                start = self._at - self._trailer_at
                piece = trailer[start : start + want]
                if not piece:
                    break
            out += piece
            self._at += len(piece)
        return bytes(out)

    def _read_file(self, size: int) -> bytes:
        rel, total = self._files[self._file]
        if self._handle is None:
            self._crc, self._done = 0, 0
            try:
                self._handle = open(self._folder / rel, "rb", buffering=0)
            except OSError as e:
                self.error = self.error or e
                self._handle = False
        want = min(size, total - self._done)
        piece = b""
        if self._handle and want:
            try:
                piece = self._handle.read(want)
            except OSError as e:
                self.error = self.error or e
        if len(piece) < want:  # gone, shorter, or unreadable: zeros, and the receiver's check fails
            if self.error is None:
                self.error = CheckpointCorruptedError(f"{str(self._folder / rel)!r} is shorter than when it was listed")
            piece = piece + bytes(want - len(piece))
            self._poisoned.add(self._file)
        self._crc = crc32c_of(piece, self._crc)
        self._done += len(piece)
        if self._done == total:
            self.close()
            self._crcs.append(self._crc)
            self._file += 1
        return piece

    def close(self) -> None:
        if self._handle:
            self._handle.close()
        self._handle = None


class Incoming:
    """Writes a stream it is fed into ``staging`` (a new folder); :meth:`finish` checks every file's
    size and CRC-32C and returns the header and the CRC-32C values. An error (a full disk) is kept
    and raised by :meth:`finish`: the receiver still takes part in every round."""

    def __init__(self, staging: Path, where: str) -> None:
        self._staging = staging
        self._where = where  # what the stream is, for errors: "process 1's ckpt-3 from process 2"
        self._buffer = bytearray()  # the header, or the trailer, as it comes
        self._header: dict[str, Any] | None = None
        self._files: list[tuple[str, int]] = []
        self._file = 0
        self._done = 0
        self._handle: Any = None
        self._crc = 0
        self._crcs: list[int] = []
        self.error: BaseException | None = None
        self._broken = False

    def feed(self, data: memoryview) -> None:
        """Take the next bytes of the stream. Never raises (the rounds go on): see :meth:`finish`."""
        view = memoryview(data)
        try:
            while len(view) and not self._broken:
                if self._header is None:
                    view = self._take_header(view)
                elif self._file < len(self._files):
                    view = self._take_file(view)
                else:
                    self._buffer += view
                    view = view[len(view) :]
        except Exception as e:  # a broken header: the rest is not read
            self.error, self._broken = self.error or e, True

    def _take_header(self, view: memoryview) -> memoryview:
        if len(self._buffer) < _HEAD.size:
            take = view[: _HEAD.size - len(self._buffer)]
            self._buffer += take
            return view[len(take) :]
        need = _HEAD.size + _HEAD.unpack_from(self._buffer)[0]
        if not _HEAD.size < need <= MAX_HEADER:
            raise CheckpointCorruptedError(f"The stream of {self._where} claims a header of {need:,} bytes.")
        take = view[: need - len(self._buffer)]
        self._buffer += take
        if len(self._buffer) == need:
            try:
                header = json.loads(bytes(self._buffer[_HEAD.size :]))
                self._files = [(_safe(str(f)), int(n)) for f, n in header["files"]]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointCorruptedError(f"The stream of {self._where} has a broken header: {e}") from None
            self._header = header
            self._buffer = bytearray()
            self._start_file()
        return view[len(take) :]

    def _start_file(self) -> None:
        while self._file < len(self._files):
            rel, size = self._files[self._file]
            self._done, self._crc = 0, 0
            try:
                target = self._staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(target, "wb")
            except OSError as e:
                self.error = self.error or e
                self._handle = None
            if size:
                return
            self._end_file()

    def _end_file(self) -> None:
        if self._handle is not None:
            try:
                self._handle.flush()
                os.fsync(self._handle.fileno())
            except OSError as e:
                self.error = self.error or e
            self._handle.close()
        self._handle = None
        self._crcs.append(self._crc)
        self._file += 1

    def _take_file(self, view: memoryview) -> memoryview:
        size = self._files[self._file][1]
        take = view[: size - self._done]
        self._crc = crc32c_of(take, self._crc)
        if self._handle is not None:
            try:
                self._handle.write(take)
            except OSError as e:
                self.error = self.error or e
        self._done += len(take)
        if self._done == size:
            self._end_file()
            self._start_file()
        return view[len(take) :]

    def finish(self) -> tuple[dict[str, Any], list[int]]:
        """The header and the CRC-32C values, once every file arrived whole and matches; else raise."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self.error is not None:
            if isinstance(self.error, OSError):
                raise locations.storage_failure(f"Cannot write the copy of {self._where}", self.error, "")
            raise self.error
        count = len(self._files)
        if self._header is None or self._file < count or len(self._buffer) != _CRC.size * count:
            raise CheckpointCorruptedError(f"The stream of {self._where} ended early.")
        sent = [_CRC.unpack_from(self._buffer, _CRC.size * i)[0] for i in range(count)]
        for (rel, _), want, got in zip(self._files, sent, self._crcs, strict=True):
            if want != got:
                raise CheckpointCorruptedError(
                    f"The copy of {self._where} is damaged: {rel!r} has CRC-32C {got:08x} where its origin's is {want:08x}."
                )
        return self._header, sent


def _safe(rel: str) -> str:
    """A relative path from a stream, refused if it would leave the folder."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in rel or "\0" in rel:
        raise CheckpointCorruptedError(f"A stream names the file {rel!r}, which is not inside a checkpoint.")
    return rel


# --- what a process holds ---------------------------------------------------------------------------


def origin_folder(local: Path, origin: int) -> Path:
    return local / PEERS / f"p{origin}"


def staging_folder(local: Path, origin: int, name: str) -> Path:
    """A new folder, next to where the copy of ``name`` goes, that nothing else writes."""
    return origin_folder(local, origin) / f".{name}.partial-{uuid.uuid4().hex[:12]}"


def place(staging: Path, local: Path, origin: int, name: str, header: Mapping[str, Any], crcs: Sequence[int]) -> None:
    """Put a checked copy in place, its marker last (an older copy of the same name goes first, its marker first)."""
    folder = origin_folder(local, origin)
    remove(local, origin, name)
    os.replace(staging, folder / name)
    locations.fsync_dir(folder)
    marker = {"header": dict(header), "crcs": list(crcs)}
    locations.write_file_atomic(locations.location(folder), f"{name}.json", checksummed_json(marker))


def remove(local: Path, origin: int, name: str) -> None:
    folder = origin_folder(local, origin)
    (folder / f"{name}.json").unlink(missing_ok=True)
    local_tree.remove_local(folder / name)


def held(local: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """The whole copies this process holds: by origin process, by checkpoint name, its marker
    (``header``, ``crcs``). A marker that fails its checksum is no copy; staging folders that a
    crash left are removed."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    root = local / PEERS
    for name in locations.children(locations.location(root)):
        match = _ORIGIN.match(name)
        if match is None:
            continue
        origin = int(match.group(1))
        for entry in locations.children(locations.location(root / name)):
            path = root / name / entry
            if entry.startswith(".") and ".partial-" in entry:
                local_tree.remove_local(path)
            elif entry.endswith(".json") and (path.with_suffix("")).is_dir():
                try:
                    data = path.read_bytes()
                    marker = json.loads(data)
                    check_checksum(data, marker, str(path))
                    header = marker["header"]
                    if header["origin"] != origin or header["name"] != entry[: -len(".json")]:
                        continue
                except (OSError, ValueError, KeyError, TypeError, JaxckptError):
                    continue
                out.setdefault(origin, {})[header["name"]] = marker
    return out


def prune(local: Path, keep: set[str]) -> None:
    """Remove the copies this process holds whose checkpoint name is not in ``keep``, markers first."""
    for origin, copies in held(local).items():
        for name in copies:
            if name not in keep:
                remove(local, origin, name)
