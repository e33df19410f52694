"""How many requests each operation makes on a bucket, counted by a recording proxy
(tests/bucket_proxy.py) in front of the tests' server; and that a path is parsed once per public call.

On a bucket every request is a round trip, billed and throttled: a restore reads its index and the
data objects it needs, each once, and nothing else; a save writes each object once and asks nothing
it knows already; ``jaxckpt ls`` of a manager's directory reads its state file once and each
checkpoint's index once.

A small file (an index, a state file, a data store's checksums) is read bounded: first one byte past
jaxckpt's limit for it (a missing object answers there too), then the whole object. TensorStore can
fetch no more than a limit in one request: a ranged read past an object's end is refused
(OUT_OF_RANGE), suffix ranges alike, and its listings carry no sizes. So "read once" is two
requests for those, counted as such below.

Parametrized over the servers in :data:`SERVERS` (moto for ``s3://``, the GCS emulator for ``gs://``).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest
import tensorstore as ts
from bucket_proxy import BucketProxy
from conftest import BUCKET

import jaxckpt
from jaxckpt.arrays import store_write
from jaxckpt.storage import locations
from jaxckpt.tools import cli

# scheme -> (the conftest fixture that starts its server and gives its environment, the variable
# in that environment that names the endpoint, which a proxy of the test's own takes the place of);
# None: this process reaches the server through the session's proxy, that fixture (TensorStore keeps
# one GCS endpoint per process).
SERVERS = {"s3": ("s3_server", "AWS_ENDPOINT_URL"), "gs": ("gcs_proxy", None)}

BOUNDED_READ = 2  # requests for one bounded read of a small file that is there (see above)
DATA = re.compile(r"data(\.p[0-9]+)?/[ap]/[0-9]+/c(/[0-9]+)*")  # a data object's key (a shard, a pack)


class Bucket(NamedTuple):
    scheme: str
    url: str  # this test's prefix: scheme://bucket/name
    prefix: str  # its key prefix in the bucket, ending in "/"
    proxy: BucketProxy

    def requests(self) -> list[tuple[str, str]]:
        """(method, key under this test's prefix) of each request since the last ``clear``; a listing
        is ("LIST", the prefix listed, under this test's)."""
        return [_request(self.scheme, method, path, self.prefix) for method, path in self.proxy.requests]

    def keys(self) -> list[str]:
        """Every key under this test's prefix (listed without the proxy's counting)."""
        kv = ts.KvStore.open(locations.location(self.url).spec(), context=store_write._context()).result()
        keys = [k.decode() for k in kv.list().result()]
        self.proxy.clear()
        return keys


def _request(scheme: str, method: str, path: str, prefix: str) -> tuple[str, str]:
    """A request in the S3 vocabulary: GET, PUT, HEAD, DELETE of a key, or LIST of a prefix."""
    where = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(where.query)
    if scheme == "s3":
        if method == "GET" and "list-type" in query:
            return "LIST", query.get("prefix", [""])[0].removeprefix(prefix)
        key = urllib.parse.unquote(where.path).removeprefix(f"/{BUCKET}/")
    elif scheme == "gs":  # the JSON API, as TensorStore's gcs driver speaks it
        if where.path == f"/upload/storage/v1/b/{BUCKET}/o":  # ?uploadType=media&name=KEY
            method, key = "PUT", query["name"][0]
        elif where.path == f"/storage/v1/b/{BUCKET}/o":
            # A listing by key range (startOffset=P&endOffset=P0, its end the prefix's successor), with
            # no prefix: what it lists is the range's start.
            assert method == "GET", (method, path)
            return "LIST", query.get("prefix", query.get("startOffset", [""]))[0].removeprefix(prefix)
        else:  # /storage/v1/b/BUCKET/o/KEY (quoted), read with ?alt=media
            key = urllib.parse.unquote(where.path.removeprefix(f"/storage/v1/b/{BUCKET}/o/"))
            if method == "GET" and query.get("alt") != ["media"]:
                method = "HEAD"  # the object's metadata, not its bytes
    else:
        raise NotImplementedError(f"say how a {scheme} request names its object")
    assert key.startswith(prefix), (method, path)
    return method, key.removeprefix(prefix)


@pytest.fixture(params=sorted(SERVERS))
def bucket(request, monkeypatch):
    """A recording proxy in front of the server for the scheme, and this test's prefix there."""
    scheme = request.param
    fixture, endpoint_variable = SERVERS[scheme]
    name = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)
    if endpoint_variable is None:  # the session's proxy, its environment set for the session
        yield Bucket(scheme, f"{scheme}://{BUCKET}/{name}", f"{name}/", request.getfixturevalue(fixture))
        return
    env = request.getfixturevalue(fixture)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    proxy = BucketProxy(env[endpoint_variable])
    monkeypatch.setenv(endpoint_variable, proxy.endpoint)
    try:
        yield Bucket(scheme, f"{scheme}://{BUCKET}/{name}", f"{name}/", proxy)
    finally:
        proxy.close()


TREE = {
    "w": np.arange(300_000, dtype=np.float32).reshape(300, 1000),  # over the pack limit: an array of its own
    "v": np.ones((400, 1000), np.float32),
    "b": np.arange(10, dtype=np.int32),  # packed
    "step": 3,
}


def _data_objects(keys: list[str], under: str = "") -> list[str]:
    return sorted(k.removeprefix(under) for k in keys if k.startswith(under) and DATA.fullmatch(k.removeprefix(under)))


def _reads(requests: list[tuple[str, str]]) -> Counter[tuple[str, str]]:
    return Counter(requests)


@pytest.mark.usefixtures("local_packing")  # arrays of their own, as on local disks
def test_a_restore_reads_the_index_and_each_data_object_once(bucket):
    path = jaxckpt.save(f"{bucket.url}/c", TREE)
    data = _data_objects(bucket.keys(), "c/")
    assert len(data) >= 3  # two arrays and a pack, at least
    for like in (jaxckpt.restore, lambda p: jaxckpt.restore(p, like=TREE)):
        bucket.proxy.clear()
        restored = like(path)
        np.testing.assert_array_equal(restored["w"], TREE["w"])
        expected = Counter({("GET", "c/index.json"): BOUNDED_READ, ("GET", "c/data/checksums.json"): BOUNDED_READ})
        expected.update(("GET", f"c/{key}") for key in data)  # no zarr.json: the index implies them
        assert _reads(bucket.requests()) == expected
        assert len(bucket.requests()) == 2 * BOUNDED_READ + len(data)  # 2 + 2 + 3 here; 10 before


def test_reading_one_value_reads_only_its_data(bucket):
    path = jaxckpt.save(f"{bucket.url}/c", TREE)
    bucket.keys()
    np.testing.assert_array_equal(jaxckpt.load_variable(path, "b"), TREE["b"])
    requests = bucket.requests()
    assert [r for r in requests if r[1] != "c/index.json"] == [("GET", "c/data/p/0/c/0")]  # its pack, no zarr.json
    assert len(requests) == BOUNDED_READ + 1


def test_a_save_writes_each_object_once_and_reads_nothing_it_knows(bucket):
    jaxckpt.save(f"{bucket.url}/c", TREE)
    requests = bucket.requests()
    keys = bucket.keys()
    assert _reads(requests) == Counter(
        [("LIST", "c/"), ("PUT", "c/.jaxckpt-save"), ("DELETE", "c/.jaxckpt-save")] + [("PUT", k) for k in keys]
    )
    # 1 + 1 + 1 + 8 objects here: before, 16 requests for 2 arrays (a listing twice, a GET of the
    # index, a GET, HEAD and PUT per zarr.json, a listing to delete the marker).
    assert len(requests) == 3 + len(keys)


def test_a_save_over_leftovers_lists_once_more_to_delete_them(bucket):
    """An interrupted save's leftovers are deleted first; the destination is still listed once to decide."""
    kv = ts.KvStore.open(locations.location(f"{bucket.url}/c").spec(), context=store_write._context()).result()
    kv.write(".jaxckpt-save", b"left").result()
    kv.write("data/a/0/zarr.json", b"{}").result()
    bucket.proxy.clear()
    jaxckpt.save(f"{bucket.url}/c", {"x": np.arange(3)})
    requests = bucket.requests()
    assert requests[0] == ("LIST", "c/")  # what is there: leftovers, which the save may replace
    assert ("DELETE", "c/data/a/0/zarr.json") in requests
    assert not [r for r in requests if r[0] in ("GET", "HEAD")]


def _manager_run(bucket: Bucket, base: str | None = None) -> str:
    """A manager's directory (``base``/run, by default in the bucket) with two checkpoints."""
    run = f"{bucket.url if base is None else base}/run"
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(1000, np.float32))
    with jaxckpt.CheckpointManager(ckpt, run, max_to_keep=3, step_counter="step") as manager:
        for step in (1, 2):
            ckpt.step = step
            manager.save()
    bucket.proxy.clear()
    return run


