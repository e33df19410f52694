"""How a LoRA-shaped state's small leaves fall into packs (issue 27): which pack each leaf of 1 MiB or
less goes to, and the share of the packed bytes that a LoRA step leaves unchanged (the frozen norms).

    python benchmarks/lora_packs.py                    # 16 layers of hidden 1024, rank 8
    python benchmarks/lora_packs.py --layers 32 --hidden 4096

A Llama-shaped model: per layer two norm scales (frozen), q/k/v/o kernels in bfloat16 (frozen, own
files), rank-``r`` LoRA A and B on q and v, with Adam's mu and nu of them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np

import jaxckpt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()
    h, r = args.hidden, args.rank
    params: dict = {"final_norm": jnp.ones(h)}
    lora: dict = {}
    for i in range(args.layers):
        layer: dict = {"attn_norm": jnp.ones(h), "mlp_norm": jnp.ones(h)}
        for m in ("q", "k", "v", "o"):
            layer[m] = {"kernel": jnp.zeros((h, h), jnp.bfloat16)}
        for m in ("q", "v"):
            layer[m]["lora_a"], layer[m]["lora_b"] = jnp.zeros((h, r)), jnp.zeros((r, h))
            lora.setdefault(f"layer_{i:02d}", {})[m] = {"lora_a": layer[m]["lora_a"], "lora_b": layer[m]["lora_b"]}
        params[f"layer_{i:02d}"] = layer
    with tempfile.TemporaryDirectory() as d:
        path = jaxckpt.save(os.path.join(d, "c"), {"params": params, "opt": {"mu": lora, "nu": lora}})
        with open(os.path.join(path, "index.json")) as f:
            leaves = json.load(f)["leaves"]
    packs: dict[int, list[str]] = {}
    packed = frozen = 0
    for key, leaf in leaves.items():
        at = leaf.get("at", {})
        if "pack" not in at:
            continue
        packs.setdefault(at["pack"], []).append(key)
        nbytes = int(np.prod(leaf["shape"])) * np.dtype(leaf["dtype"]).itemsize
        packed += nbytes
        frozen += nbytes if "norm" in key else 0
    print(f"packs: {len(packs)}; leaves in each: {[len(v) for v in packs.values()]}")
    print(
        f"packed: {packed / 2**20:.2f} MiB, of which frozen (norms): {frozen / 2**20:.3f} MiB ({100 * frozen / packed:.1f}%)"
    )


if __name__ == "__main__":
    main()
