"""One measured operation, in a fresh interpreter (run by ``run.py``; not meant to be run by hand).

    python benchmarks/child.py prepare WORKDIR WORKLOAD [--quick]
    python benchmarks/child.py run WORKDIR OP RESULT_JSON [TOUCH_EXTRA_BYTES]

``run`` loads the workload's data (untimed), deletes what the operation will write, reads what a hot
read will read once (so that all of it is in the page cache), pre-touches
memory (see /work/shared/BENCHMARKING.md: freed memory goes back to the host after 10-15 s and costs
about 2 s/GiB to touch again: 3x the checkpoint's size plus 512 MiB), resets the peak-RSS counter, times the operation, reads VmHWM, then
checks the result (untimed) and writes one JSON object to RESULT_JSON.

An op ending in ``_cold`` is the op before the suffix with the page cache dropped (``sync``, then
``3`` into /proc/sys/vm/drop_caches; root only) after the pre-touch, just before timing starts; where
the caches cannot be dropped it records status "n/a" rather than a hot figure.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import workloads as wl

MiB = 1 << 20

# In the order run.py runs them within a repetition: each restore reads what the save before it wrote.
OPS = (
    "floor_write",
    "floor_write_fsync",
    "floor_read",
    "floor_read_put",
    "floor_read_put_cold",
    "floor_read_put_each",
    "floor_copy",
    "floor_hold",
    "jaxckpt_save",
    "jaxckpt_restore",
    "jaxckpt_restore_cold",
    "jaxckpt_async_save",
    "orbax_save",
    "orbax_restore",
    "orbax_restore_cold",
    "orbax_async_save",
)
DROP_CACHES = "/proc/sys/vm/drop_caches"


def import_jaxckpt() -> Any:
    """jaxckpt, from ``$BENCH_JAXCKPT_SRC/jaxckpt`` when set (run.py --jaxckpt-src), else the installed one."""
    src = os.environ.get("BENCH_JAXCKPT_SRC")
    if src and "jaxckpt" not in sys.modules:
        import importlib.util

        package = os.path.join(os.path.abspath(src), "jaxckpt")
        spec = importlib.util.spec_from_file_location(
            "jaxckpt", os.path.join(package, "__init__.py"), submodule_search_locations=[package]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["jaxckpt"] = module
        spec.loader.exec_module(module)
    import jaxckpt

    return jaxckpt


# --- measurement helpers ---------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def pretouch(nbytes: int) -> float:
    """Allocate, write and free ``nbytes`` in 64 MiB blocks (each its own mmap, unmapped on free)."""
    t = time.perf_counter()
    blocks = []
    left = nbytes
    while left > 0:
        b = np.empty(min(64 * MiB, left), np.uint8)
        b.fill(1)
        blocks.append(b)
        left -= b.size
    del blocks, b
    return time.perf_counter() - t


def drop_page_cache() -> str | None:
    """``sync`` and drop the page cache (clean pages, dentries, inodes); None if done, else why not."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3")
    except OSError as e:
        return f"cannot drop caches ({DROP_CACHES}: {e.strerror or e}; needs root and a writable /proc/sys)"
    return None


def warm_page_cache(path: str) -> int:
    """Read every file under ``path`` (or the file itself) once, so that a hot read finds it all in the
    page cache; returns the bytes read. The machine may evict clean pages between the write and the
    read (this VM runs DAMON-based reclaim): without this, "hot" restores of 1 GiB took 0.11-0.56 s."""
    buf = bytearray(4 * MiB)
    done = 0
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                done += got
    return done


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy (not idle, not waiting for I/O) since boot:
    less this process's own, what else ran beside the measured operation."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def tree_files(path: str) -> tuple[int, int]:
    """(files, bytes) under ``path`` (a file counts as one)."""
    if os.path.isfile(path):
        return 1, os.path.getsize(path)
    files = size = 0
    for folder, _, names in os.walk(path):
        for n in names:
            files += 1
            size += os.path.getsize(os.path.join(folder, n))
    return files, size


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


# --- the operations (timed_operation below times them) ---------------------------------------------


