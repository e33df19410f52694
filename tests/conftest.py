"""Every test runs on CPU with 8 host devices, so meshes and sharded arrays are real."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import pytest

jax.config.update("jax_enable_x64", False)


@pytest.fixture
def small_packs(monkeypatch):
    """Store every array leaf as its own zarr3 array, so tests cover that path as well as packing."""
    from jaxckpt import _tensorstore

    monkeypatch.setattr(_tensorstore, "PACK_LEAF_LIMIT", -1)
