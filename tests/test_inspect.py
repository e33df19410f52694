"""jaxckpt.inspect: the text tree, the HTML display (escaped), patterns, manager directories, progress."""

import io
import json

import jax
import numpy as np
import pytest

import jaxckpt
from jaxckpt.tools.describe import key_matcher
from jaxckpt.tools.progress import Progress, human_bytes


def _tree():
    return {
        "params": {"dense": {"kernel": np.ones((4, 3), np.float32), "bias": np.zeros(3, np.float32)}},
        "opt": {"mu": {"dense": {"kernel": np.zeros((4, 3), np.float32)}}, "count": np.int32(7)},
        "step": 12,
        "name": "run-1",
    }


@pytest.fixture
def ckpt(tmp_path):
    return jaxckpt.save(tmp_path / "c", _tree())


def test_text_tree_lists_keys_dtypes_shapes_sizes_and_totals(ckpt):
    view = jaxckpt.inspect(ckpt)
    assert isinstance(view, jaxckpt.CheckpointView)
    text = repr(view)
    lines = text.splitlines()
    assert lines[0].startswith(str(ckpt)) and "written by jaxckpt" in lines[0]
    kernel = next(line for line in lines if "kernel" in line and "(4, 3)" in line)
    assert "float32" in kernel and "48 B" in kernel
    assert any("step" in line and "12" in line for line in lines)
    assert any('"run-1"' in line for line in lines)
    assert "├── " in text and "└── " in text
    assert "params/dense" in text  # a chain of single-child nodes is one row
    assert lines[-1] == "6 values: 4 arrays (112 B), 2 Python values"
    assert view.keys() == [
        "params/dense/kernel",
        "params/dense/bias",
        "opt/mu/dense/kernel",
        "opt/count",
        "step",
        "name",
    ]
    assert view.nbytes == 112 and len(view) == 6
    ascii_text = view.text(ascii=True)
    assert "|-- " in ascii_text and "├" not in ascii_text


def test_values_are_read_on_demand(ckpt):
    view = jaxckpt.inspect(ckpt)
    np.testing.assert_array_equal(view["params/dense/kernel"], np.ones((4, 3)))
    assert view["name"] == "run-1"
    with pytest.raises(jaxckpt.MissingKeyError, match="Did you mean"):
        view["params/dense/kernl"]


def test_patterns_double_star_spans_edges_single_star_stays_in_one():
    match = key_matcher(["optimizer/**/mu/**"])
    assert match("optimizer/opt_state/0/mu/l1/kernel")
    assert match("optimizer/mu/kernel")  # ** matches no edge too
    assert not match("optimizer/opt_state/0/nu/l1/kernel")
    one = key_matcher(["net/*/kernel"])
    assert one("net/l1/kernel") and not one("net/a/b/kernel")
    assert key_matcher(["**/bias"])("net/l1/bias") and key_matcher(["**/bias"])("bias")
    assert key_matcher(["net/l?"])("net/l1") and not key_matcher(["net/l?"])("net/l12")
    assert key_matcher([]) is None


def test_filtered_view_keeps_matching_keys_and_their_subtrees(ckpt):
    mu = jaxckpt.inspect(ckpt, "opt/**/mu/**")
    assert mu.keys() == ["opt/mu/dense/kernel"]
    assert "matching 'opt/**/mu/**', of 6 in all" in repr(mu)
    assert "bias" not in repr(mu)
    params = jaxckpt.inspect(ckpt, "params")  # a plain key selects its subtree
    assert params.keys() == ["params/dense/kernel", "params/dense/bias"]
    kernels = jaxckpt.inspect(ckpt).filter("**/kernel", "step")
    assert kernels.keys() == ["params/dense/kernel", "opt/mu/dense/kernel", "step"]
    assert jaxckpt.inspect(ckpt, "nothing/*").keys() == []


def test_html_is_a_collapsible_tree_and_escapes_keys_and_values(tmp_path):
    tree = {
        "<script>alert(1)</script>": np.zeros(3, np.float32),
        "a&b": {"title": "<b>bold</b>"},
        "big": {f"w{i}": np.zeros(2) for i in range(80)},
        "small": {"x": np.zeros(2)},
    }
    path = jaxckpt.save(tmp_path / "c", tree)
    page = jaxckpt.inspect(path)._repr_html_()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;~1script&gt;" in page  # "/" is escaped "~1"
    assert "<b>bold</b>" not in page and "&lt;b&gt;bold&lt;/b&gt;" in page
    assert "a&amp;b" in page
    assert "<details><summary><span class='jx-key'>big</span>" in page  # 80 values: starts folded
    assert "<details open><summary><span class='jx-key'>small</span>" in page
    assert "float32 (3,) · 12 B" in page


def test_root_leaf_and_unprintable_keys(tmp_path):
    root = jaxckpt.save(tmp_path / "root", np.arange(3))
    assert "(root)" in repr(jaxckpt.inspect(root))
    odd = jaxckpt.save(tmp_path / "odd", {"line\nbreak": 1, "a/b": 2})
    text = repr(jaxckpt.inspect(odd))
    assert "line\\nbreak" in text and "a~1b" in text
    assert len(text.splitlines()) == 4