def floor_write(leaves: list[np.ndarray], path: str, fsync: bool) -> None:
    with open(path, "wb") as f:
        for x in leaves:
            x.tofile(f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def floor_read(spec: dict[str, Any], path: str) -> list[np.ndarray]:
    return wl.read_leaves(spec, path)  # the same reads that load a workload's data


def aligned_buffer(nbytes: int, align: int = 64) -> np.ndarray:
    """``nbytes`` uint8 whose first byte is ``align``-aligned (so a CPU ``device_put`` can alias it)."""
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]


def floor_read_put(spec: dict[str, Any], path: str, shardings: list[Any], each: bool = False) -> list[Any]:
    """The restore floor: every leaf ``readinto`` its own 64-byte-aligned buffer, then one batched
    ``jax.device_put`` of all of them onto their target shardings (``each``: the naive floor, one
    ``jax.device_put`` per array)."""
    import jax

    host = []
    with open(path, "rb", buffering=0) as f:
        for leaf in spec["leaves"]:
            buf = aligned_buffer(leaf["nbytes"])
            view = memoryview(buf)
            done = 0
            while done < leaf["nbytes"]:
                got = f.readinto(view[done:])
                if not got:
                    raise EOFError(f"{path} ends inside leaf {leaf['key']}")
                done += got
            host.append(buf.view(leaf["dtype"]).reshape(leaf["shape"]))
    arrays = [jax.device_put(x, s) for x, s in zip(host, shardings)] if each else jax.device_put(host, shardings)
    jax.block_until_ready(arrays)
    return arrays


def jaxckpt_async_api() -> tuple[Callable[[str, Any], None], Callable[[], None]] | None:
    """(start, wait) for jaxckpt's async save where this jaxckpt has one, else None."""
    jaxckpt = import_jaxckpt()

    if "blocking" in inspect.signature(jaxckpt.save).parameters and hasattr(jaxckpt, "wait_until_finished"):
        return (lambda path, tree: jaxckpt.save(path, tree, blocking=False)), jaxckpt.wait_until_finished
    write = getattr(jaxckpt.Checkpoint, "write", None)
    if (
        write is not None
        and "blocking" in inspect.signature(write).parameters
        and hasattr(jaxckpt.Checkpoint, "wait_until_finished")
    ):
        holder: dict[str, Any] = {}

        def start(path: str, tree: Any) -> None:
            holder["ckpt"] = jaxckpt.Checkpoint(state=tree)
            holder["ckpt"].write(path, blocking=False)

        return start, lambda: holder["ckpt"].wait_until_finished()
    return None


def quiet_orbax() -> Any:
    import logging

    import absl.logging
    import orbax.checkpoint as ocp

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("absl").setLevel(logging.ERROR)
    return ocp


# --- driver ----------------------------------------------------------------------------------------


def prepare(workdir: str, workload: str, quick: bool) -> None:
    spec = wl.make_spec(workload, quick)
    os.makedirs(workdir, exist_ok=True)
    data = os.path.join(workdir, "data.bin")
    wl.write_data(spec, data)
    with open(os.path.join(workdir, "spec.json"), "w") as f:
        json.dump(spec, f)


def _in_spec_order(spec: dict[str, Any], tree: Any) -> list[Any]:
    """The leaves of a restored ``tree`` in the spec's order, found by their key paths."""
    import jax

    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    if spec["workload"] == "train_state":
        keys = [leaf["key"] for leaf in spec["leaves"]]
    else:
        keys = ["".join(f"[{part!r}]" for part in leaf["key"].split("/")) for leaf in spec["leaves"]]
    if all(k in flat for k in keys):
        return [flat[k] for k in keys]
    return list(flat.values())  # containers came back as other types: same order, other key paths


def _check_restored(spec: dict[str, Any], data: str, restored: list[Any], targets: list[Any] | None) -> None:
    """Compare restored leaves with the data file (all of them up to 64, else 64 spread out)."""
    n = len(spec["leaves"])
    if len(restored) != n:
        raise AssertionError(f"restored {len(restored)} leaves, expected {n}")
    picks = range(n) if n <= 64 else sorted({round(i * (n - 1) / 63) for i in range(64)})
    for i in picks:
        got = np.asarray(restored[i])
        want = wl.read_leaf(spec, data, i)
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
            raise AssertionError(f"leaf {spec['leaves'][i]['key']} differs after restore")
    if targets is not None:
        for i, (x, t) in enumerate(zip(restored, targets)):
            if not x.sharding.is_equivalent_to(t.sharding, x.ndim):
                raise AssertionError(f"leaf {spec['leaves'][i]['key']} restored with {x.sharding}, wanted {t.sharding}")


