"""Hostile files: fuzzed indexes and state files only ever raise jaxckpt's own errors.

Hypothesis mutates a real checkpoint's index.json and a real manager's state file (random values
and types anywhere, huge shapes, deep nesting, huge integers, NaN literals, lone surrogates, keys
with ``..``, absolute paths and NUL, crafted class names), usually with a valid checksum so that
parsing goes past it. Restore (with and without a template), ``Checkpoint.restore``,
``list_variables``, ``load_variable``, ``verify``, ``latest_checkpoint`` and the manager's start-up
must raise a :class:`jaxckpt.JaxckptError` or succeed: no other exception, crash or hang, no
allocation beyond what the data backs (the fuzz runs under RLIMIT_AS), no file read or written
outside the checkpoint, and no code run (no new module imported, ``os.system`` never called).

``max_examples`` is modest by default; the ``stress`` marker runs many more.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import resource
import shutil
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxckpt
from jaxckpt.arrays import store_write, zarr_meta
from jaxckpt.tools import cli

DEFAULT_EXAMPLES = 150
STRESS_EXAMPLES = 3000

SPECIAL_STRINGS = [
    "..", "../..", "../../../etc/passwd", "/etc/passwd", "/", "a\x00b", "\x00", "~", "~1", "~e", "~i0", "",
    "os.system", "posix.system", "builtins.eval", "subprocess.Popen", "antigravity.Fly", "this",
    "a/0", "a/1", "a/999999999", "p/0", "p/1", "data", "data.p1", "data.p999999", "data/../..",
    "jaxckpt", "jaxckpt-manager-state", "array", "prng_key", "state", "none", "int", "str", "dict", "namedtuple",
    "node", "nnx", "checkpoint", "float32", "bfloat16", "uint4", "object", "threefry2x32", "rbg", "nan", "inf",
    "ckpt-1", "ckpt-3", ".ckpt-1", "crc32:00000000", "\ud800", "é/ü",
]  # fmt: skip
HUGE_SHAPES = [
    [2**62], [2**31, 2**31], [2**40], [10**30], [2**62, 2**62], [0, 2**62], [2**62, 0], [-1], [1] * 65,
    [3.5], ["3"], [True], [], [0], [2**63], [2**64 + 3],
]  # fmt: skip
# Values that json.dumps cannot write (or writes otherwise): placeholders, swapped in as raw text.
RAW = {
    "\ue000deep": "[" * 20000 + "]" * 20000,
    "\ue000deepobj": '{"a":' * 5000 + "1" + "}" * 5000,
    "\ue000hugeint": "9" * 5000,  # over Python's 4300-digit limit for int("...")
    "\ue000bigint": "9" * 400,  # parses, but too large for a float
    "\ue000nan": "NaN",
    "\ue000inf": "Infinity",
    "\ue000overflow": "1e999",
    "\ue000surrogate": '"\\udc00"',
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**31, 2**62, 2**63, 2**64, -(2**63), 10**30, -1, 0])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(SPECIAL_STRINGS)
    | st.sampled_from(sorted(RAW))
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(st.text(max_size=4) | st.sampled_from(SPECIAL_STRINGS), kids, max_size=4)
    ),
    max_leaves=8,
)
replacements = json_values | st.sampled_from(HUGE_SHAPES)


# --- writing hostile JSON --------------------------------------------------------------------------


def paths_in(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of dict keys and list indexes) to a value inside ``obj``, the root first."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths_in(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths_in(v, (*prefix, i))
    return out


def mutate(data: st.DataObject, body: dict) -> dict:
    """One to three random edits anywhere in ``body`` (a deep copy is returned)."""
    body = json.loads(json.dumps(body))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        path = data.draw(st.sampled_from(paths_in(body)[1:]), label="path")
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        op = data.draw(st.sampled_from(["replace", "replace", "replace", "delete", "insert"]), label="op")
        if op == "replace":  # a copy: sampled_from hands out the same list every time
            parent[last] = copy.deepcopy(data.draw(replacements, label="value"))
        elif op == "delete":
            del parent[last]
        elif isinstance(parent, dict):
            key = data.draw(st.text(max_size=4) | st.sampled_from(SPECIAL_STRINGS), label="key")
            parent[key] = data.draw(json_values, label="value")
        else:
            parent.insert(last, data.draw(json_values, label="value"))
    return body


def dumps(body: Any, *, ascii: bool, indent: int | None = None) -> bytes:
    separators = (",", ":") if indent is None else None
    text = json.dumps(body, sort_keys=True, indent=indent, separators=separators, ensure_ascii=ascii)
    for placeholder, raw in RAW.items():
        text = text.replace(json.dumps(placeholder, ensure_ascii=ascii), raw)
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate makes invalid UTF-8 (unless escaped)


def index_bytes(data: st.DataObject, body: dict) -> bytes:
    """The index file of ``body``: usually with a valid checksum, so that parsing goes past it."""
    ascii = data.draw(st.booleans(), label="ascii")
    canonical = dumps(body, ascii=False)
    how = data.draw(st.sampled_from(["valid", "valid", "valid", "stale", "missing"]), label="checksum")
    if how == "valid":
        checksum = f"crc32:{zlib.crc32(canonical):08x}"
    elif how == "stale":
        checksum = "crc32:00000000"
    else:
        return dumps(body, ascii=ascii)
    return dumps({"checksum": checksum, **body}, ascii=ascii)


# --- watching for escapes --------------------------------------------------------------------------


class Outcomes(collections.Counter):
    """How each call ended: 'ok' or the name of the jaxckpt error."""

    def call(self, fn, *args, **kwargs) -> Any:
        try:
            result = fn(*args, **kwargs)
        except jaxckpt.JaxckptError as e:
            self[type(e).__name__] += 1
            return None
        self["ok"] += 1
        return result


_LAZY_IMPORTS = {
    "jax",
    "jaxlib",
    "numpy",
    "ml_dtypes",
    "tensorstore",
    "jaxckpt",
    "hypothesis",
    "_hypothesis",
    "encodings",
    # the foreign-format readers' dependencies, imported when a folder is checked for their formats
    "crc32c",
    "msgpack",
}


@contextlib.contextmanager
def guarded(headroom: int = 3 << 30):
    """No code runs from a checkpoint, and no allocation beyond ``headroom`` bytes of address space.

    RLIMIT_AS makes any large allocation fail at once (instead of being overcommitted and touched
    later), so a crafted shape that allocated would show up as a MemoryError or a crash.
    """
    modules = set(sys.modules)
    real_system = os.system

    def no_system(*args: Any) -> int:
        raise AssertionError(f"a checkpoint made jaxckpt call os.system{args}")

    os.system = no_system
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    limit = used + headroom if hard == resource.RLIM_INFINITY else min(hard, used + headroom)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        os.system = real_system
    # jaxckpt and JAX import some modules lazily; a class named in a checkpoint would be something else.
    new = {
        m
        for m in set(sys.modules) - modules
        if m.split(".")[0] not in _LAZY_IMPORTS and not m.startswith("_cython_")  # msgpack's compiled runtime
    }
    assert not new, f"restoring imported {sorted(new)}"


def tree_of_everything() -> dict[str, Any]:
    """Every kind of node and leaf, packed and in own arrays."""

    class Pair(NamedTuple):
        left: Any
        right: Any

    class Position:
        def __init__(self) -> None:
            self.at = 3

        def get_state(self) -> dict[str, int]:
            return {"at": self.at}

        def set_state(self, state: Any) -> None:
            self.at = state  # whatever a crafted index holds: the object's own checks are not under test

    return {
        "packed": np.arange(6, dtype=np.float32).reshape(2, 3),
        "own": np.arange(300, dtype=np.int32),  # over the (lowered) packing limit
        "bf16": jnp.ones((4,), jnp.bfloat16),
        "u4": np.arange(8, dtype=np.uint8).astype(ml_dtypes.uint4),
        "key": jax.random.key(0),
        "pair": Pair(np.float32(1.5), [1, 2.5, "s", None, True]),
        "ints": {0: np.zeros(2, np.int8), "0": "zero"},
        "pos": Position(),
        "empty": np.zeros((0, 3), np.float32),
    }


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A checkpoint of everything; leaves over 256 bytes get their own zarr3 array."""
    path = tmp_path_factory.mktemp("fuzz") / "original"
    real = store_write.PACK_LEAF_LIMIT
    store_write.PACK_LEAF_LIMIT = 256
    try:
        jaxckpt.save(path, tree_of_everything())
    finally:
        store_write.PACK_LEAF_LIMIT = real
    body = json.loads((path / "index.json").read_bytes())
    body.pop("checksum")
    return path, body


