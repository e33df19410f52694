"""Writes tests/golden/v<FORMAT_VERSION>: a small checkpoint that every later jaxckpt must still read.

Run once per format version (`.venv/bin/python tests/golden/make_golden.py`) and commit the folder;
never regenerate an existing version.
"""

import sys
import typing
from pathlib import Path

import ml_dtypes
import numpy as np


class Pair(typing.NamedTuple):
    first: typing.Any
    second: typing.Any


def golden_tree():
    """The content of every golden checkpoint: a bit of each kind of leaf and node."""
    rng = np.random.default_rng(2026)
    return {
        "net": {
            "l1": {"kernel": rng.standard_normal((1, 5)).astype(np.float32), "bias": np.arange(5, dtype=np.float32)}
        },
        "big": rng.standard_normal((600, 600)).astype(np.float32),  # its own zarr3 array (over the pack limit)
        "bf16": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
        "f8": np.arange(4).astype(ml_dtypes.float8_e4m3fn),
        "ints": (np.int64(-3), np.uint8(200), np.zeros((0, 2), np.int32)),
        "pair": Pair([1, 2.5], {"s": "text/with~slash", 0: None, "0": True}),
        "step": 42,
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jaxckpt

    out = Path(__file__).parent / f"v{jaxckpt.FORMAT_VERSION}"
    if out.exists():
        sys.exit(f"{out} exists; golden checkpoints are never regenerated.")
    jaxckpt.save(out, golden_tree())
    print("wrote", out)