def test_ls_of_a_run_reads_its_state_file_once_and_each_index_once(bucket, capsys):
    run = _manager_run(bucket)
    assert cli.main(["ls", run]) == 0
    out = capsys.readouterr().out
    expected = Counter(
        {
            ("GET", "run/index.json"): 1,  # is it a checkpoint? (no)
            ("GET", "run/checkpoint"): BOUNDED_READ,
            ("GET", "run/checkpoint.tiers"): 1,  # a two-tier manager's? (no)
            ("GET", "run/checkpoint.metadata"): 1,  # the run's metadata? (none)
            ("GET", "run/ckpt-1/index.json"): BOUNDED_READ,  # its SIZE
            ("GET", "run/ckpt-2/index.json"): BOUNDED_READ,
        }
    )
    assert _reads(bucket.requests()) == expected  # 9; 6 before, with SIZE "missing"
    assert "missing" not in out
    rows = [line for line in out.splitlines() if line.lstrip("* ").startswith("ckpt-")]
    assert len(rows) == 2 and all(re.search(r"\d+(\.\d+)? (B|KiB)", row) for row in rows), out


def test_ls_of_a_checkpoint_reads_its_index_once(bucket, capsys):
    path = jaxckpt.save(f"{bucket.url}/c", TREE)
    bucket.proxy.clear()
    assert cli.main(["ls", path]) == 0
    assert bucket.requests() == [("GET", "c/index.json")] * BOUNDED_READ
    assert "w" in capsys.readouterr().out