def _fuzz_index(tmp_path: Path, original: tuple[Path, dict], examples: int) -> None:
    source, body = original
    work = tmp_path / "work" / "ckpt"
    shutil.copytree(source, work)
    bait = tmp_path / "bait.txt"  # what a path escaping the checkpoint would find
    bait.write_text("outside")
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file() and p.name != "index.json"}
    template = tree_of_everything()
    outcomes = Outcomes()

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: st.DataObject) -> None:
        (work / "index.json").write_bytes(index_bytes(data, mutate(data, body)))
        with guarded(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unused-values warnings of partial restores
            outcomes.call(jaxckpt.restore, work)
            outcomes.call(jaxckpt.restore, work, like=template, partial=True)
            status = outcomes.call(jaxckpt.Checkpoint(**tree_of_everything()).restore, work)
            if status is not None:
                status.expect_partial()
            names = outcomes.call(jaxckpt.list_variables, work) or []
            for key, _ in names[:4]:
                outcomes.call(jaxckpt.load_variable, work, key)
            with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
                assert cli.main(["verify", str(work)]) in (0, 1)

    run()
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file() and p.name != "index.json"} == before
    assert sorted(p.name for p in work.parent.iterdir()) == ["ckpt"] and bait.read_text() == "outside"
    print(f"\nfuzz index: {examples} examples, calls ended: {dict(outcomes)}")
    assert sum(outcomes.values()) > outcomes["ok"]  # some were refused (how many pass varies by run)


