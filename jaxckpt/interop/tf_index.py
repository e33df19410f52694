"""The bytes of a TensorFlow checkpoint's index file (``prefix.index``), decoded: TensorFlow's
table format (LevelDB's SSTable), the protobuf wire format, the two messages the table holds
(``BundleHeaderProto`` under the key ``""``, a ``BundleEntryProto`` under every other key), and the
keys of slices of partitioned variables (``EncodeTensorNameSlice``). :mod:`.tensorflow` reads
checkpoints with these; nothing here opens a file.

The table: data blocks of prefix-compressed keys, an index block pointing at them and a 48-byte
footer; every block is followed by its compression type and a masked CRC-32C, which are checked.

The protobuf messages are decoded here by a small wire-format reader (varints, length-delimited
fields, fixed32/64, unknown fields skipped) rather than by generated ``_pb2`` modules: that would
need protoc and a protobuf runtime for a few dozen lines of decoding, and writing it out lets every
length be checked against the bytes that hold it, which matters for untrusted files.
"""

from __future__ import annotations

from collections.abc import Iterator

from crc32c import crc32c as _crc32c_of

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48  # two BlockHandles padded to 40 bytes, then the 8-byte magic
_BLOCK_TRAILER = 5  # compression type byte + masked CRC-32C
_MAX_RANK = 64


