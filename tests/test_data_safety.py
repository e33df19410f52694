"""Data safety of the data path: a checkpoint whose data is missing, crafted or unreadable gives a
jaxckpt error naming the key and the cause, never wrong values, an abort or an unbounded allocation.

Each test reproduces a failure of format version 1's reader (issue "Data safety, round two").
"""

import errno
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import jaxckpt
from jaxckpt.arrays import store_read, store_write, zarr_local
from jaxckpt.format.checked_json import checksummed_json
from jaxckpt.saving import pipeline
from jaxckpt.storage import local_files, locations
from jaxckpt.tools import cli, scan
from jaxckpt.tools import verify as _verify

GOLDEN = Path(__file__).parent / "golden"


def _ocdbt(path: Path, store: str = "data") -> ts.KvStore:
    """The data store of a checkpoint of format version 1 to 3 (an OCDBT database)."""
    return ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": f"{path / store}/"}}).result()


def _shard_files(path: Path, array: str = "a/0") -> list[Path]:
    """The shard files of a zarr3 array of a format version 4 data store."""
    return sorted(p for p in (Path(path) / "data" / array / "c").rglob("*") if p.is_file())


def _shard_index(file: Path) -> np.ndarray:
    """The (offset, size) entries of a shard file's index, its checksum checked."""
    raw = file.read_bytes()
    n = 1
    while n * 16 + 4 <= len(raw):  # the index length is not recorded: find the one whose checksum holds
        index = raw[-(n * 16 + 4) : -4]
        if zarr_local.crc_bytes(memoryview(index)) == raw[-4:]:
            return np.frombuffer(index, "<u8").reshape(n, 2)
        n += 1
    raise AssertionError(f"no valid index at the end of {file}")


def _mark_absent(file: Path, chunk: int) -> None:
    """Mark inner chunk ``chunk`` absent in the shard's index (what zarr3 writes for a chunk never
    written), with a valid index checksum."""
    entries = _shard_index(file).copy()
    entries[chunk] = [2**64 - 1, 2**64 - 1]
    raw = file.read_bytes()
    index = entries.astype("<u8").tobytes()
    file.write_bytes(raw[: -(len(index) + 4)] + index + zarr_local.crc_bytes(memoryview(index)))


def _index(path: Path) -> dict:
    return json.loads((Path(path) / "index.json").read_text())


def _write_index(path: Path, body: dict) -> None:
    """Rewrite the index with a valid checksum, as an attacker would."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    (Path(path) / "index.json").write_bytes(checksummed_json(body))


def _chunked(tmp_path: Path, values: np.ndarray | None = None) -> tuple[Path, np.ndarray]:
    """A checkpoint of one 16 MiB array (two 8 MiB chunks) under the key 'w'."""
    if values is None:
        values = np.arange(4 << 20, dtype=np.float32).reshape(1024, 4096)
    return Path(jaxckpt.save(tmp_path / "c", {"w": values})), values


# --- 1. a missing chunk is damage, never zeros ---------------------------------------------------


@pytest.mark.parametrize("how", ["shard file deleted", "inner chunk marked absent"])
def test_a_deleted_chunk_is_an_error_not_zeros(tmp_path, how):
    """Format version 4: one shard file (``a/0/c/0/0``) of two 8 MiB inner chunks. A deleted shard
    file, or an index entry saying "never written" (zarr3 reads that as the fill value), is damage."""
    path, _ = _chunked(tmp_path)
    (shard,) = _shard_files(path)
    assert len(_shard_index(shard)) == 2
    if how == "shard file deleted":
        shard.unlink()
    else:
        _mark_absent(shard, 1)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'.*missing"):
        jaxckpt.restore(path)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="missing"):
        jaxckpt.load_variable(path, "w")
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="missing"):  # the half not marked absent
        jaxckpt.restore(path, like={"w": np.zeros((1024, 4096), np.float32)})
    result = _verify.verify(str(path))
    assert [k for k, _ in result.damaged] == ["w"] and not result.ok


def test_a_deleted_chunk_of_a_version_3_checkpoint_is_an_error_not_zeros(tmp_path):
    """Format version 3 (OCDBT): a chunk deleted from the database is damage too."""
    path = tmp_path / "v3"
    shutil.copytree(GOLDEN / "v3", path)
    kv = _ocdbt(path)
    (chunk,) = [k.decode() for k in kv.list().result() if k.startswith(b"a/0/c/")]
    kv.delete_range(ts.KvStore.KeyRange(chunk, chunk + "\0")).result()
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'big'.*missing"):
        jaxckpt.restore(path)
    assert [k for k, _ in _verify.verify(str(path)).damaged] == ["big"]


def test_chunks_of_zeros_are_stored_and_read_back(tmp_path):
    """Every chunk is written, zeros included, so that a missing one can be told from a zero one."""
    path, values = _chunked(tmp_path, np.zeros((1024, 4096), np.float32))
    (shard,) = _shard_files(path)
    entries = _shard_index(shard)
    chunk = (8 << 20) + 4  # the bytes of 512 rows, and their CRC-32C
    assert entries.tolist() == [[0, chunk], [chunk, chunk]]
    assert shard.stat().st_size == 2 * chunk + 2 * 16 + 4
    np.testing.assert_array_equal(jaxckpt.restore(path)["w"], values)
    assert _verify.verify(str(path)).ok


def test_a_deleted_pack_chunk_is_an_error(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"small": np.zeros(16, np.float32)})
    (shard,) = _shard_files(Path(path), "p/0")
    _mark_absent(shard, 0)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'small'.*missing"):
        jaxckpt.restore(path)


def test_a_deleted_pack_shard_file_is_reported_as_missing(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"small": np.zeros(16, np.float32)})
    (shard,) = _shard_files(Path(path), "p/0")
    shard.unlink()
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'small'.*missing"):
        jaxckpt.restore(path)


def test_a_checkpoint_deleted_while_read_is_reported_as_gone(tmp_path):
    """What an evaluation job sees when a manager's retention deletes the checkpoint it is reading."""
    from jaxckpt.reading.reader import Opened
    from jaxckpt.reading.templates import NO_TEMPLATE

    path, _ = _chunked(tmp_path)
    opened = Opened(locations.location(path))  # the index is read; then retention removes everything
    for child in sorted(path.rglob("*"), reverse=True):
        child.unlink() if child.is_file() else child.rmdir()
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="deleted while it was being read"):
        opened.load({"w": NO_TEMPLATE})