def test_fuzzed_index(tmp_path, original):
    _fuzz_index(tmp_path, original, DEFAULT_EXAMPLES)


@pytest.mark.stress
def test_fuzzed_index_stress(tmp_path, original, stress_scale):
    _fuzz_index(tmp_path, original, STRESS_EXAMPLES * stress_scale)


# --- the manager's state file ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def manager_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz") / "ckpts"
    ckpt = jaxckpt.Checkpoint(step=0, w=np.ones(3, np.float32))
    with jaxckpt.CheckpointManager(ckpt, directory, max_to_keep=3, step_counter="step") as manager:
        for step in range(1, 5):
            ckpt.step = step
            manager.save(metrics={"loss": 1 / step})
    return directory, json.loads((directory / "checkpoint").read_text())


# What a crafted state file's "uses" may name: the state file itself, its lock, user folders, paths
# out of the directory, a checkpoint-shaped user folder, a listed or an unlisted checkpoint.
HOSTILE_USES = [
    "checkpoint",
    "checkpoint.lock",
    "eval_results",
    "ckpt-77",
    "../outside",
    "ckpt-1",
    "ckpt-3",
    "ckpt-9",
    ".",
]


def _fuzz_state(tmp_path: Path, manager_dir: tuple[Path, dict], examples: int) -> None:
    source, body = manager_dir
    outside = tmp_path / "outside"  # a checkpoint beside the directory, which no state file may reach
    shutil.copytree(source / "ckpt-4", outside / "ckpt-9")
    work = tmp_path / "work"
    outcomes = Outcomes()

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: st.DataObject) -> None:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(source, work)
        # The user's folders beside the checkpoints: one named as nothing of the manager's, one that
        # looks like a checkpoint (no index, no mark). No state file can make a manager delete them.
        for folder, name in (("eval_results", "scores.json"), ("ckpt-77", "mine.txt")):
            (work / folder).mkdir()
            (work / folder / name).write_text("mine")
        crafted = json.loads(json.dumps(body))
        for entry in crafted["checkpoints"]:  # retention deletes what "uses" names, once unused
            if data.draw(st.booleans(), label="crafted uses"):
                entry["uses"] = data.draw(st.lists(st.sampled_from(HOSTILE_USES), max_size=3), label="uses")
        (work / "checkpoint").write_bytes(
            dumps(mutate(data, crafted), ascii=data.draw(st.booleans(), label="ascii"), indent=2)
        )
        with guarded():
            latest = outcomes.call(jaxckpt.latest_checkpoint, work)
            if latest is not None:
                assert Path(latest).parent == work, f"latest_checkpoint gave {latest!r}, outside {work}"
            ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(3, np.float32))
            manager = outcomes.call(jaxckpt.CheckpointManager, ckpt, work, max_to_keep=1, step_counter="step")
            if manager is not None:
                for path in manager.checkpoints:
                    assert Path(path).parent == work, f"the manager lists {path!r}, outside {work}"
                ckpt.step = 50
                outcomes.call(manager.save)  # retention: every listed checkpoint but the new one dropped
                outcomes.call(manager.close)
        assert sorted(os.listdir(outside)) == ["ckpt-9"] and (outside / "ckpt-9" / "index.json").is_file()
        assert (work / "eval_results" / "scores.json").read_text() == "mine"
        assert (work / "ckpt-77" / "mine.txt").read_text() == "mine"

    run()
    print(f"\nfuzz state file: {examples} examples, calls ended: {dict(outcomes)}")
    assert sum(outcomes.values()) > outcomes["ok"]  # some were refused (how many pass varies by run)


