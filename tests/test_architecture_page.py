"""docs/architecture.md tells the truth about the package's layout: its layer list is import-linter's
contract in pyproject.toml (the source of truth, which `make lint` holds the imports to), and its
module table names every module of every layer, each in the folder where it lives."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "architecture.md").read_text()
PACKAGE = ROOT / "jaxckpt"


def _contract_layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    assert layers["containers"] == ["jaxckpt"]
    return [sorted(name.strip() for name in layer.split("|")) for layer in layers["layers"]]


def _page_layers() -> list[list[str]]:
    block = PAGE.split("<!-- layers:", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        found = re.match(r"^ (\S+(?: \| \S+)*)(?:\s{2,}|$)", line)
        if found and (found.group(1).endswith("/") or found.group(1).endswith(".py")):
            names = [n.strip().removesuffix("/").removesuffix(".py") for n in found.group(1).split("|")]
            out.append(sorted(names))
    return out


def test_the_pages_layers_are_the_import_contracts():
    assert _page_layers() == _contract_layers()


def test_every_folder_is_a_layer_and_the_top_level_holds_only_the_shared_modules():
    layered = {name for layer in _contract_layers() for name in layer}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert folders | modules == layered
    assert modules == {"_errors", "_gc_pause", "_version"}


def _table() -> dict[str, set[str]]:
    """The module table's files, by folder (``shared`` for the top level)."""
    table = PAGE.split("### Modules", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    folder = None
    for row in table.splitlines():
        heading = re.match(r"^\| \*\*(\S+?)/?\*\* \|", row)
        if heading:
            folder = heading.group(1)
            out[folder] = set()
        elif row.startswith("| `") and folder is not None:
            out[folder] |= set(re.findall(r"`([\w.]+\.py)`", row.split(" | ")[0]))
    return out


def test_the_module_table_names_every_module_where_it_lives():
    actual = {
        p.name: {f.name for f in p.glob("*.py") if f.name != "__init__.py"}
        for p in PACKAGE.iterdir()
        if p.is_dir() and (p / "__init__.py").exists()
    }
    actual["shared"] = {"_errors.py", "_gc_pause.py", "_version.py"}
    assert _table() == actual


def test_each_folder_says_its_job_and_what_it_may_use():
    for init in PACKAGE.glob("*/__init__.py"):
        text = init.read_text()
        assert text.startswith('"""') and len(text) > 200, f"{init.parent.name}/__init__.py says too little"
        assert "May use" in text or "may use" in text, f"{init.parent.name}/__init__.py: what may it use?"
