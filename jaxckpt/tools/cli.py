"""The ``jaxckpt`` command: look into, compare and verify checkpoints from a shell.

::

    jaxckpt ls PATH [PATTERN ...]     keys as a tree (dtype, shape, size); a manager's directory: its checkpoints
    jaxckpt show PATH KEY             one value: dtype, shape, sharding, statistics, the first values
    jaxckpt diff A B [PATTERN ...]    keys added, removed, changed in shape or dtype; values that differ
    jaxckpt verify PATH               read every byte and check every checksum
    jaxckpt convert SRC DST           into a jaxckpt checkpoint, or into DST.safetensors

Every command reads jaxckpt's own checkpoints and those of TensorFlow (a prefix such as
``tf_ckpts/ckpt-5``, or its manager's directory), Orbax (a checkpoint, an item, or a manager's
directory), Flax msgpack and safetensors files; ``ls`` says which format it found.

Also ``python -m jaxckpt``. ``--json`` gives machine-readable output. Where a command wants one
checkpoint and gets a manager's directory, it takes the directory's latest checkpoint (``verify``
checks every checkpoint the directory lists). ``show``, ``diff`` and ``verify`` read arrays whole, in
batches of up to 64 MiB, so memory stays near the size of the largest array; a progress bar on
stderr follows them when stderr is a terminal.

Exit status: 0 on success; 1 when the command fails (no checkpoint there, a damaged checkpoint, an
unreadable file); 2 for a usage error (wrong arguments). ``diff`` follows diff(1): 0 when the
checkpoints hold the same values, 1 when they differ, 2 when it cannot compare them. Errors are one
line on stderr, ``jaxckpt: error: <message>``, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxckpt._errors import (
    JaxckptError,
    NotACheckpointError,
    StorageError,
)
from jaxckpt.format.keys import describe
from jaxckpt.format.records import ArrayLeaf, InForeign, InPack, Leaf, ValueLeaf
from jaxckpt.reading import open as _open
from jaxckpt.reading.open import open_latest
from jaxckpt.reading.reader import Opened
from jaxckpt.storage import locations, statefile
from jaxckpt.tools.cli_parser import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, parser
from jaxckpt.tools.describe import json_value, leaf_json, leaf_shape, leaf_type
from jaxckpt.tools.diff import diff
from jaxckpt.tools.inspect import CheckpointView, ManagerView
from jaxckpt.tools.progress import Progress, human_bytes
from jaxckpt.tools.scan import Stats, number_text, pieces
from jaxckpt.tools.verify import Verified, verify

# Arrays of at most this many elements are printed whole by `show`.
_PRINT_WHOLE = 100


class UsageError(Exception):
    """The arguments make no sense together (exit status 2)."""


# --- output helpers ----------------------------------------------------------------------------


def _error(message: str) -> None:
    # The message alone: it names what and where, and a traceback would only bury it.
    print(f"jaxckpt: error: {message}", file=sys.stderr)


def _note(message: str) -> None:
    print(f"jaxckpt: {message}", file=sys.stderr)


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False))


def _tree_ascii() -> bool:
    """Draw trees in ASCII where stdout cannot encode box-drawing characters (LANG=C, cp1252)."""
    try:
        "├└│".encode(sys.stdout.encoding or "ascii")
        return False
    except (UnicodeEncodeError, LookupError):
        return True


def _one_checkpoint(path: str) -> _open.Probe:
    """What is at ``path`` (one look, see :func:`jaxckpt.reading.open.probe`), or at the latest checkpoint if
    ``path`` is a manager's directory; open it with :func:`jaxckpt.reading.open.open_found`."""
    found = _open.probe(locations.location(path))
    if not _open.is_manager_directory(found):
        return found
    state = statefile.parse_full_state(found.location, found.state)
    if not state or not state[0]:
        raise NotACheckpointError(f"{path!r} is a manager's directory, but its state file lists no checkpoint.")
    latest = found.location / os.path.basename(state[0][-1].path)
    _note(f"{path} is a manager's directory; using its latest checkpoint, {latest}")
    return _open.probe(latest)


# --- ls ----------------------------------------------------------------------------------------


