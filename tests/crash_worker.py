"""A training job that saves in a loop through a CheckpointManager, to be killed (tests/test_crash.py).

    python crash_worker.py DIRECTORY --leaves N --mbytes M --keep K --steps S [--hook HOOK --hook-at I] [--frozen]

It resumes from the latest checkpoint of DIRECTORY (step 0 without one), then saves S steps
asynchronously. Every leaf's values encode the step (:func:`leaf_value`), so a checker can tell a
checkpoint whose leaves come from different steps. One leaf in 20 is large (its own zarr3 array,
sharded over 8 CPU devices) and holds most of the bytes; the rest are packed. With ``--frozen``, one
large leaf in two (every 40th leaf, :func:`frozen`) never changes: it keeps the values of step 0 and is
the same jax.Array at every save (the one restored, after a restart), so the manager's incremental
saves hard-link its files from the previous checkpoint, and retention deletes checkpoints whose files
later ones share.

HOOK makes the process SIGKILL itself at an exact instant, the I-th time it gets there:

- ``link``: while a save hard-links a frozen leaf's files (after a random one of its first 8 links);
- ``retention``: while retention deletes a dropped checkpoint (renamed out of the way first), after a random part of its files is gone;
- ``state-mid``: halfway through writing the state file's temp file;
- ``state-before-rename``: with the new state file written and durable, before it replaces the old;
- ``state-after-rename``: right after the new state file replaced the old (the dropped checkpoints
  are not yet deleted);
- ``bucket-delete`` (DIRECTORY in a bucket): after a random one of the first 6 object deletions
  inside a checkpoint's prefix (retention deleting, or pruning shared data it holds for kept ones).

In a bucket (``s3://...``), leaves over 1 MiB are arrays of their own, so that the frozen ones are
stored by reference (jaxckpt.incremental.refs) rather than packed.

Without a hook the test kills it at a random instant. Lines on stdout tell the test where it is:
``ready`` (imported), ``resumed STEP LISTING`` (manager open and restored; LISTING is the directory
as JSON, after the manager removed leftovers), ``saving STEP`` / ``saved STEP`` around each
``manager.save()``, and ``done``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys

import numpy as np

LARGE_EVERY = 20  # one leaf in 20 is large
LARGE_SHARE = 0.8  # and the large ones hold this share of the bytes
DEVICES = 8


def layout(leaves: int, mbytes: float) -> list[tuple[int, ...]]:
    """The shape of every leaf: (rows, 256) for large ones (rows a multiple of 8), (n,) for small ones.

    Small leaves stay under the 1 MiB packing limit, so both storage paths are exercised.
    """
    total = int(mbytes * 2**20)
    n_large = max(1, leaves // LARGE_EVERY)
    large_rows = max(DEVICES, int(total * LARGE_SHARE) // n_large // 4 // 256 // DEVICES * DEVICES)
    small_elems = max(1, min((1 << 20) // 4, int(total * (1 - LARGE_SHARE)) // max(1, leaves - n_large) // 4))
    return [(large_rows, 256) if i % LARGE_EVERY == 0 else (small_elems,) for i in range(leaves)]


def leaf_base(i: int, shape: tuple[int, ...]) -> np.ndarray:
    """What leaf ``i`` holds at step 0; at step s it holds ``base + 7 * s`` (exact in float32 too)."""
    base = (np.arange(math.prod(shape), dtype=np.int64) * (2 * i + 1)) % 1_000_003
    return base.reshape(shape).astype(np.float32 if i % 4 == 3 else np.int32)


def frozen(i: int) -> bool:
    """Whether leaf ``i`` is frozen (with ``--frozen``): every other large leaf."""
    return i % (2 * LARGE_EVERY) == 0


def leaf_value(base: np.ndarray, step: int) -> np.ndarray:
    return base + base.dtype.type(7 * step)


def step_of(base: np.ndarray, value: np.ndarray) -> float:
    """The step a leaf's first value says it is from (for messages)."""
    return (float(value.flat[0]) - float(base.flat[0])) / 7 if value.size else float("nan")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_hook(hook: str, at: int, rng: random.Random) -> None:
    """Make the process kill itself at the ``at``-th arrival at the instant ``hook`` names."""
    from jaxckpt.manager import one_tier
    from jaxckpt.manager import retention as _retention
    from jaxckpt.storage import locations

    seen = {"n": 0}

    def arrived() -> bool:
        seen["n"] += 1
        return seen["n"] == at

    if hook == "link":
        real_link, at = os.link, rng.randint(1, 8)

        def link_then_die(src, dst, *args, **kwargs):
            real_link(src, dst, *args, **kwargs)
            seen["n"] += 1
            if seen["n"] == at:
                _die()

        os.link = link_then_die
        return
    if hook == "bucket-delete":
        from jaxckpt.storage import kvstore

        real_kv_delete, real_kv_delete_all, at = kvstore.kv_delete, kvstore.kv_delete_all, rng.randint(1, 6)

        def counted(call):
            def delete_then_die(base, *key):
                call(base, *key)
                if key != (".jaxckpt-save",):  # not a save publishing
                    seen["n"] += 1
                    if seen["n"] == at:
                        _die()

            return delete_then_die

        kvstore.kv_delete, kvstore.kv_delete_all = counted(real_kv_delete), counted(real_kv_delete_all)
        return
    if hook == "retention":
        real_delete = _retention._delete_renamed

        def delete_part_then_die(hidden):  # the dropped checkpoint, already renamed out of the way
            if arrived():
                files = sorted(p for p in hidden.rglob("*") if p.is_file())
                for f in rng.sample(files, rng.randint(0, len(files))):
                    f.unlink()
                _die()
            real_delete(hidden)

        _retention._delete_renamed = delete_part_then_die
        return

    real_write, real_fsync_dir = locations.write_durable, locations.fsync_dir
    state_tmp = f".{one_tier.STATE_FILE}.tmp-"  # see locations.write_file_atomic
    renaming = {"now": False}

    def write(path, data):
        if not path.name.startswith(state_tmp) or not arrived():
            return real_write(path, data)
        if hook == "state-mid":
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            _die()
        real_write(path, data)
        if hook == "state-before-rename":
            _die()
        renaming["now"] = True  # write_file_atomic renames, then makes the directory durable

    def fsync_dir(path):
        real_fsync_dir(path)
        if renaming["now"]:
            _die()

    locations.write_durable, locations.fsync_dir = write, fsync_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--leaves", type=int, default=200)
    parser.add_argument("--mbytes", type=float, default=50)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hook", default="none")
    parser.add_argument("--hook-at", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frozen", action="store_true")
    args = parser.parse_args()

    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt.arrays import store_write
    from jaxckpt.storage import locations

    if args.directory.startswith(("s3://", "gs://")):
        store_write.BUCKET_PACK_LEAF_LIMIT = 1 << 20
    if args.hook != "none":
        install_hook(args.hook, args.hook_at, random.Random(args.seed))
    print("ready", flush=True)

    sharded = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    bases = [leaf_base(i, shape) for i, shape in enumerate(layout(args.leaves, args.mbytes))]

    def params(step: int, previous: dict[str, object] | None = None) -> dict[str, object]:
        out = {}
        for i, base in enumerate(bases):
            if args.frozen and frozen(i) and previous is not None:  # the very same array
                out[f"l{i}"] = previous[f"l{i}"]
                continue
            value = leaf_value(base, 0 if args.frozen and frozen(i) else step)
            if base.ndim == 2:
                out[f"l{i}"] = jax.device_put(value, sharded)
            else:  # small ones: half jax arrays, half numpy (which a save must copy)
                out[f"l{i}"] = jax.device_put(value) if i % 2 else value
        return out

    ckpt = jaxckpt.Checkpoint(step=0, params=params(0))
    manager = jaxckpt.CheckpointManager(ckpt, args.directory, max_to_keep=args.keep, step_counter="step")
    manager.restore_or_initialize()
    step = int(ckpt.step)
    print("resumed", step, json.dumps(locations.children(locations.location(args.directory))), flush=True)
    for _ in range(args.steps):
        step += 1
        ckpt.params = params(step, ckpt.params)
        ckpt.step = step
        print("saving", step, flush=True)
        manager.save()
        print("saved", step, flush=True)
    manager.close()
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
