"""Hostile metadata (issue "Data safety, round three: format 4 attacked"): an index whose numbers are
consistent enough to pass a shallow check, but describe regions that overlap and leave a gap, a
geometry whose derivation would never end, or millions of tiny shards and chunks. Each must give a
jaxckpt error naming the key, quickly and in bounded memory, never garbage, a hang or an exhausted
host; and a legitimate checkpoint with many small shards still restores.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_data_safety import _index, _write_index

import jaxckpt
from jaxckpt.arrays import store_write, zarr_meta
from jaxckpt.format import records
from jaxckpt.reading import read_plan
from jaxckpt.tools import cli

GOLDEN = Path(__file__).parent / "golden"


# --- 2. regions must tile the array: an overlap hides a gap --------------------------------------


def _pod_with_regions(tmp_path: Path, regions: dict) -> Path:
    """The golden save of four processes, its explicitly listed array 'listed' (6, 2) int16, whose
    rows 0-3 are in data.p2 and rows 3-6 in data.p1, given other ``regions``."""
    path = tmp_path / "pod"
    shutil.copytree(GOLDEN / "pod-v4", path)
    body = _index(path)
    body["leaves"]["listed"]["at"]["regions"] = regions
    _write_index(path, body)
    return path


def test_regions_that_overlap_and_leave_a_gap_are_refused(tmp_path, capsys):
    # Column 0 of rows 3-6 listed twice, column 1 of them never: the volumes add up to 6 * 2, and
    # every listed part is really there, so only a tiling check sees the gap.
    twice = [[[3, 6], [0, 1]], [[3, 6], [0, 1]]]
    path = _pod_with_regions(tmp_path, {"data.p2": [[[0, 3], [0, 2]]], "data.p1": twice})
    with pytest.raises(jaxckpt.CheckpointFormatError, match=r"'listed'.*overlap"):
        jaxckpt.restore(path)
    assert cli.main(["verify", str(path)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "'listed'" in out.out + out.err, out


def test_regions_that_tile_the_array_are_accepted(tmp_path):
    # The same data, listed in other (disjoint, covering) pieces: rows 3-6 by column.
    by_column = [[[3, 6], [0, 1]], [[3, 6], [1, 2]]]
    path = _pod_with_regions(tmp_path, {"data.p2": [[[0, 3], [0, 2]]], "data.p1": by_column})
    np.testing.assert_array_equal(jaxckpt.restore(path)["listed"], jaxckpt.restore(GOLDEN / "pod-v4")["listed"])


@pytest.mark.parametrize(
    "boxes, tiles",
    [
        ([[(0, 3), (0, 2)], [(3, 6), (0, 2)]], True),
        ([[(0, 3), (0, 2)], [(3, 6), (0, 1)], [(3, 6), (0, 1)]], False),  # an overlap and a gap
        ([[(0, 4), (0, 2)], [(3, 6), (0, 1)], [(5, 6), (1, 2)]], False),  # 8 + 3 + 1: overlap, gap
        ([[(0, 6), (0, 1)], [(0, 6), (1, 2)]], True),
        ([[(0, 0), (0, 2)], [(0, 6), (0, 2)]], True),  # an empty box overlaps nothing
        ([[(i, i + 1), (j, j + 1)] for i in range(6) for j in range(2)], True),
        ([[(i, i + 1), (j, j + 1)] for i in range(6) for j in range(2)][:-1] + [[(0, 1), (0, 1)]], False),
    ],
)
def test_tiling_problem(boxes, tiles):
    assert (records.tiling_problem(boxes, (6, 2)) is None) == tiles


def test_a_region_read_from_parts_that_do_not_tile_it_is_refused():
    """Defence in depth: regions that were never checked by the index's parser (an index built in
    memory) still cannot hand out a buffer whose uncovered part was never written."""
    at = records.InArray("a/3", "int16", {"data.p1": [[(3, 6), (0, 1)], [(3, 6), (0, 1)]], "data": [[(0, 3), (0, 2)]]})
    with pytest.raises(jaxckpt.CheckpointFormatError, match="a/3"):
        read_plan.plan_region(at, (6, 2), (slice(0, 6), slice(0, 2)))


def test_tiling_problem_of_a_high_rank_array():
    shape = (2,) * 20 + (1,) * 44
    halves = [[(0, 1)] + [(0, n) for n in shape[1:]], [(1, 2)] + [(0, n) for n in shape[1:]]]
    assert records.tiling_problem(halves, shape) is None
    assert "overlap" in records.tiling_problem([halves[0], halves[0]], shape)


# --- hostile calls run in a child: a hang or an exhausted host must not take the test run along --


_CHILD_PREAMBLE = """
import resource, sys
import jaxckpt
from jaxckpt.tools import cli
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + {headroom}, resource.getrlimit(resource.RLIMIT_AS)[1]))
path = sys.argv[1]
"""


def _in_child(script: str, path: Path, *, timeout: float = 120, headroom: int = 3 << 29) -> str:
    """Run ``script`` (with ``path`` and jaxckpt's ``cli`` at hand) in a fresh interpreter under
    RLIMIT_AS (its address space after imports plus ``headroom``: 1.5 GiB) and ``timeout``; its output."""
    code = _CHILD_PREAMBLE.format(headroom=headroom) + textwrap.dedent(script)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s: the metadata made jaxckpt loop or read without end")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# --- 5. geometry derived from huge numbers is bounded in time -------------------------------------


def _own_array(tmp_path: Path, value: np.ndarray) -> Path:
    """A checkpoint of ``value`` under the key 'w', stored as an array of its own (a/0)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(store_write, "PACK_LEAF_LIMIT", -1)
        return Path(jaxckpt.save(tmp_path / "c", {"w": value}))


def _reshape(path: Path, shape: list[int], shard: list[int], inner: list[int]) -> None:
    """Give the array 'w' (a/0) another shape and shard shape, in its index record and its zarr.json
    alike (``inner``: its inner chunk shape, as the format derives it from the shard)."""
    body = _index(path)
    body["leaves"]["w"]["shape"] = shape
    body["leaves"]["w"]["at"]["chunks"] = shard
    _write_index(path, body)
    meta_file = path / "data" / "a" / "0" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["shape"] = shape
    meta["chunk_grid"]["configuration"]["chunk_shape"] = shard
    meta["codecs"][0]["configuration"]["chunk_shape"] = inner
    meta_file.write_text(json.dumps(meta))


def test_an_empty_array_of_a_huge_dimension_is_restored_verified_and_shown_at_once(tmp_path):
    # Shape (0, 2**62) of uint8: a shard of (1, 2**62), cut into inner chunks of 8 MiB, (1, 2**23).
    path = _own_array(tmp_path, np.zeros((0, 4), np.uint8))
    _reshape(path, [0, 2**62], [1, 2**62], [1, 2**23])
    out = _in_child(
        """
        w = jaxckpt.restore(path)["w"]
        print("restored", w.shape, w.dtype)
        print("verify", cli.main(["verify", path]))
        print("show", cli.main(["show", path, "w"]))
        """,
        path,
    )
    assert f"restored (0, {2**62}) uint8" in out and "verify 0" in out and "show 0" in out, out


def test_a_shape_that_numpy_cannot_hold_is_refused(tmp_path):
    path = _own_array(tmp_path, np.zeros((0, 4), np.float32))
    _reshape(path, [0, 2**62], [1, 2**62], [1, 2**21])  # 2**64 bytes a row: numpy's limit is 2**63
    out = _in_child(
        """
        try:
            jaxckpt.restore(path)
        except jaxckpt.CheckpointFormatError as e:
            print("refused", e)
        """,
        path,
    )
    assert "refused" in out and "'w'" in out and "shape" in out, out


def test_the_bounded_divisor_search_finds_what_the_format_always_derived():
    """The inner chunk shape is part of the format: the search bounded in time must give the rows an
    inner chunk holds exactly as before, the largest divisor of the size that fits, unless that is
    over ``_TOO_FINE`` times too small."""

    def reference(n: int, rows: int) -> int | None:
        best = max(d for d in range(1, min(n, rows) + 1) if n % d == 0)
        return best if best * zarr_meta._TOO_FINE >= rows else None

    for rows in (1, 2, 3, 7, 8, 9, 17, 64, 100, 1000):
        for n in range(1, 700):
            assert zarr_meta._divisor(n, rows) == reference(n, rows), (n, rows)
    assert zarr_meta._divisor(3_000_000, 2**21) == 1_500_000
    assert zarr_meta._divisor(2**62, 2**23) == 2**23
    assert zarr_meta._divisor(2**61 - 1, 2**23) is None  # a prime: no chunk of it fits
    assert zarr_meta.inner_chunk_shape([1000, 4096], 4) == (500, 4096)  # 512 rows fit
    assert zarr_meta.shard_shape([1009, 4096], [1009, 4096], 4) == (1024, 4096)  # prime: padded


# --- 6. tiny shards and chunks: the objects a read plans are bounded by the bytes held ------------


_RESTORE_AND_VERIFY = """
try:
    jaxckpt.restore(path)
    print("restored")
except jaxckpt.JaxckptError as e:
    print("refused:", type(e).__name__, e)
print("verify", cli.main(["verify", path]))
"""


def test_an_array_cut_into_a_million_one_element_shards_is_refused_before_planning(tmp_path):
    # 4 MB of float32 in one shard file, claimed to be a million shard files of one element each:
    # planning each one's read took 4.6 KB of memory and 30 us, before any file was opened.
    path = _own_array(tmp_path, np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024))
    _reshape(path, [1024, 1024], [1, 1], [1, 1])
    out = _in_child(_RESTORE_AND_VERIFY, path)
    assert "refused: CheckpointCorruptedError" in out and "'w'" in out and "verify 1" in out, out


