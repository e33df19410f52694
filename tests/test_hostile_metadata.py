"""Hostile metadata (issue "Data safety, round three: format 4 attacked"): an index whose numbers are
consistent enough to pass a shallow check, but describe regions that overlap and leave a gap, a
geometry whose derivation would never end, or millions of tiny shards and chunks. Each must give a
jaxckpt error naming the key, quickly and in bounded memory, never garbage, a hang or an exhausted
host; and a legitimate checkpoint with many small shards still restores.
"""

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt import _cli, _format, _read_plan

GOLDEN = Path(__file__).parent / "golden"


def _index(path: Path) -> dict:
    return json.loads((Path(path) / "index.json").read_text())


def _write_index(path: Path, body: dict) -> None:
    """Rewrite the index with a valid checksum, as an attacker would."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    data = b'{"checksum":"crc32:%08x",' % zlib.crc32(canonical) + canonical[1:] + b"\n"
    (Path(path) / "index.json").write_bytes(data)


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
    assert _cli.main(["verify", str(path)]) == 1
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
    assert (_format.tiling_problem(boxes, (6, 2)) is None) == tiles


def test_a_region_read_from_parts_that_do_not_tile_it_is_refused():
    """Defence in depth: regions that were never checked by the index's parser (an index built in
    memory) still cannot hand out a buffer whose uncovered part was never written."""
    at = _format.InArray("a/3", "int16", {"data.p1": [[(3, 6), (0, 1)], [(3, 6), (0, 1)]], "data": [[(0, 3), (0, 2)]]})
    with pytest.raises(jaxckpt.CheckpointFormatError, match="a/3"):
        _read_plan.plan_region(at, (6, 2), (slice(0, 6), slice(0, 2)))


def test_tiling_problem_of_a_high_rank_array():
    shape = (2,) * 20 + (1,) * 44
    halves = [[(0, 1)] + [(0, n) for n in shape[1:]], [(1, 2)] + [(0, n) for n in shape[1:]]]
    assert _format.tiling_problem(halves, shape) is None
    assert "overlap" in _format.tiling_problem([halves[0], halves[0]], shape)
