"""Every example in the README and in docs/ runs as written, and every command's output is what the
page shows (tests/docs_runner.py: the conventions, and how to rewrite outputs that drifted)."""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import docs_runner
import pytest

import jaxckpt

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GOLDEN = Path(__file__).parent / "golden" / "foreign"
DOCS_BUCKET = "my-bucket"  # the bucket the pages use on the test's S3 server


def _foreign_fixtures(workdir: Path) -> None:
    """Other tools' checkpoints (tests/golden/foreign, written by their own libraries: see the scripts
    there), under the names the pages use."""
    shutil.copytree(GOLDEN / "tf/tf2/tf_ckpts", workdir / "tf_ckpts")
    (workdir / "estimator").mkdir()
    for f in (GOLDEN / "tf/tf1").glob("model.ckpt-42.*"):
        shutil.copy(f, workdir / "estimator" / f.name)
    shutil.copytree(GOLDEN / "orbax/run", workdir / "orbax_run")
    migration = GOLDEN / "orbax_migration"
    shutil.copytree(migration / "trainstate_adam", workdir / "orbax_trainstate")
    shutil.copytree(migration / "nnx_state", workdir / "orbax_nnx")
    shutil.copytree(migration / "grain_iter", workdir / "orbax_grain_run")
    shutil.copy(GOLDEN / "msgpack/params.msgpack", workdir / "params.msgpack")
    shutil.copy(GOLDEN / "safetensors/model.safetensors", workdir / "model.safetensors")


def _s3_bucket(env: dict[str, str]) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{env['AWS_ENDPOINT_URL']}/{DOCS_BUCKET}", method="PUT"), timeout=10)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_examples_run(page: Path, tmp_path, request):
    text = page.read_text()
    wanted = docs_runner.needs(text)
    unknown = wanted - {"s3", "fixtures"}
    assert not unknown, f"{page.name} needs {sorted(unknown)}, which tests/test_docs.py does not provide"
    if not any(not b.skip for b in docs_runner.blocks(text)):
        pytest.skip(f"{page.name} has no examples")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STORAGE_EMULATOR"))}
    if "s3" in wanted:
        s3 = request.getfixturevalue("s3_server")
        _s3_bucket(s3)
        env.update(s3)
    if "fixtures" in wanted:
        _foreign_fixtures(workdir)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "docs_runner.py"), str(page), "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, f"{page.relative_to(ROOT)}:\n{done.stdout}\n{done.stderr}"


def test_runner_reads_blocks_markers_and_outputs():
    page = (
        "<!-- docs: needs s3, fixtures -->\n"
        "```python\nx = 1\n```\n"
        "<!-- docs: skip (a real bucket) -->\n"
        "```python\nraise SystemExit\n```\n"
        "```console\n$ jaxckpt --version\njaxckpt ...\n$ echo\n\n```\n"
    )
    found = docs_runner.blocks(page)
    assert [(b.kind, b.skip) for b in found] == [("python", False), ("python", True), ("console", False)]
    assert docs_runner.needs(page) == {"s3", "fixtures"}
    cmds = docs_runner.commands(found[2])
    assert [c.command for c in cmds] == ["jaxckpt --version", "echo"]
    assert docs_runner.matches(cmds[0].expected, ["jaxckpt 0.9.0"])
    assert not docs_runner.matches(cmds[0].expected, ["something else"])
    assert not docs_runner.matches(cmds[0].expected, ["jaxckpt 0.9.0", "and more"])
    # Decimal numbers match within 0.1%, columns may shift with their width; integers match exactly.
    assert docs_runner.matches(["* ckpt-5  50  3.2 KiB  loss=8.12855"], ["* ckpt-5  50  3.2 KiB  loss=8.1286"])
    assert docs_runner.matches(["mean   3.52238"], ["mean     3.5224"])
    assert not docs_runner.matches(["mean   3.52238"], ["mean   3.6"])
    assert not docs_runner.matches(["bytes 448..468"], ["bytes 448..469"])
    # A date and time matches any other, so listings with save times do not drift.
    assert docs_runner.matches(
        ["  ckpt-3  30  2026-11-26 15:46:28  3.1 KiB"], ["  ckpt-3  30  2027-01-02 03:04:05  3.1 KiB"]
    )
    assert not docs_runner.matches(
        ["  ckpt-3  30  2026-11-26 15:46:28  3.1 KiB"], ["  ckpt-3  31  2027-01-02 03:04:05  3.1 KiB"]
    )


def test_update_rewrites_drifted_output(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```console\n$ python -c \"print('new')\"\nold\n```\n\nMore text.\n")
    assert docs_runner.run_page(page, tmp_path / "w", update=False)
    docs_runner.run_page(page, tmp_path / "w", update=True)
    assert page.read_text() == "Text.\n\n```console\n$ python -c \"print('new')\"\nnew\n```\n\nMore text.\n"
    assert docs_runner.run_page(page, tmp_path / "w", update=False) == []


AUTODOC = re.compile(r"^\.\. auto(?:function|class|exception|data|method|attribute)::\s+jaxckpt\.(\w+)\s*$", re.M)


def test_api_reference_lists_every_public_name_once():
    found = collections.Counter(AUTODOC.findall((ROOT / "docs" / "api.md").read_text()))
    assert {name for name, n in found.items() if n > 1} == set(), "listed more than once"
    assert set(jaxckpt.__all__) - set(found) == set(), "public names missing from docs/api.md"
    assert set(found) - set(jaxckpt.__all__) == set(), "docs/api.md documents names that are not public"


def _sphinx(src: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    cmd = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-n", "-q", "-b", "dummy", str(src), str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_api_reference_builds_strictly_with_every_member(tmp_path):
    """The site builds with no warning (``make docs`` builds it as HTML), and docs/conf.py's check that
    every public name and every public member of a public class has an entry fails when one has not."""
    pytest.importorskip("sphinx", reason="the docs extra (pip install -e '.[docs]') builds the site")
    done = _sphinx(ROOT / "docs", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "docs" / "conf.py", src / "conf.py")
    (src / "index.md").write_text("# jaxckpt\n\n```{toctree}\napi\n```\n")
    api = (ROOT / "docs" / "api.md").read_text()
    without = api.replace(
        ".. autoclass:: jaxckpt.CheckpointManager\n",
        ".. autoclass:: jaxckpt.CheckpointManager\n   :exclude-members: all_steps\n",
    )
    assert without != api
    (src / "api.md").write_text(without.replace(".. autofunction:: jaxckpt.save\n", ""))
    done = _sphinx(src, tmp_path / "less")
    assert done.returncode != 0
    assert "jaxckpt.save is not in the API reference" in done.stderr
    assert "jaxckpt.CheckpointManager.all_steps is not in the API reference" in done.stderr


def test_readme_is_a_front_door():
    """At most 12 KB, and every page it links into exists (GitHub renders these links; Sphinx never sees them)."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    links = re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme)
    assert links and all((ROOT / link).exists() for link in links), [
        link for link in links if not (ROOT / link).exists()
    ]
