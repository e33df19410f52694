"""The checkpoints users already have, through jaxckpt's public calls: TensorFlow (TF2 and TF1),
Orbax, Flax msgpack and safetensors golden fixtures (tests/golden/foreign, written by the real
libraries; see the make_*.py scripts there), compared with what those libraries read back.

The per-format tests (test_foreign_tf.py, test_foreign_orbax.py, test_foreign_msgpack_safetensors.py)
check each reader's parsing and damage detection; these check that every call takes every format.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jaxckpt
from jaxckpt.tools import convert as _convert
from jaxckpt.tools.cli import main

GOLDEN = Path(__file__).parent / "golden" / "foreign"
TF_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def _typed(array: np.ndarray, dtype: str | None) -> np.ndarray:
    """npz has no bfloat16: the writing scripts stored its bits, with the dtype in expected.json."""
    return array.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else array


def _tf(case: str, prefix: str) -> dict:
    folder = GOLDEN / "tf" / case
    stem = Path(prefix).name
    arrays = np.load(folder / f"{stem}.expected.npz", allow_pickle=False)
    dtypes = json.loads((folder / f"{stem}.expected.json").read_text())["dtypes"]
    return {
        k.removesuffix(TF_VALUE).replace("/.ATTRIBUTES/", "/"): _typed(arrays[k], dtypes.get(k)) for k in arrays.files
    }


def _tagged(fmt: str, fixture: str) -> dict:
    """Values from a format's expected.npz (``fixture:key``) and its expected.json's Python values."""
    arrays = np.load(GOLDEN / fmt / "expected.npz", allow_pickle=False)
    doc = json.loads((GOLDEN / fmt / "expected.json").read_text())
    entries = doc.get("fixtures", doc)[fixture]
    entries = entries.get("tensors", entries)
    out = {}
    for key, info in entries.items():
        if f"{fixture}:{key}" in arrays.files:
            out[key] = _typed(arrays[f"{fixture}:{key}"], info.get("dtype"))
        else:
            out[key] = info["value"]
    return out


CASES = {
    # name: (path under GOLDEN, format shown by ls, expected values by jaxckpt key)
    "tf2": ("tf/tf2/tf_ckpts/ckpt-5", "TensorFlow", lambda: _tf("tf2", "ckpt-5")),
    "tf1": ("tf/tf1/model.ckpt-42", "TensorFlow", lambda: _tf("tf1", "model.ckpt-42")),
    "orbax-standard": ("orbax/standard", "Orbax", lambda: _tagged("orbax", "standard")),
    "orbax-per-array": ("orbax/standard_no_ocdbt", "Orbax", lambda: _tagged("orbax", "standard_no_ocdbt")),
    "orbax-zarr3": ("orbax/zarr3", "Orbax", lambda: _tagged("orbax", "zarr3")),
    "orbax-pytree": ("orbax/pytree", "Orbax", lambda: _tagged("orbax", "pytree")),
    "orbax-step": ("orbax/run/30", "Orbax", lambda: _tagged("orbax", "run/30")),
    "msgpack": ("msgpack/params.msgpack", "msgpack", lambda: _tagged("msgpack", "params.msgpack")),
    "msgpack-legacy": ("msgpack/legacy/checkpoint_20", "msgpack", lambda: _tagged("msgpack", "legacy/checkpoint_20")),
    "safetensors": (
        "safetensors/model.safetensors",
        "safetensors",
        lambda: _tagged("safetensors", "model.safetensors"),
    ),
}


def _same(got, want, key):
    if isinstance(want, np.ndarray):
        got = np.asarray(got)
        assert got.dtype == want.dtype, key
        assert got.shape == want.shape, key
        bits = [np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in (got, want)]
        np.testing.assert_array_equal(*bits, err_msg=key)  # bit for bit
    else:
        assert got == want and type(got) is type(want), key


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}/{k}" if prefix else k))
        return out
    return {prefix: tree}


@pytest.fixture(params=sorted(CASES))
def case(request):
    path, fmt, expected = CASES[request.param]
    if not (GOLDEN / path).exists() and not (GOLDEN / (path + ".index")).exists():
        pytest.fail(f"missing golden fixture {path}")
    return str(GOLDEN / path), fmt, expected()


def test_every_call_reads_every_format(case):
    path, fmt, expected = case
    listed = dict(jaxckpt.list_variables(path))
    skipped = set(listed) - set(expected)
    assert set(expected) <= set(listed)
    notes = jaxckpt.inspect(path).skipped
    assert set(notes) == skipped
    assert all(what.split()[0] in ("DT_VARIANT", "DT_STRING") for what in notes.values()), notes  # TF's alone
    for key, want in expected.items():
        assert listed[key] == np.shape(want), key
        _same(jaxckpt.load_variable(path, key), want, key)
    restored = _flat(jaxckpt.restore(path))
    assert set(restored) == set(expected)
    for key, want in expected.items():
        _same(restored[key], want, key)
    view = jaxckpt.inspect(path)
    assert fmt in view.format and fmt in view.text()
    assert set(view.keys()) == set(expected)


def test_the_cli_lists_verifies_and_converts_every_format(case, tmp_path, capsys):
    path, fmt, expected = case
    assert main(["ls", path]) == 0
    assert fmt in capsys.readouterr().out
    assert main(["verify", path]) == 0
    assert main(["show", path, sorted(expected)[0]]) == 0
    assert main(["convert", path, str(tmp_path / "converted")]) == 0
    assert main(["verify", str(tmp_path / "converted")]) == 0
    converted = _flat(jaxckpt.restore(tmp_path / "converted"))
    assert set(converted) == set(expected)
    for key, want in expected.items():
        _same(converted[key], want, key)
    assert main(["diff", path, str(tmp_path / "converted")]) == 0  # same keys, same values


def test_latest_checkpoint_of_each_managers_directory():
    assert jaxckpt.latest_checkpoint(GOLDEN / "tf/tf2/tf_ckpts") == str(GOLDEN / "tf/tf2/tf_ckpts/ckpt-5")
    assert jaxckpt.latest_checkpoint(GOLDEN / "orbax/run") == str(GOLDEN / "orbax/run/30")
    assert jaxckpt.latest_checkpoint(GOLDEN / "msgpack/legacy") == str(GOLDEN / "msgpack/legacy/checkpoint_20")
    # and every reading call takes the directory as its latest checkpoint, as for jaxckpt's own
    assert jaxckpt.load_variable(GOLDEN / "tf/tf2/tf_ckpts", "step") == 50
    assert jaxckpt.load_variable(GOLDEN / "orbax/run", "meta/step") == 30
    assert jaxckpt.load_variable(GOLDEN / "msgpack/legacy", "step") == 20


def test_a_tensorflow_directory_is_not_taken_for_a_jaxckpt_managers(tmp_path, capsys):
    """TensorFlow's state file has jaxckpt's name (``checkpoint``): reading tools take the TF one
    for what it is, and a jaxckpt manager refuses to write over it."""
    tf_dir = tmp_path / "tf_ckpts"
    shutil.copytree(GOLDEN / "tf/tf2/tf_ckpts", tf_dir)
    assert main(["ls", str(tf_dir)]) == 0
    assert "ckpt-5" in capsys.readouterr().out
    before = (tf_dir / "checkpoint").read_bytes()
    with pytest.raises(jaxckpt.CheckpointFormatError, match="TensorFlow state file"):
        jaxckpt.CheckpointManager(jaxckpt.Checkpoint(w=jnp.zeros(2)), tf_dir)
    assert (tf_dir / "checkpoint").read_bytes() == before


def test_tf2_checkpoint_restores_into_a_checkpoint_graph_like_the_guides():
    """The guide's TF2 checkpoint, restored by edge names into jaxckpt.Checkpoint: the iterator's
    DT_VARIANT state is reported as skipped, and the status says so."""
    path = jaxckpt.latest_checkpoint(GOLDEN / "tf/tf2/tf_ckpts")
    expected = _tf("tf2", "ckpt-5")
    net = {"l1": {"_kernel": jnp.zeros((1, 5)), "bias": jnp.zeros(5)}}
    ckpt = jaxckpt.Checkpoint(step=0, net=net)
    status = ckpt.restore(path)
    assert ckpt.step == 50
    np.testing.assert_array_equal(ckpt.net["l1"]["_kernel"], expected["net/l1/_kernel"])
    assert isinstance(ckpt.net["l1"]["_kernel"], jax.Array)
    assert status.skipped_keys == ["iterator/ITERATOR_STATE"]
    status.assert_existing_objects_matched()
    assert "optimizer/_variables/2" in status.unused_keys
    status.expect_partial()
    with pytest.raises(jaxckpt.UnsupportedValueError, match=r"DT_VARIANT.*no numpy form"):
        jaxckpt.load_variable(path, "iterator/ITERATOR_STATE")


def test_orbax_sharded_on_8_devices_restores_on_1_and_onto_a_mesh():
    path = GOLDEN / "orbax/standard"
    expected = _tagged("orbax", "standard")
    kernel = expected["params/dense/kernel"]
    one = jaxckpt.restore(
        path, like={"params": {"dense": {"kernel": jax.ShapeDtypeStruct(kernel.shape, kernel.dtype)}}}, partial=True
    )
    assert one["params"]["dense"]["kernel"].sharding.device_set == {jax.devices()[0]}
    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    like = {"params": {"dense": {"kernel": jax.ShapeDtypeStruct(kernel.shape, kernel.dtype, sharding=sharding)}}}
    out = jaxckpt.restore(path, like=like, partial=True)["params"]["dense"]["kernel"]
    assert out.sharding == sharding
    np.testing.assert_array_equal(out, kernel)


def test_hugging_face_safetensors_into_an_nnx_module_with_key_map(tmp_path):
    """The one call of the issue: rename torch-style names, transpose (out, in) weights, cast."""
    from flax import nnx

    expected = _tagged("safetensors", "model.safetensors")

    class Attn(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = nnx.Linear(4, 4, use_bias=False, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed_tokens = nnx.Embed(5, 4, rngs=rngs)
            self.attn = Attn(rngs)

    def hf_to_nnx(key, value):
        if key == "model.embed_tokens.weight":
            return "embed_tokens/embedding", value
        if key.endswith("q_proj.weight"):  # torch Linear (out, in) -> NNX kernel (in, out)
            return "attn/q_proj/kernel", value.T.astype(np.float32)
        return None

    model = Model(nnx.Rngs(0))
    jaxckpt.restore(GOLDEN / "safetensors/model.safetensors", like=model, key_map=hf_to_nnx, partial=True)
    np.testing.assert_array_equal(model.embed_tokens.embedding[...], expected["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        model.attn.q_proj.kernel[...], expected["model.layers.0.self_attn.q_proj.weight"].T.astype(np.float32)
    )
    status = jaxckpt.Checkpoint(model=model).restore(
        GOLDEN / "safetensors/model.safetensors",
        key_map=lambda k, v: ("model/" + hf_to_nnx(k, v)[0], hf_to_nnx(k, v)[1]) if hf_to_nnx(k, v) else None,
    )
    assert sorted(status.dropped_keys) == [
        "model.layers.0.input_layernorm.position_ids",
        "model.layers.0.mlp.up_proj.weight",
    ]
    status.assert_consumed()


def test_a_jaxckpt_checkpoint_out_to_safetensors_and_back_keeps_bfloat16(tmp_path):
    tree = {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3), "h": np.ones(2, np.float16)}
    src = jaxckpt.save(tmp_path / "c", tree)
    _convert.convert(src, tmp_path / "m.safetensors")
    back = jaxckpt.restore(tmp_path / "m.safetensors")
    assert back["w"].dtype == jnp.bfloat16 and back["h"].dtype == np.float16
    np.testing.assert_array_equal(back["w"], np.asarray(tree["w"]))


def test_a_folder_that_is_no_checkpoint_names_what_jaxckpt_reads(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(jaxckpt.NotACheckpointError, match=r"TensorFlow.*Orbax.*safetensors"):
        jaxckpt.restore(tmp_path / "empty")