# --- 9. zarr.json must agree with the index ------------------------------------------------------


def _rewrite_zarr_json(path: Path, edit) -> None:
    """Edit the zarr.json of array a/0 (format version 4: a plain file)."""
    file = Path(path) / "data" / "a" / "0" / "zarr.json"
    meta = json.loads(file.read_bytes())
    edit(meta)
    file.write_bytes(json.dumps(meta).encode())


def _inner(meta: dict) -> dict:
    """The sharding_indexed codec's configuration: inner chunks, their codecs, the index's codecs."""
    (sharding,) = meta["codecs"]
    assert sharding["name"] == "sharding_indexed"
    return sharding["configuration"]


@pytest.mark.parametrize(
    "case",
    [
        "drop the checksum codec",
        "gzip and a 2 GiB chunk",
        "chunk shape of 2**40",
        "inner chunk shape of 2**40",
        "v2 chunk keys",
        "big endian",
        "index at the start",
        "index without checksum",
        "no sharding",
    ],
)
def test_a_crafted_zarr_json_is_refused_before_reading(tmp_path, case):
    path, _ = _chunked(tmp_path)
    edits = {
        "drop the checksum codec": lambda m: _inner(m).update(codecs=_inner(m)["codecs"][:1]),
        "gzip and a 2 GiB chunk": lambda m: (
            _inner(m).update(codecs=[*_inner(m)["codecs"][:1], {"name": "gzip", "configuration": {"level": 1}}]),
            _inner(m).update(chunk_shape=[1 << 15, 1 << 14]),
            m["chunk_grid"]["configuration"].update(chunk_shape=[1 << 15, 1 << 14]),
        ),
        "chunk shape of 2**40": lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[2**40, 1]),
        "inner chunk shape of 2**40": lambda m: _inner(m).update(chunk_shape=[2**40, 1]),
        "v2 chunk keys": lambda m: m.update(chunk_key_encoding={"name": "v2"}),
        "big endian": lambda m: _inner(m)["codecs"][0].update(configuration={"endian": "big"}),
        "index at the start": lambda m: _inner(m).update(index_location="start"),
        "index without checksum": lambda m: _inner(m).update(index_codecs=_inner(m)["index_codecs"][:1]),
        "no sharding": lambda m: m.update(codecs=_inner(m)["codecs"]),
    }
    _rewrite_zarr_json(path, edits[case])
    # Before the fix the 2**40 chunk shape aborted the process (std::bad_alloc), in restore and verify.
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'w'"):
        jaxckpt.restore(path, like={"w": np.zeros((1024, 4096), np.float32)})
    result = _verify.verify(str(path))
    assert [k for k, _ in result.damaged] == ["w"]


