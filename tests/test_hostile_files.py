"""Files of a checkpoint that are not what jaxckpt wrote: folders, symlink loops, symlinks out of the
checkpoint (a file or a folder anywhere on the way), an oversized ``checksums.json``, and damage that
only a read of whole inner chunks sees on buckets (TensorStore's path). Each is a jaxckpt error,
never a raw ``OSError``, a read outside the checkpoint, an unbounded allocation or other values.

Found by an adversarial review of format 5 (probes in subprocesses under memory limits).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.format import checked_json
from jaxckpt.storage import kvstore, locations
from jaxckpt.tools import verify as _verify


def _tree() -> dict[str, np.ndarray]:
    return {"x": np.arange(300_000, dtype=np.float32), "small": np.arange(5, dtype=np.int32)}


def _saved(tmp_path: Path) -> Path:
    return Path(jaxckpt.save(tmp_path / "c", _tree()))


@pytest.mark.parametrize("file", ["data/checksums.json", "index.json"])
@pytest.mark.parametrize("kind", ["folder", "symlink loop", "link out of the checkpoint"])
def test_a_metadata_file_that_is_not_a_regular_file_in_the_checkpoint_is_a_jaxckpt_error(tmp_path, file, kind):
    path = _saved(tmp_path)
    target = path / file
    outside = tmp_path / "outside"
    shutil.copyfile(target, outside)  # the right content, outside the checkpoint
    target.unlink()
    if kind == "folder":
        target.mkdir()
    elif kind == "symlink loop":
        target.symlink_to(target)
    else:
        target.symlink_to(outside)
    with pytest.raises(jaxckpt.JaxckptError, match=r"regular file|symbolic link|is a folder"):
        jaxckpt.restore(path)
    try:
        assert not _verify.verify(str(path)).ok
    except jaxckpt.NotACheckpointError:  # an index.json that is a folder: the folder is no checkpoint
        assert file == "index.json" and kind == "folder"


@pytest.mark.parametrize("folder", ["data/a", "data/a/0", "data/a/0/c"])
def test_a_symlinked_folder_inside_a_data_store_is_never_followed(tmp_path, folder, monkeypatch):
    """Even to a copy of the right files: nothing outside the checkpoint is read (a file of padding in
    the store satisfies the size check before reading)."""
    path = _saved(tmp_path)
    outside = tmp_path / "outside"
    shutil.copytree(path, outside)
    shutil.rmtree(path / folder)
    (path / folder).symlink_to(outside / folder)
    (path / "data" / "pad").write_bytes(bytes(2 << 20))
    opened = []
    real = os.open

    def watching(file, flags, *args, **kwargs):
        opened.append(os.path.join(str(kwargs.get("dir_fd", "")), os.fspath(file)))
        return real(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", watching)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'x'.*symbolic link"):
        jaxckpt.restore(path)
    monkeypatch.setattr(os, "open", real)
    assert not any(str(outside) in f for f in opened), [f for f in opened if str(outside) in f]
    assert [k for k, _ in _verify.verify(str(path)).damaged] == ["x"]


def test_an_oversized_checksums_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A store's checksums hold about a dozen bytes per inner chunk the index implies: a 5 MB one in a
    checkpoint of one shard of one chunk is refused by its size, not parsed (600 MB ran out of memory)."""
    path = _saved(tmp_path)
    file = path / "data" / "checksums.json"
    body = json.loads(file.read_bytes())
    del body["checksum"]
    body["pad"] = [0] * 2_500_000
    file.write_bytes(checked_json.checksummed_json(body))
    assert file.stat().st_size > 5_000_000
    parsed = []
    monkeypatch.setattr(json, "loads", lambda *a, **k: parsed.append(1) or json.JSONDecoder().decode(*a, **k))
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"checksums\.json.*over jaxckpt's limit"):
        jaxckpt.load_variable(path, "x")
    assert len(parsed) <= 1  # the index alone


def test_a_store_s_checksums_are_read_once_per_checkpoint_opened(tmp_path, monkeypatch):
    from jaxckpt.tools import scan

    tree = {f"x{i}": np.full(300_000, i, np.float32) for i in range(4)}
    path = jaxckpt.save(tmp_path / "c", tree)
    monkeypatch.setattr(scan, "BATCH_BYTES", 2 << 20)  # a batch per array
    reads = []
    real = locations.read_file

    def counting(folder, name, *args, **kwargs):
        reads.append(name)
        return real(folder, name, *args, **kwargs)

    monkeypatch.setattr(locations, "read_file", counting)
    assert _verify.verify(str(path)).ok  # reads the arrays in several batches
    assert reads.count("data/checksums.json") == 1


def _swap_index_entries(base: dict, key: str, chunks: int, i: int, j: int) -> None:
    """Swap two entries of a shard's index in an object store, with a valid index checksum."""
    data = kvstore.kv_read(base, key)
    assert data is not None
    size = chunks * 16
    index = bytearray(data[-size - 4 : -4])
    index[16 * i : 16 * i + 16], index[16 * j : 16 * j + 16] = index[16 * j : 16 * j + 16], index[16 * i : 16 * i + 16]
    kvstore.kv_write(base, key, data[: -size - 4] + bytes(index) + struct.pack("<I", crc32c.crc32c(bytes(index))))


def test_inner_chunks_read_in_part_from_a_bucket_are_checked_too(small_inner_chunks):
    """TensorStore checks each chunk by its own CRC-32C; jaxckpt checks each against the store's
    checksums for its place, also when a read (another mesh, a piece of ``verify``) covers it in part."""
    path = "memory://in-part"
    values = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)  # 16 chunks of 4 rows
    jaxckpt.save(path, {"w": values})
    mesh = Mesh(np.array(jax.devices()), ("x",))
    columns = {"w": jax.ShapeDtypeStruct(values.shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))}
    np.testing.assert_array_equal(np.asarray(jaxckpt.restore(path, like=columns)["w"]), values)
    _swap_index_entries(locations.location(path).spec(), "data/a/0/c/0/0", 16, 1, 3)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'.*not the data the index records"):
        jaxckpt.restore(path, like=columns)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'.*not the data the index records"):
        jaxckpt.load_variable(path, "w")


def test_verify_of_a_bucket_checks_chunks_its_pieces_cut(small_inner_chunks, monkeypatch):
    """verify reads a large array in pieces that need not follow inner chunks."""
    from jaxckpt.tools import scan

    path = "memory://pieces"
    values = np.random.default_rng(6).standard_normal((64, 64)).astype(np.float32)
    jaxckpt.save(path, {"w": values})
    monkeypatch.setattr(scan, "BATCH_BYTES", 64 * 4 * 6)  # pieces of 6 rows; inner chunks of 4
    _swap_index_entries(locations.location(path).spec(), "data/a/0/c/0/0", 16, 1, 4)  # rows 4-8, 16-20: cut
    assert [k for k, _ in _verify.verify(path).damaged] == ["w"]