def test_fuzzed_state_file(tmp_path, manager_dir):
    _fuzz_state(tmp_path, manager_dir, DEFAULT_EXAMPLES)


@pytest.mark.stress
def test_fuzzed_state_file_stress(tmp_path, manager_dir, stress_scale):
    _fuzz_state(tmp_path, manager_dir, STRESS_EXAMPLES // 3 * stress_scale)


# --- zarr.json, shard files and the OCDBT manifest: what no index checksum covers -----------------


def _same_values(restored: dict, expected: dict) -> None:
    """A restore that succeeds returns exactly what was saved: damage is an error, never other values."""
    for key in ("packed", "own", "bf16", "u4", "empty"):
        assert np.asarray(restored[key]).tobytes() == np.asarray(expected[key]).tobytes(), key


def _same_golden(restored: Any, expected: Any) -> None:
    """Like :func:`_same_values`, for the golden tree: every leaf, bit for bit."""
    if isinstance(expected, dict):
        assert set(restored) == set(expected)
        for k in expected:
            _same_golden(restored[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert len(restored) == len(expected)
        for r, e in zip(restored, expected):
            _same_golden(r, e)
    elif isinstance(expected, (np.ndarray, np.generic)):
        assert np.asarray(restored).dtype == expected.dtype
        assert np.asarray(restored).tobytes() == np.asarray(expected).tobytes()
    else:
        assert restored == expected


def _golden_v3() -> tuple[Path, Any]:
    """tests/golden/v3 (an OCDBT data store) and the function giving its content."""
    sys.path.insert(0, str(Path(__file__).parent / "golden"))
    from make_golden import golden_tree

    return Path(__file__).parent / "golden" / "v3", golden_tree


def _fuzz_store(
    tmp_path: Path, original: tuple[Path, dict], examples: int, damage, tree=None, same=_same_values
) -> Outcomes:
    """Restore and verify a copy of the checkpoint after ``damage(data, work)``, many times over."""
    source, _ = original
    tree = tree or tree_of_everything
    work = tmp_path / "work" / "ckpt"
    expected = tree()
    outcomes = Outcomes()

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: st.DataObject) -> None:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(source, work)
        damage(data, work)
        with guarded(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restored = outcomes.call(jaxckpt.restore, work)
            if restored is not None:
                same(restored, expected)
            restored = outcomes.call(jaxckpt.restore, work, like=tree())
            if restored is not None:
                same(restored, expected)
            with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
                assert cli.main(["verify", str(work)]) in (0, 1)

    run()
    return outcomes


def _store_files(work: Path, want) -> list[Path]:
    """The data store's files (format version 4: plain folders) for which ``want(relative path)``."""
    files = sorted(p for p in (work / "data").rglob("*") if p.is_file() and want(p.relative_to(work / "data")))
    assert files, f"no such file under {work / 'data'}"
    return files


def _zarr_json_damage(data: st.DataObject, work: Path) -> None:
    file = data.draw(st.sampled_from(_store_files(work, lambda p: p.name == "zarr.json")), label="file")
    meta = json.loads(file.read_bytes())
    edited = mutate(data, meta)
    extra = data.draw(
        st.sampled_from(
            [
                {},
                {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip"}]},
                {"codecs": [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}]},
                {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2**40]}}},
                {"chunk_key_encoding": {"name": "v2"}},
                {"fill_value": 1},
                {"data_type": "int64"},
            ]
        ),
        label="planted",
    )
    file.write_bytes(dumps({**edited, **extra}, ascii=True))


