"""The ``jaxckpt`` command's arguments: the parser, its subcommands and their help texts.

Kept apart from :mod:`jaxckpt.tools.cli`, which runs the commands, so that the words a user reads in
``--help`` sit in one place. Each subcommand records its name in ``args.command`` and the exit
status its errors take in ``args.error_status``; :func:`jaxckpt.tools.cli.main` dispatches on the name.
"""

from __future__ import annotations

import argparse

from jaxckpt._version import __version__

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

PATTERN_HELP = "only keys matching a pattern, and what is below them: '*' within one edge, '**' across edges"

# What PATH may be, said once for every command that takes one.
PATH_HELP = (
    "a checkpoint folder, a manager's directory (its latest checkpoint), or another tool's checkpoint: "
    "TensorFlow (a prefix such as tf_ckpts/ckpt-5), Orbax, Flax msgpack, safetensors; a local path or a bucket URL (gs://, s3://)"
)

LS_DESCRIPTION = (
    "For a checkpoint: its keys as a tree, with dtype, shape (or value) and size. For a manager's "
    "directory: its checkpoints, with step, time saved, size on disk and metrics. Says which format it found."
)
SHOW_DESCRIPTION = (
    "Print one value of a checkpoint. For an array: dtype, shape, size, sharding, where its bytes are "
    "stored, statistics (min, max, mean, std, norm, NaN and inf counts) over the whole array, and its first "
    "values. For a Python value or an object's state: the value. For a node (a dict, a list, an object): "
    "the keys below it."
)
DIFF_DESCRIPTION = (
    "Compare checkpoint A with checkpoint B: keys removed (-), added (+), changed in shape, dtype or type "
    "(~), and values that differ (!) with their largest absolute difference; NaN equals NaN. Checkpoints "
    "of different formats compare by key. Exit status as diff(1): 0 when they hold the same values, 1 when "
    "they differ, 2 when they cannot be compared."
)
VERIFY_DESCRIPTION = (
    "Read every byte of a checkpoint and check every checksum (where a format stores none, such as "
    "safetensors: every size and offset); name each damaged or unreadable key. A manager's directory: every "
    "checkpoint its state file lists. Exit status 0 when all is well, 1 when something is damaged or "
    "unreadable."
)


def parser() -> argparse.ArgumentParser:
    """The ``jaxckpt`` argument parser, with one subparser per command."""
    top = argparse.ArgumentParser(
        prog="jaxckpt",
        description="Look into, compare, verify and convert checkpoints (jaxckpt's, TensorFlow's, Orbax's, "
        "Flax msgpack, safetensors).",
        epilog=(
            "Exit status: 0 success; 1 failure (no checkpoint, damage, an unreadable file; for diff: the "
            "checkpoints differ); 2 usage error (for diff: any error). PATH may be a manager's directory: "
            "ls lists its checkpoints, show and diff use its latest one, verify checks them all."
        ),
    )
    top.add_argument("--version", action="version", version=f"jaxckpt {__version__}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)

    ls = sub.add_parser("ls", help="list keys (or a manager's checkpoints)", description=LS_DESCRIPTION)
    ls.add_argument("path", metavar="PATH", help=PATH_HELP)
    ls.add_argument("patterns", metavar="PATTERN", nargs="*", default=[], help=PATTERN_HELP)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--flat", action="store_true", help="one value a line: key, type, shape or value, bytes")
    ls.set_defaults(error_status=EXIT_FAILURE)

    show = sub.add_parser(
        "show", help="one value: dtype, shape, sharding, statistics, values", description=SHOW_DESCRIPTION
    )
    show.add_argument("path", metavar="PATH", help=PATH_HELP)
    show.add_argument("key", metavar="KEY", help="the value's key, as ls prints it (e.g. params/dense/kernel)")
    show.add_argument(
        "--values",
        type=int,
        default=10,
        metavar="N",
        help="how many first values to print (default 10; arrays of up to 100 values are printed whole)",
    )
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(error_status=EXIT_FAILURE)

    d = sub.add_parser(
        "diff", help="compare two checkpoints (exit 0 same, 1 different, 2 error)", description=DIFF_DESCRIPTION
    )
    d.add_argument("a", metavar="A", help="the first checkpoint; " + PATH_HELP)
    d.add_argument("b", metavar="B", help="the second checkpoint, of any format jaxckpt reads")
    d.add_argument("patterns", metavar="PATTERN", nargs="*", default=[], help=PATTERN_HELP)
    d.add_argument("--atol", type=float, default=0.0, help="values within this max abs difference count as equal")
    d.add_argument("--all", action="store_true", help="list identical keys too")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(error_status=EXIT_USAGE)

    v = sub.add_parser("verify", help="read every byte and check every checksum", description=VERIFY_DESCRIPTION)
    v.add_argument("path", metavar="PATH", help=PATH_HELP.replace("(its latest checkpoint)", "(all its checkpoints)"))
    v.add_argument("--json", action="store_true", help="print JSON")
    v.set_defaults(error_status=EXIT_FAILURE)

    c = sub.add_parser(
        "convert",
        help="any readable checkpoint into a jaxckpt checkpoint, or into a .safetensors file",
        description=(
            "Write SRC (any format jaxckpt reads, or a manager's directory: its latest checkpoint) as a new "
            "checkpoint at DST: a safetensors file if DST ends in .safetensors, else a jaxckpt checkpoint. "
            "Arrays are read one at a time; values with no numpy form are left out and listed."
        ),
    )
    c.add_argument("src", metavar="SRC", help="the checkpoint to read; " + PATH_HELP)
    c.add_argument("dst", metavar="DST", help="where to write: a new folder, or a file ending in .safetensors")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(error_status=EXIT_FAILURE)
    return top
