"""Pod scale (issue 18): what a save by N processes records, and what a restoring process opens, do
not grow with N. Checkpoints of up to 4,096 processes are simulated (benchmarks/simulate_pod.py):
the index a save by N processes writes, and the data store of one of them."""

import copy
import json
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.format import records as _format
from jaxckpt.saving import pipeline
from jaxckpt.storage import locations

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from simulate_pod import build, restore_own, value


def index_size(tmp_path, processes, arrays=2000):
    folder = tmp_path / f"n{processes}"
    build(folder, processes, arrays, me=0, writers=[])
    return (folder / "index.json").stat().st_size


def test_the_index_of_1024_processes_and_2000_arrays_fits_2_mib_and_hardly_grows(tmp_path):
    sizes = {n: index_size(tmp_path, n) for n in (2, 1024, 4096)}
    assert sizes[1024] <= 2 << 20, sizes
    # Only the device table (id and process, then the mesh's ids: about 14 bytes a device, once per
    # checkpoint) and the digits of the shapes grow.
    assert sizes[4096] - sizes[2] <= 24 * 4096, sizes
    # Format version 2 listed every region of every process: 64 processes of 100 arrays already cost more.
    folder = tmp_path / "explicit"
    build(folder, 64, 100, me=0, explicit=True, writers=[])
    assert (folder / "index.json").stat().st_size > 2 * index_size(tmp_path, 4096, arrays=100)


@pytest.mark.parametrize("me", [0, 37, 63])
def test_a_same_mesh_restore_opens_one_data_store(tmp_path, me):
    index = build(tmp_path / "c", 64, 20, me)  # only process me's store exists: any other would fail
    assert restore_own(tmp_path / "c", index, me) == [_format.data_store(me)]


def test_with_several_devices_per_process_still_one_store(tmp_path):
    index = build(tmp_path / "c", 16, 10, 5, devices_per_process=4)
    assert restore_own(tmp_path / "c", index, 5, devices_per_process=4) == ["data.p5"]


def test_a_process_reading_two_processes_regions_opens_their_two_stores(tmp_path):
    index = build(tmp_path / "c", 32, 10, me=0, writers=[6, 7])
    opened = jaxckpt.reading.reader.Opened(locations.location(tmp_path / "c"))
    wanted = {k: [(slice(12, 16), slice(0, 16))] for k in index.leaves}  # rows of processes 6 and 7
    got = opened.read_regions(wanted)
    for i, key in enumerate(index.leaves):
        np.testing.assert_array_equal(got[key][0], value(i, (64, 16))[12:16])
    assert opened.stores_opened == ["data.p6", "data.p7"]


@pytest.mark.parametrize("explicit", [False, True])
def test_every_process_wrote_its_share_and_one_cpu_reads_it_all(tmp_path, explicit):
    index = build(tmp_path / "c", 4, 3, me=0, explicit=explicit, writers=[0, 1, 2, 3])
    for i, key in enumerate(index.leaves):
        np.testing.assert_array_equal(jaxckpt.load_variable(tmp_path / "c", key), value(i, (8, 16)))
    restored = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(restored["layer00002"]["w"], value(2, (8, 16)))
    assert dict(jaxckpt.list_variables(tmp_path / "c"))["layer00001/w"] == (8, 16)


# --- layouts agree with JAX's own device -> index map ---------------------------------------------


SPECS = [P("x"), P("x", "y"), P("y", "x"), P(("x", "y")), P(("y", "x")), P(None, "y"), P(), P(None, ("x", "y"))]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("order", ["plain", "shuffled"])
def test_a_layout_gives_the_regions_and_writers_that_jax_gives(spec, order):
    devices = np.array(jax.devices()[:8])
    if order == "shuffled":
        devices = devices[[5, 2, 7, 0, 3, 6, 1, 4]]
    mesh = Mesh(devices.reshape(4, 2), ("x", "y"))
    x = jax.device_put(np.zeros((16, 8), np.float32), NamedSharding(mesh, spec))
    owners = pipeline._owners(x)
    found = pipeline._layout(x, owners, {})
    assert found is not None
    # As if every device were its own process: the data store then names the device that writes.
    by_device = _format.Layout(
        _format.MeshRecord(found.mesh.axes, found.mesh.shape, found.mesh.devices, found.mesh.devices), found.spec
    )
    computed = _format.regions(_format.InArray("", "", layout=by_device), x.shape)
    expected = {}
    for region, device in owners.items():
        expected.setdefault(_format.data_store(device.id), []).append([tuple(r) for r in region])
    assert {s: sorted(r) for s, r in computed.items()} == {s: sorted(r) for s, r in expected.items()}


