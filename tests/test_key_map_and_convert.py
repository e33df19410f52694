"""``key_map`` on restore (rename, transpose, cast, drop) and ``jaxckpt convert`` (streaming, verifiable),
on jaxckpt's own checkpoints; tests/test_foreign.py does the same on other libraries' files."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.arrays import store_write
from jaxckpt.tools import convert as _convert
from jaxckpt.tools.cli import main


def _tree():
    return {
        "dense": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)},
        "step": 7,
        "key": jax.random.key(3),
        "notes": ["x", None, 1.5],
    }


def test_key_map_renames_transposes_casts_and_drops(tmp_path):
    path = jaxckpt.save(tmp_path / "c", _tree())
    seen = []

    def key_map(key, value):
        seen.append(key)
        if key.startswith("notes"):
            return None
        if key == "dense/w":
            return "layer/kernel", value.T.astype(np.float16)
        return key.replace("dense/", "layer/"), value

    out = jaxckpt.restore(path, key_map=key_map)
    assert sorted(seen) == sorted(jaxckpt.inspect(path).keys())  # every value, once
    assert out["layer"]["kernel"].dtype == np.float16 and out["layer"]["kernel"].shape == (3, 2)
    np.testing.assert_array_equal(out["layer"]["kernel"], _tree()["dense"]["w"].T)
    assert out["step"] == 7 and "notes" not in out
    assert jnp.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(3)))


def test_key_map_into_a_template_with_a_status(tmp_path):
    path = jaxckpt.save(tmp_path / "c", _tree())
    target = {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(3), "extra": jnp.full(2, 5.0)}
    ckpt = jaxckpt.Checkpoint(layer=target)

    def key_map(key, value):
        if key == "dense/w":
            return "layer/kernel", value.T
        if key == "dense/b":
            return "layer/bias", value
        return None

    status = ckpt.restore(path, key_map=key_map)
    assert status.mapped_keys == {"dense/w": "layer/kernel", "dense/b": "layer/bias"}
    assert sorted(status.dropped_keys) == sorted(["step", "key", "notes/0", "notes/1", "notes/2"])
    assert status.missing_keys == ["layer/extra"]
    assert isinstance(ckpt.layer["kernel"], jax.Array)
    np.testing.assert_array_equal(ckpt.layer["kernel"], _tree()["dense"]["w"].T)
    with pytest.raises(jaxckpt.RestoreAssertionError, match="layer/extra"):
        status.assert_existing_objects_matched()
    # restore with like= and partial: unmatched leaves keep their values
    out = jaxckpt.restore(
        path, like=target, key_map=lambda k, v: ("kernel", v.T) if k == "dense/w" else None, partial=True
    )
    np.testing.assert_array_equal(out["extra"], np.full(2, 5.0))
    np.testing.assert_array_equal(out["kernel"], _tree()["dense"]["w"].T)


def test_a_wrong_shape_after_key_map_names_the_key(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"w": np.zeros((2, 3), np.float32)})
    with pytest.raises(jaxckpt.MismatchError, match=r"'w'.*shape"):
        jaxckpt.restore(path, like={"w": np.zeros((2, 3), np.float32)}, key_map=lambda k, v: (k, v.T))


@pytest.mark.parametrize(
    ("result", "error", "match"),
    [
        (("", 1), TypeError, "non-empty str key"),
        ("w", TypeError, "must return"),
        ((1, 2), TypeError, "must return"),
    ],
)
def test_key_map_that_returns_nonsense_is_refused(tmp_path, result, error, match):
    path = jaxckpt.save(tmp_path / "c", {"w": np.zeros(2)})
    with pytest.raises(error, match=match):
        jaxckpt.restore(path, key_map=lambda k, v: result)


def test_key_map_that_maps_two_keys_to_one_is_refused(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"a": np.zeros(2), "b": np.ones(2)})
    with pytest.raises(ValueError, match="both 'a' and 'b' to 'x'"):
        jaxckpt.restore(path, key_map=lambda k, v: ("x", v))


def test_convert_round_trips_and_verifies(tmp_path, capsys):
    src = jaxckpt.save(tmp_path / "c", _tree())
    assert main(["convert", src, str(tmp_path / "d")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "d")]) == 0
    a, b = jaxckpt.restore(src), jaxckpt.restore(tmp_path / "d")
    np.testing.assert_array_equal(a["dense"]["w"], b["dense"]["w"])
    assert b["notes"] == ["x", None, 1.5] and b["step"] == 7
    assert jnp.array_equal(jax.random.key_data(a["key"]), jax.random.key_data(b["key"]))
    # an existing destination is refused, and --overwrite replaces it
    assert main(["convert", src, str(tmp_path / "d")]) == 1
    assert "exists" in capsys.readouterr().err
    assert main(["convert", src, str(tmp_path / "d"), "--overwrite"]) == 0


def test_convert_holds_about_one_array_at_a_time(tmp_path, monkeypatch):
    """Arrays are read as the writer reaches them, and written out once the held bytes pass the
    budget: the flushes come between reads, not after all of them."""
    arrays = {f"a{i}": np.full(64 << 10, i, np.float32) for i in range(6)}  # 256 KiB each, none packed
    src = jaxckpt.save(tmp_path / "c", arrays)
    events = []
    flush = store_write.Writer.flush

    def recording_flush(self, *args, **kwargs):
        events.append("flush")
        return flush(self, *args, **kwargs)

    monkeypatch.setattr(store_write.Writer, "flush", recording_flush)
    monkeypatch.setattr(_convert, "BUDGET", 300 << 10)  # a little over one array
    _convert.convert(src, tmp_path / "d", on_read=lambda n: events.append("read"))
    reads_before_first_flush = events.index("flush")
    assert reads_before_first_flush <= 2, events
    assert events.count("flush") >= 3, events
    out = jaxckpt.restore(tmp_path / "d")
    for k, v in arrays.items():
        np.testing.assert_array_equal(out[k], v)


def test_convert_to_safetensors_and_back(tmp_path):
    src = jaxckpt.save(tmp_path / "c", _tree())
    dst = str(tmp_path / "m.safetensors")
    result = _convert.convert(src, dst)
    assert set(result.left_out) == {"notes/0", "notes/1"}  # a str and a None: not tensors
    back = jaxckpt.restore(dst)
    np.testing.assert_array_equal(back["dense/w"], _tree()["dense"]["w"])
    assert back["step"] == 7 and back["notes/2"] == 1.5
    np.testing.assert_array_equal(back["key"], jax.random.key_data(jax.random.key(3)))
    with pytest.raises(jaxckpt.CheckpointExistsError):
        _convert.convert(src, dst)


def test_convert_of_something_that_is_no_checkpoint_fails_clearly(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["convert", str(tmp_path / "notes.txt"), str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "notes.txt" in err and "error" in err
    assert not (tmp_path / "d").exists()
