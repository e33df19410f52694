"""Data iterator state (``get_state()`` / ``set_state()``): a real grain iterator, and per-process states.

grain's checkpointing saves one state per process (``process_{i}-of-{n}.json``) and reads the one of
the restoring process's index and count; a run with another process count finds none. jaxckpt
keeps the same rule inside one checkpoint: the per-process states of a key differ, each process gets
its own back, and another process count is refused naming the key and both counts.
"""

from __future__ import annotations

import base64
import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.format import checked_json, index_encode, index_json, records

grain = pytest.importorskip("grain")


def _manager(ckpt, directory):
    return jaxckpt.CheckpointManager(ckpt, directory, async_save=False)


def test_grain_dataloader_iterator_resumes_where_it_was_saved(tmp_path):
    # As grain's docs write a DataLoader: a data source, an IndexSampler, operations, no workers.
    def loader():
        source = grain.sources.RangeDataSource(0, 40, 1)
        sampler = grain.samplers.IndexSampler(
            num_records=len(source), shuffle=True, seed=0, num_epochs=1, shard_options=grain.sharding.NoSharding()
        )
        return grain.DataLoader(
            data_source=source, sampler=sampler, operations=[grain.transforms.Batch(batch_size=4)], worker_count=0
        )

    iterator = iter(loader())
    ckpt = jaxckpt.Checkpoint(data=iterator, w=jnp.zeros(2))
    with _manager(ckpt, tmp_path) as manager:
        for step in range(3):
            next(iterator)
            manager.save(step=step)
    expected = [next(iterator) for _ in range(3)]
    resumed = iter(loader())
    with _manager(jaxckpt.Checkpoint(data=resumed, w=jnp.zeros(2)), tmp_path) as manager:
        manager.restore(2).assert_consumed()
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)


def test_grain_map_dataset_iterator_resumes_where_it_was_saved(tmp_path):
    dataset = grain.MapDataset.range(30).shuffle(seed=1).map(lambda x: x * 2).batch(3)
    iterator = iter(dataset)
    for _ in range(4):
        next(iterator)
    jaxckpt.Checkpoint(data=iterator).write(tmp_path / "ckpt")
    expected = [next(iterator) for _ in range(3)]
    resumed = iter(dataset)
    jaxckpt.Checkpoint(data=resumed).restore(tmp_path / "ckpt").assert_consumed()
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)


class Counter:
    def __init__(self) -> None:
        self.position = 0

    def get_state(self) -> dict[str, int]:
        return {"position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _per_process(path, key, states):
    """Rewrite the checkpoint at ``path`` as if ``len(states)`` processes had saved these states of ``key``."""
    index_file = path / "index.json"
    index = index_json.decode_index(index_file.read_bytes(), "index.json")
    leaves = tuple(records.ValueLeaf("state_bytes" if isinstance(s, bytes) else "state", s) for s in states)
    index.leaves[key] = records.ValueLeaf("state_per_process", leaves)
    index_file.write_bytes(index_encode.encode_index(index))


def test_per_process_states_are_written_and_read_back(tmp_path):
    path = jaxckpt.Checkpoint(data=Counter()).write(tmp_path / "ckpt")
    _per_process(tmp_path / "ckpt", "data", [{"position": 3}, b"\x00\xff"])
    raw = json.loads((tmp_path / "ckpt" / "index.json").read_text())["leaves"]["data"]
    assert raw == {
        "type": "state_per_process",
        "value": [
            {"type": "state", "value": {"position": 3}},
            {"type": "state_bytes", "value": base64.b64encode(b"\x00\xff").decode()},
        ],
    }
    # Without a template: every process's state, in process order.
    assert jaxckpt.restore(path)["data"] == [{"position": 3}, b"\x00\xff"]


def test_per_process_states_of_another_process_count_are_refused_naming_key_and_counts(tmp_path):
    path = jaxckpt.Checkpoint(data=Counter()).write(tmp_path / "ckpt")
    _per_process(tmp_path / "ckpt", "data", [{"position": 3}, {"position": 5}])
    fresh = Counter()
    with pytest.raises(jaxckpt.MismatchError, match=r"'data'.*2 processes.*1 process"):
        jaxckpt.Checkpoint(data=fresh).restore(path)
    assert fresh.position == 0  # never another process's state


def test_a_crafted_per_process_state_is_refused_by_name(tmp_path):
    path = jaxckpt.Checkpoint(data=Counter()).write(tmp_path / "ckpt")
    index_file = tmp_path / "ckpt" / "index.json"
    for value in ([{"type": "int", "value": 1}], [[1]], "x", [{"type": "state_per_process", "value": []}]):
        body = json.loads(index_file.read_text())
        body["leaves"]["data"] = {"type": "state_per_process", "value": value}
        raw = checked_json.checksummed_json({k: v for k, v in body.items() if k != "checksum"})
        with pytest.raises(jaxckpt.JaxckptError, match="data"):
            index_json.decode_index(raw, "index.json")
    del path


def test_per_process_states_are_listed_and_converted(tmp_path, capsys):
    from jaxckpt.tools import cli

    path = jaxckpt.Checkpoint(data=Counter()).write(tmp_path / "ckpt")
    _per_process(tmp_path / "ckpt", "data", [{"position": 3}, b"\x00\xff"])
    assert "state_per_process" in repr(jaxckpt.inspect(path))
    assert cli.main(["ls", "--json", str(path)]) == 0
    listed = {v["key"]: v for v in json.loads(capsys.readouterr().out)["leaves"]}
    assert listed["data"]["value"] == [
        {"type": "state", "value": {"position": 3}},
        {"type": "state_bytes", "value": "AP8="},
    ]
    assert cli.main(["convert", str(path), str(tmp_path / "out")]) == 0
    assert jaxckpt.restore(tmp_path / "out")["data"] == [{"position": 3}, b"\x00\xff"]
