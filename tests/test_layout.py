"""The house rules of jaxckpt/, checked: no module reaching for another's private names
(``from jaxckpt.a.b import _name`` or ``b._name``): what a module shares, it names without an
underscore; no import loop; and a module past 550 lines is a smell (two jobs in one file), not a
reason for a file of its own. Which layer may import which is import-linter's contract in
pyproject.toml (``make lint``), which ``tests/test_architecture_page.py`` holds the docs against."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxckpt"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 550


def _module_names() -> set[str]:
    return {p.stem for p in MODULES} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_stays_within_550_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines; split it by job (see docs/architecture.md)"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_uses_another_modules_private_names(path):
    tree = ast.parse(path.read_text())
    modules = _module_names()
    aliases: set[str] = set()  # names bound to jaxckpt modules here (`from jaxckpt.storage import locations`)
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


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The jaxckpt modules that ``path`` imports, function-level imports and those under
    ``if TYPE_CHECKING:`` included (a loop there is a loop for a reader too).
    ``from jaxckpt.a.b import name`` is an import of ``jaxckpt.a.b``, and ``from jaxckpt.a import b``
    of ``jaxckpt.a.b`` where that is a module."""
    name = _module_of(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            for a in node.names:
                found.add(f"{module}.{a.name}" if f"{module}.{a.name}" in known else module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name}


def test_the_modules_import_one_another_without_a_cycle():
    """Imports run one way (README, Layout of the code): a cycle, even through an import inside a
    function, means two modules that cannot be read, tested or changed apart."""
    known = {_module_of(p) for p in MODULES}
    graph = {_module_of(p): _imports(p, known) for p in MODULES}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(module: str) -> None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                cycles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported not in state:
                walk(imported)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module)
    assert not cycles, "import cycles: " + "; ".join(cycles)