def test_a_pack_cut_into_one_byte_chunks_is_refused_before_planning(tmp_path):
    # Eight leaves of 1 MB packed together: one shard of two 4 MiB inner chunks, claimed to be eight
    # million chunks of one byte.
    tree = {f"w{i}": np.full(250_000, i, np.float32) for i in range(8)}
    path = Path(jaxckpt.save(tmp_path / "c", tree))
    body = _index(path)
    assert [(p["nbytes"] >= 8_000_000, p["chunk"]) for p in body["packs"]] == [(True, 4 << 20)]
    body["packs"][0]["chunk"] = 1
    _write_index(path, body)
    meta_file = path / "data" / "p" / "0" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [body["packs"][0]["nbytes"]]  # one chunk fills it
    meta["codecs"][0]["configuration"]["chunk_shape"] = [1]
    meta_file.write_text(json.dumps(meta))
    out = _in_child(_RESTORE_AND_VERIFY, path)
    assert "refused: CheckpointFormatError" in out and "chunk" in out and "verify 1" in out, out


@pytest.mark.parametrize("saved, restored", [(("x",), (None, "x")), (("x", None), ("x", None)), ((None, "x"), ("x",))])
def test_an_array_in_many_small_shards_restores(tmp_path, small_packs, saved, restored):
    """A (64, 64) int8 array sharded over the 8 devices: 8 shard files of 512 bytes, each mostly its
    own index and checksums. Restored onto another sharding, every device reads from all 8."""
    mesh = jax.make_mesh((8,), ("x",))
    value = np.arange(64 * 64, dtype=np.int32).astype(np.int8).reshape(64, 64)
    x = jax.device_put(value, NamedSharding(mesh, P(*saved)))
    path = Path(jaxckpt.save(tmp_path / "c", {"w": x}))
    assert len([f for f in (path / "data" / "a" / "0" / "c").rglob("*") if f.is_file()]) == 8
    like = {"w": jax.ShapeDtypeStruct((64, 64), np.int8, sharding=NamedSharding(mesh, P(*restored)))}
    got = jaxckpt.restore(path, like=like)["w"]
    np.testing.assert_array_equal(np.asarray(got), value)
    assert got.sharding == like["w"].sharding
    assert cli.main(["verify", str(path)]) == 0