def test_to_json_and_abstract_tree(ckpt, tmp_path):
    doc = jaxckpt.inspect(ckpt).to_json()
    json.dumps(doc, allow_nan=False)
    assert doc["kind"] == "checkpoint" and doc["values"] == 6 and doc["nbytes"] == 112
    by_key = {leaf["key"]: leaf for leaf in doc["leaves"]}
    assert by_key["params/dense/kernel"] == {
        "key": "params/dense/kernel",
        "type": "array",
        "dtype": "float32",
        "shape": [4, 3],
        "nbytes": 48,
        "container": "numpy",
        "sharding": None,
    }
    assert by_key["name"] == {"key": "name", "type": "str", "value": "run-1"}
    nan = jaxckpt.save(tmp_path / "nan", {"x": float("nan")})
    assert jaxckpt.inspect(nan).to_json()["leaves"][0]["value"] == "nan"

    arrays = jaxckpt.save(tmp_path / "arrays", {"a": np.ones((2, 2), np.float32), "k": jax.random.key(1)})
    abstract = jaxckpt.inspect(arrays).abstract_tree()
    assert abstract["a"] == jax.ShapeDtypeStruct((2, 2), np.float32)
    assert abstract["k"].shape == () and jax.dtypes.issubdtype(abstract["k"].dtype, jax.dtypes.prng_key)
    restored = jaxckpt.restore(arrays, like={"a": abstract["a"]}, partial=True)
    assert isinstance(restored["a"], jax.Array)
    np.testing.assert_array_equal(restored["a"], np.ones((2, 2)))


class FakeClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def test_manager_directory_lists_its_checkpoints(tmp_path):
    clock = FakeClock()
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros((8, 8), np.float32))
    directory = tmp_path / "ckpts"
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=2, step_counter="step", clock=clock) as manager:
        for step in (10, 20, 30):
            ckpt.step = step
            clock.now += 60
            manager.save(metrics={"loss": 1.0 / step})
    view = jaxckpt.inspect(directory)
    assert isinstance(view, jaxckpt.ManagerView) and len(view) == 2
    text = repr(view)
    assert "2 checkpoints, latest ckpt-3" in text
    rows = text.splitlines()[2:]
    assert rows[0].startswith("  ckpt-2") and " 20 " in rows[0] and "loss=0.05" in rows[0]
    assert rows[1].startswith("* ckpt-3") and "loss=0.0333333" in rows[1] and "KiB" in rows[1]
    doc = view.to_json()
    assert [c["name"] for c in doc["checkpoints"]] == ["ckpt-2", "ckpt-3"]
    assert doc["checkpoints"][1]["step"] == 30 and doc["checkpoints"][1]["time"] == 1_700_000_180.0
    assert doc["checkpoints"][1]["disk_bytes"] > 256
    assert doc["latest"].endswith("ckpt-3")
    page = view._repr_html_()
    assert "<table>" in page and "ckpt-3" in page and "latest:" in page
    assert view.latest.keys() == ["step", "w", "save_counter"]
    with pytest.raises(ValueError, match="manager's directory"):
        jaxckpt.inspect(directory, "w")


def test_progress_draws_only_on_a_terminal():
    assert human_bytes(0) == "0 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(3 << 30) == "3.0 GiB"

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    quiet = io.StringIO()
    with Progress(100, "verify", stream=quiet, delay=0) as bar:
        bar.update(50)
    assert quiet.getvalue() == "" and not bar.enabled and bar.done == 50

    tty = Tty()
    with Progress(1000, "verify x", stream=tty, delay=0) as bar:
        bar.update(500)
        bar._bar.refresh()  # tqdm redraws at most ten times a second; draw now
        assert "verify x" in tty.getvalue() and "50%" in tty.getvalue()
    assert tty.getvalue().endswith("\r")  # erased when done (leave=False)


def test_a_filtered_views_abstract_tree_holds_only_the_selected_keys(tmp_path):
    tree = {**_tree(), "layers": [np.ones(2, np.float32), np.ones(3, np.float32), np.ones(4, np.float32)]}
    path = jaxckpt.save(tmp_path / "c", tree)
    mu = jaxckpt.inspect(path).filter("opt/**/mu/**")
    assert mu.abstract_tree() == {"opt": {"mu": {"dense": {"kernel": jax.ShapeDtypeStruct((4, 3), np.float32)}}}}
    # A list that keeps every element stays a list; one that lost some becomes a dict by index.
    assert jaxckpt.inspect(path, "layers").abstract_tree() == {
        "layers": [jax.ShapeDtypeStruct((n,), np.float32) for n in (2, 3, 4)]
    }
    assert jaxckpt.inspect(path, "layers/2", "step").abstract_tree() == {
        "layers": {2: jax.ShapeDtypeStruct((4,), np.float32)},
        "step": 12,
    }
    assert jaxckpt.inspect(path, "nothing").abstract_tree() == {}
    assert jaxckpt.inspect(path).abstract_tree()["layers"][0].shape == (2,)  # unfiltered: as saved