def _cmd_ls(args: argparse.Namespace) -> int:
    found = _open.probe(locations.location(args.path))  # one look; what it read is handed on
    if _open.is_manager_directory(found):
        if args.patterns:
            latest = statefile.parse_full_state(found.location, found.state)
            raise UsageError(
                f"{args.path!r} is a manager's directory, which lists checkpoints; patterns select keys "
                f"of one checkpoint. Pass one of them, e.g. {latest[0][-1].path if latest and latest[0] else None!r}."
            )
        view: CheckpointView | ManagerView = ManagerView(found.location, state=found.state)
    else:
        view = CheckpointView(found.location, args.patterns, found=found)
    if args.json:
        _print_json(view.to_json())
    elif args.flat and isinstance(view, CheckpointView):
        for key, leaf in view.leaves.items():
            print("\t".join([key, *_describe(leaf)]))
    elif isinstance(view, CheckpointView):
        print(view.text(ascii=_tree_ascii()))
    else:
        print(view.text())
    if isinstance(view, CheckpointView) and args.patterns and not len(view):
        _note(f"no key matches {' or '.join(map(repr, args.patterns))}")
        return EXIT_FAILURE
    return EXIT_OK


def _describe(leaf: Leaf) -> list[str]:
    """Type, shape (or value) and bytes, as the columns of ``ls --flat``."""
    if isinstance(leaf, ValueLeaf):
        return [leaf.type, json.dumps(json_value(leaf.value), ensure_ascii=False), "0"]
    return [leaf_type(leaf), str(leaf_shape(leaf)), str(leaf.nbytes)]


# --- show --------------------------------------------------------------------------------------


def _where(leaf: ArrayLeaf) -> str:
    at = leaf.at
    if isinstance(at, InForeign):
        return "in a checkpoint of another library (read-only; read whole)"
    if isinstance(at, InPack):
        return f"packed: pack {at.pack}, bytes {at.offset}..{at.offset + at.nbytes}, checksum {at.checksum:08x}"
    return f"zarr3 array {at.path}/ (stored as {at.stored}, each chunk with a crc32c)"


def _first_values(opened: Opened, key: str, leaf: ArrayLeaf, count: int, progress: Progress) -> tuple[Stats, Any]:
    """Statistics of the whole array, and its first ``count`` values (all of it if it is small)."""
    stats, first = Stats(), None
    for data in pieces(opened, key):
        progress.update(data.nbytes)
        if not leaf.prng_impl:
            stats.add(data)
        if first is None:
            first = data if data.size == math.prod(leaf.shape) else data.reshape(-1)[:count]
    assert first is not None
    if first.size <= max(count, _PRINT_WHOLE):
        return stats, first
    return stats, first.reshape(-1)[:count]


def _cmd_show(args: argparse.Namespace) -> int:
    if args.values < 0:
        raise UsageError(f"--values must be 0 or more, not {args.values}.")
    found = _one_checkpoint(args.path)
    opened = _open.open_found(found)
    index, key = opened.index, args.key
    if key in index.nodes:
        info = index.nodes[key]
        sub = CheckpointView(found.location, [key], found=found)
        if args.json:
            _print_json({**sub.to_json(), "node": {"key": key, "kind": info.kind, "class": info.cls}})
        else:
            print(f"{describe(key)} is a node ({info.kind}, {info.cls}), not a value; it holds:")
            print(sub.text(ascii=_tree_ascii()))
        return EXIT_OK
    leaf = opened.leaf(key)  # MissingKeyError, with close matches, for a wrong key
    if isinstance(leaf, ValueLeaf):
        if args.json:
            _print_json(leaf_json(key, leaf))
        else:
            rows = [("key", key), ("type", _VALUE_TYPES.get(leaf.type, f"Python {leaf.type}"))]
            value = json.dumps(json_value(leaf.value), indent=2, ensure_ascii=False) if leaf.type != "none" else "None"
            _print_rows([*rows, ("value", value)])
        return EXIT_OK
    with Progress(leaf.nbytes, f"show {key}") as progress:
        stats, first = _first_values(opened, key, leaf, args.values, progress)
    doc = {**leaf_json(key, leaf), "stored": _where(leaf)}
    if not leaf.prng_impl:
        doc["stats"] = stats.to_json()
    doc["first_values"] = json_value(_as_list(first))
    if args.json:
        _print_json(doc)
        return EXIT_OK
    size = math.prod(leaf_shape(leaf))
    rows = [
        ("key", key),
        ("type", f"PRNG key array ({leaf.prng_impl}); its key data is shown" if leaf.prng_impl else "array"),
        ("dtype", leaf.dtype.name),
        ("shape", f"{leaf_shape(leaf)}, {size:,} element{'s' if size != 1 else ''}"),
        ("size", f"{human_bytes(leaf.nbytes)} ({leaf.nbytes:,} bytes)"),
        ("restores as", {"jax": "jax.Array", "numpy": "numpy array", "numpy_scalar": "numpy scalar"}[leaf.container]),
        ("sharding", leaf.sharding or "none recorded (one device, or a numpy array)"),
        ("stored", _where(leaf)),
    ]
    if not leaf.prng_impl and stats.size:
        s = stats.to_json()
        of = " of |x|" if stats.of_abs else ""
        finite = f" (of the {stats.finite:,} finite values)" if stats.nan or stats.inf else ""
        rows += [
            (f"min{of}", number_text(s["min"]) + finite),
            (f"max{of}", number_text(s["max"])),
            (f"mean{of}", number_text(s["mean"])),
            (f"std{of}", number_text(s["std"])),
            ("norm", number_text(s["norm"])),
            ("nan", f"{stats.nan:,}"),
            ("inf", f"{stats.inf:,}"),
        ]
    label = "values" if first.size == math.prod(leaf.shape) else f"first {first.size}"
    rows.append((label, np.array2string(first, threshold=10 * _PRINT_WHOLE, separator=", ")))
    _print_rows(rows)
    return EXIT_OK