def test_a_version_1_zarr_json_with_a_chunk_larger_than_its_array_is_refused(tmp_path):
    """Version 1 indexes record no chunk shape: the stored one must at least fit the array.
    (A copy of tests/golden/v1, whose data store is an OCDBT database.)"""
    path = tmp_path / "v1"
    shutil.copytree(GOLDEN / "v1", path)
    body = _index(path)
    assert body["version"] == 1 and "chunks" not in body["leaves"]["big"]["at"]
    expected = jaxckpt.restore(GOLDEN / "v1")["big"]
    np.testing.assert_array_equal(jaxckpt.restore(path)["big"], expected)
    kv = _ocdbt(path)
    meta = json.loads(kv.read("a/0/zarr.json").result().value)
    meta["chunk_grid"]["configuration"].update(chunk_shape=[2**40, 1])
    kv.write("a/0/zarr.json", json.dumps(meta).encode()).result()
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"'big'.*claims chunks of shape"):
        jaxckpt.restore(path)


# --- 10. claimed sizes are checked against the data before allocating ---------------------------


def test_a_small_checkpoint_claiming_a_huge_array_allocates_nothing(tmp_path, capsys):
    path = Path(jaxckpt.save(tmp_path / "c", {"w": np.ones((2048, 1024), np.float32)}))  # 8 MiB on disk
    body = _index(path)
    body["leaves"]["w"].update(shape=[1 << 22, 4096])  # 64 GiB
    body["leaves"]["w"]["at"]["chunks"] = [512, 4096]
    _write_index(path, body)
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match=r"claims 68,719,476,736 bytes .*'w'.*holds only"):
        jaxckpt.load_variable(path, "w")
    for argv, status in (
        (["show", str(path), "w"], 1),
        (["verify", str(path)], 1),
        (["diff", str(path), str(path)], 2),
    ):
        assert cli.main(argv) == status, argv
        out = capsys.readouterr()
        assert "Traceback" not in out.err and "holds only" in out.out + out.err, (argv, out)


# --- 13. storage that refuses is not damage ------------------------------------------------------


@pytest.mark.parametrize(
    "code, error, errno_name",
    [
        ("PERMISSION_DENIED", jaxckpt.StorageError, "EACCES"),
        ("UNAVAILABLE", jaxckpt.StorageError, "EIO"),
        ("DEADLINE_EXCEEDED", jaxckpt.StorageError, "ETIMEDOUT"),
        ("DATA_LOSS", jaxckpt.CheckpointCorruptedError, None),
        ("NOT_FOUND", jaxckpt.CheckpointCorruptedError, None),
    ],
)
def test_tensorstore_errors_map_by_status_code(code, error, errno_name):
    mapped = store_write.failure("the data of 'w'", ValueError(f"{code}: something happened"))
    assert type(mapped) is error and "'w'" in str(mapped)
    if errno_name:
        assert mapped.errno == getattr(errno, errno_name)


@pytest.mark.parametrize("refused", ["zarr.json", "shard file", "version 3 (TensorStore)"])
def test_verify_reports_a_permission_error_as_unreadable_not_damaged(tmp_path, monkeypatch, capsys, refused):
    if refused.startswith("version 3"):
        path, key = tmp_path / "v3", "big"
        shutil.copytree(GOLDEN / "v3", path)

        class Refused:
            def __init__(self, path):
                self.path = path

            def result(self, timeout=None):  # as a TensorStore future's (jaxckpt waits with a deadline)
                raise ValueError(f'PERMISSION_DENIED: Error opening "{self.path}": Permission denied')

        real_open_store = store_read.Reader._open

        def refuse(self, path, metadata, **options):  # the array of 'big' only; the pack reads
            return Refused(path) if path == "a/0" else real_open_store(self, path, metadata, **options)

        monkeypatch.setattr(store_read.Reader, "_open", refuse)
    else:  # format version 4 on a local disk: jaxckpt opens the files itself (as root, chmod refuses nothing)
        (path, _), key = _chunked(tmp_path), "w"
        target = str(path / "data" / "a" / "0" / ("zarr.json" if refused == "zarr.json" else "c"))
        real_open, real_builtin_open = os.open, open
        # opened by path, or in the checkpoint's folder held open (dir_fd)
        targets = (target, os.path.relpath(target, path))

        def os_open(file, *args, **kwargs):
            if str(file).startswith(targets):
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        def builtin_open(file, *args, **kwargs):
            if str(file).startswith(target):
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return real_builtin_open(file, *args, **kwargs)

        real_beneath = local_files.open_beneath

        def open_beneath(folder, relative, flags):  # a file in the folder held open, a component at a time
            if relative.startswith(targets[1]):
                raise PermissionError(errno.EACCES, "Permission denied", relative)
            return real_beneath(folder, relative, flags)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(local_files, "open_beneath", open_beneath)
        monkeypatch.setattr("builtins.open", builtin_open)
    result = _verify.verify(str(path))
    assert not result.damaged and [k for k, _ in result.unreadable] == [key]
    assert cli.main(["verify", str(path)]) == 1
    out = capsys.readouterr()
    assert "UNREADABLE" in out.out and "DAMAGED" not in out.out and "not known to be damaged" in out.err
    with pytest.raises(jaxckpt.StorageError, match=rf"'{key}'.*refused") as info:
        jaxckpt.restore(path)
    assert isinstance(info.value, OSError) and info.value.errno == errno.EACCES