@pytest.mark.usefixtures("local_packing")  # arrays of their own, as on local disks
def test_show_and_verify_read_the_index_once(bucket, capsys):
    path = jaxckpt.save(f"{bucket.url}/c", TREE)
    data = _data_objects(bucket.keys(), "c/")
    assert cli.main(["verify", path]) == 0
    expected = Counter({("GET", "c/index.json"): BOUNDED_READ, ("GET", "c/data/checksums.json"): BOUNDED_READ})
    expected.update(("GET", f"c/{key}") for key in data)
    # verify also reads each array's and pack's zarr.json: what TensorStore and zarr-python read.
    expected.update(("GET", f"c/{key.split('/c/')[0]}/zarr.json") for key in data)
    assert _reads(bucket.requests()) == expected
    bucket.proxy.clear()
    assert cli.main(["show", path, "step"]) == 0
    assert bucket.requests() == [("GET", "c/index.json")] * BOUNDED_READ  # a Python value: the index alone
    capsys.readouterr()


def test_latest_checkpoint_reads_the_state_file_once(bucket):
    run = _manager_run(bucket)
    assert jaxckpt.latest_checkpoint(run) == f"{run}/ckpt-2"
    assert bucket.requests() == [("GET", "run/checkpoint")] * BOUNDED_READ
    assert jaxckpt.latest_checkpoint(f"{bucket.url}/nothing") is None
    assert bucket.requests()[BOUNDED_READ:] == [("GET", "nothing/checkpoint")]


def test_a_restore_of_a_run_reads_its_state_file_once(bucket):
    run = _manager_run(bucket)
    data = _data_objects(bucket.keys(), "run/ckpt-2/")
    assert jaxckpt.restore(run)["step"] == 2
    expected = Counter(
        {("GET", "run/index.json"): 1, ("GET", "run/checkpoint"): BOUNDED_READ}
        | {("GET", "run/ckpt-2/index.json"): BOUNDED_READ}
    )
    expected.update(("GET", f"run/ckpt-2/{k}") for k in data)
    assert _reads(bucket.requests()) == expected


def test_a_manager_starts_and_restores_with_few_requests(bucket):
    run = _manager_run(bucket)
    data = _data_objects(bucket.keys(), "run/ckpt-2/")
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(1000, np.float32))
    manager = jaxckpt.CheckpointManager(ckpt, run, max_to_keep=3, step_counter="step")
    # Its state file, and one listing (for adoption and leftovers alike; two before).
    assert _reads(bucket.requests()) == Counter({("GET", "run/checkpoint"): BOUNDED_READ, ("LIST", "run/"): 1})
    bucket.proxy.clear()
    assert manager.restore_or_initialize() == f"{run}/ckpt-2"
    assert ckpt.step == 2
    expected = Counter({("GET", "run/ckpt-2/index.json"): BOUNDED_READ})
    expected.update(("GET", f"run/ckpt-2/{k}") for k in data)  # no zarr.json
    assert _reads(bucket.requests()) == expected
    manager.close()


