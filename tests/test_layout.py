"""The house rules of jaxckpt/, checked: each module within 500 lines, and no module reaching for
another's private names (``from jaxckpt._x import _name`` or ``_x._name``): what a module shares,
it names without an underscore."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxckpt"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 500


def _module_names() -> set[str]:
    return {p.stem for p in MODULES} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_stays_within_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines; split it by job (see docs/architecture.md)"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_uses_another_modules_private_names(path):
    tree = ast.parse(path.read_text())
    modules = _module_names()
    aliases: set[str] = set()  # names bound to jaxckpt modules here (`from jaxckpt import _storage`)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxckpt"):
            for a in node.names:
                if a.name in modules:
                    aliases.add(a.asname or a.name)
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in modules
        ):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not found, f"{path.name} uses private names of other modules: " + "; ".join(found)
