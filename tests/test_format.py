"""The on-disk format: golden checkpoints stay readable, few files, readable by TensorStore alone."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import jaxckpt

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from make_golden import golden_tree, pod_tree  # noqa: E402

from jaxckpt.format import records  # noqa: E402
from jaxckpt.reading import reader as _reader  # noqa: E402
from jaxckpt.storage import locations  # noqa: E402
from jaxckpt.tools import cli  # noqa: E402


def _assert_same(restored, expected, key=""):
    if isinstance(expected, dict):
        assert set(restored) == set(expected), key
        for k in expected:
            _assert_same(restored[k], expected[k], f"{key}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(restored).__name__ == type(expected).__name__ and len(restored) == len(expected), key
        for i, (r, e) in enumerate(zip(restored, expected)):
            _assert_same(r, e, f"{key}/{i}")
    elif isinstance(expected, (np.ndarray, np.generic)):
        assert type(restored) is type(expected) and restored.dtype == expected.dtype, key
        assert np.asarray(restored).tobytes() == np.asarray(expected).tobytes(), key
    else:
        assert type(restored) is type(expected) and restored == expected, key


def test_every_golden_version_is_still_readable():
    versions = sorted(GOLDEN.glob("v*"))
    # Version 6 is version 5 with references between the checkpoints of a bucket's manager directory
    # (tests/test_bucket_incremental.py): no single folder shows it.
    assert [v.name for v in versions] == [f"v{i}" for i in range(1, records.PLAIN_VERSION + 1)]
    for folder in versions:
        _assert_same(jaxckpt.restore(folder), golden_tree())
        _assert_same(jaxckpt.restore(folder, like=golden_tree()), golden_tree())
        assert dict(jaxckpt.list_variables(folder))["big"] == (600, 600)


@pytest.mark.parametrize("version", [3, 4, 5])
def test_the_golden_save_of_four_processes_is_still_readable(version):
    """tests/golden/pod-v3, pod-v4 and pod-v5: what 4 processes of 2 devices each wrote, sharded over a (2, 4)
    mesh whose positions hold devices 3, 1, 0, 2, 7, 5, 4, 6 (device d of process d // 2)."""
    folder = GOLDEN / f"pod-v{version}"
    _assert_same(jaxckpt.restore(folder), pod_tree())
    opened = _reader.Opened(locations.location(folder))
    # P("x", "y"): shard (i, j) written by the process of mesh position (i, j).
    assert records.regions(opened.index.leaves["xy"].at, (4, 8)) == {
        "data.p1": [[(0, 2), (0, 2)], [(0, 2), (6, 8)]],
        "data": [[(0, 2), (2, 4)], [(0, 2), (4, 6)]],
        "data.p3": [[(2, 4), (0, 2)], [(2, 4), (6, 8)]],
        "data.p2": [[(2, 4), (2, 4)], [(2, 4), (4, 6)]],
    }
    # P(("y", "x")): row c is shard c, y major: row 1 is y 0, x 1, mesh position (1, 0), process 3.
    got = opened.read_regions({"yx_rows": [(slice(1, 2), slice(0, 3))]})["yx_rows"][0]
    np.testing.assert_array_equal(got, pod_tree()["yx_rows"][1:2])
    assert opened.stores_opened == ["data.p3"]
    for name, value in pod_tree().items():  # in pieces of one row or less, as `jaxckpt verify` reads large arrays
        pieces = list(_reader.Opened(locations.location(folder)).read_pieces(name, budget=8))
        np.testing.assert_array_equal(np.concatenate([p.reshape(-1) for p in pieces]), value.reshape(-1))
    assert cli.main(["verify", str(folder)]) == 0


def _files(path):
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())


