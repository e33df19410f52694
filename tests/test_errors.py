"""Bad input gets a clear error naming what and where; damage is never returned as data."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.arrays import store_write


def _rewrite_index(path, edit):
    """Apply ``edit`` to the parsed index and store it with a valid checksum (a crafted index)."""
    index_file = Path(path) / "index.json"
    body = json.loads(index_file.read_text())
    body.pop("checksum")
    edit(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    body["checksum"] = f"crc32:{zlib.crc32(canonical):08x}"
    index_file.write_text(json.dumps(body))


def _data_files(path):
    return sorted(p for p in (Path(path) / "data").rglob("*") if p.is_file() and "manifest" not in p.name)


def test_missing_path(tmp_path):
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="does not exist"):
        jaxckpt.restore(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        jaxckpt.list_variables(tmp_path / "nope")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("hi")
    (tmp_path / "file").write_text("x")
    with pytest.raises(jaxckpt.NotACheckpointError, match=r"no index\.json") as e:
        jaxckpt.restore(tmp_path / "dir")
    # restore takes a manager's directory itself: the message says what one would hold, and does not
    # tell the user to pass one of its checkpoints.
    assert "pass one of its checkpoints" not in str(e.value)
    assert "state file ('checkpoint')" in str(e.value)
    with pytest.raises(jaxckpt.NotACheckpointError, match="is a file"):
        jaxckpt.load_variable(tmp_path / "file", "a")
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "index.json").write_text('{"hello": 1}')
    with pytest.raises(jaxckpt.CheckpointFormatError, match="not a jaxckpt index"):
        jaxckpt.restore(tmp_path / "fake")


def test_unsupported_leaf_names_key_and_type(tmp_path):
    with pytest.raises(jaxckpt.UnsupportedValueError, match=r"'model/act'.*builtin_function_or_method"):
        jaxckpt.save(tmp_path / "c", {"model": {"act": max}})
    with pytest.raises(jaxckpt.UnsupportedValueError, match=r"'x'.*dtype object"):
        jaxckpt.save(tmp_path / "c", {"x": np.array([object()])})
    with pytest.raises(jaxckpt.UnsupportedValueError, match="template"):
        jaxckpt.save(tmp_path / "c", {"x": jax_sds()})
    assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []


def jax_sds():
    import jax

    return jax.ShapeDtypeStruct((2,), jnp.float32)


def test_state_that_is_not_json(tmp_path):
    class Bad:
        def get_state(self):
            return {"when": object()}

        def set_state(self, state):
            pass

    with pytest.raises(jaxckpt.UnsupportedValueError, match=r"'it'.*not JSON"):
        jaxckpt.save(tmp_path / "c", {"it": Bad()})


def test_shape_and_dtype_mismatch_name_key_expected_and_found(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"net": {"w": jnp.full((1, 5), 0.5)}, "step": 3, "n": np.arange(3)})
    with pytest.raises(jaxckpt.MismatchError, match=r"'net/w'.*float32 array of shape \(1, 5\).*shape \(2, 5\)"):
        jaxckpt.restore(path, like={"net": {"w": jnp.ones((2, 5))}, "step": 0, "n": np.arange(3)})
    with pytest.raises(jaxckpt.MismatchError, match=r"'net/w' as int32.*not whole numbers \(such as 0\.5\)"):
        jaxckpt.restore(path, like={"net": {"w": jnp.ones((1, 5), jnp.int32)}, "step": 0, "n": np.arange(3)})
    with pytest.raises(jaxckpt.MismatchError, match=r"'n'.*expects a float32 array.*across kinds"):
        jaxckpt.restore(path, like={"net": {"w": jnp.ones((1, 5))}, "step": 0, "n": np.zeros(3, np.float32)})
    with pytest.raises(jaxckpt.MismatchError, match=r"'step'.*Python int \(3\).*Python str"):
        jaxckpt.restore(path, like={"net": {"w": jnp.ones((1, 5))}, "step": "x", "n": np.arange(3)})


def test_save_refuses_to_overwrite_unless_asked(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"a": 1})
    with pytest.raises(jaxckpt.CheckpointExistsError, match="overwrite=True"):
        jaxckpt.save(path, {"a": 2})
    assert jaxckpt.restore(path) == {"a": 1}
    jaxckpt.save(path, {"a": 2}, overwrite=True)
    assert jaxckpt.restore(path) == {"a": 2}
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "precious.txt").write_text("keep me")
    with pytest.raises(jaxckpt.CheckpointExistsError, match="not a jaxckpt checkpoint"):
        jaxckpt.save(tmp_path / "user", {"a": 1}, overwrite=True)
    assert (tmp_path / "user" / "precious.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    def boom(self):
        raise OSError("disk full")

    monkeypatch.setattr(store_write.Writer, "flush", boom)
    with pytest.raises(OSError, match="disk full"):
        jaxckpt.save(tmp_path / "c", {"a": jnp.ones(3)})
    assert list(tmp_path.iterdir()) == []


def test_killed_save_leaves_no_checkpoint(tmp_path):
    """SIGKILL in the middle of a save: nothing appears at the path; the old checkpoint still restores."""
    old = jaxckpt.save(tmp_path / "old", {"a": np.arange(3)})
    script = textwrap.dedent(
        f"""
        import os, signal, numpy as np, jaxckpt
        from jaxckpt.arrays import store_write
        real = store_write.Writer.flush
        def commit_then_die(self):
            real(self)  # data durable, index not yet written: the worst instant
            os.kill(os.getpid(), signal.SIGKILL)
        store_write.Writer.flush = commit_then_die
        jaxckpt.save({str(tmp_path / "new")!r}, {{"a": np.ones((600, 600), np.float32)}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert not (tmp_path / "new").exists()
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(tmp_path / "new")
    assert jaxckpt.restore(old)["a"].tolist() == [0, 1, 2]
    jaxckpt.save(tmp_path / "new", {"a": 1})  # the leftover does not block the next save
    assert jaxckpt.restore(tmp_path / "new") == {"a": 1}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "own-array"])