_VALUE_TYPES = {
    "state": "object state (the JSON of get_state(), given to set_state() on restore)",
    "state_bytes": "object state (the bytes of get_state(), given to set_state() on restore; shown as base64)",
    "state_per_process": "object states, one per process of the run that saved them (each process's set_state() "
    "gets its own on restore; another process count is refused)",
    "none": "None",
}


def _as_list(values: np.ndarray) -> Any:
    if values.dtype.kind in "biufc" and values.dtype.kind != "c":
        return values.tolist()
    if values.dtype.kind == "c":
        return [[float(v.real), float(v.imag)] for v in values.reshape(-1)]
    return values.astype(np.float64).tolist()  # bfloat16, float8, int4...: exact in float64


def _print_rows(rows: Sequence[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for name, value in rows:
        lines = str(value).split("\n")
        print(f"{name:<{width}}  {lines[0]}")
        for line in lines[1:]:
            print(f"{'':<{width}}  {line}")


# --- diff --------------------------------------------------------------------------------------


def _cmd_diff(args: argparse.Namespace) -> int:
    found_a, found_b = _one_checkpoint(args.a), _one_checkpoint(args.b)
    a, b = found_a.location.text, found_b.location.text
    opened_a, opened_b = _open.open_found(found_a), _open.open_found(found_b)  # each index read once
    total = sum(
        v.nbytes for v in CheckpointView(a, args.patterns, found=found_a).leaves.values() if isinstance(v, ArrayLeaf)
    )
    with Progress(total, "diff") as progress:
        result = diff(opened_a, opened_b, args.patterns, atol=args.atol, progress=progress)
    if args.json:
        _print_json(
            {
                "a": a,
                "b": b,
                "identical": result.identical,
                "added": result.added,
                "removed": result.removed,
                "changed": [{"key": k, "a": x, "b": y} for k, x, y in result.changed],
                "different": [{"key": k, "max_abs_diff": json_value(d), "detail": t} for k, d, t in result.different],
                "same": result.same,
            }
        )
    else:
        rows = [("-", k, "") for k in result.removed] + [("+", k, "") for k in result.added]
        rows += [("~", k, f"{x} -> {y}") for k, x, y in result.changed]
        rows += [("!", k, text) for k, _, text in result.different]
        if args.all:
            rows += [("=", k, "") for k in result.same]
        print(f"--- {a}\n+++ {b}")
        width = min(64, max((len(k) for _, k, _ in rows), default=0))
        for mark, key, text in rows:
            print(f"{mark} {key:<{width}}  {text}".rstrip())
        counts = [
            f"{len(result.removed)} removed",
            f"{len(result.added)} added",
            f"{len(result.changed)} changed in shape, dtype or type",
            f"{len(result.different)} with different values",
            f"{len(result.same)} identical",
        ]
        print(", ".join(counts) + (f" (tolerance {args.atol:g})" if args.atol else ""))
    return EXIT_OK if result.identical else EXIT_FAILURE


# --- verify ------------------------------------------------------------------------------------


def _cmd_verify(args: argparse.Namespace) -> int:
    looked = _open.probe(locations.location(args.path))
    is_dir = _open.is_manager_directory(looked)
    if is_dir:
        state = statefile.parse_full_state(looked.location, looked.state)
        paths = [c.path for c in state[0]] if state is not None else []
        if not paths:
            _note(f"{args.path} is a manager's directory with no checkpoints; nothing to verify")
    else:
        paths = [args.path]
    results = []
    for path in paths:
        opened = _opened_or_none(path if is_dir else looked)
        total = sum(v.nbytes for v in opened.index.leaves.values() if isinstance(v, ArrayLeaf)) if opened else 0
        with Progress(total, f"verify {path}") as progress:
            try:
                results.append(verify(path, progress, opened=opened))
            except JaxckptError as e:
                if not is_dir:
                    raise
                # A listed checkpoint that is gone or unreadable: report it with the others.
                found = [("", str(e))]
                storage = isinstance(e, StorageError)
                results.append(Verified(path, unreadable=found) if storage else Verified(path, damaged=found))
    if args.json:
        _print_json(
            [
                {
                    "path": r.path,
                    "ok": r.ok,
                    "checked": r.checked,
                    "values": r.values,
                    "nbytes": r.nbytes,
                    "damaged": [{"key": k, "error": m} for k, m in r.damaged],
                    "unreadable": [{"key": k, "error": m} for k, m in r.unreadable],
                }
                for r in results
            ]
        )
    else:
        for r in results:
            if r.ok:
                print(f"OK       {r.path}: {r.values} values, {human_bytes(r.nbytes)} read, {r.checked}")
            for label, found in (("DAMAGED", r.damaged), ("UNREADABLE", r.unreadable)):
                if found:
                    print(f"{label:<9}{r.path}:")
                for key, message in found:
                    print(f"  {key or '(index)'}: {message}")
    problems = []
    for label, attr in (
        ("damaged", "damaged"),
        ("unreadable (the storage refused; not known to be damaged)", "unreadable"),
    ):
        bad = [r for r in results if getattr(r, attr)]
        if bad:
            names = "; ".join(
                f"{r.path} ({', '.join(repr(k) if k else 'its index' for k, _ in getattr(r, attr))})" for r in bad
            )
            problems.append(f"{label}: {names}")
    if problems:
        _error("; ".join(problems))
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from jaxckpt.tools.convert import convert

    try:
        total = sum(
            v.nbytes
            for v in open_latest(locations.location(args.src)).index.leaves.values()
            if isinstance(v, ArrayLeaf)
        )
    except (JaxckptError, OSError):
        total = 0  # convert() itself reports why
    with Progress(total, f"convert {args.src}") as progress:
        result = convert(args.src, args.dst, overwrite=args.overwrite, on_read=progress.update)
    if args.json:
        _print_json(dataclasses.asdict(result))
        return EXIT_OK
    print(
        f"wrote {result.destination}: {result.values} values, {human_bytes(result.nbytes)} "
        f"from {result.source} ({result.source_format})"
    )
    if result.left_out:
        print(f"left out, {len(result.left_out)}:")
        for key, why in result.left_out.items():
            print(f"  {key}: {why}")
    return EXIT_OK


def _opened_or_none(path: str | _open.Probe) -> Opened | None:
    """The checkpoint at ``path`` (or what a probe found) opened, for the progress bar's total and then
    read by :func:`verify`; or None: errors surface in :func:`verify` itself, which opens it again."""
    try:
        return _open.open_found(path) if isinstance(path, _open.Probe) else open_latest(locations.location(path))
    except (JaxckptError, OSError):
        return None


_COMMANDS = {"ls": _cmd_ls, "show": _cmd_show, "diff": _cmd_diff, "verify": _cmd_verify, "convert": _cmd_convert}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script passes it to sys.exit)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return _COMMANDS[args.command](args)
    except UsageError as e:
        _error(str(e))
        return EXIT_USAGE
    except BrokenPipeError:  # `jaxckpt ls ... | head`: the reader left; nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that flushing stdout at exit fails no more
        return EXIT_FAILURE
    except NotACheckpointError as e:  # the library's advice, put as the command's
        _error(_open.command_line_message(e))
        return args.error_status
    except (JaxckptError, OSError, NotImplementedError) as e:
        # Wrong paths, damaged files, unsupported storage: the message says what and where.
        _error(str(e))
        return args.error_status
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