def test_an_array_cut_into_more_shards_than_any_save_writes_is_refused_by_the_parser(tmp_path):
    path = _own_array(tmp_path, np.zeros((1100, 1000), np.uint8))
    _reshape(path, [1100, 1000], [1, 1], [1, 1])  # 1.1 million shards: more than one per device of any index
    out = _in_child(_RESTORE_AND_VERIFY, path)
    assert "refused: CheckpointFormatError" in out and "'w'" in out and "1,048,576 shards" in out, out


@pytest.mark.parametrize(
    "boxes, step, cells",
    [
        ([], (4, 4), 0),
        ([[(0, 8), (0, 8)]], (4, 4), 4),
        ([[(1, 3), (0, 8)]], (4, 4), 2),  # part of a shard touches all of it
        ([[(0, 8), (8 * i, 8 * i + 8)] for i in range(8)], (8, 64), 1),  # eight columns of one shard
        ([[(8 * j, 8 * j + 8), (8 * i, 8 * i + 8)] for i in range(8) for j in range(8)], (8, 64), 8),
        ([[(0, 4), (0, 4)], [(2, 6), (2, 6)]], (1, 1), 16 + 16 - 4),
        ([[(0, 0), (0, 4)]], (1, 1), 0),
    ],
)
def test_grid_cells_counts_the_shards_a_read_touches_once(boxes, step, cells):
    assert records.grid_cells(boxes, step) == cells