def test_bit_flip_in_data_is_detected_and_names_the_key(tmp_path, monkeypatch, packed):
    if not packed:
        monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", -1)
    victim = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    path = jaxckpt.save(tmp_path / "c", {"fine": np.arange(4.0), "victim": victim})
    needle = victim.tobytes()[1000:1064]
    for f in _data_files(path):
        raw = bytearray(f.read_bytes())
        at = raw.find(needle)
        if at >= 0:
            raw[at + 7] ^= 0x10
            f.write_bytes(bytes(raw))
            break
    else:
        pytest.fail("array bytes not found in the data files")
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="'victim'"):
        jaxckpt.restore(path)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="'victim'"):
        jaxckpt.load_variable(path, "victim")
    np.testing.assert_array_equal(jaxckpt.load_variable(path, "fine"), np.arange(4.0))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "own-array"])
def test_truncated_data_is_detected(tmp_path, monkeypatch, packed):
    if not packed:
        monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", -1)
    path = jaxckpt.save(tmp_path / "c", {"x": np.random.default_rng(0).standard_normal(20000).astype(np.float32)})
    biggest = max(_data_files(path), key=lambda f: f.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    with pytest.raises(jaxckpt.CheckpointCorruptedError):
        jaxckpt.restore(path)


def test_damaged_index_is_detected(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"shape_here": np.zeros((2, 3))})
    index = Path(path) / "index.json"
    text = index.read_text()
    index.write_text(text.replace("[\n    2,", "[\n    9,", 1) if "[\n    2," in text else text.replace("2", "9", 1))
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="checksum"):
        jaxckpt.restore(path)
    index.write_bytes(b'{"format": "jaxckpt", "vers')
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="not valid JSON"):
        jaxckpt.restore(path)


def test_newer_format_version_is_refused(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"a": 1})
    _rewrite_index(path, lambda body: body.update(version=jaxckpt.FORMAT_VERSION + 1))
    with pytest.raises(jaxckpt.UnsupportedVersionError, match="Upgrade jaxckpt"):
        jaxckpt.restore(path)