def run(workdir: str, op: str, result_path: str, touch_extra: int) -> None:
    spec = wl.load_spec(workdir)
    data = os.path.join(workdir, "data.bin")
    out_dir = os.path.join(workdir, "out")
    os.makedirs(out_dir, exist_ok=True)
    size = spec["nbytes"]
    result: dict[str, Any] = {"op": op, "workload": spec["workload"], "nbytes": size, "status": "ok"}
    lib = op.split("_")[0]
    cold = op.endswith("_cold")
    base = op.removesuffix("_cold")  # what is timed; "_cold" only drops the page cache first
    target = {
        "floor_write": "floor.bin",
        "floor_write_fsync": "floor.bin",
        "floor_read": "floor.bin",
        "floor_read_put": "floor.bin",
        "floor_read_put_each": "floor.bin",
        "jaxckpt_save": "jaxckpt",
        "jaxckpt_restore": "jaxckpt",
        "jaxckpt_async_save": "jaxckpt_async",
        "orbax_save": "orbax",
        "orbax_restore": "orbax",
        "orbax_async_save": "orbax_async",
    }.get(base)
    path = os.path.join(out_dir, target) if target else None
    writes = base.endswith("save") or base.startswith("floor_write")
    restores = base.endswith("restore") or base.startswith("floor_read_put")  # builds arrays on the target shardings

    # Untimed setup: imports, input data, the library objects.
    tree = abstract = targets = None
    leaves: list[Any] = []
    if op.startswith("jaxckpt"):
        jaxckpt = import_jaxckpt()
        result["jaxckpt_file"] = jaxckpt.__file__
    async_api = jaxckpt_async_api() if op == "jaxckpt_async_save" else None
    if op == "jaxckpt_async_save" and async_api is None:
        result["status"] = "n/a"
        result["why"] = "this jaxckpt has no async save (save(..., blocking=False) / wait_until_finished)"
        _write(result_path, result)
        return
    checkpointer = None
    if lib == "orbax":
        ocp = quiet_orbax()
        # Orbax's defaults; the synchronous Checkpointer for "save", StandardCheckpointer otherwise.
        if base == "orbax_save":
            checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        else:
            checkpointer = ocp.StandardCheckpointer()
    if lib == "floor" and not restores and base != "floor_hold":
        if base != "floor_read":
            leaves = wl.read_leaves(spec, data)
    else:
        import jax

        if restores:
            targets = [
                jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(leaf["dtype"]), sharding=s)
                for leaf, s in zip(spec["leaves"], wl.shardings(spec, wl.RESTORE_MESH))
            ]
            if lib != "floor":
                abstract = wl.build_tree(spec, targets)
        else:
            host = wl.read_leaves(spec, data)
            arrays = jax.device_put(host, wl.shardings(spec, wl.SAVE_MESH))  # one call: 1M leaves
            jax.block_until_ready(arrays)
            del host
            tree = wl.build_tree(spec, arrays)
            if base == "floor_hold":
                leaves = arrays
            del arrays
    if writes and path:
        remove(path)
    if base == "floor_read" or restores:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: run the matching save first")

    if base.endswith("async_save"):  # timed is the second save in the process, as in a training loop
        first = path + "-first"
        if base == "jaxckpt_async_save":
            async_api[0](first, tree)
            async_api[1]()
        else:
            checkpointer.save(first, tree)
            checkpointer.wait_until_finished()
        remove(first)
    if (base == "floor_read" or restores) and not cold:  # a hot read: the page cache holds it all
        result["warmed_bytes"] = warm_page_cache(path)
    gc.collect()
    result["pretouch_bytes"] = touch = 3 * size + touch_extra
    result["pretouch_seconds"] = pretouch(touch)
    if cold:
        t = time.perf_counter()
        why = drop_page_cache()
        if why is not None:
            result.update({"status": "n/a", "why": why})
            _write(result_path, result)
            return
        result["drop_caches_seconds"] = time.perf_counter() - t
    rss0 = reset_peak()
    cpu0 = cpu_seconds()
    busy0 = machine_busy_seconds()
    profiler = None
    if os.environ.get("BENCH_CPROFILE"):  # set by profile_jaxckpt.py: profile the timed part only
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()

    timing, produced = timed_operation(base, path, spec, leaves, tree, abstract, targets, async_api, checkpointer)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.environ["BENCH_CPROFILE"])

    cpu = cpu_seconds() - cpu0
    # Busy CPU seconds of the rest of the machine during the operation (kernel I/O work included).
    result["others_cpu_seconds"] = machine_busy_seconds() - busy0 - cpu
    hwm = _status_kib("VmHWM") * 1024
    result.update(timing)
    result.update({"cpu_seconds": cpu, "rss_start": rss0, "rss_peak": hwm})
    if checkpointer is not None:
        checkpointer.close()

    # Untimed checks and counts.
    if writes and path:
        result["files"], result["disk_bytes"] = tree_files(path)
    if base.endswith("restore"):
        import jax

        result["same_structure"] = jax.tree_util.tree_structure(produced) == jax.tree_util.tree_structure(abstract)
        _check_restored(spec, data, _in_spec_order(spec, produced), targets)
    elif base.startswith("floor_read_put"):
        _check_restored(spec, data, produced, targets)
    elif base == "floor_read":
        _check_restored(spec, data, produced, None)
    if base.endswith("async_save"):
        remove(path)  # nothing reads it; free its page cache for what follows
    _write(result_path, result)


