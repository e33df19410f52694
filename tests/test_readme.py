"""The README's Quick start runs as written (in a fresh folder)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_quick_start_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", _section("Quick start"), flags=re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    net, jaxckpt = namespace["net"], namespace["jaxckpt"]
    assert sorted(k for k, _ in jaxckpt.list_variables("state_checkpoint")) == ["l1/bias", "l1/kernel"]
    assert sorted(k for k, _ in jaxckpt.list_variables("pure_checkpoint")) == ["l1/bias", "l1/kernel"]
    assert type(net).__name__ == "Net" and net.l1.kernel[...].shape == (1, 5)


def test_other_libraries_section_runs(tmp_path, monkeypatch):
    """The section on TensorFlow, Orbax, Flax and Hugging Face checkpoints, on the golden fixtures
    copied to the names it uses."""
    import shutil

    golden = Path(__file__).parent / "golden" / "foreign"
    shutil.copytree(golden / "tf/tf2/tf_ckpts", tmp_path / "tf_ckpts")
    (tmp_path / "estimator").mkdir()
    for f in (golden / "tf/tf1").glob("model.ckpt-42.*"):
        shutil.copy(f, tmp_path / "estimator" / f.name)
    shutil.copytree(golden / "orbax/run", tmp_path / "orbax_run")
    shutil.copy(golden / "msgpack/params.msgpack", tmp_path / "params.msgpack")
    shutil.copy(golden / "safetensors/model.safetensors", tmp_path / "model.safetensors")
    blocks = re.findall(
        r"```python\n(.*?)```", _section("Checkpoints from TensorFlow, Orbax, Flax and Hugging Face"), flags=re.S
    )
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    q = namespace["weights"]["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert q.shape == (4, 4) and q.dtype == "float32"
    assert namespace["tree"]["params"]["dense"]["kernel"].shape == (8, 16)