@pytest.mark.parametrize(
    "at",
    [{"array": "../../../etc/passwd", "stored": "float32"}, {"array": "/abs", "stored": "float32"},
     {"array": "a/0/../../x", "stored": "float32"}, {"array": "a/0\u0000", "stored": "float32"}],
)  # fmt: skip
def test_crafted_index_cannot_name_files_outside(tmp_path, monkeypatch, at):
    monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", -1)
    path = jaxckpt.save(tmp_path / "c", {"x": np.ones(3, np.float32)})
    _rewrite_index(path, lambda body: body["leaves"]["x"].update(at=at))
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"'x'.*array path"):
        jaxckpt.restore(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b["leaves"]["x"].update(dtype="object"), "unsupported dtype"),
        (lambda b: b["leaves"]["x"].update(shape=[10**12]), "cannot hold shape"),
        (lambda b: b["leaves"]["x"].update(shape=[-1]), "non-negative"),
        (lambda b: b["leaves"]["x"]["at"].update(offset=10**9), "outside pack"),
        (lambda b: b["nodes"][""].update(keys=["x", "ghost"]), "no entry"),
        (lambda b: b["leaves"].update(orphan={"type": "int", "value": 1}), "not reachable"),
        (lambda b: b["nodes"][""].update(kind="exec"), "unknown node kind"),
        (lambda b: b["leaves"]["x"].update(type="pickle"), "unknown leaf type"),
        (lambda b: b.update(packs=[{"path": "../p", "nbytes": 16}]), "pack path"),
    ],
)
def test_crafted_index_fields_are_rejected(tmp_path, edit, message):
    path = jaxckpt.save(tmp_path / "c", {"x": np.ones(3, np.float32)})
    _rewrite_index(path, edit)
    with pytest.raises(jaxckpt.CheckpointFormatError, match=message):
        jaxckpt.restore(path)


def test_index_inconsistent_with_stored_array(tmp_path, monkeypatch):
    monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", -1)
    path = jaxckpt.save(tmp_path / "c", {"x": np.ones(3, np.float32), "y": np.ones(4, np.float32)})
    own_at = json.loads((Path(path) / "index.json").read_text())["leaves"]["x"]["at"]
    assert own_at["array"] == "a/0"
    # x pointed at y's array: its zarr.json (format version 4) is checked against what x's index entry implies.
    _rewrite_index(path, lambda b: b["leaves"]["x"].update(at={**b["leaves"]["y"]["at"], "chunks": [3]}))
    differs = r"its zarr\.json does not match the index: its 'shape' is \[4\], where the index implies \[3\]"
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=rf"'x' \(array 'a/1' in the checkpoint\): {differs}"):
        jaxckpt.restore(path)
    # y's own shard shape [4] is a padded shard for x (allowed in version 4): still the zarr.json check.
    _rewrite_index(path, lambda b: b["leaves"]["x"].update(at=b["leaves"]["y"]["at"]))
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=rf"'x' \(array 'a/1' in the checkpoint\): {differs}"):
        jaxckpt.restore(path)
    # x's own array, with another shard shape in the index: the chunk grid differs.
    _rewrite_index(path, lambda b: b["leaves"]["x"].update(at={**own_at, "chunks": [2]}))
    with pytest.raises(
        jaxckpt.CheckpointCorruptedError,
        match=r"'x' \(array 'a/0' in the checkpoint\): its zarr\.json does not match the index: its 'chunk_grid' is "
        r".*\[3\].*where the index implies .*\[2\]",
    ):
        jaxckpt.restore(path)
    # The shard shape recorded in the index must fit the array it describes (padded by less than a shard).
    _rewrite_index(path, lambda b: b["leaves"]["x"].update(at={**own_at, "chunks": [8]}))
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"'x'.*shard shape \[8\] does not fit shape \(3,\)"):
        jaxckpt.restore(path)


def test_errors_share_one_root(tmp_path):
    for name in jaxckpt.__all__:
        obj = getattr(jaxckpt, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, jaxckpt.JaxckptError), name
    assert os.path.exists(tmp_path)


def test_overwrite_swaps_in_one_step_on_linux(tmp_path, monkeypatch):
    """Replacing a checkpoint never leaves the path empty: the folders are exchanged atomically."""
    path = jaxckpt.save(tmp_path / "c", {"a": 1})
    real_rename = os.rename

    def guarded_rename(src, dst):
        assert Path(src) != Path(path), "the old checkpoint was moved aside: a window with no checkpoint"
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", guarded_rename)
    jaxckpt.save(path, {"a": 2}, overwrite=True)
    assert jaxckpt.restore(path) == {"a": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_load_variable_of_a_missing_key_says_how_to_list_the_keys(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"net": {"kernel": np.ones(2, np.float32)}})
    with pytest.raises(jaxckpt.MissingKeyError) as e:
        jaxckpt.load_variable(path, "q")  # nothing close to it: say how to see what there is
    assert "'q'" in str(e.value) and "jaxckpt.list_variables" in str(e.value) and "jaxckpt ls" in str(e.value)
    with pytest.raises(jaxckpt.MissingKeyError, match="Did you mean 'net/kernel'"):
        jaxckpt.load_variable(path, "net/kernal")
