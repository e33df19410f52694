"""Run a Markdown page's examples as a reader would: its ``python`` blocks in order, in one namespace,
and the commands of its ``console`` blocks, comparing what they print with what the page shows.

    python tests/docs_runner.py docs/inspecting.md --workdir /tmp/x           # run, report drift
    python tests/docs_runner.py docs/inspecting.md --workdir /tmp/x --update  # rewrite drifted outputs

``tests/test_docs.py`` runs every page of ``docs/`` and the README this way, in a fresh folder each.

Conventions for pages (they render unchanged on GitHub and in Sphinx with MyST):

- A fenced ``python`` block runs. A block preceded by ``<!-- docs: skip (why) -->`` does not (a
  block that cannot run here: a real bucket, a TPU pod). Keep those rare.
- A fenced ``console`` block holds commands, each on a line starting with ``$ ``, followed by the
  output it prints (stdout and stderr together). ``jaxckpt`` runs as ``python -m jaxckpt`` of this
  interpreter. An output line may hold ``...``, which matches any text (temporary paths), and a date
  and time (``2026-11-26 15:46:28``) matches any other. A decimal number matches one within 0.1%
  (XLA's float results may differ in the last digits between CPUs); spaces between columns may vary.
  Output is compared line by line after stripping trailing spaces; ``--update`` rewrites the
  output of every command whose output does not match. A console block preceded by
  ``<!-- docs: no-output -->`` runs its commands without comparing their output.
- ``<!-- docs: needs NAME, ... -->`` anywhere in a page declares what it needs from the test that
  runs it (see tests/test_docs.py: ``s3`` a bucket server, ``fixtures`` other tools' checkpoints).

Every page runs with 8 CPU devices (``XLA_FLAGS``), so sharding examples use real meshes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?")  # any date and time matches any other
MARKER = re.compile(r"<!--\s*docs:\s*(?P<what>[a-z-]+)\b(?P<rest>.*?)-->")


@dataclasses.dataclass
class Block:
    kind: str  # "python" or "console"
    line: int  # 1-based line of the first line of the block's content
    end: int  # 1-based line of the closing fence
    text: str
    skip: bool = False
    compare: bool = True


def blocks(page: str) -> list[Block]:
    """The page's python and console blocks, in order, with their markers."""
    lines = page.split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m["fence"], m["info"].strip().split(" ")[0].strip("{}")
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip(fence[0]) == ""):
            j += 1
        if info in ("python", "console"):
            before = lines[i - 1].strip() if i > 0 else ""
            marker = MARKER.search(before)
            what = marker["what"] if marker else ""
            body = "\n".join(line[len(m["indent"]) :] for line in lines[i + 1 : j])
            out.append(Block(info, i + 2, j + 1, body + "\n", skip=what == "skip", compare=what != "no-output"))
        i = j + 1
    return out


def needs(page: str) -> set[str]:
    """What the page declares it needs (``<!-- docs: needs s3, fixtures -->``)."""
    found: set[str] = set()
    for m in MARKER.finditer(page):
        if m["what"] == "needs":
            found.update(n.strip() for n in m["rest"].split(",") if n.strip())
    return found


@dataclasses.dataclass
class Command:
    command: str
    expected: list[str]
    line: int  # 1-based line of the "$ " line in the page


def commands(block: Block) -> list[Command]:
    out: list[Command] = []
    for k, line in enumerate(block.text.rstrip("\n").split("\n")):
        if line.startswith("$ "):
            out.append(Command(line[2:], [], block.line + k))
        elif out:
            out[-1].expected.append(line)
        elif line.strip():
            raise ValueError(f"line {block.line + k}: a console block starts with a '$ ' command line")
    return out


