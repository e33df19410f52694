"""A run's metadata: what ``CheckpointManager(..., metadata={...})`` records once for the whole run.

Orbax's managers take the same argument: a run's configuration (model, learning rate, data), which
belongs to no step. It is JSON only, checked before the manager touches its directory, and kept in
a small file beside the state file, ``checkpoint.metadata``::

    {"format": "jaxckpt-run-metadata", "version": 1, "metadata": {"model": "mlp", "lr": 0.001}}

Orbax's rule: it is written once, by the first manager of the directory that is given some; a
later manager's metadata never replaces it (a warning says so when it differs), and every manager
reads the recorded one. A read-only manager never writes: without a recorded one it reports the
metadata it was given. A file of its own, not a field of the state file, so that it is written once
and never again with each save. The file is untrusted input: read bounded, and checked as JSON.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from typing import Any

from jaxckpt._errors import CheckpointFormatError, UnsupportedValueError, UnsupportedVersionError, caller_level
from jaxckpt.storage import locations

METADATA_FILE = "checkpoint.metadata"
METADATA_FORMAT = "jaxckpt-run-metadata"
METADATA_VERSION = 1
_MAX_DEPTH = 64  # deeper than any config; a bound, so that a hostile file cannot exhaust the stack
_MAX_BYTES = 1 << 20  # a run's configuration, not data: save data as a Checkpoint child


def _bad(path: str, value: object, why: str) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"{path} = {value!r} {why}. Run metadata is JSON only: dicts with str keys, lists, str, int, float "
        "(finite), bool and None."
    )


def _check(value: Any, path: str, depth: int) -> Any:
    """``value`` as JSON, or the error that names where in ``metadata`` it is not JSON."""
    if depth > _MAX_DEPTH:
        raise _bad(path, "...", f"is nested more than {_MAX_DEPTH} levels deep")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and type(value) is int:
        if not -(2**63) <= value < 2**64:
            raise _bad(path, value, "does not fit 64 bits, which JSON readers keep")
        return value
    if isinstance(value, float) and type(value) is float:
        if not math.isfinite(value):
            raise _bad(path, value, "is not finite, which JSON cannot hold")
        return value
    if isinstance(value, str) and type(value) is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(path, value, "is not valid Unicode text") from None
        return value
    if isinstance(value, list):
        return [_check(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedValueError(
                    f"{path} has the key {k!r}, a {type(k).__name__}; JSON keys are str. Use str({k!r}) as the key."
                )
            out[_check(k, f"{path} key", depth + 1)] = _check(v, f"{path}[{k!r}]", depth + 1)
        return out
    if isinstance(value, tuple):
        raise _bad(path, value, "is a tuple, which JSON would give back as a list: pass a list")
    if hasattr(value, "item") and hasattr(value, "dtype"):  # a NumPy or JAX scalar or array
        raise _bad(
            path, value, "is an array or array scalar, not a Python number: convert it with float(), int() or .tolist()"
        )
    raise _bad(path, value, f"is a {type(value).__module__}.{type(value).__qualname__}")


def check(metadata: object) -> dict[str, Any]:
    """The run metadata as it will be recorded (a copy), or an UnsupportedValueError naming what is not JSON."""
    if not isinstance(metadata, Mapping):
        raise UnsupportedValueError(
            f"metadata must be a mapping of str keys to JSON values (a dict), not {type(metadata).__name__} {metadata!r}."
        )
    checked: dict[str, Any] = _check(metadata, "metadata", 0)
    size = len(_encode(checked))
    if size > _MAX_BYTES:
        raise UnsupportedValueError(
            f"metadata takes {size:,} bytes as JSON, over the limit of {_MAX_BYTES:,} for a run's configuration; "
            "save large values in the Checkpoint instead."
        )
    return checked


def _encode(metadata: dict[str, Any]) -> bytes:
    doc = {"format": METADATA_FORMAT, "version": METADATA_VERSION, "metadata": metadata}
    return (json.dumps(doc, ensure_ascii=False, allow_nan=False, indent=1) + "\n").encode("utf-8")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as JSON (key order aside; 1 and 1.0, or True and 1, are not the same value)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def read(folder: locations.Location) -> dict[str, Any] | None:
    """The metadata recorded in ``folder``, or None without any; a damaged file is a CheckpointFormatError."""
    where = str(folder / METADATA_FILE)
    data = locations.read_file(folder, METADATA_FILE, _MAX_BYTES + 4096)
    if data is None:
        return None

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=refuse)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, too deep, or an integer of 4300 digits
        raise CheckpointFormatError(
            f"{where!r} is not a valid jaxckpt run metadata file: it is not JSON ({e}). The checkpoints are "
            "untouched; remove the file (the run's metadata is then forgotten) or put back the one jaxckpt wrote."
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != METADATA_FORMAT:
        raise CheckpointFormatError(
            f'{where!r} is not a jaxckpt run metadata file: it has no "format": "{METADATA_FORMAT}".'
        )
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointFormatError(f"{where!r}: its version {version!r} is not a positive int.")
    if version > METADATA_VERSION:
        raise UnsupportedVersionError(
            f"{where!r} has version {version}, written by a newer jaxckpt; this one reads version "
            f"{METADATA_VERSION}. Upgrade jaxckpt."
        )
    try:
        return check(doc.get("metadata"))
    except UnsupportedValueError as e:
        raise CheckpointFormatError(f"{where!r} holds metadata that is not JSON as jaxckpt writes it: {e}") from None


def start(folder: locations.Location, given: dict[str, Any] | None, *, write: bool) -> dict[str, Any]:
    """The run metadata a manager starting in ``folder`` reports; with ``write``, records ``given``
    there first if nothing is recorded yet (Orbax's rule: see the module's description)."""
    recorded = read(folder)
    if recorded is None:
        if given is not None and write:
            locations.write_file_atomic(folder, METADATA_FILE, _encode(given))
        return {} if given is None else given
    if given is not None and not _same(given, recorded):
        changed = sorted(
            k for k in given.keys() | recorded.keys() if not _same({k: given.get(k)}, {k: recorded.get(k)})
        )
        warnings.warn(
            f"{str(folder / METADATA_FILE)!r} keeps the metadata it has, recorded by the run's first manager: the "
            f"metadata given here differs in {changed}, and is not recorded (Orbax's rule: written once). "
            "To record other metadata, use another directory, or remove that file.",
            stacklevel=caller_level(),  # the code that created the manager
        )
    return recorded
