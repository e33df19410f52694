"""The caller's part of a save (jaxckpt.saving.snapshot, and flatten's shortcuts): the same leaves, the
same refusals, as the long way round."""

import jax
import numpy as np
import pytest

import jaxckpt
from jaxckpt._errors import UnsupportedValueError
from jaxckpt.storage import locations


@pytest.mark.parametrize("bad", [1.0, True], ids=["float", "bool"])
def test_a_dict_key_equal_to_an_earlier_dicts_int_key_is_still_refused(tmp_path, bad):
    # flatten reuses the checks of dicts with the same keys; 1 == 1.0 == True must not share them.
    with pytest.raises(UnsupportedValueError, match="key"):
        jaxckpt.save(tmp_path / "c", {"a": {1: 1}, "b": {bad: 2}})
    path = jaxckpt.save(tmp_path / "ok", {"a": {1: 1}, "b": {1: 2}, "c": {"x": 3}, "d": {"x": 4}})
    assert jaxckpt.restore(path) == {"a": {1: 1}, "b": {1: 2}, "c": {"x": 3}, "d": {"x": 4}}


def test_errors_are_raised_by_the_async_call_itself(tmp_path):
    one = jax.devices()[0]
    deleted = jax.device_put(np.ones(3, np.float32), one)
    deleted.delete()
    tree = {f"l{i}": jax.device_put(np.ones(3, np.float32), one) for i in range(10)}
    with pytest.raises(UnsupportedValueError, match="deleted"):
        jaxckpt.save(tmp_path / "a", {**tree, "z": deleted}, blocking=False)
    with pytest.raises(UnsupportedValueError, match="dtype"):
        jaxckpt.save(tmp_path / "b", {**tree, "z": np.array(["text"])}, blocking=False)
    with pytest.raises(UnsupportedValueError, match="not supported"):
        jaxckpt.save(tmp_path / "c", {**tree, "z": object()}, blocking=False)
    jaxckpt.wait_until_finished()
    assert not any(tmp_path.iterdir())


def test_views_of_every_dtype_are_saved_as_they_were(tmp_path):
    """A CPU array is taken as a memoryview where jax exports its dtype, else as np.asarray."""
    one = jax.devices()[0]
    values = {
        str(np.dtype(d)): np.arange(12).reshape(3, 4).astype(d)
        for d in (np.float32, np.float16, np.int8, np.uint32, np.bool_, np.complex64, jax.numpy.bfloat16)
    }
    values["scalar"] = np.float32(2.5).reshape(())
    tree = {k: jax.device_put(v, one) for k, v in values.items()}
    path = jaxckpt.save(tmp_path / "c", tree, blocking=False)
    for x in tree.values():
        x.delete()
    jaxckpt.wait_until_finished()
    restored = jaxckpt.restore(path)
    for k, v in values.items():
        assert restored[k].dtype == v.dtype, k
        np.testing.assert_array_equal(restored[k], v, err_msg=k)


def test_the_collector_runs_again_once_the_background_has_recorded(tmp_path):
    """The snapshot's pause of the garbage collector lasts until the background has recorded what it
    took (so the put-off collection is not the caller's), and no longer; a pause the user made stays."""
    import gc

    from jaxckpt.saving import pipeline

    tree = {f"l{i}": np.full(3, i, np.float32) for i in range(100)}
    assert gc.isenabled()
    jaxckpt.save(tmp_path / "a", tree, blocking=False)
    jaxckpt.wait_until_finished()
    assert gc.isenabled()
    jaxckpt.save(tmp_path / "b", tree)
    assert gc.isenabled()
    prepared = pipeline.prepare(locations.location(tmp_path / "c"), tree)
    assert not gc.isenabled()  # until recorded
    del prepared  # dropped unwritten (a multi-process save whose agreement failed)
    assert gc.isenabled()
    gc.disable()
    try:
        jaxckpt.save(tmp_path / "d", tree, blocking=False)
        jaxckpt.wait_until_finished()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32", "int4"])
def test_the_view_of_an_array_on_one_cpu_device_is_its_buffer_and_holds_it(dtype):
    import jax.numpy as jnp

    from jaxckpt.saving.snapshot import one_cpu_view

    x = jax.device_put(np.arange(-4, 4).astype(jnp.dtype(dtype)), jax.devices()[0])
    expected = np.asarray(x).copy()
    view = one_cpu_view(x)
    assert view.dtype == expected.dtype and np.array_equal(view, expected)
    if dtype != "int4":  # packed two to a byte: no plain view of its buffer
        assert view.__array_interface__["data"][0] == x.unsafe_buffer_pointer()
    step = jax.jit(lambda a: a * 0 + 1, donate_argnums=0)  # donation reuses a buffer nobody holds
    step(x).block_until_ready()
    assert np.array_equal(view, expected)
