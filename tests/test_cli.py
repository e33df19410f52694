"""The jaxckpt command: ls, show, diff, verify, their exit statuses and error messages."""

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.tools import cli as _cli
from jaxckpt.tools import scan

RNG = np.random.default_rng(0)
KERNEL = RNG.standard_normal((4, 3)).astype(np.float32)
MU = RNG.standard_normal((4, 3)).astype(np.float32)


class Position:
    """A data iterator's position, saved through get_state / set_state."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_state(self) -> dict:
        return {"position": self.n}

    def set_state(self, state: dict) -> None:
        self.n = state["position"]


def _state(kernel=KERNEL, step=3):
    return {
        "params": {"dense": {"kernel": kernel, "bias": np.zeros(3, np.float32)}},
        "optimizer": {"opt_state": [{"mu": {"dense": {"kernel": MU}}, "count": np.int32(step)}]},
        "step": step,
        "data": Position(30),
    }


def run(capsys, *argv):
    """``jaxckpt ARGV`` in this process: (exit status, stdout, stderr)."""
    code = _cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def flip_byte(path, needle: bytes) -> None:
    """Flip one bit inside the stored bytes ``needle`` (data files hold array bytes uncompressed)."""
    for f in sorted(p for p in (Path(path) / "data").rglob("*") if p.is_file()):
        raw = bytearray(f.read_bytes())
        at = raw.find(needle)
        if at >= 0:
            raw[at + len(needle) // 2] ^= 0x10
            f.write_bytes(bytes(raw))
            return
    pytest.fail("array bytes not found in the data files")


@pytest.fixture
def ckpt(tmp_path):
    return jaxckpt.save(tmp_path / "ckpt-3", _state())


# --- ls ----------------------------------------------------------------------------------------


def test_ls_checkpoint_prints_the_tree(capsys, ckpt):
    code, out, err = run(capsys, "ls", ckpt)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(str(ckpt))
    assert any("kernel" in line and "float32" in line and "(4, 3)" in line and "48 B" in line for line in lines)
    assert any("opt_state/0" in line for line in lines)
    assert lines[-1] == "6 values: 4 arrays (112 B), 2 Python values"


def test_ls_json_parses_and_lists_every_value(capsys, ckpt):
    code, out, _ = run(capsys, "ls", "--json", ckpt)
    doc = json.loads(out)
    assert code == 0 and doc["kind"] == "checkpoint" and doc["values"] == 6
    assert sorted(leaf["key"] for leaf in doc["leaves"]) == [k for k, _ in jaxckpt.list_variables(ckpt)]
    state = next(leaf for leaf in doc["leaves"] if leaf["key"] == "data")
    assert state == {"key": "data", "type": "state", "value": {"position": 30}}


def test_ls_filters_with_globs(capsys, ckpt):
    code, out, _ = run(capsys, "ls", "--json", ckpt, "optimizer/**/mu/**")
    assert code == 0
    assert [leaf["key"] for leaf in json.loads(out)["leaves"]] == ["optimizer/opt_state/0/mu/dense/kernel"]
    code, out, _ = run(capsys, "ls", "--flat", ckpt, "*/*/kernel", "step")
    assert code == 0
    assert out.splitlines() == ["params/dense/kernel\tfloat32\t(4, 3)\t48", "step\tint\t3\t0"]
    code, out, err = run(capsys, "ls", ckpt, "nothing/**")
    assert code == 1 and "no key matches 'nothing/**'" in err


def test_ls_manager_directory_lists_checkpoints(capsys, tmp_path):
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(4, np.float32))
    directory = tmp_path / "ckpts"
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=3, step_counter="step") as manager:
        for step in range(10, 60, 10):
            ckpt.step = step
            manager.save(metrics={"loss": 100.0 / step})
    code, out, err = run(capsys, "ls", directory)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "3 checkpoints, latest ckpt-5" in lines[0]
    assert lines[1].split() == ["CHECKPOINT", "STEP", "SAVED", "SIZE", "METRICS"]
    assert [line.split()[0] for line in lines[2:]] == ["ckpt-3", "ckpt-4", "*"]
    assert lines[-1].split()[1:3] == ["ckpt-5", "50"] and "loss=2" in lines[-1]
    code, out, _ = run(capsys, "ls", "--json", directory)
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [30, 40, 50]
    assert doc["checkpoints"][-1]["metrics"] == {"loss": 2.0}
    code, _, err = run(capsys, "ls", directory, "w")
    assert code == 2 and "manager's directory" in err and "ckpt-5" in err


# --- show --------------------------------------------------------------------------------------


def test_show_prints_stats_and_values(capsys, ckpt):
    code, out, _ = run(capsys, "show", ckpt, "params/dense/kernel")
    assert code == 0
    rows = dict(line.split(None, 1) for line in out.splitlines() if line and not line.startswith(" "))
    assert rows["dtype"] == "float32" and rows["shape"] == "(4, 3), 12 elements"
    assert float(rows["min"]) == pytest.approx(KERNEL.min(), rel=1e-5)
    assert float(rows["max"]) == pytest.approx(KERNEL.max(), rel=1e-5)
    assert float(rows["mean"]) == pytest.approx(KERNEL.mean(), rel=1e-5)
    assert float(rows["std"]) == pytest.approx(KERNEL.std(), rel=1e-5)
    assert float(rows["norm"]) == pytest.approx(np.linalg.norm(KERNEL), rel=1e-5)
    assert rows["nan"] == "0" and rows["inf"] == "0"
    assert "values" in rows  # small: printed whole

    code, out, _ = run(capsys, "show", "--json", ckpt, "params/dense/kernel")
    doc = json.loads(out)
    np.testing.assert_allclose(np.array(doc["first_values"]), KERNEL)
    assert doc["stats"]["size"] == 12 and doc["sharding"] is None


def test_show_python_values_states_and_nodes(capsys, ckpt):
    code, out, _ = run(capsys, "show", ckpt, "step")
    assert code == 0 and out.splitlines()[-1].split() == ["value", "3"]
    code, out, _ = run(capsys, "show", "--json", ckpt, "step")
    assert json.loads(out) == {"key": "step", "type": "int", "value": 3}
    code, out, _ = run(capsys, "show", ckpt, "data")
    assert "object state" in out and '"position": 30' in out
    code, out, _ = run(capsys, "show", ckpt, "params")
    assert code == 0 and "'params' is a node" in out and "kernel" in out


def test_show_nan_inf_and_sharding(capsys, tmp_path, small_packs):
    x = RNG.standard_normal((64, 8)).astype(np.float32)
    x[1, 1], x[2, 2], x[3, 3] = np.nan, np.inf, -np.inf
    mesh = jax.make_mesh((8,), ("d",))
    sharded = jax.device_put(jnp.asarray(x), jax.sharding.NamedSharding(mesh, jax.P("d")))
    path = jaxckpt.save(tmp_path / "c", {"x": sharded})
    code, out, _ = run(capsys, "show", "--json", path, "x", "--values", "5")
    assert code == 0
    doc = json.loads(out)
    finite = x[np.isfinite(x)].astype(np.float64)
    stats = doc["stats"]
    assert (stats["nan"], stats["inf"], stats["finite"]) == (1, 2, 509)
    assert stats["mean"] == pytest.approx(finite.mean()) and stats["std"] == pytest.approx(finite.std())
    assert stats["min"] == pytest.approx(finite.min()) and stats["norm"] == pytest.approx(np.linalg.norm(finite))
    assert doc["first_values"] == pytest.approx(x.reshape(-1)[:5].tolist())
    assert "NamedSharding" in doc["sharding"]
    code, out, _ = run(capsys, "show", path, "x", "--values", "5")
    assert code == 0 and "(of the 509 finite values)" in out and "first 5" in out
    assert run(capsys, "show", path, "x", "--values", "-1")[0] == 2


def test_stats_added_in_parts_equal_stats_of_the_whole():
    x = (RNG.standard_normal(10_000) * 3 + 1e4).astype(np.float64)  # a large mean: naive formulas cancel
    whole, parts = scan.Stats(), scan.Stats()
    whole.add(x)
    for part in np.array_split(x, 7):
        parts.add(part)
    a, b = whole.to_json(), parts.to_json()
    assert a["min"] == b["min"] and a["max"] == b["max"] and a["size"] == b["size"] == 10_000
    for name in ("mean", "std", "norm"):
        assert a[name] == pytest.approx(b[name], rel=1e-12)
    assert a["std"] == pytest.approx(x.std(), rel=1e-12)
    ints = scan.Stats()
    ints.add(np.array([2**62, -(2**62), 5], np.int64))
    assert ints.to_json()["max"] == 2**62 and ints.to_json()["min"] == -(2**62)  # exact


def test_show_prng_keys_and_bfloat16(capsys, tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"key": jax.random.key(0), "h": jnp.arange(4, dtype=jnp.bfloat16)})
    code, out, _ = run(capsys, "show", path, "key")
    assert code == 0 and "PRNG key array (threefry2x32)" in out and "min" not in out
    code, out, _ = run(capsys, "show", "--json", path, "h")
    doc = json.loads(out)
    assert doc["dtype"] == "bfloat16" and doc["first_values"] == [0.0, 1.0, 2.0, 3.0]
    assert doc["stats"]["mean"] == 1.5


def test_show_wrong_key_suggests_close_ones(capsys, ckpt):
    code, out, err = run(capsys, "show", ckpt, "params/dense/kernl")
    assert code == 1 and out == ""
    assert err.startswith("jaxckpt: error: ") and "Did you mean 'params/dense/kernel'" in err


# --- diff --------------------------------------------------------------------------------------


def test_diff_identical_checkpoints_exit_0(capsys, tmp_path, ckpt):
    other = jaxckpt.save(tmp_path / "again", _state())
    code, out, _ = run(capsys, "diff", ckpt, other)
    assert code == 0 and out.splitlines()[-1].endswith("6 identical")


def test_diff_reports_added_removed_changed_and_max_abs_difference(capsys, tmp_path, ckpt):
    state = _state(kernel=KERNEL + np.float32(0.5), step=4)
    state["params"]["dense"]["bias"] = np.zeros(5, np.float32)  # changed shape
    del state["data"]
    state["extra"] = np.ones(2)
    other = jaxckpt.save(tmp_path / "ckpt-4", state)
    code, out, _ = run(capsys, "diff", ckpt, other)
    assert code == 1
    lines = out.splitlines()
    assert lines[:2] == [f"--- {ckpt}", f"+++ {other}"]
    marks = {line.split()[1]: line for line in lines[2:-1]}
    assert marks["data"].startswith("- ")
    assert marks["extra"].startswith("+ ")
    assert marks["params/dense/bias"].startswith("~ ") and "float32 (3,) -> float32 (5,)" in marks["params/dense/bias"]
    assert marks["params/dense/kernel"].startswith("! ") and "max |a - b| = 0.5" in marks["params/dense/kernel"]
    assert "3 -> 4" in marks["step"]
    assert "optimizer/opt_state/0/mu/dense/kernel" not in marks  # identical: counted, not listed

    code, out, _ = run(capsys, "diff", "--json", ckpt, other)
    doc = json.loads(out)
    assert code == 1 and not doc["identical"]
    assert doc["added"] == ["extra"] and doc["removed"] == ["data"]
    kernel = next(d for d in doc["different"] if d["key"] == "params/dense/kernel")
    assert kernel["max_abs_diff"] == pytest.approx(0.5)
    assert doc["same"] == ["optimizer/opt_state/0/mu/dense/kernel"]

    code, out, _ = run(capsys, "diff", "--atol", "0.6", ckpt, other, "params/dense/kernel")
    assert code == 0 and "1 identical" in out


def test_diff_counts_nan_equal_to_nan(capsys, tmp_path):
    x = np.array([1.0, np.nan, np.inf], np.float32)
    a = jaxckpt.save(tmp_path / "a", {"x": x})
    b = jaxckpt.save(tmp_path / "b", {"x": x.copy()})
    assert run(capsys, "diff", a, b)[0] == 0
    c = jaxckpt.save(tmp_path / "c", {"x": np.array([1.0, 2.0, np.inf], np.float32)})
    code, out, _ = run(capsys, "diff", a, c)
    assert code == 1 and "max |a - b| = nan" in out


def test_diff_error_exits_2(capsys, tmp_path, ckpt):
    code, out, err = run(capsys, "diff", ckpt, tmp_path / "missing")
    assert code == 2 and out == "" and err.startswith("jaxckpt: error: No checkpoint at")


# --- verify ------------------------------------------------------------------------------------


def test_verify_ok(capsys, ckpt):
    code, out, err = run(capsys, "verify", ckpt)
    assert code == 0 and err == ""
    assert out.startswith(f"OK       {ckpt}: 6 values, 112 B read, every checksum matches")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "own-array"])
def test_verify_finds_a_flipped_bit_and_names_the_key(capsys, tmp_path, monkeypatch, packed):
    if not packed:
        monkeypatch.setattr(jaxckpt.arrays.store_write, "PACK_LEAF_LIMIT", -1)
    victim = RNG.standard_normal(4096).astype(np.float32)
    path = jaxckpt.save(tmp_path / "c", {"fine": np.arange(4.0), "victim": victim})
    flip_byte(path, victim.tobytes()[1000:1064])
    code, out, err = run(capsys, "verify", path)
    assert code == 1
    assert out.splitlines()[0] == f"DAMAGED  {path}:" and out.splitlines()[1].startswith("  victim: ")
    assert "fine" not in out
    assert err == f"jaxckpt: error: damaged: {path} ('victim')\n"
    code, out, _ = run(capsys, "verify", "--json", path)
    (doc,) = json.loads(out)
    assert code == 1 and doc["ok"] is False and [d["key"] for d in doc["damaged"]] == ["victim"]


def test_verify_reads_in_batches(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(jaxckpt.arrays.store_write, "PACK_LEAF_LIMIT", 100)
    tree = {f"small{i}": np.full(4, i, np.float32) for i in range(6)}
    tree |= {f"big{i}": np.full(40, i, np.float32) for i in range(3)}
    path = jaxckpt.save(tmp_path / "c", tree)
    opened = jaxckpt.inspect(path)._opened
    groups = list(scan.batches(opened, list(tree), budget=40))
    assert sorted(k for g in groups for k in g) == sorted(tree)
    assert [len(g) for g in groups] == [2, 2, 2, 1, 1, 1]  # packed: 16 bytes each; arrays: 160 bytes alone
    monkeypatch.setattr(scan, "BATCH_BYTES", 40)
    flip_byte(path, np.full(40, 1, np.float32).tobytes()[:64])
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and [line.split(":")[0].strip() for line in out.splitlines()[1:]] == ["big1"]


def test_verify_manager_directory_checks_every_checkpoint(capsys, tmp_path):
    ckpt = jaxckpt.Checkpoint(w=RNG.standard_normal(512).astype(np.float32))
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "ckpts") as manager:
        manager.save()
        ckpt.w = ckpt.w + 1
        manager.save()
    code, out, _ = run(capsys, "verify", tmp_path / "ckpts")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["OK", "OK"]
    flip_byte(tmp_path / "ckpts" / "ckpt-2", np.asarray(ckpt.w).tobytes()[100:164])
    code, out, err = run(capsys, "verify", tmp_path / "ckpts")
    assert code == 1 and out.startswith("OK ") and "DAMAGED" in out and "ckpt-2 ('w')" in err


def test_damaged_index_is_reported(capsys, ckpt):
    index = Path(ckpt) / "index.json"
    index.write_bytes(index.read_bytes().replace(b'"step"', b'"stop"', 1))
    code, out, err = run(capsys, "verify", ckpt)
    assert code == 1 and "(index): " in out and "fails its checksum" in out
    code, out, err = run(capsys, "ls", ckpt)
    assert code == 1 and out == "" and "fails its checksum" in err


# --- errors and usage --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["ls", "show", "verify"])
def test_wrong_path_is_one_line_without_traceback(capsys, tmp_path, command):
    argv = [command, tmp_path / "nope"] + (["k"] if command == "show" else [])
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    assert err == f"jaxckpt: error: No checkpoint at {str(tmp_path / 'nope')!r}: the path does not exist.\n"


def test_not_a_checkpoint_directory(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "ls", tmp_path / "empty")
    assert code == 1 and err.startswith("jaxckpt: error: ") and "has no index.json" in err
    assert len(err.splitlines()) == 1
    jaxckpt.save(tmp_path / "runs" / "ckpt-1", {"a": 1})
    jaxckpt.save(tmp_path / "runs" / "ckpt-2", {"a": 2})
    code, _, err = run(capsys, "verify", tmp_path / "runs")
    assert code == 1 and "it holds checkpoints: ckpt-1, ckpt-2" in err


def test_usage_errors_exit_2(capsys):
    assert run(capsys, "ls")[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "Exit status" in out


def test_python_dash_m_and_console_script(tmp_path, ckpt):
    result = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "ls", "--json", ckpt], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["values"] == 6
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}  # a terminal that cannot draw box characters
    result = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "ls", ckpt], capture_output=True, text=True, check=False, env=env
    )
    assert result.returncode == 0 and "|-- " in result.stdout, result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "verify", tmp_path / "nope"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("jaxckpt: error: No checkpoint at")
    (script,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "jaxckpt"]
    assert script.value == "jaxckpt.tools.cli:main"


def test_ls_manager_directory_shows_the_run_metadata(capsys, tmp_path):
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(4, np.float32))
    directory = tmp_path / "ckpts"
    with jaxckpt.CheckpointManager(ckpt, directory, metadata={"model": "mlp", "lr": 0.001}) as manager:
        manager.save(step=10)
    code, out, err = run(capsys, "ls", directory)
    assert code == 0 and err == ""
    assert out.splitlines()[1] == '  metadata: {"model": "mlp", "lr": 0.001}'
    code, out, _ = run(capsys, "ls", "--json", directory)
    assert json.loads(out)["metadata"] == {"model": "mlp", "lr": 0.001}


def test_ls_lists_the_checkpoints_of_a_run_whose_metadata_file_is_damaged(capsys, tmp_path):
    """The run's metadata is an aside: a damaged checkpoint.metadata is named, and the checkpoints
    are still listed."""
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(4, np.float32))
    directory = tmp_path / "ckpts"
    with jaxckpt.CheckpointManager(ckpt, directory, metadata={"model": "mlp"}) as manager:
        manager.save(step=10)
    (directory / "checkpoint.metadata").write_text('{"format": "jaxckpt-run-metadata", "version": 1, "metadata": [')
    code, out, _ = run(capsys, "ls", directory)
    assert code == 0 and "ckpt-10" in out  # the checkpoints themselves are whole
    assert "metadata: damaged" in out and "checkpoint.metadata" in out
    code, out, _ = run(capsys, "ls", "--json", directory)
    assert code == 0
    listed = json.loads(out)
    assert [c["path"].rsplit("/", 1)[-1] for c in listed["checkpoints"]] == ["ckpt-10"]
    assert listed["metadata"] is None and "checkpoint.metadata" in listed["metadata_problem"]


# --- version and help --------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    from jaxckpt._version import __version__

    code, out, err = run(capsys, "--version")
    assert code == 0 and out == f"jaxckpt {__version__}\n" and err == ""
    result = subprocess.run([sys.executable, "-m", "jaxckpt", "--version"], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout == f"jaxckpt {__version__}\n", result.stderr


def test_every_subcommand_has_a_description_and_help(capsys):
    from jaxckpt.tools.cli_parser import parser

    (commands,) = [a for a in parser()._actions if a.dest == "command"]
    helps = {a.dest: a.help for a in commands._choices_actions}  # the one-line help in `jaxckpt --help`
    assert set(commands.choices) == {"ls", "show", "diff", "verify", "convert"}
    for name, sub in commands.choices.items():
        assert sub.description and sub.description.strip(), f"{name} has no description"
        assert helps[name] and helps[name].strip(), f"{name} has no help"
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
        code, out, _ = run(capsys, name, "--help")
        assert code == 0 and sub.description.split()[0] in out


# --- two tiers ---------------------------------------------------------------------------------


def test_ls_of_either_tier_lists_both_and_never_calls_a_full_tier_empty(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(4, np.float32))
    options = dict(max_to_keep=2, save_interval_steps=2, durable_interval_steps=4, step_counter="step")
    # Relative paths, as a training script gives them; ls runs from elsewhere.
    with jaxckpt.CheckpointManager(ckpt, "durable", local_directory="local", **options) as manager:
        for step in range(1, 13):
            ckpt.step = step
            manager.save(step=step)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for path, tier in [("../local", "local"), ("../durable", "durable"), (f"file://{tmp_path}/local", "local")]:
        code, out, err = run(capsys, "ls", path)
        assert code == 0 and err == ""
        assert "no checkpoints" not in out, out
        assert out.startswith(f"{path}  ({tier} tier of a two-tier"), out
        other = "durable" if tier == "local" else "local"
        assert f"{tmp_path / other}  ({other} tier of a two-tier" in out, out
        assert "ckpt-8" in out and "ckpt-10" in out  # durable holds 8, 12; local 10, 12
        doc = json.loads(run(capsys, "ls", "--json", path)[1])
        assert doc["tier"] == tier and [c["step"] for c in doc["other_tier"]["checkpoints"]] == (
            [8, 12] if tier == "local" else [10, 12]
        )


def test_ls_says_the_other_tier_has_no_checkpoints_only_when_it_has_none(capsys, tmp_path):
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(4, np.float32))
    with jaxckpt.CheckpointManager(ckpt, tmp_path / "durable", local_directory=tmp_path / "local") as manager:
        manager.save(step=1)  # the first save is copied to the durable tier too
    for name in ("ckpt-1", "checkpoint"):
        path = tmp_path / "durable" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    code, out, _ = run(capsys, "ls", tmp_path / "local")
    assert code == 0 and out.splitlines()[-1] == f"{tmp_path / 'durable'}  (the other tier: no checkpoints)"
    assert out.count("no checkpoints") == 1


# --- convert: names kept ----------------------------------------------------------------------


def _safetensors_names(path) -> list[str]:
    raw = Path(path).read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return sorted(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("source", ["golden", "slashes"])
def test_convert_safetensors_to_jaxckpt_and_back_keeps_names_byte_for_byte(capsys, tmp_path, source):
    from jaxckpt.interop import safetensors as sf

    if source == "golden":
        src = Path(__file__).parent / "golden" / "foreign" / "safetensors" / "model.safetensors"
    else:  # names as other tools write them: dots, slashes (TF/Keras-style), a tilde
        tensors = {
            "net.l1.bias": np.arange(3, dtype=np.float32),
            "net/l1/kernel": np.ones((2, 3), np.float32),
            "enc~0/w": np.full(2, 7, np.int32),
            "plain": np.zeros(1, np.float16),
        }
        src = tmp_path / "model.safetensors"
        sf.write(src, [(k, v.dtype, v.shape) for k, v in tensors.items()], tensors.__getitem__)
    names = _safetensors_names(src)
    assert run(capsys, "convert", src, tmp_path / "j")[0] == 0
    assert run(capsys, "convert", tmp_path / "j", tmp_path / "back.safetensors")[0] == 0
    assert _safetensors_names(tmp_path / "back.safetensors") == names
    for a, b in [
        (src, tmp_path / "j"),
        (src, tmp_path / "back.safetensors"),
        (tmp_path / "j", tmp_path / "back.safetensors"),
    ]:
        code, out, err = run(capsys, "diff", a, b)
        assert code == 0 and err == "", out
        assert out.splitlines()[-1].endswith(f"0 with different values, {len(names)} identical")


def test_convert_to_safetensors_refuses_two_keys_that_would_share_a_name(capsys, tmp_path):
    src = jaxckpt.save(tmp_path / "c", {"a/b": np.zeros(2, np.float32), "a": {"b": np.ones(2, np.float32)}})
    code, out, err = run(capsys, "convert", src, tmp_path / "m.safetensors")
    assert code == 1 and out == "" and "would both be the tensor 'a/b'" in err and "'a~1b'" in err
    assert not (tmp_path / "m.safetensors").exists()


# --- what the command takes ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["ls", "show", "diff", "verify", "convert"])
def test_not_a_checkpoint_says_what_the_command_takes(capsys, tmp_path, command):
    folder = tmp_path / "empty"
    folder.mkdir()
    extra = {"show": ["k"], "diff": [folder], "convert": [tmp_path / "out"]}.get(command, [])
    code, out, err = run(capsys, command, folder, *extra)
    assert code == (2 if command == "diff" else 1) and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"jaxckpt: error: {str(folder)!r} ")
    assert "pass one of its checkpoints" not in err  # the command takes a manager's directory itself
    for accepted in ("index.json", "manager's directory", "TensorFlow", "Orbax", "Flax msgpack", "safetensors"):
        assert accepted in err, (accepted, err)
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = run(capsys, command, tmp_path / "notes.txt", *extra)
    assert "manager's directory" in err and "pass one of its checkpoints" not in err


# --- object stores -------------------------------------------------------------------------------


def test_ls_of_a_manager_in_an_object_store_prints_every_size(capsys, tmp_path):
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(64, np.float32))
    run_dir = f"memory://cli-sizes-{tmp_path.name}"  # memory:// lives as long as the process: a fresh name
    with jaxckpt.CheckpointManager(ckpt, run_dir, max_to_keep=2) as manager:
        for step in (1, 2):
            manager.save(step=step)
    code, out, err = run(capsys, "ls", run_dir)
    assert code == 0 and err == ""
    assert "missing" not in out, out
    rows = out.splitlines()[2:]
    assert [row.split()[-1] for row in rows] == ["B", "B"] and all(int(row.split()[-2]) > 256 for row in rows), out
    doc = json.loads(run(capsys, "ls", "--json", run_dir)[1])
    assert [c["disk_bytes"] > 256 for c in doc["checkpoints"]] == [True, True]
    # a prefix that holds objects but no checkpoint: the command says what it takes
    code, _, err = run(capsys, "ls", f"{run_dir}/ckpt-1/data")
    assert code == 1 and "manager's directory" in err and "local paths only" in err, err