def _shard_damage(data: st.DataObject, work: Path) -> None:
    """A shard file (format version 4) flipped, truncated, zeroed or given a crafted index entry,
    mostly in its trailing bytes: the shard index (offset, size per inner chunk) and its CRC-32C."""
    file = data.draw(st.sampled_from(_store_files(work, lambda p: "c" in p.parts)), label="file")
    raw = bytearray(file.read_bytes())
    how = data.draw(st.sampled_from(["flip", "truncate", "zero", "entry", "append"]), label="how")
    near_end = data.draw(st.booleans(), label="near end")
    back = data.draw(st.integers(1, min(len(raw), 4 + 16 * 4 if near_end else len(raw))), label="from end")
    at = len(raw) - back
    if how == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    elif how == "truncate":
        del raw[at:]
    elif how == "zero":
        raw[at : at + 8] = bytes(len(raw[at : at + 8]))
    elif how == "append":
        raw += data.draw(st.binary(min_size=1, max_size=64), label="appended")
    else:  # rewrite the first index entry, with a valid index checksum: only the bounds checks stand in the way
        import crc32c

        entries = len(raw) - 4 - data.draw(st.sampled_from([16, 32]), label="index bytes")
        value = data.draw(
            st.sampled_from([0, 1, 4, len(raw), len(raw) - 20, 2**63, 2**64 - 1, 2**62 + 1]), label="value"
        )
        field = data.draw(st.sampled_from([0, 8]), label="field")
        if entries >= 0:
            raw[entries + field : entries + field + 8] = value.to_bytes(8, "little")
            index = bytes(raw[entries:-4])
            raw[-4:] = crc32c.crc32c(index).to_bytes(4, "little")
    file.write_bytes(bytes(raw))


def _manifest_damage(data: st.DataObject, work: Path) -> None:
    manifest = work / "data" / "manifest.ocdbt"
    raw = bytearray(manifest.read_bytes())
    how = data.draw(st.sampled_from(["flip", "truncate", "zero"]), label="how")
    at = data.draw(st.integers(0, len(raw) - 1), label="at")
    if how == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    elif how == "truncate":
        del raw[at:]
    else:
        raw[at : at + 8] = bytes(len(raw[at : at + 8]))
    manifest.write_bytes(bytes(raw))


def _misplaced_tree() -> dict[str, Any]:
    """Three arrays of one shape (shard files of one size), each in two shards of four inner chunks
    under :func:`_small_chunks`, and a packed leaf."""
    rng = np.random.default_rng(11)
    return {
        **{k: rng.standard_normal((64, 8)).astype(np.float32) for k in ("a", "b", "c")},
        "packed": np.arange(5, dtype=np.int32),
    }


def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zarr_meta, "INNER_CHUNK_LIMIT", 256)
    monkeypatch.setattr(store_write, "PACK_LEAF_LIMIT", 256)


def _same_misplaced(restored: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert np.asarray(restored[key]).tobytes() == value.tobytes(), key


def _entries_of(file: Path) -> tuple[int, np.ndarray]:
    """A shard file's index: where it starts, and its (offset, size) entries (4 inner chunks)."""
    start = file.stat().st_size - 4 * 16 - 4
    return start, np.frombuffer(file.read_bytes()[start:-4], "<u8").reshape(4, 2).copy()


def _misplacement_damage(data: st.DataObject, work: Path) -> None:
    """Bytes moved with their own checksums intact (format 5): inner chunks swapped or copied within a
    shard, shard index entries swapped or duplicated, shard files swapped or copied, shard lists of
    the data store's checksums swapped. Each is damage or leaves the values as they were."""
    import crc32c

    shards = _store_files(work, lambda p: "c" in p.parts and p.parts[0] == "a")
    how = data.draw(
        st.sampled_from(
            ["swap chunks", "copy chunk", "swap entries", "same entry", "swap files", "copy file", "swap sums"]
        ),
        label="how",
    )
    i, j = data.draw(st.integers(0, 3), label="i"), data.draw(st.integers(0, 3), label="j")
    if how in ("swap files", "copy file"):
        a, b = data.draw(st.sampled_from(shards), label="a"), data.draw(st.sampled_from(shards), label="b")
        raw_a, raw_b = a.read_bytes(), b.read_bytes()
        b.write_bytes(raw_a)
        if how == "swap files":
            a.write_bytes(raw_b)
        return
    if how == "swap sums":
        file = work / "data" / "checksums.json"
        body = json.loads(file.read_bytes())
        del body["checksum"]
        lists = [(path, n) for path, by in sorted(body["arrays"].items()) for n in sorted(by)]
        (pa, na), (pb, nb) = data.draw(st.sampled_from(lists), label="x"), data.draw(st.sampled_from(lists), label="y")
        arrays = body["arrays"]
        arrays[pa][na], arrays[pb][nb] = arrays[pb][nb], arrays[pa][na]
        from jaxckpt.format.checked_json import checksummed_json

        file.write_bytes(checksummed_json(body))
        return
    file = data.draw(st.sampled_from(shards), label="file")
    raw = bytearray(file.read_bytes())
    start, entries = _entries_of(file)
    if how in ("swap entries", "same entry"):
        entries[j] = entries[i].copy() if how == "same entry" else entries[j]
        if how == "swap entries":
            entries[[i, j]] = entries[[j, i]]
        index = entries.astype("<u8").tobytes()
        raw[start:] = index + crc32c.crc32c(index).to_bytes(4, "little")
    else:
        (oi, size), (oj, _) = (map(int, entries[i]), map(int, entries[j]))
        chunk_i, chunk_j = bytes(raw[oi : oi + size]), bytes(raw[oj : oj + size])
        raw[oj : oj + size] = chunk_i
        if how == "swap chunks":
            raw[oi : oi + size] = chunk_j
    file.write_bytes(bytes(raw))


def _fuzz_misplacements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, examples: int) -> Outcomes:
    _small_chunks(monkeypatch)
    source = tmp_path / "misplaced"
    jaxckpt.save(source, _misplaced_tree())
    for key in "abc":  # as the damage above assumes: two shard files of 4 inner chunks each
        assert (
            len(
                list(
                    (
                        source
                        / "data"
                        / json.loads((source / "index.json").read_bytes())["leaves"][key]["at"]["array"]
                        / "c"
                    ).rglob("*")
                )
            )
            >= 2
        )
    return _fuzz_store(tmp_path, (source, {}), examples, _misplacement_damage, _misplaced_tree, _same_misplaced)


