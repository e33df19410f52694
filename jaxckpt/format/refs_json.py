"""The ``refs.json`` of a data store (format version 6): its encoding and its strict parser. What
references are, and who reads and writes them, is :mod:`jaxckpt.incremental.refs`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import NamedTuple

from jaxckpt._errors import CheckpointCorruptedError
from jaxckpt.format.checked_json import check_checksum, checksummed_json

REFS_FILE = "refs.json"
FORMAT = "jaxckpt-refs"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")  # a sibling: no "/", not "." or ".."
STORE = re.compile(r"^data(\.p[1-9][0-9]{0,5})?$")
_ARRAY = re.compile(r"^a/[0-9]{1,9}$")
_SAVE = re.compile(r"^[0-9a-f]{1,64}$")
_SHARD = re.compile(r"^(0|[1-9][0-9]{0,17})$")


class Ref(NamedTuple):
    """Where the shards of an array are: array ``array`` of data store ``store`` of the sibling
    ``checkpoint``, written by save ``save``; ``shards``: shard number -> CRC-32C of its inner chunks."""

    checkpoint: str
    store: str
    array: str
    save: str
    shards: Mapping[int, tuple[int, ...]]


def is_plain_name(name: object) -> bool:
    return isinstance(name, str) and bool(_NAME.fullmatch(name))


def encode(save: str, refs: Mapping[str, Ref]) -> bytes:
    arrays = {
        path: {
            "checkpoint": r.checkpoint,
            "store": r.store,
            "array": r.array,
            "save": r.save,
            "shards": {str(n): list(c) for n, c in sorted(r.shards.items())},
        }
        for path, r in refs.items()
    }
    return checksummed_json({"format": FORMAT, "save": save, "arrays": arrays})


def decode(data: bytes, where: str, save: str | None) -> dict[str, Ref]:
    """The references of a ``refs.json``, every field checked; ``save``: the index's (None: not checked)."""

    def damaged(what: str) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(f"The references {where} are damaged: {what}.")

    try:
        body = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise damaged(f"it is not valid JSON ({e})") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise damaged(f'it has no "format": "{FORMAT}" field')
    check_checksum(data, body, where)
    if save is not None and body.get("save") != save:
        raise damaged(f"it was written by save {str(body.get('save'))[:80]!r}, not by save {save!r} of the index")
    arrays = body.get("arrays")
    if not isinstance(arrays, dict):
        raise damaged("its field 'arrays' is not an object")
    out = {}
    for path, raw in arrays.items():
        ok = isinstance(raw, dict) and _ARRAY.fullmatch(path) and set(raw) == set(Ref._fields)
        ok = ok and is_plain_name(raw["checkpoint"]) and isinstance(raw["store"], str) and isinstance(raw["array"], str)
        ok = ok and bool(STORE.fullmatch(raw["store"]) and _ARRAY.fullmatch(raw["array"]))
        ok = ok and isinstance(raw["save"], str) and bool(_SAVE.fullmatch(raw["save"]))
        shards = raw.get("shards") if isinstance(raw, dict) else None
        shards = shards if isinstance(shards, dict) else {}
        ok = ok and bool(shards)
        ok = ok and all(
            _SHARD.fullmatch(n) and isinstance(v, list) and all(type(c) is int and 0 <= c < 1 << 32 for c in v)
            for n, v in shards.items()
        )
        if not ok:
            raise damaged(
                f"its entry for {str(path)[:80]!r} is not a reference (a plain sibling name, a data store, an array "
                "a/<n>, a save id and shard CRCs)"
            )
        out[path] = Ref(
            raw["checkpoint"], raw["store"], raw["array"], raw["save"], {int(n): tuple(v) for n, v in shards.items()}
        )
    return out