def timed_operation(
    op: str,
    path: str | None,
    spec: dict[str, Any],
    leaves: list[np.ndarray],
    tree: Any,
    abstract: Any,
    targets: list[Any] | None,
    async_api: tuple[Callable[[str, Any], None], Callable[[], None]] | None,
    checkpointer: Any,
) -> tuple[dict[str, float], Any]:
    """The measured operation ``op`` (no "_cold" suffix): returns ({"seconds", maybe "blocking"}, what it produced)."""
    produced: Any = None
    t0 = time.perf_counter()
    if op in ("floor_write", "floor_write_fsync"):
        floor_write(leaves, path, fsync=op == "floor_write_fsync")
    elif op == "floor_read":
        produced = floor_read(spec, path)
    elif op in ("floor_read_put", "floor_read_put_each"):
        produced = floor_read_put(spec, path, [t.sharding for t in targets], each=op == "floor_read_put_each")
    elif op == "floor_copy":
        produced = [np.copy(x) for x in leaves]
    elif op == "floor_hold":  # what a zero-copy snapshot must do at least: hold each buffer against donation
        try:
            produced = list(map(memoryview, leaves))
        except BufferError:  # arrays of several shards: no one view holds them
            return {"status": "n/a", "why": "arrays of several shards"}, None
    elif op == "jaxckpt_save":
        import_jaxckpt().save(path, tree)
    elif op == "jaxckpt_async_save":
        start, wait = async_api
        start(path, tree)
        t1 = time.perf_counter()
        wait()
        return {"seconds": time.perf_counter() - t0, "blocking": t1 - t0}, None
    elif op == "jaxckpt_restore":
        import jax

        produced = import_jaxckpt().restore(path, like=abstract)
        jax.block_until_ready(produced)
    elif op == "orbax_save":
        import orbax.checkpoint as ocp

        checkpointer.save(path, args=ocp.args.StandardSave(tree))
    elif op == "orbax_async_save":
        checkpointer.save(path, tree)
        t1 = time.perf_counter()
        checkpointer.wait_until_finished()
        return {"seconds": time.perf_counter() - t0, "blocking": t1 - t0}, None
    elif op == "orbax_restore":
        import jax

        produced = checkpointer.restore(path, abstract)
        jax.block_until_ready(produced)
    else:
        raise ValueError(f"unknown op {op!r}")
    return {"seconds": time.perf_counter() - t0}, produced


def _write(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


def main(argv: list[str]) -> None:
    if argv[0] == "prepare":
        prepare(argv[1], argv[2], "--quick" in argv[3:])
    elif argv[0] == "run":
        run(argv[1], argv[2], argv[3], int(argv[4]) if len(argv) > 4 else 512 * MiB)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
