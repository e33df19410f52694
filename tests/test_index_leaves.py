"""jaxckpt.format.index_json: records of small packed arrays checked in short give the leaves, and the
errors, that the full parser gives."""

import json

import numpy as np
import pytest

import jaxckpt
from jaxckpt._errors import CheckpointFormatError
from jaxckpt.format import checked_json, index_json


def _full_only(records, packs, version, full):
    return {key: full(key, raw) for key, raw in records.items()}


def _body(tmp_path) -> dict:
    tree = {f"w{i}": np.full(16, i, np.float32) for i in range(6)}
    tree["b"] = np.arange(3, dtype=np.int8)  # another kind
    jaxckpt.save(tmp_path / "c", tree)
    body = json.loads((tmp_path / "c" / "index.json").read_bytes())
    del body["checksum"]
    return body


def _decode(body: dict, monkeypatch=None):
    data = checked_json.checksummed_json(body)
    if monkeypatch is None:
        return index_json.decode_index(data, "index")
    with monkeypatch.context() as m:
        m.setattr(index_json, "parse_leaves", _full_only)
        return index_json.decode_index(data, "index")


def test_leaves_are_those_the_full_parser_gives(tmp_path, monkeypatch):
    body = _body(tmp_path)
    ours, theirs = _decode(body), _decode(body, monkeypatch)
    assert ours.leaves == theirs.leaves
    assert ours.leaves["w5"].shape is ours.leaves["w1"].shape  # one kind shares its shape


@pytest.mark.parametrize(
    "change",
    [
        {"offset": 10**9},
        {"nbytes": 60},
        {"pack": True},
        {"pack": 7},
        {"offset": -64},
        {"crc32c": -1},
        {"crc32c": 1.5},
        {"array": "a/0"},
    ],
    ids=repr,
)
def test_a_bad_place_of_a_known_kind_fails_as_in_the_full_parser(tmp_path, monkeypatch, change):
    body = _body(tmp_path)
    body["leaves"]["w4"]["at"].update(change)
    with pytest.raises(CheckpointFormatError) as theirs:
        _decode(body, monkeypatch)
    with pytest.raises(CheckpointFormatError) as ours:
        _decode(body)
    assert str(ours.value) == str(theirs.value) and "'w4'" in str(ours.value)


@pytest.mark.parametrize(
    "change",
    [{"shape": [16.0]}, {"shape": [True] * 16}, {"sharding": 3}, {"dtype": "float33"}, {"type": "prng_key"}],
    ids=repr,
)
def test_a_record_of_another_form_goes_through_the_full_parser(tmp_path, monkeypatch, change):
    body = _body(tmp_path)
    body["leaves"]["w4"].update(change)
    with pytest.raises(CheckpointFormatError) as theirs:
        _decode(body, monkeypatch)
    with pytest.raises(CheckpointFormatError) as ours:
        _decode(body)
    assert str(ours.value) == str(theirs.value)
