"""Pytree paths become named edges that round-trip, and containers keep their types."""

import collections
import dataclasses
import typing

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.format.keys import edges_for


@pytest.mark.parametrize(
    "key", ["a/b", "~", "~0", "~1/", "with space", "ünï©ødé", "", "~i0", "0", "-1", ".", "..", "a\nb"]
)
def test_every_str_dict_key_round_trips(tmp_path, key):
    tree = {key: np.arange(3), "other": 1}
    path = jaxckpt.save(tmp_path / "c", tree)
    restored = jaxckpt.restore(path)
    assert set(restored) == {key, "other"}
    np.testing.assert_array_equal(restored[key], tree[key])
    assert jaxckpt.restore(path, like=tree)[key].tolist() == [0, 1, 2]


def test_int_and_str_keys_stay_apart(tmp_path):
    tree = {0: np.float32(1), "0": np.float32(2), 1: {"x": 3}, "nested": {-5: "neg"}}
    path = jaxckpt.save(tmp_path / "c", tree)
    restored = jaxckpt.restore(path)
    assert restored[0] == 1 and restored["0"] == 2 and restored[1] == {"x": 3} and restored["nested"] == {-5: "neg"}
    keys = [k for k, _ in jaxckpt.list_variables(path)]
    assert keys == sorted(["~i0", "0", "1/x", "nested/-5"])
    assert jaxckpt.load_variable(path, "~i0") == 1 and jaxckpt.load_variable(path, "0") == 2


def test_unsupported_dict_keys_are_named(tmp_path):
    with pytest.raises(jaxckpt.UnsupportedValueError, match=r"'outer'.*\(1, 2\)"):
        jaxckpt.save(tmp_path / "c", {"outer": {(1, 2): 3}})


class Point(typing.NamedTuple):
    x: typing.Any
    y: typing.Any


@dataclasses.dataclass
class Plain:
    a: typing.Any


jax.tree_util.register_dataclass(Plain, data_fields=["a"], meta_fields=[])


@flax.struct.dataclass
class Struct:
    w: typing.Any
    tag: str = flax.struct.field(pytree_node=False, default="t")


def test_containers_keep_their_types_with_a_template(tmp_path):
    tree = {
        "tuple": (np.ones(2), (3, [4.0])),
        "list": [np.zeros(1), None],
        "point": Point(jnp.ones(2), Point(1, 2)),
        "dataclass": Plain(np.arange(2)),
        "struct": Struct(jnp.ones(3)),
        "ordered": collections.OrderedDict(b=1, a=2),
        "empty": (),
        "adam": optax.adam(0.1).init({"w": jnp.ones(2)}),
    }
    path = jaxckpt.save(tmp_path / "c", tree)
    restored = jaxckpt.restore(path, like=tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    assert type(restored["adam"][0]) is optax.ScaleByAdamState
    assert type(restored["struct"]) is Struct and type(restored["dataclass"]) is Plain
    assert type(restored["ordered"]) is collections.OrderedDict
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(a, b)


def test_without_template_containers_are_rebuilt_as_saved(tmp_path):
    tree = {"t": (1, 2), "l": [3], "p": Point(4, 5), "d": Plain(6), "adam": optax.adam(0.1).init(jnp.ones(1))}
    restored = jaxckpt.restore(jaxckpt.save(tmp_path / "c", tree))
    assert restored["t"] == (1, 2) and restored["l"] == [3]
    assert restored["p"].x == 4 and restored["p"].y == 5 and type(restored["p"]).__name__ == "Point"
    assert restored["d"] == {"a": 6}  # other nodes come back as dicts of their fields
    assert restored["adam"][0].mu.shape == (1,) and type(restored["adam"][0]).__name__ == "ScaleByAdamState"


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(1, 5, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(5, 5, rngs=rngs) for _ in range(2)])


def test_nnx_variables_are_leaves_and_restore_in_place(tmp_path):
    net = Net(nnx.Rngs(0))
    path = jaxckpt.save(tmp_path / "c", net)
    keys = [k for k, _ in jaxckpt.list_variables(path)]
    assert "l1/kernel" in keys and "blocks/1/bias" in keys and not any(k.endswith("/value") for k in keys)
    other = Net(nnx.Rngs(1))
    assert not np.array_equal(other.l1.kernel[...], net.l1.kernel[...])
    assert jaxckpt.restore(path, like=other) is other
    np.testing.assert_array_equal(other.l1.kernel[...], net.l1.kernel[...])
    np.testing.assert_array_equal(other.blocks[1].bias[...], net.blocks[1].bias[...])


def test_nnx_optimizer_keys_read_naturally(tmp_path):
    net = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.adam(0.1), wrt=nnx.Param)
    path = jaxckpt.Checkpoint(optimizer=opt, net=net).write(tmp_path / "c")
    keys = dict(jaxckpt.list_variables(path))
    assert keys["optimizer/opt_state/0/mu/l1/kernel"] == (1, 5)
    assert keys["net/l1/kernel"] == (1, 5) and "optimizer/step" in keys


def test_edges_are_unique_and_unambiguous():
    keys = ["a/b", "a~1b", "~", "", 0, "0", 1]
    edges = edges_for(keys)
    assert len(set(edges)) == len(edges)
    assert edges == ["a~1b", "a~01b", "~0", "~e", "~i0", "0", "1"]