def test_regions_that_no_layout_gives_are_listed_region_by_region():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    x = jax.device_put(np.zeros((16, 8), np.float32), NamedSharding(mesh, P("x")))
    y = jax.device_put(np.zeros((16, 8), np.float32), NamedSharding(mesh, P(None, "y")))
    assert pipeline._layout(x, pipeline._owners(x), {}) is not None
    assert pipeline._layout(x, pipeline._owners(y), {}) is None  # the save then lists x's regions, as version 2 did
    assert pipeline._layout(jax.device_put(np.zeros(4), jax.devices()[0]), {((0, 4),): None}, {}) is None


def test_equal_meshes_are_recorded_once():
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    x = jax.device_put(np.zeros((16, 8), np.float32), NamedSharding(Mesh(devices, ("x", "y")), P("x")))
    y = jax.device_put(np.zeros((8, 8), np.float32), NamedSharding(Mesh(devices.copy(), ("x", "y")), P("y")))
    meshes = {}
    assert (
        pipeline._layout(x, pipeline._owners(x), meshes).mesh is pipeline._layout(y, pipeline._owners(y), meshes).mesh
    )


# --- crafted layouts: refused, never obeyed -------------------------------------------------------


def rewrite(path, edit):
    body = json.loads((path / "index.json").read_bytes())
    body.pop("checksum")
    body = copy.deepcopy(body)
    edit(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    (path / "index.json").write_bytes(b'{"checksum":"crc32:%08x",' % zlib.crc32(canonical) + canonical[1:])


def at(body):
    return body["leaves"]["layer00000/w"]["at"]


CRAFTED = {
    "mesh out of range": (lambda b: at(b).update(mesh=7), "mesh 7 is not one of"),
    "negative mesh": (lambda b: at(b).update(mesh=-1), "mesh -1"),
    "unknown axis": (lambda b: at(b).update(spec=[["z"], None]), "axes that mesh"),
    "axis used twice": (lambda b: at(b).update(spec=[["x"], ["x"]]), "axis twice"),
    "uneven split": (
        lambda b: (b["leaves"]["layer00000/w"].update(shape=[8, 6]), at(b).update(spec=[None, ["x"]], chunks=[2, 6])),
        "6 into 4 uneven",
    ),
    "spec of wrong rank": (lambda b: at(b).update(spec=[["x"]]), "one entry per dimension"),
    "spec not a list": (lambda b: at(b).update(spec="x"), "'spec' has type"),
    "layout and regions": (lambda b: at(b).update(regions={"data": [[[0, 8], [0, 16]]]}), "both"),
    "device not in the table": (lambda b: b["meshes"][0]["devices"].__setitem__(0, 99), "not in the device table"),
    "duplicate device ids": (lambda b: b["devices"]["id"].__setitem__(1, 0), "duplicate ids"),
    "process beyond data.p999999": (lambda b: b["devices"]["process"].__setitem__(1, 10**6), "integers from 0"),
    "mesh shape of 2**62": (lambda b: b["meshes"][0].update(shape=[2**62]), "integers from 1"),
    "mesh shape that devices do not fill": (lambda b: b["meshes"][0].update(shape=[2, 4]), "do not fill"),
    "no device table": (lambda b: b.pop("devices"), "missing field 'devices'"),
    "meshes not a list": (lambda b: b.update(meshes={"0": 1}), "'meshes' has type"),
    "duplicate axes": (lambda b: b["meshes"][0].update(axes=["x", "x"], shape=[2, 2]), "distinct names"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_layout_is_refused(tmp_path, case):
    edit, message = CRAFTED[case]
    path = tmp_path / "c"
    build(path, 4, 2, me=0, writers=[0, 1, 2, 3])
    rewrite(path, edit)
    with pytest.raises(jaxckpt.CheckpointFormatError, match=message):
        jaxckpt.list_variables(path)


def test_an_index_of_version_2_with_a_layout_ignores_it_and_needs_regions(tmp_path):
    path = tmp_path / "c"
    build(path, 4, 2, me=0, writers=[0, 1, 2, 3])
    rewrite(path, lambda b: b.update(version=2))  # a version 2 reader knew no layouts: the array is process 0's
    with pytest.raises(jaxckpt.JaxckptError):
        jaxckpt.restore(path)


def test_fuzzed_layouts_only_raise_jaxckpt_errors(tmp_path):
    """tests/test_fuzz.py's hostile edits, on the index of a simulated 4-process save (layouts, meshes,
    the device table)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_fuzz import Outcomes, guarded, index_bytes, mutate

    path = tmp_path / "c"
    build(path, 4, 3, me=0, writers=[0, 1, 2, 3])
    body = json.loads((path / "index.json").read_bytes())
    body.pop("checksum")
    outcomes = Outcomes()

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        (path / "index.json").write_bytes(index_bytes(data, mutate(data, body)))
        with guarded():
            outcomes.call(jaxckpt.restore, path)
            for key, _ in outcomes.call(jaxckpt.list_variables, path) or []:
                outcomes.call(jaxckpt.load_variable, path, key)

    run()
    assert sum(outcomes.values()) > outcomes["ok"]