# --- 16. packed leaves count against the host memory budget ---------------------------------------


def test_packed_leaf_copies_are_bounded_by_the_host_memory_budget(tmp_path, monkeypatch):
    """numpy leaves are copied at save; before the fix 64 leaves of 1 MiB were all held in one pack."""
    monkeypatch.setenv("JAXCKPT_HOST_MEMORY_BUDGET", str(4 << 20))
    packs: list[int] = []
    flushed_during_snapshot: list[int] = []
    real_add_pack, real_flush = store_write.Writer.add_pack, store_write.Writer.flush
    in_prepare = {"on": False}

    def add_pack(self, path, nbytes, pieces):
        packs.append(nbytes)
        return real_add_pack(self, path, nbytes, pieces)

    def flush(self):
        if in_prepare["on"]:
            flushed_during_snapshot.append(len(packs))
        return real_flush(self)

    real_prepare = pipeline.prepare

    def prepare(*args, **kwargs):
        in_prepare["on"] = True
        try:
            return real_prepare(*args, **kwargs)
        finally:
            in_prepare["on"] = False

    monkeypatch.setattr(store_write.Writer, "add_pack", add_pack)
    monkeypatch.setattr(store_write.Writer, "flush", flush)
    monkeypatch.setattr(pipeline, "prepare", prepare)
    rng = np.random.default_rng(0)
    tree = {f"leaf{i}": rng.standard_normal(1 << 18).astype(np.float32) for i in range(64)}  # 1 MiB each
    path = pipeline.write(locations.location(tmp_path / "c"), tree)
    assert flushed_during_snapshot, "nothing was written before the snapshot ended"
    assert max(packs) <= (4 << 20) + (1 << 20) + store_write.PACK_ALIGN, packs
    restored = jaxckpt.restore(path)
    for key in ("leaf0", "leaf31", "leaf63"):
        np.testing.assert_array_equal(restored[key], tree[key])


# --- 18. durability is asked for, not assumed ----------------------------------------------------


def test_tensorstore_fsyncs_data_files_by_explicit_setting():
    assert store_write._context().spec.to_json()["file_io_sync"] is True


# --- 12. a deleted array is named ----------------------------------------------------------------


def test_saving_a_deleted_array_names_its_key(tmp_path):
    x = jnp.ones(4)
    x.delete()
    with pytest.raises(jaxckpt.UnsupportedValueError, match=r"'params/w'.*deleted"):
        jaxckpt.save(tmp_path / "c", {"params": {"w": x, "b": jnp.zeros(2)}})
    assert not os.path.exists(tmp_path / "c")
    donated = jax.jit(lambda a: a + 1, donate_argnums=0)
    y = jnp.ones(8)
    donated(y)
    if y.is_deleted():  # CPU honours donation in recent jax versions
        with pytest.raises(jaxckpt.UnsupportedValueError, match=r"'y'.*deleted"):
            jaxckpt.save(tmp_path / "d", {"y": y})


# --- 10. the CLI reads a large array in bounded pieces ---------------------------------------------


@pytest.mark.parametrize("shape", [(512, 1024), (2, 262144), (1 << 19,)])
def test_cli_reads_large_arrays_in_bounded_pieces(tmp_path, monkeypatch, capsys, shape):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(shape).astype(np.float32)  # 2 MiB
    b = a.copy()
    b.reshape(-1)[-1] += 1.0  # differs in the very last element
    pa, pb = jaxckpt.save(tmp_path / "a", {"w": a}), jaxckpt.save(tmp_path / "b", {"w": b})
    monkeypatch.setattr(scan, "BATCH_BYTES", 256 << 10)
    sizes: list[int] = []
    real = store_write.aligned_empty

    def recording(shape, dtype):
        out = real(shape, dtype)
        sizes.append(out.nbytes)
        return out

    monkeypatch.setattr(store_write, "aligned_empty", recording)
    monkeypatch.setattr(zarr_local, "aligned_empty", recording)  # format version 4 on a local disk
    assert cli.main(["show", "--json", pa, "w"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["size"] == a.size and stats["min"] == pytest.approx(float(a.min()))
    assert stats["mean"] == pytest.approx(float(a.mean()), rel=1e-6, abs=1e-9)
    assert cli.main(["verify", pa]) == 0
    assert cli.main(["diff", pa, pb]) == 1
    assert "max |a - b| = 1" in capsys.readouterr().out
    assert sizes and max(sizes) <= 256 << 10, max(sizes)