# --- a path is parsed once per public call --------------------------------------------------------


@pytest.fixture
def parses(monkeypatch):
    """How many times locations.location parsed a path (a Location passed on is returned as it is)."""
    real = locations.location
    parsed: list[str] = []

    def counting(path):
        if not isinstance(path, locations.Location):
            parsed.append(str(path))
        return real(path)

    monkeypatch.setattr(locations, "location", counting)
    return parsed


@pytest.mark.parametrize("where", ["bucket", "local"])
def test_a_path_becomes_a_location_once_per_public_call(bucket, tmp_path, parses, where, capsys):
    base = bucket.url if where == "bucket" else str(tmp_path)
    run = _manager_run(bucket, base)
    calls = {
        "save": lambda: jaxckpt.save(f"{base}/c", TREE),
        "restore": lambda: jaxckpt.restore(f"{base}/c"),
        "restore like": lambda: jaxckpt.restore(f"{base}/c", like=TREE),
        "restore of a run": lambda: jaxckpt.restore(run),
        "list_variables": lambda: jaxckpt.list_variables(f"{base}/c"),
        "load_variable": lambda: jaxckpt.load_variable(f"{base}/c", "w"),
        "latest_checkpoint": lambda: jaxckpt.latest_checkpoint(run),
        "inspect": lambda: jaxckpt.inspect(f"{base}/c"),
        "inspect a run": lambda: jaxckpt.inspect(run),
        "ls": lambda: cli.main(["ls", f"{base}/c"]),
        "ls a run": lambda: cli.main(["ls", run]),
        "Checkpoint.restore": lambda: jaxckpt.Checkpoint(step=0, w=np.zeros(1000, np.float32)).restore(f"{run}/ckpt-2"),
    }
    for name, call in calls.items():
        parses.clear()
        call()
        assert len(parses) == 1, (name, parses)
    capsys.readouterr()


# --- zarr.json: not read on restore (format 5), and that can never change a value -----------------


def _array_of(bucket: Bucket, path: str, key: str) -> str:
    index = json.loads(locations.read_index_bytes(locations.location(path)))
    return index["leaves"][key]["at"]["array"]


@pytest.mark.usefixtures("local_packing")  # arrays of their own, as on local disks
def test_a_damaged_zarr_json_changes_no_value(bucket):
    path = jaxckpt.save(f"{bucket.url}/c", TREE)
    kv = ts.KvStore.open(locations.location(path).spec(), context=store_write._context()).result()
    array = _array_of(bucket, path, "w")
    meta = json.loads(kv.read(f"data/{array}/zarr.json").result().value)
    kv.write(f"data/{array}/zarr.json", json.dumps({**meta, "data_type": "int32"}).encode()).result()
    np.testing.assert_array_equal(jaxckpt.restore(path)["w"], TREE["w"])  # read as the index says
    kv.write(f"data/{array}/zarr.json", b"\0garbage").result()
    np.testing.assert_array_equal(jaxckpt.load_variable(path, "w"), TREE["w"])


@pytest.mark.usefixtures("local_packing")  # arrays of their own, as on local disks
def test_an_array_rewritten_with_its_own_zarr_json_is_refused_not_read(bucket):
    """Another tool rewrites an array in place, zarr.json and shards consistent with each other but
    not with the index (other values, another chunking): an error, never those values."""
    path = jaxckpt.save(f"{bucket.url}/c", TREE)
    location = locations.location(path)
    array = _array_of(bucket, path, "w")
    folder = {**location.spec(), "path": location.spec()["path"] + f"data/{array}/"}
    for chunks in ([300, 1000], [100, 1000]):
        ts.KvStore.open(folder, context=store_write._context()).result().delete_range(ts.KvStore.KeyRange()).result()
        store = ts.open(
            {"driver": "zarr3", "kvstore": folder, "metadata": {"shape": [300, 1000], "data_type": "float32",
             "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}}}},
            create=True,
            context=store_write._context(),
        ).result()  # fmt: skip
        store.write(np.full((300, 1000), 7, np.float32)).result()
        with pytest.raises(jaxckpt.CheckpointCorruptedError):
            jaxckpt.restore(path)
