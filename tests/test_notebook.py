"""colab/checkpoints.ipynb runs end to end on CPU, and shows what its text says it shows."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOK = Path(__file__).resolve().parents[1] / "colab" / "checkpoints.ipynb"


def _text(output) -> str:
    """The text of a stream, result or display output."""
    if output.output_type == "stream":
        return output.text
    data = output.get("data", {})
    return data.get("text/plain", "")


def _execute(workdir: Path):
    """The notebook, executed in ``workdir`` (it writes its checkpoints there), with its outputs."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this process's environment: JAX on CPU, as tests/conftest.py sets it. Less
    # JAXCKPT_PIP, which would make the first cell install over .venv's jaxckpt.
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("JAXCKPT_PIP", raising=False)
        client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    return nb


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook, executed in a fresh folder, with its outputs; and the folder."""
    workdir = tmp_path_factory.mktemp("notebook")
    return _execute(workdir), workdir


def _cell(nb, source_fragment: str):
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and source_fragment in c.source]
    return cell


def _all_text(cell) -> str:
    return "".join(_text(o) for o in cell.outputs)


def _assert_clean(nb):
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    # No warnings either: deprecations, unused restore values, fork-in-a-threaded-process...
    stderr = [o.text for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("name") == "stderr"]
    assert not stderr


def test_notebook_runs_without_errors_and_writes_checkpoints(executed):
    nb, workdir = executed
    _assert_clean(nb)
    assert sorted(p.name for p in (workdir / "ckpts").iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-10",
        "ckpt-8",
        "ckpt-9",
    ]
    state = json.loads((workdir / "ckpts" / "checkpoint").read_text())
    assert [c["step"] for c in state["checkpoints"]] == [80, 90, 100]
    assert (workdir / "easy_checkpoint" / "index.json").is_file()


def _install_cell(nb):
    return next(c for c in nb.cells if c.cell_type == "code")


def test_install_cell_does_nothing_where_jaxckpt_is_installed(executed):
    nb, _ = executed
    assert _install_cell(nb).outputs == []


JAXCKPT_PYPROJECT = '[project]\nname = "jaxckpt"\n'


@pytest.mark.parametrize(
    ("pip_env", "pyproject", "installed", "expected"),
    [
        # JAXCKPT_PIP first, even where jaxckpt is installed (a wheel uploaded to a Colab session)
        ("/content/jaxckpt-0.2.0-py3-none-any.whl", JAXCKPT_PYPROJECT, True, "/content/jaxckpt-0.2.0-py3-none-any.whl"),
        # in a checkout (the notebook in its colab/ folder): the checkout, with the flax extra
        (None, JAXCKPT_PYPROJECT, False, "{checkout}[flax]"),
        # beside another project, or anywhere else: the package index
        (None, '[project]\nname = "other"\n', False, "jaxckpt[flax]"),
        (None, None, False, "jaxckpt[flax]"),
        # installed already (the repository's .venv): nothing
        (None, JAXCKPT_PYPROJECT, True, None),
    ],
)  # fmt: skip
def test_install_cell_installs_in_order_of_preference(tmp_path, monkeypatch, pip_env, pyproject, installed, expected):
    from IPython.core.inputtransformer2 import TransformerManager

    code = TransformerManager().transform_cell(_install_cell(nbformat.read(NOTEBOOK, as_version=4)).source)
    (tmp_path / "colab").mkdir()
    if pyproject is not None:
        (tmp_path / "pyproject.toml").write_text(pyproject)
    monkeypatch.chdir(tmp_path / "colab")
    if pip_env is None:
        monkeypatch.delenv("JAXCKPT_PIP", raising=False)
    else:
        monkeypatch.setenv("JAXCKPT_PIP", pip_env)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: find_spec(name, *a) if installed or name != "jaxckpt" else None
    )
    magics = []
    namespace = {}

    class Shell:  # what get_ipython() gives: records the %pip line, with {requirement} expanded
        def run_line_magic(self, magic, line):
            magics.append((magic, line.format_map(namespace)))

    namespace["get_ipython"] = Shell
    exec(code, namespace)
    wanted = None if expected is None else expected.format(checkout=tmp_path)
    assert magics == ([] if wanted is None else [("pip", f'install -q "{wanted}"')])


def test_training_restarts_where_it_left_off(executed):
    nb, _ = executed
    first = _all_text(_cell(nb, "def train_and_checkpoint"))
    assert first.startswith("Initializing from scratch.")
    assert "Saved checkpoint for step 10: ./ckpts/ckpt-1" in first
    restart = _all_text(_cell(nb, "manager.close()"))
    assert restart.startswith("Restored from ./ckpts/ckpt-5")
    assert "Saved checkpoint for step 100: ./ckpts/ckpt-10" in restart
    assert "step 100, data position 99" in restart
    kept = _all_text(_cell(nb, "print(manager.checkpoints)"))
    assert kept.strip() == "['./ckpts/ckpt-8', './ckpts/ckpt-9', './ckpts/ckpt-10']"
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", first + restart)]
    assert len(losses) == 10 and losses[-1] < losses[0]


def test_inspect_displays_an_html_tree(executed):
    nb, _ = executed
    (shown,) = [o for o in _cell(nb, "jaxckpt.inspect(manager.latest_checkpoint)").outputs if "data" in o]
    html = shown["data"]["text/html"]
    assert "<details" in html and "opt_state/0" in html and "float32 (1, 5)" in html
    assert "└── " in shown["data"]["text/plain"]  # the terminal tree, for plain frontends
    mu = _all_text(_cell(nb, '"optimizer/**/mu/**"'))
    assert "bias" in mu and "nu" not in mu.split("\n", 1)[1]


def test_partial_and_delayed_restores(executed):
    nb, _ = executed
    partial = _all_text(_cell(nb, "fake_layer = jaxckpt.Checkpoint(bias=to_restore)"))
    zeros, restored = partial.strip().split("\n", 1)
    assert zeros == "[0. 0. 0. 0. 0.]" and restored.startswith("[") and restored != zeros
    consumed = _all_text(_cell(nb, "status.assert_consumed()"))
    assert "did not match one to one" in consumed and "found no object" in consumed
    delayed = _all_text(_cell(nb, "fake_layer.kernel = delayed_restore"))
    assert delayed.startswith("[[0. 0. 0. 0. 0.]]") and "matched" in delayed
    listed = _all_text(_cell(nb, "restore.listed = [jnp.array(0.0)]"))
    assert "Array(1." in listed


def test_cli_cells_print_what_the_guide_says(executed):
    nb, _ = executed
    ls = _all_text(_cell(nb, 'jaxckpt_command("ls"'))
    assert "CHECKPOINT" in ls and "* ckpt-10" in ls
    show_verify = _all_text(_cell(nb, 'jaxckpt_command("show"'))
    assert "dtype        float32" in show_verify and show_verify.count("OK ") == 3
    variables = _all_text(_cell(nb, "jaxckpt.list_variables("))
    assert "('net/l1/kernel', (1, 5))" in variables


def test_coming_from_orbax_restores_into_abstract_models(executed):
    nb, workdir = executed
    steps = _all_text(_cell(nb, "mngr.save(step=step)"))
    assert "[5, 10] 10" in steps
    assert "ShapeDtypeStruct" in _all_text(_cell(nb, 'jaxckpt.save("orbax_style/state", state)'))
    assert sorted(p.name for p in (workdir / "orbax_style" / "ckpts").iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-10",
        "ckpt-5",
    ]


def test_notebook_runs_again_in_the_same_folder(executed):
    """Run from the top a second time where it ran already (the first run's files are there), it
    starts from a clean slate and prints what it printed the first time."""
    first, workdir = executed
    again = _execute(workdir)
    _assert_clean(again)
    for fragment in [
        "def train_and_checkpoint",
        "manager.close()",
        "print(manager.checkpoints)",
        "mngr.save(step=step)",
    ]:
        assert _all_text(_cell(again, fragment)) == _all_text(_cell(first, fragment)), fragment
    assert _all_text(_cell(again, "save.save(")) == _all_text(_cell(first, "save.save("))
