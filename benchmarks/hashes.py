"""What comparing host data by content could cost (issue 27): single-thread GB/s of hashes and of
the operations a save's content comparison does, over one buffer of random bytes in memory.

    python benchmarks/hashes.py            # 256 MiB, best of 5 each
    python benchmarks/hashes.py --mib 64

xxhash is measured only where it is installed (it is not a dependency of jaxckpt).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import ssl
import time
from collections.abc import Callable

import crc32c
import numpy as np


def best(f: Callable[[], object], reps: int) -> float:
    out = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    n = args.mib << 20
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    other = data.copy()
    view = memoryview(data)
    memcmp = ctypes.CDLL(None).memcmp
    memcmp.argtypes, memcmp.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    cases: dict[str, Callable[[], object]] = {
        "numpy copy": data.copy,
        "memcmp (libc)": lambda: memcmp(data.ctypes.data, other.ctypes.data, n),
        "numpy array_equal (uint64)": lambda: np.array_equal(data.view(np.uint64), other.view(np.uint64)),
        "CRC-32C (crc32c, SSE4.2)": lambda: crc32c.crc32c(view),
    }
    for name in ("blake2b", "blake2s", "sha1", "sha256", "sha512", "md5"):
        cases[f"hashlib {name}"] = lambda name=name: hashlib.new(name, view).digest()
    try:
        import xxhash

        cases["xxhash xxh3_64"] = lambda: xxhash.xxh3_64_digest(view)
        cases["xxhash xxh3_128"] = lambda: xxhash.xxh3_128_digest(view)
        cases["xxhash xxh64"] = lambda: xxhash.xxh64_digest(view)
    except ImportError:
        pass
    print(f"{args.mib} MiB, best of {args.reps}; {ssl.OPENSSL_VERSION}")
    print("| what | GB/s |\n|---|---:|")
    for name, f in cases.items():
        print(f"| {name} | {n / best(f, args.reps) / 1e9:.2f} |")


if __name__ == "__main__":
    main()
