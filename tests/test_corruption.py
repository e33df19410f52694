"""Damaged files: every flipped byte and every truncation is an error that names what, or harmless.

Each file of a checkpoint (index.json, each array's zarr.json, each shard file: format version 4
keeps every array as a zarr3 array in a plain folder, one file per shard), in turn, gets bytes
flipped at random positions and is truncated at several lengths. Then ``restore`` and ``verify``
(the CLI) must agree: either both report the damage, with a message naming the index or a key
of the checkpoint, or ``restore`` returns exactly the original values (a flip in unused bytes such
as a pack's alignment padding changes nothing observable) and ``verify`` finds nothing. Wrong data
is never returned. Counts are printed (``pytest -s``); ``JAXCKPT_TEST_SEED`` replays a run.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import random
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.arrays import store_write
from jaxckpt.tools import cli


def original_tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)  # random values, so that a flipped bit cannot go unseen
    mesh = Mesh(np.array(jax.devices()), ("x",))
    big = rng.standard_normal((64, 256)).astype(np.float32)
    sparse = np.zeros((64, 256), np.float32)
    sparse[:8] = rng.standard_normal((8, 256))  # 7 shards of 8 are zeros (stored all the same)
    return {
        "packed_f32": rng.standard_normal(16).astype(np.float32),
        "packed_i32": rng.integers(-1000, 1000, 100).astype(np.int32),
        "own_f32": rng.standard_normal(2000).astype(np.float32),
        "own_sharded": jax.device_put(big, NamedSharding(mesh, P("x"))),  # 8 chunks
        "own_mostly_zeros": jax.device_put(sparse, NamedSharding(mesh, P("x"))),
        "own_bf16": rng.standard_normal(3000).astype(jax.numpy.bfloat16),
        "step": 7,
        "name": "run-1",
    }


KEYS = sorted(original_tree())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint whose leaves over 4 KiB have their own zarr3 array; the rest are packed."""
    path = tmp_path_factory.mktemp("corruption") / "pristine"
    real = store_write.PACK_LEAF_LIMIT
    store_write.PACK_LEAF_LIMIT = 4096
    try:
        jaxckpt.save(path, original_tree())
    finally:
        store_write.PACK_LEAF_LIMIT = real
    return path, jaxckpt.restore(path)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape):
                return False
            if x.tobytes() != y.tobytes():  # bit for bit
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def verify(path: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["verify", str(path)])
    return code, out.getvalue()