def test_fuzzed_misplacements(tmp_path, monkeypatch):
    outcomes = _fuzz_misplacements(tmp_path, monkeypatch, DEFAULT_EXAMPLES // 3)
    print(f"\nfuzz misplacements: calls ended: {dict(outcomes)}, 0 wrong")
    assert outcomes["CheckpointCorruptedError"] > 0


def test_fuzzed_zarr_json(tmp_path, original):
    outcomes = _fuzz_store(tmp_path, original, DEFAULT_EXAMPLES // 3, _zarr_json_damage)
    print(f"\nfuzz zarr.json: calls ended: {dict(outcomes)}")
    assert outcomes["CheckpointCorruptedError"] > 0


def test_fuzzed_shard_files(tmp_path, original):
    outcomes = _fuzz_store(tmp_path, original, DEFAULT_EXAMPLES // 3, _shard_damage)
    print(f"\nfuzz shard files: calls ended: {dict(outcomes)}")
    assert outcomes["CheckpointCorruptedError"] > 0


def test_fuzzed_ocdbt_manifest(tmp_path):
    """Format versions 1 to 3 keep the data in an OCDBT database: a copy of tests/golden/v3's, damaged."""
    source, tree = _golden_v3()
    outcomes = _fuzz_store(tmp_path, (source, {}), DEFAULT_EXAMPLES // 3, _manifest_damage, tree, _same_golden)
    print(f"\nfuzz OCDBT manifest: calls ended: {dict(outcomes)}")
    assert outcomes["CheckpointCorruptedError"] > 0


@pytest.mark.stress
def test_fuzzed_zarr_json_shards_and_manifest_stress(tmp_path, original, stress_scale):
    for damage in (_zarr_json_damage, _shard_damage):
        outcomes = _fuzz_store(tmp_path, original, STRESS_EXAMPLES // 6 * stress_scale, damage)
        print(f"\nfuzz {damage.__name__}: calls ended: {dict(outcomes)}")
    source, tree = _golden_v3()
    examples = STRESS_EXAMPLES // 6 * stress_scale
    outcomes = _fuzz_store(tmp_path, (source, {}), examples, _manifest_damage, tree, _same_golden)
    print(f"\nfuzz _manifest_damage: calls ended: {dict(outcomes)}")


@pytest.mark.stress
def test_fuzzed_misplacements_stress(tmp_path, monkeypatch, stress_scale):
    outcomes = _fuzz_misplacements(tmp_path, monkeypatch, STRESS_EXAMPLES // 6 * stress_scale)
    print(f"\nfuzz misplacements (stress): calls ended: {dict(outcomes)}, 0 wrong")


# --- crafted indexes: each hostile idea once, by hand ----------------------------------------------


def write_index(path: Path, body: dict) -> None:
    """``body`` as ``path``'s index, with a valid checksum: only the validation stands in the way."""
    canonical = dumps(body, ascii=False)
    (path / "index.json").write_bytes(dumps({"checksum": f"crc32:{zlib.crc32(canonical):08x}", **body}, ascii=False))


def nested(depth: int):
    """An edit that hangs a chain of ``depth`` dicts under the root."""

    def edit(body: dict) -> None:
        key = ""
        body["nodes"][""]["keys"].append("deep")
        for _ in range(depth):
            key = f"{key}/deep" if key else "deep"
            body["nodes"][key] = {"kind": "dict", "class": "dict", "keys": ["deep"]}
        body["leaves"][f"{key}/deep"] = {"type": "int", "value": 1}

    return edit


def leaf(name: str, **fields: Any):
    return lambda body: body["leaves"][name].update(fields)


CRAFTED = {
    "float beyond float's range": (leaf("pair/right/1", value=10**400), "out of range"),
    "unknown PRNG implementation": (leaf("key", impl="os.system"), "unknown PRNG implementation"),
    "rbg keys with threefry data": (leaf("key", impl="rbg"), "key data must be uint32"),
    "float32 key data": (leaf("key", dtype="float32"), "key data must be uint32"),
    "nodes 3000 deep": (nested(3000), "nested more than"),
    "huge own-array shape": (leaf("own", shape=[2**62]), "larger than any array can be"),
    "huge own-array shape, in one shard": (
        lambda body: (leaf("own", shape=[2**60])(body), body["leaves"]["own"]["at"].update(chunks=[2**60])),
        r"claims [0-9,]+ bytes .*'own'.*holds only",
    ),
    "huge packed shape": (leaf("packed", shape=[2**58, 3]), "cannot hold shape"),
    "huge pack": (
        lambda body: (
            body["packs"][0].update(nbytes=2**62, chunk=4 << 20),
            body["leaves"]["packed"].update(shape=[2**59]),
            body["leaves"]["packed"]["at"].update(offset=0, nbytes=2**61),
        ),
        r"claims [0-9,]+ bytes .*'packed'.*holds only",
    ),
    "NUL in an array path": (lambda body: body["leaves"]["own"]["at"].update(array="a/0\x00"), "array path"),
    "data store outside": (
        lambda body: body["leaves"]["own"]["at"].update(regions={"../data": [[[0, 300]]]}),
        "data store '../data'",
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_index_is_refused_before_any_read(tmp_path, original, case):
    source, body = original
    edit, message = CRAFTED[case]
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    body = copy.deepcopy(body)
    edit(body)
    write_index(path, body)
    with guarded(headroom=1 << 30):  # a huge shape that allocated would fail here, not pass
        with pytest.raises(jaxckpt.JaxckptError, match=message):
            jaxckpt.restore(path)
        with pytest.raises(jaxckpt.JaxckptError):  # the same, or a template that disagrees first
            jaxckpt.restore(path, like=tree_of_everything(), partial=True)


@pytest.mark.parametrize("kind", ["namedtuple", "node", "nnx", "checkpoint"])
@pytest.mark.parametrize("cls", ["os.system", "antigravity.Fly", "builtins.exec", "subprocess.Popen", "this"])
def test_class_names_in_an_index_are_never_imported_or_called(tmp_path, original, kind, cls):
    source, body = original
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    body = copy.deepcopy(body)
    body["nodes"]["pair"].update({"kind": kind, "class": cls})
    write_index(path, body)
    with guarded():
        restored = jaxckpt.restore(path)
    assert "antigravity" not in sys.modules and "this" not in sys.modules
    assert list(restored["pair"]) != [] and restored["packed"].tolist() == [[0, 1, 2], [3, 4, 5]]


HOSTILE_KEYS = ["..", "../..", "../../outside", "/etc/passwd", "/", "a\x00b", "~1", "~e", "data", "index.json", ""]


def test_hostile_keys_round_trip_and_write_nothing_outside(tmp_path):
    tree = {k: {"v": np.full(3, i, np.float32), k: i} for i, k in enumerate(HOSTILE_KEYS)}
    tree["big"] = {k: np.full(70_000, i, np.float32) for i, k in enumerate(HOSTILE_KEYS)}  # own arrays
    path = jaxckpt.save(tmp_path / "c", tree)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert sorted(os.listdir(path)) == ["data", "index.json"]
    restored = jaxckpt.restore(path)
    assert list(restored) == list(tree)
    for k in HOSTILE_KEYS:
        np.testing.assert_array_equal(restored[k]["v"], tree[k]["v"])
        np.testing.assert_array_equal(restored["big"][k], tree["big"][k])
    keys = [k for k, _ in jaxckpt.list_variables(path)]
    assert all(jaxckpt.load_variable(path, k) is not None for k in keys if k.startswith("~e") or ".." in k)


def test_crafted_keys_stay_keys(tmp_path, original):
    """Renaming a leaf to a path-like key in the index changes what the dict is called, nothing on disk."""
    source, pristine = original
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    for hostile in ("../../../etc/passwd", "/etc/passwd", "a\x00b", ".."):
        body = copy.deepcopy(pristine)
        keys = body["nodes"][""]["keys"]
        keys[keys.index("packed")] = hostile
        body["leaves"][hostile.replace("~", "~0").replace("/", "~1")] = body["leaves"].pop("packed")
        write_index(path, body)
        with guarded():
            restored = jaxckpt.restore(path)
        assert restored[hostile].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# --- bad input: not hostile, just wrong --------------------------------------------------------------


def test_python_int_that_does_not_fit_the_template_dtype(tmp_path):
    path = jaxckpt.save(tmp_path / "c", {"n": 2**40, "big": 10**400})
    for template in (np.int32(0), jnp.int32(0), jax.ShapeDtypeStruct((), jnp.int32)):
        with pytest.raises(jaxckpt.MismatchError, match=r"'n'.*Python int.*int32 array.*does not fit"):
            jaxckpt.restore(path, like={"n": template, "big": 0})
    with pytest.raises(jaxckpt.MismatchError, match=r"'big'.*does not fit"):
        jaxckpt.restore(path, like={"n": 0, "big": np.float32(0)})
    assert jaxckpt.restore(path, like={"n": np.int64(0), "big": 0}) == {"n": 2**40, "big": 10**400}


def test_manager_directory_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("mine")
    for directory in (tmp_path / "file", tmp_path / "file" / "ckpts"):
        with pytest.raises(jaxckpt.CheckpointExistsError, match=rf"{directory}.*cannot be one"):
            jaxckpt.CheckpointManager(jaxckpt.Checkpoint(a=1), directory)
    assert (tmp_path / "file").read_text() == "mine"


def test_manager_with_a_checkpoint_of_a_newer_format(tmp_path):
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(a=1), tmp_path) as manager:
        latest = manager.save()
    body = json.loads((Path(latest) / "index.json").read_bytes())
    body.pop("checksum")
    body["version"] = jaxckpt.FORMAT_VERSION + 1
    write_index(Path(latest), body)
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(a=0), tmp_path) as manager:
        with pytest.raises(jaxckpt.UnsupportedVersionError, match=rf"{latest}/index.json.*Upgrade jaxckpt"):
            manager.restore_or_initialize()
    assert cli.main(["verify", str(tmp_path)]) == 1


def test_path_with_dot_dot(tmp_path):
    """A user's path may go up and down again; TensorStore alone would refuse it."""
    (tmp_path / "sub").mkdir()
    jaxckpt.save(tmp_path / "c", {"x": np.arange(300_000, dtype=np.float32), "y": 1})
    roundabout = tmp_path / "sub" / ".." / "c"
    assert jaxckpt.restore(roundabout)["x"][-1] == 299_999
    jaxckpt.save(tmp_path / "sub" / ".." / "d", {"x": np.ones(300_000, np.float32)})
    assert jaxckpt.load_variable(tmp_path / "d", "x").sum() == 300_000


def test_save_refuses_a_tree_too_deep_to_restore(tmp_path):
    """Restores rebuild trees recursively: a save never writes what the reader would refuse as too deep."""
    from jaxckpt.format.records import MAX_DEPTH

    def chain(depth: int) -> Any:
        tree: Any = np.ones(2, np.float32)
        for _ in range(depth):
            tree = {"d": tree}
        return tree

    deepest_ok = jaxckpt.save(tmp_path / "ok", chain(MAX_DEPTH))
    assert jaxckpt.restore(deepest_ok, like=chain(MAX_DEPTH)) is not None
    with pytest.raises(jaxckpt.UnsupportedValueError, match=rf"'d/d/d.*nested more than {MAX_DEPTH} levels"):
        jaxckpt.save(tmp_path / "deep", chain(MAX_DEPTH + 1))
    assert sorted(os.listdir(tmp_path)) == ["ok"]