def test_ten_thousand_leaves_make_a_handful_of_files(tmp_path):
    rng = np.random.default_rng(0)
    tree = {f"layer{i}": {"w": rng.standard_normal(20).astype(np.float32)} for i in range(9_990)}
    tree["big"] = [rng.standard_normal(300_000).astype(np.float32) for _ in range(10)]
    path = jaxckpt.save(tmp_path / "c", tree)
    files = _files(path)
    index = json.loads((Path(path) / "index.json").read_text())
    # Format version 5: index.json, the data store's checksums.json, and per zarr3 array (each pack,
    # each array of its own) its zarr.json and one file per shard; none of these arrays needs a second shard.
    assert len(index["packs"]) == 1
    assert {tree_key for tree_key, leaf in index["leaves"].items() if leaf["at"].get("pack") == 0} == {
        f"layer{i}/w" for i in range(9_990)
    }
    own = [leaf["at"]["array"] for leaf in index["leaves"].values() if "array" in leaf["at"]]
    assert len(own) == 10
    assert len(files) == 2 + 2 * len(index["packs"]) + 2 * len(own), files
    assert "index.json" in files and "data/checksums.json" in files
    for folder in [pack["path"] for pack in index["packs"]] + own:
        assert f"data/{folder}/zarr.json" in files
        assert [f for f in files if f.startswith(f"data/{folder}/c/")], (folder, files)
    restored = jaxckpt.restore(path)
    np.testing.assert_array_equal(restored["layer9989"]["w"], tree["layer9989"]["w"])
    np.testing.assert_array_equal(restored["big"][9], tree["big"][9])


def test_arrays_are_readable_with_tensorstore_alone(tmp_path):
    """What docs/format.md promises someone who never installed jaxckpt."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((700, 400)).astype(np.float32)
    small = np.arange(7, dtype=np.int16)
    path = Path(jaxckpt.save(tmp_path / "c", {"big": big, "small": small}))
    index = json.loads((path / "index.json").read_text())

    def kvstore(folder):  # format version 4: each array is a zarr3 array in a plain folder
        return {"driver": "file", "path": f"{path}/data/{folder}/"}

    at = index["leaves"]["big"]["at"]
    store = ts.open({"driver": "zarr3", "kvstore": kvstore(at["array"])}).result()
    assert list(store.shape) == [700, 400] and store.dtype.name == "float32"
    np.testing.assert_array_equal(store.read().result(), big)

    at = index["leaves"]["small"]["at"]
    pack = index["packs"][at["pack"]]["path"]
    store = ts.open({"driver": "zarr3", "kvstore": kvstore(pack)}).result()
    raw = store[at["offset"] : at["offset"] + at["nbytes"]].read().result()
    np.testing.assert_array_equal(raw.view("<i2"), small)


def test_index_records_kinds_and_is_plain_json(tmp_path):
    path = Path(jaxckpt.save(tmp_path / "c", {"t": (1, 2), 3: [np.float32(1)]}))
    index = json.loads((path / "index.json").read_text())
    assert index["format"] == "jaxckpt" and index["version"] == records.PLAIN_VERSION  # 6: with references only
    assert index["nodes"][""] == {"kind": "dict", "class": "dict", "keys": ["t", 3]}
    assert index["nodes"]["t"]["kind"] == "tuple" and index["leaves"]["t/0"] == {"type": "int", "value": 1}
    assert index["leaves"]["3/0"]["container"] == "numpy_scalar"


def test_an_index_rewritten_in_other_json_spelling_still_reads_and_a_changed_one_does_not(tmp_path):
    """The index's checksum is of its canonical JSON: a reader checks the bytes as written when they are
    canonical, and re-encodes otherwise (indented, keys reordered); either way a changed value fails."""
    path = Path(jaxckpt.save(tmp_path / "c", {"w": np.arange(3.0), "step": 7}))
    index = path / "index.json"
    body = json.loads(index.read_text())
    index.write_text(json.dumps(dict(reversed(list(body.items()))), indent=2))
    assert jaxckpt.restore(path)["step"] == 7
    body["leaves"]["step"]["value"] = 8
    index.write_text(json.dumps(body, sort_keys=True, separators=(",", ":")) + "\n")
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="fails its checksum"):
        jaxckpt.restore(path)