def damage(raw: bytes, rng: random.Random, kind: str) -> tuple[bytes, str]:
    """One flipped byte (a single bit, or a random byte) or a truncation."""
    if kind == "flip":
        pos = rng.randrange(len(raw))
        mask = 1 << rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1, 256)
        out = bytearray(raw)
        out[pos] ^= mask
        return bytes(out), f"byte {pos} ^= {mask:#04x}"
    cut = rng.choice([0, len(raw) // 2, len(raw) - 1, rng.randrange(len(raw))])
    return raw[:cut], f"truncated to {cut} of {len(raw)} bytes"


def run_damage(tmp_path: Path, pristine: tuple[Path, dict[str, Any]], flips: int, truncations: int) -> None:
    source, original = pristine
    seed = int(os.environ.get("JAXCKPT_TEST_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    files = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())
    assert "index.json" in files and any(f.endswith("/zarr.json") for f in files)
    assert any(kind_of(f) == "pack shard" for f in files) and any(kind_of(f) == "array shard" for f in files)
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    case = 0
    for name in files:
        kind_of_file = kind_of(name)
        raw = (source / name).read_bytes()
        for kind in ["flip"] * flips + ["truncate"] * truncations:
            case += 1
            work = tmp_path / f"case-{case}"  # a fresh path each time: nothing cached can hide damage
            shutil.copytree(source, work)
            damaged, how = damage(raw, rng, kind)
            (work / name).write_bytes(damaged)
            context = f"{name} {how} (seed {seed})"
            code, report = verify(work)
            try:
                restored = jaxckpt.restore(work)
            except jaxckpt.JaxckptError as e:
                message = str(e)
                if name == "index.json":
                    assert "index.json" in message, f"{context}: the error does not name the index: {message}"
                else:
                    assert any(f"'{k}'" in message for k in KEYS), f"{context}: the error names no key: {message}"
                assert code == 1, f"{context}: restore failed ({message}) but verify passed:\n{report}"
                assert "damaged" in report or "error" in report, f"{context}: {report}"
                counts[kind_of_file, "detected"] += 1
            else:
                assert same(restored, original), f"{context}: restore returned wrong data without an error"
                assert code == 0, f"{context}: verify found damage that restore did not:\n{report}"
                counts[kind_of_file, "harmless"] += 1
            shutil.rmtree(work)
    detected = sum(n for (_, outcome), n in counts.items() if outcome == "detected")
    lines = "; ".join(
        f"{f}: {counts[f, 'detected']} detected, {counts[f, 'harmless']} harmless" for f in files_kinds(files)
    )
    print(
        f"\ncorruption: {case} damaged copies, {detected} detected, {case - detected} harmless, 0 wrong (seed {seed}); {lines}"
    )
    assert detected > case * 3 // 4


def kind_of(name: str) -> str:
    """index.json, zarr.json, a data store's checksums.json, or the shard file of a pack
    (``data/p/<n>/c/...``) or an array (``data/a/...``)."""
    parts = name.split("/")
    if name == "index.json" or parts[-1] == "zarr.json" or name == "data/checksums.json":
        return parts[-1]
    assert parts[0] == "data" and parts[1] in ("a", "p") and parts[3] == "c", name
    return "pack shard" if parts[1] == "p" else "array shard"


def files_kinds(files: list[str]) -> list[str]:
    return list(dict.fromkeys(kind_of(f) for f in files))


def test_flipped_and_truncated_files(tmp_path, pristine):
    run_damage(tmp_path, pristine, flips=20, truncations=6)


@pytest.mark.stress
def test_flipped_and_truncated_files_stress(tmp_path, pristine, stress_scale):
    run_damage(tmp_path, pristine, flips=300 * stress_scale, truncations=40 * stress_scale)


def zarr_metadata(source: Path) -> list[tuple[str, int, int]]:
    """Each array's zarr.json (format version 4: a file of its own): (file, start, stop). It has no
    checksum: the reader checks it against what the index implies."""
    return [(str(f.relative_to(source)), 0, f.stat().st_size) for f in sorted((source / "data").rglob("zarr.json"))]


def run_metadata_flips(tmp_path: Path, pristine: tuple[Path, dict[str, Any]], per_array: int | None) -> None:
    """Flip bytes of the arrays' zarr.json (fill value, chunk shape, codecs...): error, or no change."""
    source, original = pristine
    rng = random.Random(int(os.environ.get("JAXCKPT_TEST_SEED", random.randrange(2**32))))
    spans = zarr_metadata(source)
    assert len(spans) >= 5, spans  # the own arrays and the pack
    counts: collections.Counter[str] = collections.Counter()
    for name, start, stop in spans:
        if per_array is None:
            positions = list(range(start, stop))
        else:  # always the fill value's bytes: their damage is the one that no checksum covers
            raw = (source / name).read_bytes()
            value = raw.index(b'"fill_value":', start, stop) + len(b'"fill_value":')
            value += raw[value:stop].startswith(b" ")
            positions = [*range(value, raw.index(b",", value)), *rng.sample(range(start, stop), per_array)]
        for pos in positions:
            work = tmp_path / f"case-{sum(counts.values())}"
            shutil.copytree(source, work)
            raw = bytearray((work / name).read_bytes())
            mask = 1 << rng.randrange(8)
            raw[pos] ^= mask
            (work / name).write_bytes(bytes(raw))
            context = f"{name} byte {pos} ^= {mask:#04x} in {bytes(raw[start:stop])!r}"
            code, report = verify(work)
            try:
                restored = jaxckpt.restore(work)
            except jaxckpt.JaxckptError as e:
                assert any(f"'{k}'" in str(e) for k in KEYS), f"{context}: the error names no key: {e}"
                assert code == 1, f"{context}: verify passed:\n{report}"
                counts["detected"] += 1
            else:
                assert same(restored, original), f"{context}: restore returned wrong data without an error"
                assert code == 0, f"{context}: {report}"
                counts["harmless"] += 1
            shutil.rmtree(work)
    print(
        f"\ncorruption: {sum(counts.values())} bit flips in zarr.json of {len(spans)} arrays: {dict(counts)}, 0 wrong"
    )


def test_flipped_zarr_metadata(tmp_path, pristine):
    run_metadata_flips(tmp_path, pristine, per_array=12)


@pytest.mark.stress
def test_flipped_zarr_metadata_stress(tmp_path, pristine):
    run_metadata_flips(tmp_path, pristine, per_array=None)


def test_a_damaged_value_spares_the_others(tmp_path, pristine):
    """Damage in one array's chunk names that key; the other values still load."""
    source, original = pristine
    path = tmp_path / "c"
    shutil.copytree(source, path)
    needle = original["own_f32"].tobytes()[4000:4064]
    for f in sorted((path / "data").rglob("*")):
        raw = bytearray(f.read_bytes()) if f.is_file() else bytearray()
        at = raw.find(needle)
        if at >= 0:
            raw[at + 9] ^= 0x40
            f.write_bytes(bytes(raw))
            break
    else:
        pytest.fail("the array's bytes are not in any data file")
    with pytest.raises(jaxckpt.CheckpointCorruptedError, match="'own_f32'"):
        jaxckpt.restore(path)
    code, report = verify(path)
    assert code == 1 and "'own_f32'" in report and "'own_sharded'" not in report
    for key in KEYS:
        if key != "own_f32":
            value = jaxckpt.load_variable(path, key)
            assert np.array_equal(value, original[key]) if isinstance(value, np.ndarray) else value == original[key]
