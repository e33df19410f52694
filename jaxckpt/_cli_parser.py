"""The ``jaxckpt`` command's arguments: the parser, its subcommands and their help texts.

Kept apart from :mod:`jaxckpt._cli`, which runs the commands, so that the words a user reads in
``--help`` sit in one place. Each subcommand records its name in ``args.command`` and the exit
status its errors take in ``args.error_status``; :func:`jaxckpt._cli.main` dispatches on the name.
"""

from __future__ import annotations

import argparse

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

PATTERN_HELP = "only keys matching a pattern, and what is below them: '*' within one edge, '**' across edges"

LS_DESCRIPTION = (
    "For a checkpoint: its keys as a tree, with dtype, shape (or value) and size. For a manager's "
    "directory: its checkpoints, with step, time saved, size on disk and metrics."
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
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)

    ls = sub.add_parser("ls", help="list keys (or a manager's checkpoints)", description=LS_DESCRIPTION)
    ls.add_argument("path", metavar="PATH")
    ls.add_argument("patterns", metavar="PATTERN", nargs="*", default=[], help=PATTERN_HELP)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--flat", action="store_true", help="one value a line: key, type, shape or value, bytes")
    ls.set_defaults(error_status=EXIT_FAILURE)

    show = sub.add_parser("show", help="one value: dtype, shape, sharding, statistics, values")
    show.add_argument("path", metavar="PATH")
    show.add_argument("key", metavar="KEY")
    show.add_argument(
        "--values",
        type=int,
        default=10,
        metavar="N",
        help="how many first values to print (default 10; arrays of up to 100 values are printed whole)",
    )
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(error_status=EXIT_FAILURE)

    d = sub.add_parser("diff", help="compare two checkpoints (exit 0 same, 1 different, 2 error)")
    d.add_argument("a", metavar="A")
    d.add_argument("b", metavar="B")
    d.add_argument("patterns", metavar="PATTERN", nargs="*", default=[], help=PATTERN_HELP)
    d.add_argument("--atol", type=float, default=0.0, help="values within this max abs difference count as equal")
    d.add_argument("--all", action="store_true", help="list identical keys too")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(error_status=EXIT_USAGE)

    v = sub.add_parser("verify", help="read every byte and check every checksum")
    v.add_argument("path", metavar="PATH")
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
    c.add_argument("src", metavar="SRC")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(error_status=EXIT_FAILURE)
    return top
