"""An object graph, not only a tree, as TensorFlow's checkpoint tests write it: a Checkpoint reachable
by two paths is saved once and restored into one object; two Checkpoints that refer to each other
save and restore, with delayed restoration on both sides."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt


def _index(path):
    return json.loads((path / "index.json").read_text())


def test_a_checkpoint_reached_by_two_paths_is_saved_once(tmp_path):
    shared = jaxckpt.Checkpoint(v=jnp.arange(3.0))
    root = jaxckpt.Checkpoint(a=jaxckpt.Checkpoint(dep=shared), b=jaxckpt.Checkpoint(dep=shared))
    path = tmp_path / "c"
    root.write(path)
    keys = [k for k, _ in jaxckpt.list_variables(path)]
    assert "a/dep/v" in keys and "b/dep/v" not in keys  # stored once
    assert _index(path)["aliases"] == {"b/dep": "a/dep"}

    restored_shared = jaxckpt.Checkpoint(v=jnp.zeros(3))
    new = jaxckpt.Checkpoint(a=jaxckpt.Checkpoint(dep=restored_shared), b=jaxckpt.Checkpoint(dep=restored_shared))
    new.restore(path).assert_consumed()
    assert new.a.dep is new.b.dep
    np.testing.assert_array_equal(new.b.dep.v, [0.0, 1.0, 2.0])


def test_one_saved_object_loaded_into_two_objects_is_reported(tmp_path):
    shared = jaxckpt.Checkpoint(v=jnp.ones(2))
    path = tmp_path / "c"
    jaxckpt.Checkpoint(a=shared, b=shared).write(path)
    first, second = jaxckpt.Checkpoint(v=jnp.zeros(2)), jaxckpt.Checkpoint(v=jnp.zeros(2))
    status = jaxckpt.Checkpoint(a=first, b=second).restore(path)
    np.testing.assert_array_equal(first.v, [1.0, 1.0])
    np.testing.assert_array_equal(second.v, [1.0, 1.0])  # both get the value, and the assertions say so
    with pytest.raises(jaxckpt.RestoreAssertionError, match=r"(?s)restored into more than one object.*\n    a$"):
        status.assert_consumed()
    with pytest.raises(jaxckpt.RestoreAssertionError, match="more than one object"):
        status.assert_existing_objects_matched()


def test_two_saved_objects_loaded_into_one_object_works(tmp_path):
    path = tmp_path / "c"
    jaxckpt.Checkpoint(a=jaxckpt.Checkpoint(v=jnp.ones(2)), b=jaxckpt.Checkpoint(v=jnp.ones(2) * 2)).write(path)
    one = jaxckpt.Checkpoint(v=jnp.zeros(2))
    jaxckpt.Checkpoint(a=one, b=one).restore(path).assert_consumed()
    # Restored from each saved object, as TF's restore binds each to it: where both hold ``v``, the
    # last one reached (b) gives the value.
    np.testing.assert_array_equal(one.v, [2.0, 2.0])


def test_a_cycle_saves_and_restores_with_delayed_restoration_on_both_sides(tmp_path):
    a, b = jaxckpt.Checkpoint(x=jnp.ones(2)), jaxckpt.Checkpoint(y=jnp.full(3, 2.0))
    a.b, b.a = b, a
    path = tmp_path / "c"
    a.write(path)  # before: RecursionError, later an UnsupportedValueError naming the cycle
    assert _index(path)["aliases"] == {"b/a": ""}
    assert sorted(k for k, _ in jaxckpt.list_variables(path)) == ["b/save_counter", "b/y", "save_counter", "x"]

    new_a = jaxckpt.Checkpoint()
    status = new_a.restore(path)
    new_b = jaxckpt.Checkpoint()
    new_a.b = new_b  # delayed: b's values wait until it is assigned
    new_a.x = jnp.zeros(2)
    new_b.y = jnp.zeros(3)
    new_b.a = new_a  # around the cycle again: nothing more to restore, no recursion
    np.testing.assert_array_equal(new_a.x, [1.0, 1.0])
    np.testing.assert_array_equal(new_b.y, [2.0, 2.0, 2.0])
    status.assert_consumed()
    new_a.write(tmp_path / "again")  # the restored graph saves again, its cycle stored once
    assert _index(tmp_path / "again")["aliases"] == {"b/a": ""}


def test_a_cycle_restores_into_an_existing_cycle(tmp_path):
    a, b = jaxckpt.Checkpoint(x=jnp.ones(2)), jaxckpt.Checkpoint(y=jnp.ones(1))
    a.b, b.a = b, a
    path = tmp_path / "c"
    a.write(path)
    c, d = jaxckpt.Checkpoint(x=jnp.zeros(2)), jaxckpt.Checkpoint(y=jnp.zeros(1))
    c.b, d.a = d, c
    c.restore(path).assert_consumed()
    np.testing.assert_array_equal(c.x, [1.0, 1.0])
    np.testing.assert_array_equal(d.y, [1.0])
    restored = jaxckpt.restore(path)  # without a template: the alias is an empty node
    assert restored["b"]["a"] == {}


def test_aliases_in_a_crafted_index_are_checked(tmp_path):
    from test_data_safety import _write_index

    a = jaxckpt.Checkpoint(x=jnp.ones(2))
    a.me = a
    path = tmp_path / "c"
    a.write(path)
    body = _index(path)
    body["aliases"] = {"x": ""}  # a leaf, not an empty checkpoint node
    _write_index(path, body)
    with pytest.raises(jaxckpt.CheckpointFormatError, match="not an empty checkpoint node"):
        jaxckpt.list_variables(path)
    body["aliases"] = {"me": "me"}
    _write_index(path, body)
    with pytest.raises(jaxckpt.CheckpointFormatError, match="not a stored checkpoint node"):
        jaxckpt.list_variables(path)


def test_the_golden_object_graph_is_still_readable():
    """tests/golden/graph-v3 (make_golden.py graph): a Checkpoint shared by two paths, and a cycle."""
    from pathlib import Path

    golden = Path(__file__).parent / "golden" / "graph-v3"
    shared = jaxckpt.Checkpoint(v=jnp.zeros(3))
    a, b = jaxckpt.Checkpoint(left=shared, step=0), jaxckpt.Checkpoint(right=shared)
    a.b, b.a = b, a
    a.restore(golden).assert_consumed()
    assert a.step == 5 and a.b.right is a.left
    np.testing.assert_array_equal(shared.v, [0.0, 1.0, 2.0])
