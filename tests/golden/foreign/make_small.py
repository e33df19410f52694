"""Write the small foreign-format fixtures with the real libraries (run once, never by the tests).

    python3.11 -m venv /tmp/venv-st
    /tmp/venv-st/bin/pip install safetensors numpy ml_dtypes 'flax==0.12.8' 'jax[cpu]==0.10.2'
    /tmp/venv-st/bin/python tests/golden/foreign/make_small.py

Writes, beside this script:
    msgpack/params.msgpack              flax.serialization.to_bytes of a params dict
    msgpack/legacy/checkpoint_{10,20}   flax.training.checkpoints.save_checkpoint (legacy, no Orbax)
    safetensors/model.safetensors       safetensors.numpy.save_file, with __metadata__
    {msgpack,safetensors}/expected.npz  the arrays, by "<file>:<key>" (bfloat16 as its uint16 bits)
    {msgpack,safetensors}/expected.json what each file holds (keys, dtypes, shapes, Python values),
                                        and the library versions that wrote it
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import version

import flax
import flax.serialization
import ml_dtypes
import numpy as np
from flax.training import checkpoints
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def params(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "dense": {
            "kernel": rng.standard_normal((3, 4)).astype(np.float32),
            "bias": np.arange(4, dtype=np.float32) + step,
        },
        "layers": [  # a list: to_bytes turns it into a map keyed "0", "1"
            {"scale": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16)},
            {"ids": np.arange(6, dtype=np.int32).reshape(2, 3) * step},
        ],
        "step": step,
        "lr": 0.125,
    }


VERSIONS = {p: version(p) for p in ("flax", "jax", "safetensors", "numpy", "ml_dtypes", "msgpack")}


def dump(folder: str, arrays: dict[str, np.ndarray], expected: dict) -> None:
    # bfloat16 is stored as its uint16 bits: np.load(allow_pickle=False) cannot make ml_dtypes arrays.
    np.savez(os.path.join(folder, "expected.npz"), **arrays)
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump({"versions": VERSIONS, **expected}, f, indent=1, sort_keys=True)
        f.write("\n")


def main() -> None:
    arrays: dict[str, np.ndarray] = {}
    expected: dict = {}

    def record(prefix: str, tree: dict) -> dict:
        keys: dict = {}

        def walk(x, key):
            if isinstance(x, dict):
                for k, v in x.items():
                    walk(v, f"{key}/{k}" if key else str(k))
            elif isinstance(x, (list, tuple)):
                for i, v in enumerate(x):
                    walk(v, f"{key}/{i}" if key else str(i))
            elif isinstance(x, np.ndarray):
                arrays[f"{prefix}:{key}"] = x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x
                keys[key] = {"dtype": str(x.dtype), "shape": list(x.shape)}
            else:
                keys[key] = {"value": x, "type": type(x).__name__}

        walk(tree, "")
        return keys

    out = os.path.join(HERE, "msgpack")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    p = params(1)
    with open(os.path.join(out, "params.msgpack"), "wb") as f:
        f.write(flax.serialization.to_bytes(p))
    expected["params.msgpack"] = record("params.msgpack", p)

    flax.config.update("flax_use_orbax_checkpointing", False)
    legacy = os.path.join(out, "legacy")
    for step in (10, 20):
        p = params(step)
        checkpoints.save_checkpoint(legacy, p, step=step, keep=5)
        expected[f"legacy/checkpoint_{step}"] = record(f"legacy/checkpoint_{step}", p)
    assert sorted(os.listdir(legacy)) == ["checkpoint_10", "checkpoint_20"], os.listdir(legacy)

    dump(out, arrays, expected)

    arrays, expected = {}, {}
    out = os.path.join(HERE, "safetensors")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((5, 4)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((4, 4)).astype(np.float16),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "model.layers.0.input_layernorm.position_ids": np.arange(7, dtype=np.int64),
    }
    meta = {"format": "pt", "source": "jaxckpt make_small.py"}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata=meta)
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)  # save_file creates it 0600
    keys = {}
    for name, x in tensors.items():
        arrays[f"model.safetensors:{name}"] = x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x
        keys[name] = {"dtype": str(x.dtype), "shape": list(x.shape)}
    expected["model.safetensors"] = {"tensors": keys, "metadata": meta}
    dump(out, arrays, expected)


if __name__ == "__main__":
    main()
