"""Reading Orbax checkpoints without Orbax: golden fixtures that Orbax 0.12.8 wrote
(tests/golden/foreign/make_orbax.py), compared bit for bit with what Orbax itself restored; and
damaged or crafted copies of them."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import jaxckpt
from jaxckpt._errors import CheckpointCorruptedError, CheckpointFormatError, NotACheckpointError
from jaxckpt.format.records import DTYPES, ArrayLeaf, ValueLeaf
from jaxckpt.interop import orbax
from jaxckpt.interop.formats import ForeignCheckpoint

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "foreign", "orbax")
FIXTURES = ["standard", "standard_no_ocdbt", "zarr3", "zarr3_no_ocdbt", "pytree", "run/20", "run/30"]


@pytest.fixture(scope="module")
def expected() -> tuple[dict, dict[str, np.ndarray]]:
    with open(os.path.join(GOLDEN, "expected.json"), encoding="utf-8") as f:
        listing = json.load(f)["fixtures"]
    with np.load(os.path.join(GOLDEN, "expected.npz"), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return listing, arrays


def read_all(path: str) -> dict[str, object]:
    """Every value of the Orbax checkpoint at ``path``, by key."""
    ckpt = ForeignCheckpoint(orbax.open(path))
    out: dict[str, object] = {}
    for key, leaf in ckpt.index.leaves.items():
        out[key] = ckpt.read(key) if isinstance(leaf, ArrayLeaf) else leaf
    return out


def copy(tmp_path, name: str) -> str:
    target = str(tmp_path / name.replace("/", "_"))
    shutil.copytree(os.path.join(GOLDEN, name), target)
    return target


# --- what Orbax restores, bit for bit ---------------------------------------------------------


@pytest.mark.parametrize("fixture", FIXTURES)
def test_golden_values(fixture, expected):
    listing, arrays = expected
    want = listing[fixture]
    got = read_all(os.path.join(GOLDEN, fixture))
    assert set(got) == set(want)
    for key, record in want.items():
        value = got[key]
        if "dtype" in record:  # an array: npz keeps bfloat16 as raw 2-byte voids, hence the view
            array = arrays[f"{fixture}:{key}"].view(DTYPES[record["dtype"]])
            assert isinstance(value, np.ndarray), key
            assert value.dtype == DTYPES[record["dtype"]] and value.shape == tuple(record["shape"]), key
            assert value.tobytes() == array.tobytes(), key
        else:  # a Python value: the same type as Orbax gives
            assert isinstance(value, ValueLeaf), key
            assert value.value == record["value"] and type(value.value).__name__ == record["type"], key


def test_bfloat16_and_sharded_kernel():
    got = read_all(os.path.join(GOLDEN, "standard"))
    import ml_dtypes

    assert got["params/embed"].dtype == np.dtype(ml_dtypes.bfloat16)
    # Saved sharded over a 4x2 mesh of 8 devices, read whole as one numpy array.
    assert type(got["params/dense/kernel"]) is np.ndarray and got["params/dense/kernel"].shape == (8, 16)
    leaves = ForeignCheckpoint(orbax.open(os.path.join(GOLDEN, "standard"))).index.leaves
    assert (
        leaves["params/dense/kernel"].sharding == "NamedSharding(mesh={'data': 4, 'model': 2}, spec=('data', 'model'))"
    )
    assert leaves["params/embed"].sharding is None  # one device


def test_sharding_table_is_informational(tmp_path):
    path = copy(tmp_path, "standard")
    with open(os.path.join(path, "_sharding"), "w") as f:
        f.write('{"cGFyYW1zLmVtYmVk": "{not json", "%%%": 5}')
    leaves = ForeignCheckpoint(orbax.open(path)).index.leaves
    assert all(leaf.sharding is None for leaf in leaves.values() if isinstance(leaf, ArrayLeaf))


def test_strings_none_and_empty_containers():
    ckpt = ForeignCheckpoint(orbax.open(os.path.join(GOLDEN, "pytree")))
    assert ckpt.index.leaves["tag"] == ValueLeaf("str", "hello")
    assert ckpt.index.leaves["nothing"] == ValueLeaf("none", None)
    assert "empty" not in ckpt.skipped and ckpt.index.nodes["empty"].keys == ()  # an empty dict
    assert ckpt.name == "Orbax" and orbax.NAME == "Orbax"


def test_item_folder_has_no_prefix():
    step = read_all(os.path.join(GOLDEN, "run", "30"))
    item = read_all(os.path.join(GOLDEN, "run", "30", "state"))
    assert {f"state/{k}" for k in item} == {k for k in step if k.startswith("state/")}
    for key, value in item.items():
        other = step[f"state/{key}"]
        if isinstance(value, np.ndarray):
            assert value.tobytes() == other.tobytes() and value.dtype == other.dtype
        else:
            assert value == other
    assert step["meta/step"] == ValueLeaf("int", 30) and step["meta/name"] == ValueLeaf("str", "exp")


# --- detect, manages, latest ------------------------------------------------------------------


def test_detect():
    for fixture in [*FIXTURES, "run/30/state"]:
        assert orbax.detect(os.path.join(GOLDEN, fixture)), fixture
    assert not orbax.detect(os.path.join(GOLDEN, "run"))  # a manager's directory, not a checkpoint
    assert not orbax.detect(os.path.join(GOLDEN, "expected.json"))
    assert not orbax.detect(os.path.join(GOLDEN, "nothing-here"))


def test_detect_false_for_other_folders(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "notes.txt").write_text("not a checkpoint")
    assert not orbax.detect(str(empty)) and not orbax.detect(str(other))
    with pytest.raises(NotACheckpointError):
        orbax.open(str(empty))
    saved = jaxckpt.save(str(tmp_path / "mine"), {"w": np.ones(3, np.float32)})
    assert not orbax.detect(saved)
    assert not orbax.detect(os.path.join(saved, "data"))  # jaxckpt's OCDBT data store


def test_manager_directory(tmp_path):
    run = os.path.join(GOLDEN, "run")
    assert orbax.manages(run)
    assert orbax.latest(run) == os.path.join(run, "30")
    assert not orbax.manages(os.path.join(run, "30")) and not orbax.manages(os.path.join(GOLDEN, "standard"))
    # A step still being written (temporary name), and a step folder with nothing in it: not finished.
    copied = copy(tmp_path, "run")
    shutil.copytree(os.path.join(copied, "30"), os.path.join(copied, "40.orbax-checkpoint-tmp-1795441287"))
    os.mkdir(os.path.join(copied, "50"))
    assert orbax.latest(copied) == os.path.join(copied, "30")
    with pytest.raises(NotACheckpointError, match=r"CheckpointManager.*'.*30'"):
        orbax.open(run)


def test_numbered_standard_saves(tmp_path):
    """Steps saved with StandardCheckpointer into numbered folders: each step is an item."""
    for step in (5, 7):
        shutil.copytree(os.path.join(GOLDEN, "standard"), str(tmp_path / str(step)))
    assert not orbax.detect(str(tmp_path))
    assert orbax.manages(str(tmp_path)) and orbax.latest(str(tmp_path)) == str(tmp_path / "7")


def test_jaxckpt_manager_is_not_orbax(tmp_path):
    ckpt = jaxckpt.Checkpoint(w=np.zeros(3, np.float32))
    d = str(tmp_path / "ckpts")
    with jaxckpt.CheckpointManager(ckpt, d, max_to_keep=2, async_save=False) as manager:
        manager.save(checkpoint_number=10)
        manager.save(checkpoint_number=20)
    assert not orbax.manages(d) and orbax.latest(d) is None
    assert not orbax.manages(str(tmp_path / "nowhere"))


# --- damage: CheckpointCorruptedError naming the key ------------------------------------------


def test_deleted_chunk(tmp_path):
    path = copy(tmp_path, "standard_no_ocdbt")
    os.remove(os.path.join(path, "params.dense.kernel", "1.0"))
    ckpt = ForeignCheckpoint(orbax.open(path))
    with pytest.raises(CheckpointCorruptedError, match="params/dense/kernel"):
        ckpt.read("params/dense/kernel")


@pytest.mark.parametrize(
    ("fixture", "chunk"),
    [("standard_no_ocdbt", "params.embed/0.0"), ("zarr3_no_ocdbt", "params.embed/c/0/0")],
)
def test_truncated_chunk(tmp_path, fixture, chunk):
    path = copy(tmp_path, fixture)
    file = os.path.join(path, *chunk.split("/"))
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    ckpt = ForeignCheckpoint(orbax.open(path))
    with pytest.raises(CheckpointCorruptedError, match="params/embed"):
        ckpt.read("params/embed")


def test_truncated_ocdbt_data(tmp_path):
    path = copy(tmp_path, "standard")
    # Small chunks are stored inline in the B-tree nodes, which the merged database keeps in d/.
    for folder in ("d", os.path.join("ocdbt.process_0", "d")):
        for name in os.listdir(os.path.join(path, folder)):
            file = os.path.join(path, folder, name)
            with open(file, "r+b") as f:
                f.truncate(os.path.getsize(file) // 2)
    # The scalars are read on open, the arrays on read: one of them fails, naming its key.
    with pytest.raises(CheckpointCorruptedError, match=r"'[\w/.]+' of the Orbax checkpoint"):
        read_all(path)


def test_deleted_ocdbt_manifest(tmp_path):
    path = copy(tmp_path, "standard")
    os.remove(os.path.join(path, "manifest.ocdbt"))
    with pytest.raises(CheckpointCorruptedError, match=r"manifest\.ocdbt"):
        orbax.open(path)


# --- crafted metadata: CheckpointFormatError naming the key or file -------------------------------


def edit_json(file: str, change) -> None:
    with open(file, encoding="utf-8") as f:
        meta = json.load(f)
    change(meta)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(meta, f)


def tree_record(meta: dict, key: str) -> dict:
    return meta["tree_metadata"][str(tuple(key.split("/")))]


def test_metadata_not_json(tmp_path):
    path = copy(tmp_path, "standard")
    with open(os.path.join(path, "_METADATA"), "w") as f:
        f.write('{"tree_metadata": ')
    with pytest.raises(CheckpointFormatError, match="_METADATA"):
        orbax.open(path)


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["value_metadata"].update(write_shape=[2, 8, 1]),  # rank differs from the array's
        lambda r: r["value_metadata"].update(write_shape=[64, 8]),  # larger than the array
        lambda r: r["value_metadata"].update(value_type="scalar"),  # an 8x16 array is no scalar
        lambda r: r["value_metadata"].update(write_shape="big"),
    ],
)
def test_crafted_tree_metadata(tmp_path, change):
    path = copy(tmp_path, "standard")
    edit_json(os.path.join(path, "_METADATA"), lambda m: change(tree_record(m, "params/dense/kernel")))
    with pytest.raises(CheckpointFormatError, match="params/dense/kernel"):
        orbax.open(path)


def test_leaf_name_cannot_leave_the_folder(tmp_path):
    path = copy(tmp_path, "standard_no_ocdbt")

    def escape(meta: dict) -> None:
        tree_record(meta, "params/dense/kernel")["key_metadata"][0]["key"] = "../../outside"

    edit_json(os.path.join(path, "_METADATA"), escape)
    with pytest.raises(CheckpointFormatError, match="inside the checkpoint"):
        orbax.open(path)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "|O"),  # Python objects
        ("dtype", ">f4"),  # big-endian
        ("compressor", {"id": "lz4"}),
        ("filters", [{"id": "delta", "dtype": "<f4"}]),
        ("shape", [8, 16, 1]),  # rank differs from the chunks'
        ("shape", [1 << 30, 1 << 30]),  # 4 EiB
        ("shape", [1] * 65),
        ("order", "F"),
    ],
)
def test_crafted_zarray(tmp_path, field, value):
    path = copy(tmp_path, "standard_no_ocdbt")
    edit_json(os.path.join(path, "params.dense.kernel", ".zarray"), lambda m: m.update({field: value}))
    with pytest.raises(CheckpointFormatError, match="params/dense/kernel") as info:
        orbax.open(path)
    assert not isinstance(info.value, CheckpointCorruptedError)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update(data_type="string"),
        lambda m: m.update(shape=[2, 4]),  # chunks [2, 8] larger than the array
        lambda m: m["codecs"][0]["configuration"]["codecs"].append({"name": "made_up"}),
        lambda m: m.update(codecs=[{"name": "transpose", "configuration": {"order": [1, 0]}}]),
        lambda m: m.update(storage_transformers=[{"name": "x"}]),
    ],
)
def test_crafted_zarr_json(tmp_path, change):
    path = copy(tmp_path, "zarr3_no_ocdbt")
    edit_json(os.path.join(path, "params.dense.kernel", "zarr.json"), change)
    with pytest.raises(CheckpointFormatError, match="params/dense/kernel"):
        orbax.open(path)


def test_huge_zarr_metadata_is_refused_unread(tmp_path):
    path = copy(tmp_path, "standard_no_ocdbt")
    with open(os.path.join(path, "params.embed", ".zarray"), "ab") as f:
        f.write(b" " * (orbax.ZARR_METADATA_LIMIT + 1))
    with pytest.raises(CheckpointFormatError, match=r"params/embed.*larger than"):
        orbax.open(path)


def test_dtype_change_is_caught_by_tensorstore_constraints(tmp_path):
    """A .zarray changed after open (between the check and the read) is refused by TensorStore,
    since the checked metadata is passed as constraints."""
    path = copy(tmp_path, "standard_no_ocdbt")
    ckpt = ForeignCheckpoint(orbax.open(path))
    edit_json(os.path.join(path, "params.dense.kernel", ".zarray"), lambda m: m.update(dtype="<i4"))
    with pytest.raises(CheckpointFormatError, match="params/dense/kernel"):
        ckpt.read("params/dense/kernel")


def test_missing_item_folder(tmp_path):
    path = copy(tmp_path, "run/30")
    shutil.rmtree(os.path.join(path, "meta"))
    with pytest.raises(CheckpointCorruptedError, match="'meta'"):
        orbax.open(path)


def test_old_layout_without_metadata_is_named(tmp_path):
    path = copy(tmp_path, "standard_no_ocdbt")
    os.remove(os.path.join(path, "_METADATA"))
    with open(os.path.join(path, "checkpoint"), "wb") as f:
        f.write(b"\x80")  # msgpack of {}
    with pytest.raises(CheckpointFormatError, match=r"older Orbax"):
        orbax.open(path)


def test_deleted_chunk_in_ocdbt(tmp_path):
    import tensorstore as ts  # the test damages the database; the reader itself never imports it

    path = copy(tmp_path, "zarr3")
    store = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": path + "/"}}).result()
    chunk = "params.dense.kernel/c/1/0"
    assert store.read(chunk).result().state == "value"
    store.delete_range(ts.KvStore.KeyRange(chunk, chunk + "\0")).result()
    ckpt = ForeignCheckpoint(orbax.open(path))
    with pytest.raises(CheckpointCorruptedError, match="params/dense/kernel"):
        ckpt.read("params/dense/kernel")


def test_missing_chunk_is_the_fill_value_when_orbax_skipped_such_chunks(tmp_path):
    """Older Orbax did not store chunks equal to the fill value; its _METADATA says so."""
    path = copy(tmp_path, "standard_no_ocdbt")
    edit_json(os.path.join(path, "_METADATA"), lambda m: m.update(store_array_data_equal_to_fill_value=False))
    os.remove(os.path.join(path, "layers.1.w", "0.0"))
    got = read_all(path)
    assert got["layers/1/w"].dtype == np.int32 and not got["layers/1/w"].any()


def test_zarray_not_json(tmp_path):
    path = copy(tmp_path, "standard_no_ocdbt")
    with open(os.path.join(path, "params.embed", ".zarray"), "wb") as f:
        f.write(b"\xff{not json")
    with pytest.raises(CheckpointFormatError, match=r"params/embed.*\.zarray.*not valid JSON"):
        orbax.open(path)


def test_item_of_another_handler_is_listed_as_skipped(tmp_path):
    path = copy(tmp_path, "run/30")
    os.mkdir(os.path.join(path, "extra"))
    handler = "orbax.checkpoint._src.handlers.proto_checkpoint_handler.ProtoCheckpointHandler"
    edit_json(os.path.join(path, "_CHECKPOINT_METADATA"), lambda m: m["item_handlers"].update(extra=handler))
    ckpt = ForeignCheckpoint(orbax.open(path))
    assert ckpt.skipped["extra"].note == "Orbax item of ProtoCheckpointHandler"
    assert "state/params/embed" in ckpt.index.leaves


@pytest.mark.parametrize("fixture", ["standard", "standard_no_ocdbt"])
def test_metadata_without_layout_flags(tmp_path, fixture, expected):
    """Older _METADATA has no use_ocdbt / use_zarr3: OCDBT is recognised by its manifest."""
    path = copy(tmp_path, fixture)
    edit_json(os.path.join(path, "_METADATA"), lambda m: [m.pop("use_ocdbt"), m.pop("use_zarr3")])
    got = read_all(path)
    kernel = expected[1][f"{fixture}:params/dense/kernel"]
    assert got["params/dense/kernel"].tobytes() == kernel.tobytes()


def test_metadata_that_is_not_a_file(tmp_path):
    path = copy(tmp_path, "standard")
    os.remove(os.path.join(path, "_METADATA"))
    os.mkfifo(os.path.join(path, "_METADATA"))  # opening it to read would block forever
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        orbax.open(path)
