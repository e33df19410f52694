"""The TensorFlow checkpoint reader, against checkpoints that TensorFlow itself wrote
(tests/golden/foreign/make_tf.py) and against damaged and crafted ones. TensorFlow is not imported."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import crc32c
import numpy as np
import pytest

from jaxckpt import CheckpointCorruptedError, CheckpointFormatError
from jaxckpt._errors import UnsupportedVersionError
from jaxckpt.format.keys import escape_edge
from jaxckpt.interop import tensorflow as tf_format
from jaxckpt.interop import tf_index
from jaxckpt.interop.formats import ForeignCheckpoint

GOLDEN = Path(__file__).parent / "golden" / "foreign" / "tf"
# (directory with expected.*, the checkpoint's prefix relative to it)
FIXTURES = {
    "tf2": ("tf2", "tf_ckpts/ckpt-5"),
    "tf2_slots": ("tf2_slots", "ckpt-1"),
    "tf1": ("tf1", "model.ckpt-42"),
    "tf1_sharded": ("tf1/sharded", "model.ckpt-42"),
}


def expected(fixture: str) -> tuple[str, dict, dict[str, np.ndarray]]:
    directory, prefix = FIXTURES[fixture]
    stem = os.path.basename(prefix)
    with open(GOLDEN / directory / f"{stem}.expected.json") as f:
        info = json.load(f)
    with np.load(GOLDEN / directory / f"{stem}.expected.npz", allow_pickle=False) as npz:
        values = {name: npz[name] for name in npz.files}
    return str(GOLDEN / directory / prefix), info, values


def key_of(tf_name: str) -> str:
    return "/".join(escape_edge(e) for e in tf_format.edges_of(tf_name))


# --- what TensorFlow wrote reads back as TensorFlow reads it ---------------------------------


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_values_match_tensorflow_bit_for_bit(fixture: str) -> None:
    prefix, info, values = expected(fixture)
    assert tf_format.detect(prefix)
    checkpoint = ForeignCheckpoint(tf_format.open(prefix))
    listed = {name: tuple(shape) for name, shape in info["list_variables"]}
    listed.pop(tf_format.OBJECT_GRAPH_KEY, None)
    # Every name TensorFlow lists is here, under the key rule, with its shape; nothing else is.
    ours = {key: leaf.shape for key, leaf in checkpoint.index.leaves.items()}
    ours |= {key: entry.shape for key, entry in checkpoint.skipped.items()}
    assert ours == {key_of(name): shape for name, shape in listed.items()}
    strings = {name: shape for name, shape in info["strings"].items() if name != tf_format.OBJECT_GRAPH_KEY}
    assert set(values) | set(info["unreadable"]) | set(strings) == set(listed)
    for name, shape in strings.items():  # TensorFlow's string tensors: listed, not read
        entry = checkpoint.skipped[key_of(name)]
        assert entry.leaf is None and entry.note == "DT_STRING" and entry.shape == tuple(shape)
    for name, value in values.items():
        array = checkpoint.read(key_of(name))
        assert str(array.dtype) == info["dtypes"][name], name
        assert array.shape == value.shape, name
        assert array.tobytes() == value.tobytes(), name  # bit for bit (bfloat16 is stored as raw bytes)


def test_tf1_string_variable_is_skipped() -> None:
    checkpoint = ForeignCheckpoint(tf_format.open(expected("tf1")[0]))
    assert checkpoint.skipped["vocab"].note == "DT_STRING" and "vocab" not in checkpoint.index.leaves


def test_formats_are_named() -> None:
    assert tf_format.open(expected("tf2")[0]).name == "TensorFlow (tf.train.Checkpoint)"
    assert tf_format.open(expected("tf1")[0]).name == "TensorFlow (tf1 Saver)"
    assert not tf_format.detect(str(GOLDEN / "tf1" / "model.ckpt"))
    assert not tf_format.detect(str(GOLDEN / "tf1"))


def test_the_guide_example_keys_and_iterator_state() -> None:
    checkpoint = ForeignCheckpoint(tf_format.open(expected("tf2")[0]))
    assert {"net/l1/_kernel", "net/l1/bias", "step", "save_counter"} <= set(checkpoint.index.leaves)
    assert tf_format.OBJECT_GRAPH_KEY not in checkpoint.index.leaves
    assert tf_format.OBJECT_GRAPH_KEY not in checkpoint.skipped
    state = checkpoint.skipped["iterator/ITERATOR_STATE"]
    assert state.leaf is None and state.note == "DT_VARIANT" and state.shape == (5,)
    assert checkpoint.read("step").dtype == np.int32 and int(checkpoint.read("step")) == 50  # saved every 10 steps


def test_key_rule() -> None:
    assert tf_format.edges_of("net/l1/kernel/.ATTRIBUTES/VARIABLE_VALUE") == ("net", "l1", "kernel")
    assert tf_format.edges_of("iterator/.ATTRIBUTES/ITERATOR_STATE") == ("iterator", "ITERATOR_STATE")
    assert tf_format.edges_of("dense/kernel") == ("dense", "kernel")
    assert tf_format.edges_of("global_step") == ("global_step",)
    slot = "net/l1/kernel/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE"
    assert tf_format.edges_of(slot) == ("optimizer", "m", "net", "l1", "kernel")


def test_slot_variables_sit_beside_their_variable() -> None:
    prefix, _, values = expected("tf2_slots")
    checkpoint = ForeignCheckpoint(tf_format.open(prefix))
    assert "model/w" in checkpoint.index.leaves
    m = checkpoint.read("optimizer/m/model/w")
    assert m.tobytes() == values["model/w/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE"].tobytes()


def test_objects_of_the_guide_example() -> None:
    objects = tf_format.open(expected("tf2")[0]).objects
    assert {"net", "net/l1", "optimizer", "step", "iterator", "save_counter", "net/l1/_kernel"} <= set(objects)
    assert len(objects) == len(set(objects))
    assert tf_format.open(expected("tf1")[0]).objects == []


def test_partitioned_variable_is_assembled_from_its_slices() -> None:
    for fixture in ("tf1", "tf1_sharded"):
        prefix, _, values = expected(fixture)
        reader = tf_format.open(prefix)
        assert len(reader._slices) == 3  # fixed_size_partitioner(3): stored as three slices
        checkpoint = ForeignCheckpoint(reader)
        assert not any(key.startswith("~e") or "\x00" in key for key in checkpoint.index.leaves)
        part = checkpoint.read("part")
        assert part.shape == (10, 3) and part.tobytes() == values["part"].tobytes()


def test_sharded_checkpoint_has_two_data_files() -> None:
    reader = tf_format.open(expected("tf1_sharded")[0])
    assert reader.num_shards == 2
    assert {entry.shard_id for entry in reader._entries.values()} == {0, 1}


def test_slice_keys_match_tensorflow_ordered_code() -> None:
    # Numbers TensorFlow's OrderedCode tests spell out: -1 is 0x7f, 64 needs two bytes.
    assert tf_index._signed_num_increasing(0) == b"\x80"
    assert tf_index._signed_num_increasing(-1) == b"\x7f"
    assert tf_index._signed_num_increasing(63) == b"\xbf"
    assert tf_index._signed_num_increasing(64) == b"\xc0\x40"
    assert tf_index._signed_num_increasing(-65) == b"\x3f\xbf"
    assert tf_index._num_increasing(0) == b"\x00" and tf_index._num_increasing(258) == b"\x02\x01\x02"
    key = tf_index.encode_tensor_name_slice("a", ((0, 4), (0, -1)))
    assert key == b"\x00" + b"a\x00\x01" + b"\x01\x02" + b"\x80\x84" + b"\x80\x7f"


# --- the manager's directory ---------------------------------------------------------------


def test_latest_in_a_manager_directory() -> None:
    directory = str(GOLDEN / "tf2" / "tf_ckpts")
    assert tf_format.manages(directory)
    assert tf_format.latest(directory) == os.path.join(directory, "ckpt-5")
    _, info, _ = expected("tf2")
    assert info["latest_checkpoint"] == "tf_ckpts/ckpt-5"
    assert tf_format.manages(str(GOLDEN / "tf1"))
    assert tf_format.latest(str(GOLDEN / "tf1")) == str(GOLDEN / "tf1" / "model.ckpt-42")
    assert not tf_format.manages(str(GOLDEN))


def test_the_state_file_names_checkpoints_relative_to_its_directory() -> None:
    # The fixtures' `checkpoint` files hold relative names, so these tests pass wherever the repo is.
    for directory in ("tf1", "tf1/sharded", "tf2/tf_ckpts", "tf2_slots"):
        text = (GOLDEN / directory / "checkpoint").read_text()
        assert "model_checkpoint_path" in text and "/work" not in text and '"/' not in text


def test_c_escapes_in_the_state_file() -> None:
    assert tf_format._c_unescape(rb"a\"b\\c\101\x42\n") == b'a"b\\cAB\n'


def test_latest_follows_tensorflow_state_file_rules(tmp_path: Path) -> None:
    shutil.copy(GOLDEN / "tf1" / "model.ckpt-42.index", tmp_path / 'odd "name".index')
    (tmp_path / "checkpoint").write_text(
        'model_checkpoint_path: "odd \\"name\\""\nall_model_checkpoint_paths: "odd \\"name\\""\n'
    )
    assert tf_format.latest(str(tmp_path)) == str(tmp_path / 'odd "name"')
    (tmp_path / "checkpoint").write_text(f'model_checkpoint_path: "{tmp_path / "gone"}"\n')
    assert tf_format.manages(str(tmp_path)) and tf_format.latest(str(tmp_path)) is None  # its data is gone
    (tmp_path / "checkpoint").write_text("not a state file\n")
    assert not tf_format.manages(str(tmp_path)) and tf_format.latest(str(tmp_path)) is None


# --- damaged checkpoints ---------------------------------------------------------------------


def copy_tf1(tmp_path: Path) -> str:
    for path in (GOLDEN / "tf1").glob("model.ckpt-42.*"):
        shutil.copy(path, tmp_path / path.name)
    return str(tmp_path / "model.ckpt-42")


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_data_byte_names_the_key(tmp_path: Path) -> None:
    prefix = copy_tf1(tmp_path)
    entry = tf_format.open(prefix)._entries["dense/kernel"]
    flip(prefix + ".data-00000-of-00001", entry.offset + 5)
    checkpoint = ForeignCheckpoint(tf_format.open(prefix))
    with pytest.raises(CheckpointCorruptedError, match="'dense/kernel' fails its checksum"):
        checkpoint.read("dense/kernel")
    checkpoint.read("dense/bias")  # the others still read


def test_a_flipped_index_byte_fails_the_block_checksum(tmp_path: Path) -> None:
    prefix = copy_tf1(tmp_path)
    flip(prefix + ".index", 30)
    with pytest.raises(CheckpointFormatError, match=r"model\.ckpt-42\.index.*checksum"):
        tf_format.open(prefix)


def test_a_truncated_shard_is_refused_before_reading(tmp_path: Path) -> None:
    prefix = copy_tf1(tmp_path)
    data = prefix + ".data-00000-of-00001"
    entry = tf_format.open(prefix)._entries["dense/kernel"]
    os.truncate(data, entry.offset + 4)
    checkpoint = ForeignCheckpoint(tf_format.open(prefix))
    with pytest.raises(CheckpointCorruptedError, match=r"'dense/kernel' is 48 bytes.*truncated"):
        checkpoint.read("dense/kernel")


def test_a_tf2_checkpoint_with_a_missing_shard_still_lists(tmp_path: Path) -> None:
    for path in (GOLDEN / "tf2" / "tf_ckpts").glob("ckpt-5.index"):
        shutil.copy(path, tmp_path / path.name)
    reader = tf_format.open(str(tmp_path / "ckpt-5"))
    checkpoint = ForeignCheckpoint(reader)
    assert "net/l1/bias" in checkpoint.index.leaves
    with pytest.raises(CheckpointCorruptedError, match=r"'net/l1/bias'.*ckpt-5\.data-00000-of-00001.*missing"):
        checkpoint.read("net/l1/bias")
    with pytest.raises(CheckpointCorruptedError, match="_CHECKPOINTABLE_OBJECT_GRAPH"):
        reader.objects  # noqa: B018 - read on first use


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    prefix = copy_tf1(tmp_path)
    os.remove(prefix + ".data-00000-of-00001")
    checkpoint = ForeignCheckpoint(tf_format.open(prefix))
    with pytest.raises(CheckpointCorruptedError, match=r"'counts'.*data-00000-of-00001.*missing"):
        checkpoint.read("counts")


@pytest.mark.parametrize("content", [b"", b"garbage" * 3, bytes(48), os.urandom(200)])
def test_a_garbage_index_is_a_format_error(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "x.index").write_bytes(content)
    assert tf_format.detect(str(tmp_path / "x"))
    with pytest.raises(CheckpointFormatError, match=r"x\.index"):
        tf_format.open(str(tmp_path / "x"))


# --- crafted indexes: a small writer of TensorFlow's table and messages -----------------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, bytes):
        return varint(number << 3 | 2) + varint(len(value)) + value
    return varint(number << 3) + varint(value)


def entry_proto(
    dtype: int, shape: tuple[int, ...], size: int, crc: int = 0, shard: int = 0, offset: int = 0, slices: tuple = ()
) -> bytes:
    dims = b"".join(field(2, field(1, d)) for d in shape)
    crc_field = varint(6 << 3 | 5) + crc.to_bytes(4, "little")
    out = field(1, dtype) + field(2, dims) + field(3, shard) + field(4, offset) + field(5, size) + crc_field
    for extents in slices:  # TensorSliceProto: an Extent per dim, empty for a whole dim
        out += field(7, b"".join(field(1, b"" if n < 0 else field(1, s) + field(2, n)) for s, n in extents))
    return out


def block(entries: list[tuple[bytes, bytes]], kind: int = 0) -> bytes:
    body = b"".join(varint(0) + varint(len(k)) + varint(len(v)) + k + v for k, v in entries)
    body += (0).to_bytes(4, "little") + (1).to_bytes(4, "little")  # one restart point, at 0
    crc = tf_index.mask_crc(crc32c.crc32c(body + bytes([kind])))
    return body + bytes([kind]) + crc.to_bytes(4, "little")


def write_index(path: Path, entries: list[tuple[bytes, bytes]], kind: int = 0) -> None:
    entries = sorted(entries)  # a table's keys are in order
    data = block(entries, kind)
    meta = block([])
    handle = varint(0) + varint(len(data) - 5)
    index = block([(entries[-1][0], handle)])
    meta_handle = varint(len(data)) + varint(len(meta) - 5)
    index_handle = varint(len(data) + len(meta)) + varint(len(index) - 5)
    footer = (meta_handle + index_handle).ljust(40, b"\x00") + (0xDB4775248B80FB57).to_bytes(8, "little")
    path.write_bytes(data + meta + index + footer)


def header(num_shards: int = 1, endianness: int = 0) -> tuple[bytes, bytes]:
    return b"", field(1, num_shards) + field(2, endianness) + field(3, field(1, 1))


def test_the_crafted_writer_round_trips(tmp_path: Path) -> None:
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    crc = tf_index.mask_crc(crc32c.crc32c(value.tobytes()))
    write_index(tmp_path / "c.index", [header(), (b"v", entry_proto(1, (2, 3), 24, crc))])
    (tmp_path / "c.data-00000-of-00001").write_bytes(value.tobytes())
    checkpoint = ForeignCheckpoint(tf_format.open(str(tmp_path / "c")))
    assert np.array_equal(checkpoint.read("v"), value)


def test_a_value_claiming_a_terabyte_is_refused_without_allocating(tmp_path: Path) -> None:
    size = 2**40
    write_index(tmp_path / "c.index", [header(), (b"huge", entry_proto(1, (size // 4,), size))])
    (tmp_path / "c.data-00000-of-00001").write_bytes(bytes(64))
    checkpoint = ForeignCheckpoint(tf_format.open(str(tmp_path / "c")))
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptedError, match=r"'huge' is 1099511627776 bytes.*only 64 bytes"):
            checkpoint.read("huge")
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("entries", "kind", "match"),
    [
        (
            [header(), (b"v", entry_proto(1, (2, 3), 2**40))],
            0,
            "'v' is float32 of shape .* 24 bytes, but its entry says",
        ),
        ([header(), (b"v", entry_proto(1, (4,), 16, shard=1))], 0, "'v' is in data shard 1, but the checkpoint has 1"),
        ([header(), (b"v", entry_proto(1, (2,) * 65, 0))], 0, "more than 64 dimensions"),
        ([header(), (b"v", entry_proto(1, (-1, 2), 0))], 0, "a dimension is -1"),
        ([header(), (b"v", entry_proto(1, (2**40, 2**40, 2**40), 0))], 0, "more than any file holds"),
        ([header(endianness=1), (b"v", entry_proto(1, (4,), 16))], 0, "big-endian"),
        ([header(), (b"v", entry_proto(1, (4,), 16))], 1, r"compressed \(type 1\)"),
        ([(b"v", entry_proto(1, (4,), 16))], 0, "first key is not the header"),
        ([header(), (b"v", b"\x0a\xff\x01")], 0, "claims 255 bytes"),
    ],
)
def test_crafted_indexes_are_refused(tmp_path: Path, entries: list, kind: int, match: str) -> None:
    write_index(tmp_path / "c.index", entries, kind)
    with pytest.raises(CheckpointFormatError, match=match):
        tf_format.open(str(tmp_path / "c"))


def test_a_newer_bundle_version_is_refused(tmp_path: Path) -> None:
    newer = (b"", field(1, 1) + field(3, field(1, 9) + field(2, 5)))
    write_index(tmp_path / "c.index", [newer])
    with pytest.raises(UnsupportedVersionError, match="version 5"):
        tf_format.open(str(tmp_path / "c"))


def partitioned(tmp_path: Path, pieces: list[tuple[tuple[int, int], ...]], listed: list | None = None) -> str:
    """A float32 (4, 3) variable "p" stored as ``pieces`` (extents of dim 0; dim 1 whole)."""
    full = np.arange(12, dtype=np.float32).reshape(4, 3)
    data, entries = b"", [header()]
    for start, length in pieces:
        piece = full[start : start + length].tobytes()
        crc = tf_index.mask_crc(crc32c.crc32c(piece))
        key = tf_index.encode_tensor_name_slice("p", ((start, length), (0, -1)))
        entries.append((key, entry_proto(1, (length, 3), len(piece), crc, offset=len(data))))
        data += piece
    slices = [((s, n), (0, -1)) for s, n in (pieces if listed is None else listed)]
    entries.append((b"p", entry_proto(1, (4, 3), 0, slices=tuple(slices))))
    write_index(tmp_path / "c.index", entries)
    (tmp_path / "c.data-00000-of-00001").write_bytes(data)
    return str(tmp_path / "c")


def test_crafted_partitions(tmp_path: Path) -> None:
    checkpoint = ForeignCheckpoint(tf_format.open(partitioned(tmp_path, [(0, 1), (1, 3)])))
    assert list(checkpoint.index.leaves) == ["p"]
    assert np.array_equal(checkpoint.read("p"), np.arange(12, dtype=np.float32).reshape(4, 3))
    with pytest.raises(CheckpointFormatError, match=r"'p' has 12 elements, but its slices hold 9"):
        tf_format.open(partitioned(tmp_path, [(0, 1), (2, 2)]))
    with pytest.raises(CheckpointFormatError, match=r"its slice .* is not in the index"):
        tf_format.open(partitioned(tmp_path, [(0, 2)], listed=[(0, 2), (2, 2)]))
    with pytest.raises(CheckpointFormatError, match=r"its slice .* is outside it"):
        tf_format.open(partitioned(tmp_path, [(0, 2), (2, 2)], listed=[(0, 2), (2, 3)]))
    with pytest.raises(
        CheckpointFormatError, match=r"'a slice of p' is float32 of shape \(3, 3\), 36 bytes, but its entry says 24"
    ):
        tf_format.open(partitioned(tmp_path, [(0, 2), (2, 3)]))  # row 4 is past the array: 2 rows stored
    with pytest.raises(CheckpointFormatError, match="overlapping slices"):
        ForeignCheckpoint(tf_format.open(partitioned(tmp_path, [(0, 2), (1, 2)], listed=[(0, 2), (1, 2)]))).read("p")


@pytest.mark.parametrize("fixture", ["tf1", "tf2"])
def test_every_damaged_index_byte_is_a_format_error_or_harmless(tmp_path: Path, fixture: str) -> None:
    # Each byte flipped, and the file cut at each length: opening and reading raise
    # CheckpointFormatError (its subclasses included) or succeed; never another exception.
    prefix = expected(fixture)[0]
    original = Path(prefix + ".index").read_bytes()
    for path in Path(prefix).parent.glob(Path(prefix).name + ".data-*"):
        shutil.copy(path, tmp_path / path.name)
    target = tmp_path / (Path(prefix).name + ".index")
    damaged = [original[:i] + bytes([original[i] ^ 0x40]) + original[i + 1 :] for i in range(len(original))]
    damaged += [original[:i] for i in range(len(original))]
    for content in damaged:
        target.write_bytes(content)
        try:
            reader = tf_format.open(str(tmp_path / Path(prefix).name))
            checkpoint = ForeignCheckpoint(reader)
            for key in checkpoint.index.leaves:
                checkpoint.read(key)
            reader.objects  # noqa: B018
        except CheckpointFormatError:
            pass


def test_a_damaged_object_graph_is_named(tmp_path: Path) -> None:
    for path in (GOLDEN / "tf2" / "tf_ckpts").glob("ckpt-5.*"):
        shutil.copy(path, tmp_path / path.name)
    prefix = str(tmp_path / "ckpt-5")
    entry = tf_format.open(prefix)._entries[tf_format.OBJECT_GRAPH_KEY]
    flip(prefix + ".data-00000-of-00001", entry.offset + entry.size - 3)
    reader = tf_format.open(prefix)
    assert ForeignCheckpoint(reader).read("net/l1/bias").shape == (5,)
    with pytest.raises(CheckpointCorruptedError, match="'_CHECKPOINTABLE_OBJECT_GRAPH' fails its checksum"):
        reader.objects  # noqa: B018


def test_a_partition_claiming_a_terabyte_is_refused_without_allocating(tmp_path: Path) -> None:
    rows = 2**38  # float32 rows of 3: 3 TiB in two slices
    half = rows // 2
    entries = [header()]
    for start in (0, half):
        key = tf_index.encode_tensor_name_slice("p", ((start, half), (0, -1)))
        entries.append((key, entry_proto(1, (half, 3), half * 12)))
    slices = (((0, half), (0, -1)), ((half, half), (0, -1)))
    entries.append((b"p", entry_proto(1, (rows, 3), 0, slices=slices)))
    write_index(tmp_path / "c.index", entries)
    (tmp_path / "c.data-00000-of-00001").write_bytes(bytes(64))
    checkpoint = ForeignCheckpoint(tf_format.open(str(tmp_path / "c")))
    assert checkpoint.index.leaves["p"].shape == (rows, 3)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptedError, match=r"'p' is 1649267441664 bytes .* only 64 bytes"):
            checkpoint.read("p")
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
