"""Right checksums, wrong places: the index vouches for each array's content in order.

Every inner chunk of format 4 carries its own CRC-32C, which proves its bytes intact but not where
they belong: two chunks swapped with their checksums, shard files swapped between two arrays of one
shape, or a shard copied from an older checkpoint would read as other values. From format version 5
each data store lists the CRC-32C of every inner chunk of its shards in position order, for the save
that its index names (``jaxckpt.arrays.checksums``), so each of these is damage that restores and
``verify`` report, naming the value.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from test_data_safety import _write_index
from test_zarr_local import _CRC, _ENTRY, _entries, _folder, _index, _refused, _saved, _shards, _write_entries

import jaxckpt
from jaxckpt.arrays import zarr_local
from jaxckpt.format.checked_json import canonical_json
from jaxckpt.reading.reader import Opened
from jaxckpt.storage import kvstore, locations
from jaxckpt.tools import verify as _verify


def _swap_chunk_bytes(shard: Path, a: int, b: int) -> None:
    """Swap inner chunks ``a`` and ``b`` of a shard file, each with its own CRC-32C (the index stays)."""
    entries = _entries(shard, 4)
    raw = bytearray(shard.read_bytes())
    (oa, size), (ob, _) = (map(int, entries[a]), map(int, entries[b]))
    raw[oa : oa + size], raw[ob : ob + size] = raw[ob : ob + size], raw[oa : oa + size]
    shard.write_bytes(bytes(raw))


def test_two_inner_chunks_swapped_with_their_checksums_are_refused(tmp_path, small_inner_chunks):
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    _swap_chunk_bytes(shard, 0, 2)
    _refused(path, tree, "w", "not the data the index records")


def test_shard_files_swapped_between_two_arrays_of_one_shape_are_refused(tmp_path, small_inner_chunks):
    rng = np.random.default_rng(3)
    tree = {k: rng.standard_normal((32, 32)).astype(np.float32) for k in ("a", "b")}
    path = Path(jaxckpt.save(tmp_path / "c", tree))
    (sa,), (sb,) = _shards(_folder(path, "a")), _shards(_folder(path, "b"))
    data = sa.read_bytes()
    sa.write_bytes(sb.read_bytes())
    sb.write_bytes(data)
    for key in tree:
        with pytest.raises(jaxckpt.CheckpointCorruptedError, match=rf"'{key}'.*not the data the index records"):
            jaxckpt.load_variable(path, key)
    assert sorted(k for k, _ in _verify.verify(str(path)).damaged) == ["a", "b"]


def test_a_shard_copied_from_an_older_checkpoint_is_refused(tmp_path, small_inner_chunks):
    old = Path(jaxckpt.save(tmp_path / "old", {"w": np.zeros((32, 32), np.float32)}))
    new = Path(jaxckpt.save(tmp_path / "new", {"w": np.ones((32, 32), np.float32)}))
    (shard,) = _shards(_folder(new, "w"))
    shutil.copyfile(_shards(_folder(old, "w"))[0], shard)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'.*not the data the index records"):
        jaxckpt.restore(new)
    assert [k for k, _ in _verify.verify(str(new)).damaged] == ["w"]


def test_a_region_read_checks_the_chunks_it_reads_against_the_index(tmp_path, small_inner_chunks):
    """A partial read (another mesh, ``load_variable`` of a slice) is bound too: only the chunks it
    reads are checked, each against the index."""
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    _swap_chunk_bytes(shard, 0, 1)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'.*not the data the index records"):
        Opened(locations.location(path)).read_regions({"w": [(slice(0, 8), slice(0, 32))]})
    got = Opened(locations.location(path)).read_regions({"w": [(slice(24, 32), slice(0, 32))]})["w"][
        0
    ]  # chunk 3: untouched
    np.testing.assert_array_equal(got, tree["w"][24:32])


def test_a_shard_file_that_is_a_symlink_is_refused(tmp_path, small_inner_chunks):
    """Even to a file with the right bytes: nothing outside the checkpoint is read."""
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    outside = tmp_path / "outside"
    shard.rename(outside)
    shard.symlink_to(outside)
    _refused(path, tree, "w", "not a regular file")


def test_each_data_store_records_a_checksum_per_inner_chunk_in_order_for_the_save(tmp_path, small_inner_chunks):
    path, tree = _saved(tmp_path)
    at = _index(path)["leaves"]["w"]["at"]
    values = np.ascontiguousarray(tree["w"])
    rows = len(values) // 4
    expected = [zarr_local.crc32c_of(memoryview(values[i * rows : (i + 1) * rows]).cast("B")) for i in range(4)]
    sums = json.loads((path / "data" / "checksums.json").read_bytes())
    assert sums["arrays"][at["array"]] == {"0": expected}
    assert sums["save"] == _index(path)["save"] and _index(path)["version"] >= 5


def test_an_index_without_its_save_id_is_refused_from_version_5(tmp_path, small_inner_chunks):
    """Deleting what names the checksums must not switch the check off."""
    path, _ = _saved(tmp_path)
    body = _index(path)
    del body["save"]
    _write_index(path, body)
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"missing field 'save'"):
        jaxckpt.restore(path)


def test_missing_checksums_are_damage(tmp_path, small_inner_chunks):
    path, tree = _saved(tmp_path)
    (path / "data" / "checksums.json").unlink()
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"checksums.json.* missing"):
        jaxckpt.load_variable(path, "w")
    np.testing.assert_array_equal(jaxckpt.load_variable(path, "small"), tree["small"])  # packed: the index checks it
    assert sorted(k for k, _ in _verify.verify(str(path)).damaged) == ["v", "w"]


def test_a_data_store_copied_whole_from_another_checkpoint_is_refused(tmp_path, small_inner_chunks):
    """Shards and checksums both from an older save of the same tree: the save ids differ."""
    old = Path(jaxckpt.save(tmp_path / "old", {"w": np.zeros((32, 32), np.float32)}))
    new = Path(jaxckpt.save(tmp_path / "new", {"w": np.ones((32, 32), np.float32)}))
    shutil.rmtree(new / "data")
    shutil.copytree(old / "data", new / "data")
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"written by save .*, not by save"):
        jaxckpt.restore(new)
    assert [k for k, _ in _verify.verify(str(new)).damaged] == ["w"]


@pytest.mark.parametrize(
    "edit",
    [
        lambda body: body["arrays"]["a/0"].pop("0"),
        lambda body: body["arrays"]["a/0"]["0"].pop(),
        lambda body: body["arrays"]["a/0"].update({"0": "x"}),
        lambda body: body["arrays"].update({"a/0": [1]}),
    ],
    ids=["shard missing", "chunk missing", "not a list", "not an object"],
)
def test_crafted_checksums_are_damage(tmp_path, small_inner_chunks, edit):
    path, tree = _saved(tmp_path)
    file = path / "data" / "checksums.json"
    body = json.loads(file.read_bytes())
    del body["checksum"]
    assert _index(path)["leaves"]["w"]["at"]["array"] == "a/0"
    edit(body)
    file.write_bytes(json.dumps({"checksum": f"crc32:{zlib.crc32(canonical_json(body)):08x}", **body}).encode())
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'.*checksums|checksums.*damaged"):
        jaxckpt.load_variable(path, "w")
    np.testing.assert_array_equal(jaxckpt.load_variable(path, "v"), tree["v"])


@pytest.mark.parametrize("offset", [2**63, 2**64 - 2**10])
def test_a_shard_index_offset_past_2_to_the_63_in_a_short_file_is_damage(tmp_path, small_inner_chunks, offset):
    """The bound ``offset > end - size`` must not wrap (it raised OverflowError with a traceback)."""
    path, tree = _saved(tmp_path)
    (shard,) = _shards(_folder(path, "w"))
    shard.write_bytes(shard.read_bytes()[-(4 * _ENTRY + _CRC) :])  # the index alone: a short file
    entries = _entries(shard, 4)
    entries[0] = [offset, entries[0][1]]
    _write_entries(shard, entries)  # valid: the index's checksum holds
    _refused(path, tree, "w", "outside the file")
    assert os.path.getsize(shard) == 4 * _ENTRY + _CRC


def test_shards_swapped_in_a_bucket_are_refused(s3, small_inner_chunks):
    """Read through TensorStore (which checks each chunk's own checksum alone), the chunks a read
    covers whole are checked against the data store's checksums too."""
    rng = np.random.default_rng(4)
    tree = {k: rng.standard_normal((32, 32)).astype(np.float32) for k in ("a", "b")}
    path = f"{s3}/swapped"
    jaxckpt.save(path, tree)
    for key, value in tree.items():  # intact: read back
        np.testing.assert_array_equal(jaxckpt.load_variable(path, key), value)
    data = locations.location(path) / "data"
    arrays = {k: _index_of_bucket(path)["leaves"][k]["at"]["array"] for k in tree}
    sa, sb = (kvstore.kv_read(data.spec(), f"{arrays[k]}/c/0/0") for k in ("a", "b"))
    kvstore.kv_write(data.spec(), f"{arrays['a']}/c/0/0", sb)
    kvstore.kv_write(data.spec(), f"{arrays['b']}/c/0/0", sa)
    for key in tree:
        with pytest.raises(jaxckpt.CheckpointCorruptedError, match=rf"'{key}'.*not the data the index records"):
            jaxckpt.load_variable(path, key)
    assert sorted(k for k, _ in _verify.verify(path).damaged) == ["a", "b"]


def _index_of_bucket(path: str) -> dict:
    return json.loads(locations.read_index_bytes(locations.location(path)))
