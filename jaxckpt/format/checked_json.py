"""JSON files that carry their own checksum (the index, each data store's checksums): canonical
compact JSON (keys sorted, separators ``,`` and ``:``, UTF-8) with a ``checksum`` field, the zlib
CRC-32 of the canonical JSON of the rest."""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

from jaxckpt._errors import CheckpointCorruptedError


def canonical_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(body: Mapping[str, Any]) -> bytes:
    return canonical_text(body).encode()


def checksummed_json(body: Mapping[str, Any]) -> bytes:
    """``body`` as canonical JSON with a ``checksum`` field: the zlib CRC-32 of the canonical JSON
    of the rest. "checksum" sorts first, so the file is the canonical body with it put in front."""
    return with_checksum(canonical_json(body))


_HEAD = b'{"checksum":"crc32:%08x",'  # the file's start: "checksum" sorts first
CHECKSUM_SLOT = _HEAD % 0


def with_checksum(canonical: bytes) -> bytes:
    """The canonical JSON of an object (not empty, without a ``checksum`` field) with one put in
    front, in one copy."""
    return b"".join((_HEAD % zlib.crc32(canonical), memoryview(canonical)[1:], b"\n"))


def fill_checksum(data: bytearray) -> bytearray:
    """What :func:`with_checksum` makes, in place: ``data`` is :data:`CHECKSUM_SLOT` followed by
    the canonical JSON of an object without its opening ``{`` (an object not empty, without a
    ``checksum`` field). An index of a million leaves is 150 MB: built in place, it is never copied."""
    head = len(CHECKSUM_SLOT)
    data[:head] = _HEAD % zlib.crc32(memoryview(data)[head:], zlib.crc32(b"{"))
    data += b"\n"
    return data


def check_checksum(data: bytes, body: dict[str, Any], where: str) -> None:
    """That ``body`` (parsed from ``data``; its ``checksum`` field is taken out) is what
    :func:`checksummed_json` wrote."""
    checksum = body.pop("checksum", None)
    if _written_as_checksummed(data, checksum):
        expected = checksum
    else:
        expected = _recomputed_checksum(body, where)
    if checksum != expected:
        raise CheckpointCorruptedError(
            f"{where} fails its checksum (recorded {checksum!r}, computed {expected!r}); "
            "the file was modified or damaged."
        )


_CHECKSUM_HEAD = b'{"checksum":"crc32:'


def _written_as_checksummed(data: bytes, checksum: Any) -> bool:
    """Whether ``data`` is byte for byte what :func:`checksummed_json` writes for the recorded checksum:
    the canonical body with the checksum put in front. Then the CRC-32 of those bytes is the check,
    and the body need not be encoded again (a fifth of a 10,000-leaf restore's index work)."""
    head = len(_CHECKSUM_HEAD)
    if not (data.startswith(_CHECKSUM_HEAD) and data[head + 8 : head + 10] == b'",' and data.endswith(b"}\n")):
        return False
    if checksum != "crc32:" + data[head : head + 8].decode("ascii", "replace"):
        return False
    return f"{zlib.crc32(memoryview(data)[head + 10 : -1], zlib.crc32(b'{')):08x}" == checksum[6:]  # no copy


def _recomputed_checksum(body: dict[str, Any], where: str) -> str:
    """The checksum of ``body`` (without its checksum field) as canonical JSON."""
    try:
        return f"crc32:{zlib.crc32(canonical_json(body)):08x}"
    except (ValueError, RecursionError) as e:  # NaN, Infinity, 1e999, lone surrogates: never written by jaxckpt
        raise CheckpointCorruptedError(f"{where} holds values that are not canonical JSON ({e}).") from e