def matches(expected: list[str], actual: list[str]) -> bool:
    def strip(lines: list[str]) -> list[str]:
        lines = [x.rstrip() for x in lines]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    expected, actual = strip(expected), strip(actual)
    expected, actual = [TIME.sub("<time>", x) for x in expected], [TIME.sub("<time>", x) for x in actual]
    if len(expected) != len(actual):
        return False
    return all(_line_matches(e, a) for e, a in zip(expected, actual))


DECIMAL = re.compile(r"-?\d+\.\d+(?:e[+-]?\d+)?")


def _line_matches(expected: str, actual: str) -> bool:
    """``...`` matches any text, runs of spaces match any run (columns move with a number's width),
    and a decimal number matches one within 0.1% of it: float results of XLA on CPU may differ in
    their last digits from one CPU to another. Other text and integers (offsets, sizes) match exactly."""
    numbers: list[float] = []

    def literal(text: str) -> str:
        out, at = [], 0
        for m in DECIMAL.finditer(text):
            out.append(re.escape(text[at : m.start()]))
            out.append(r"(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)")
            numbers.append(float(m.group()))
            at = m.end()
        out.append(re.escape(text[at:]))
        return re.sub(r"(\\ )+", " +", "".join(out))

    found = re.fullmatch(".*".join(literal(part) for part in expected.split("...")), actual)
    if not found:
        return False
    return all(abs(float(got) - want) <= 1e-3 * abs(want) + 1e-6 for got, want in zip(found.groups(), numbers))


def run_command(command: str, cwd: Path) -> str:
    """One console command, ``jaxckpt`` as ``python -m jaxckpt`` of this interpreter."""
    argv = shlex.split(command)
    if argv and argv[0] == "jaxckpt":
        argv = [sys.executable, "-m", "jaxckpt", *argv[1:]]
    elif argv and argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    return done.stdout + done.stderr


def run_page(path: Path, workdir: Path, update: bool) -> list[str]:
    """Run the page's examples in ``workdir``; return the drift found (and rewrite it if ``update``)."""
    page = path.read_text()
    workdir.mkdir(parents=True, exist_ok=True)
    before = os.getcwd()
    os.chdir(workdir)
    try:
        return _run_blocks(path, page, workdir, update)
    finally:
        os.chdir(before)


def _run_blocks(path: Path, page: str, workdir: Path, update: bool) -> list[str]:
    namespace: dict[str, object] = {"__name__": "__main__"}
    problems: list[str] = []
    replacements: list[tuple[int, int, list[str]]] = []  # (first line, line after, new lines), 1-based
    for block in blocks(page):
        if block.skip:
            continue
        if block.kind == "python":
            # Line numbers in a traceback are the page's: the block is compiled after as many newlines.
            code = compile("\n" * (block.line - 1) + block.text, str(path), "exec")
            exec(code, namespace)
            continue
        for cmd in commands(block):
            actual = run_command(cmd.command, workdir).rstrip("\n").split("\n")
            if block.compare and not matches(cmd.expected, actual):
                shown = "\n".join(f"    {x}" for x in actual)
                problems.append(f"{path}:{cmd.line}: `$ {cmd.command}` printed:\n{shown}")
                replacements.append((cmd.line + 1, cmd.line + 1 + len(cmd.expected), actual))
    if update and replacements:
        lines = page.split("\n")
        for first, after, new in sorted(replacements, reverse=True):
            lines[first - 1 : after - 1] = [x.rstrip() for x in new]
        path.write_text("\n".join(lines))
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--update", action="store_true", help="rewrite the outputs that drifted")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["COLUMNS"] = "100"
    page, workdir = args.page.resolve(), args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)  # and stay there: a background save of the page's may still be writing
    problems = run_page(page, workdir, args.update)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} command(s) printed something else than the page shows"
            + (
                " (rewritten)" if args.update else f"; to rewrite: python tests/docs_runner.py {args.page} --update ..."
            ),
            file=sys.stderr,
        )
    return 1 if problems and not args.update else 0


if __name__ == "__main__":
    sys.exit(main())