def mask_crc(crc: int) -> int:
    """TensorFlow's (LevelDB's) masked CRC: stored CRCs are rotated and offset, so that a CRC of
    bytes that contain CRCs stays well distributed."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def crc32c(view: memoryview) -> int:
    """The CRC-32C of a buffer, read in place (the ``crc32c`` package takes any buffer, SSE4.2)."""
    return _crc32c_of(view)


# --- protobuf wire format ---------------------------------------------------------------------


class Malformed(Exception):
    """Bytes that do not parse; the caller turns it into a CheckpointFormatError naming the file."""


def varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """The unsigned varint at ``pos`` (at most 10 bytes, never past ``end``) and the position after it."""
    result = shift = 0
    for _ in range(10):
        if pos >= end:
            raise Malformed("a varint runs past the end of its bytes")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >= 1 << 64:
                raise Malformed("a varint is longer than 64 bits")
            return result, pos
        shift += 7
    raise Malformed("a varint is longer than 10 bytes")


def _signed(value: int) -> int:
    """A protobuf int32/int64 varint as the signed number it encodes (two's complement, 64 bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) for each field of a message: ints for varint and fixed
    fields, bytes for length-delimited ones. Groups (wire types 3, 4) are not used by these messages."""
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise Malformed("a field has number 0")
        value: int | bytes
        if wire == 0:
            value, pos = varint(buf, pos, end)
        elif wire == 1:
            if pos + 8 > end:
                raise Malformed("a fixed64 field runs past the end of its message")
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire == 2:
            size, pos = varint(buf, pos, end)
            if size > end - pos:
                raise Malformed(f"a field claims {size} bytes, but only {end - pos} remain in its message")
            value, pos = bytes(buf[pos : pos + size]), pos + size
        elif wire == 5:
            if pos + 4 > end:
                raise Malformed("a fixed32 field runs past the end of its message")
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise Malformed(f"field {number} has wire type {wire}, which these messages never use")
        yield number, wire, value


def as_int(wire: int, value: int | bytes, what: str) -> int:
    if wire != 0 or not isinstance(value, int):
        raise Malformed(f"{what} is not a varint")
    return _signed(value)


def as_bytes(wire: int, value: int | bytes, what: str) -> bytes:
    if wire != 2 or not isinstance(value, bytes):
        raise Malformed(f"{what} is not length-delimited")
    return value


def as_text(wire: int, value: int | bytes, what: str) -> str:
    try:
        return as_bytes(wire, value, what).decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed(f"{what} is not UTF-8") from None


# --- the table (SSTable) ------------------------------------------------------------------------


def _block(data: bytes, offset: int, size: int, what: str) -> memoryview:
    """The contents of the block at (offset, size), its trailer's type and CRC checked."""
    if offset > len(data) or size > len(data) - offset or _BLOCK_TRAILER > len(data) - offset - size:
        raise Malformed(f"{what} at offset {offset}, {size} bytes, runs past the end of the file ({len(data)} bytes)")
    view = memoryview(data)
    kind = data[offset + size]
    if kind != 0:
        raise Malformed(
            f"{what} is compressed (type {kind}); only uncompressed tables (type 0), which TensorFlow writes, are read"
        )
    stored = int.from_bytes(data[offset + size + 1 : offset + size + 5], "little")
    actual = mask_crc(_crc32c_of(view[offset : offset + size + 1]))
    if stored != actual:
        raise Malformed(f"{what} fails its checksum (stored {stored:#010x}, computed {actual:#010x})")
    return view[offset : offset + size]


def _block_entries(block: memoryview, what: str) -> Iterator[tuple[bytes, memoryview]]:
    """The (key, value) pairs of a block: keys share a prefix with the previous key."""
    n = len(block)
    if n < 4:
        raise Malformed(f"{what} is {n} bytes, too short to hold its restart count")
    restarts = int.from_bytes(block[n - 4 :], "little")
    if restarts > (n - 4) // 4:
        raise Malformed(f"{what} claims {restarts} restart points, more than its {n} bytes can hold")
    end = n - 4 - 4 * restarts
    pos, key = 0, b""
    while pos < end:
        shared, pos = varint(block, pos, end)
        unshared, pos = varint(block, pos, end)
        size, pos = varint(block, pos, end)
        if shared > len(key):
            raise Malformed(f"{what}: a key shares {shared} bytes with a previous key of {len(key)}")
        if unshared > end - pos or size > end - pos - unshared:
            raise Malformed(f"{what}: an entry runs past the end of the block")
        key = key[:shared] + bytes(block[pos : pos + unshared])
        pos += unshared
        yield key, block[pos : pos + size]
        pos += size


def _handle(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int, int]:
    offset, pos = varint(buf, pos, end)
    size, pos = varint(buf, pos, end)
    return offset, size, pos


def table(data: bytes) -> Iterator[tuple[bytes, memoryview]]:
    """Every (key, value) of a table file, in key order, each block checked."""
    if len(data) < _FOOTER_SIZE:
        raise Malformed(f"the file is {len(data)} bytes, shorter than a table's {_FOOTER_SIZE}-byte footer")
    footer = data[-_FOOTER_SIZE:]
    magic = int.from_bytes(footer[40:], "little")
    if magic != _TABLE_MAGIC:
        raise Malformed(f"the footer's magic number is {magic:#018x}, not a table's {_TABLE_MAGIC:#018x}")
    _, _, pos = _handle(footer, 0, 40)  # the metaindex block: TensorFlow puts nothing in it
    index_offset, index_size, _ = _handle(footer, pos, 40)
    index = _block(data, index_offset, index_size, "the index block")
    for _, value in _block_entries(index, "the index block"):
        offset, size, _ = _handle(value, 0, len(value))
        yield from _block_entries(_block(data, offset, size, f"the data block at offset {offset}"), "a data block")


# --- the bundle's messages -------------------------------------------------------------------


class BundleHeader:
    def __init__(self, buf: bytes) -> None:
        self.num_shards, self.endianness, self.min_consumer = 0, 0, 0
        for number, wire, value in fields(buf):
            if number == 1:
                self.num_shards = as_int(wire, value, "num_shards")
            elif number == 2:
                self.endianness = as_int(wire, value, "endianness")
            elif number == 3:  # VersionDef: producer 1, min_consumer 2, bad_consumers 3
                for n, w, v in fields(as_bytes(wire, value, "version")):
                    if n == 2:
                        self.min_consumer = as_int(w, v, "version.min_consumer")


class BundleEntry:
    """A BundleEntryProto: a value's dtype and shape, and where its bytes are."""

    def __init__(self, buf: bytes) -> None:
        self.dtype = 0
        self.shape: tuple[int, ...] = ()
        self.shard_id = self.offset = self.size = self.crc32c = 0
        self.slices: list[tuple[tuple[int, int], ...]] = []  # (start, length or -1 for all) per dim
        for number, wire, value in fields(buf):
            if number == 1:
                self.dtype = as_int(wire, value, "dtype")
            elif number == 2:
                self.shape = _shape(as_bytes(wire, value, "shape"))
            elif number == 3:
                self.shard_id = as_int(wire, value, "shard_id")
            elif number == 4:
                self.offset = as_int(wire, value, "offset")
            elif number == 5:
                self.size = as_int(wire, value, "size")
            elif number == 6:
                if wire != 5 or not isinstance(value, int):
                    raise Malformed("crc32c is not a fixed32")
                self.crc32c = value
            elif number == 7:
                self.slices.append(_slice(as_bytes(wire, value, "slices")))
        if self.shard_id < 0 or self.offset < 0 or self.size < 0:
            raise Malformed(f"negative shard_id, offset or size ({self.shard_id}, {self.offset}, {self.size})")


def _shape(buf: bytes) -> tuple[int, ...]:
    """A TensorShapeProto: dims (field 2, each a Dim with size in field 1); unknown_rank (3)."""
    dims: list[int] = []
    for number, wire, value in fields(buf):
        if number == 2:
            size = 0
            for n, w, v in fields(as_bytes(wire, value, "shape.dim")):
                if n == 1:
                    size = as_int(w, v, "shape.dim.size")
            if size < 0:
                raise Malformed(f"a dimension is {size}: a stored value has no unknown dimensions")
            dims.append(size)
            if len(dims) > _MAX_RANK:
                raise Malformed(f"a shape has more than {_MAX_RANK} dimensions")
        elif number == 3 and as_int(wire, value, "unknown_rank"):
            raise Malformed("a stored value's shape has unknown rank")
    return tuple(dims)


def _slice(buf: bytes) -> tuple[tuple[int, int], ...]:
    """A TensorSliceProto: one Extent per dim, start (1) and length (2; absent means the whole dim)."""
    extents: list[tuple[int, int]] = []
    for number, wire, value in fields(buf):
        if number == 1:
            start, length = 0, -1
            for n, w, v in fields(as_bytes(wire, value, "slice extent")):
                if n == 1:
                    start = as_int(w, v, "extent.start")
                elif n == 2:
                    length = as_int(w, v, "extent.length")
                    if length < 0:
                        raise Malformed(f"a slice extent has length {length}")
            if start < 0:
                raise Malformed(f"a slice extent starts at {start}")
            extents.append((start, length))
            if len(extents) > _MAX_RANK:
                raise Malformed(f"a slice has more than {_MAX_RANK} dimensions")
    return tuple(extents)


# --- OrderedCode, for the keys of slices ------------------------------------------------------


def _num_increasing(value: int) -> bytes:
    """OrderedCode::WriteNumIncreasing: a length byte, then the number big-endian."""
    body = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return bytes([len(body)]) + body


def _signed_num_increasing(value: int) -> bytes:
    """OrderedCode::WriteSignedNumIncreasing: the two's complement in the fewest bytes L that keep
    its sign, with the top L bits flipped, so that the bytes sort as the numbers do."""
    x = ~value if value < 0 else value
    length = x.bit_length() // 7 + 1  # 7 bits per byte are the number's, one of them its sign
    bits = 8 * length
    word = (value % (1 << bits)) ^ (((1 << length) - 1) << (bits - length))
    return word.to_bytes(length, "big")


def encode_tensor_name_slice(name: str, extents: tuple[tuple[int, int], ...]) -> bytes:
    """The key under which TensorFlow's BundleWriter::AddSlice stores one slice of ``name``
    (EncodeTensorNameSlice): a 0, the escaped name, the rank, then start and length of each dim
    (a whole dim is start 0, length -1). Starting with a 0 byte, it never clashes with a name."""
    escaped = name.encode("utf-8").replace(b"\xff", b"\xff\x00").replace(b"\x00", b"\x00\xff")
    out = [_num_increasing(0), escaped + b"\x00\x01", _num_increasing(len(extents))]
    for start, length in extents:
        out += [_signed_num_increasing(start), _signed_num_increasing(length if length >= 0 else -1)]
    return b"".join(out)


def slice_key_name(key: bytes) -> str:
    """How messages name a slice's entry: the variable's name in its EncodeTensorNameSlice key."""
    name = key[1:].split(b"\x00\x01", 1)[0].replace(b"\x00\xff", b"\x00").replace(b"\xff\x00", b"\xff")
    return f"a slice of {name.decode('utf-8', 'replace')}"
