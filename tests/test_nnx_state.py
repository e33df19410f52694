"""jaxckpt.tree.nnx_state: an NNX object saved again gives what ``nnx.to_pure_dict(nnx.state(obj))`` gives
now, through what the last traversal saw when the graph is the same, and through Flax when it is not."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.tree import nnx_state, structure
from jaxckpt.tree import objects as _tree


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([Block(rngs) for _ in range(3)])
        self.heads = nnx.Dict({"a": nnx.Linear(4, 2, rngs=rngs), "b": nnx.Linear(4, 3, rngs=rngs)})
        self.scale = nnx.Param(jnp.ones(()))
        self.shared = self.blocks[0].linear  # one module under two paths: Flax lists it once
        self.rngs = rngs
        self.width = 4

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block.dropout(block.norm(block.linear(x)))
        return self.heads["a"](x) * self.scale


def _same(a, b) -> bool:
    """The same nested dicts (keys in order) with the very same leaves."""
    if type(a) is dict and type(b) is dict:
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a is b


class _Counting:
    """flax.nnx, counting the full traversals (nnx.state) that pure_state makes."""

    def __init__(self) -> None:
        self.calls = 0
        self.to_pure_dict = nnx.to_pure_dict

    def state(self, x):
        self.calls += 1
        return nnx.state(x)


@pytest.fixture(autouse=True)
def fresh():
    nnx_state.forget()
    yield
    nnx_state.forget()


def _check(flax: _Counting, x, *, remembered: bool) -> None:
    """pure_state(x) equals Flax's own answer now; ``remembered``: without a traversal."""
    before = flax.calls
    got = nnx_state.pure_state(flax, x)
    assert _same(got, nnx.to_pure_dict(nnx.state(x)))
    assert (flax.calls == before) is remembered


@pytest.fixture
def net() -> Net:
    return Net(nnx.Rngs(0))


def test_a_second_call_replays_the_traversal_and_reads_the_values_now(net):
    flax = _Counting()
    _check(flax, net, remembered=False)
    _check(flax, net, remembered=True)
    net.scale.value = jnp.full((), 3.0)  # values change in place between saves: still the same graph
    net.blocks[1].linear.kernel.value = net.blocks[1].linear.kernel.value + 1
    _check(flax, net, remembered=True)


def change_submodule(net):
    net.blocks[1] = Block(nnx.Rngs(1))


def append_block(net):
    net.blocks.append(Block(nnx.Rngs(1)))


def new_attribute(net):
    net.extra = nnx.Param(jnp.zeros(2))


def delete_attribute(net):
    del net.heads["b"]


def swap_variable(net):
    net.scale = nnx.Param(jnp.ones(()))


def swap_modules(net):
    net.heads["a"], net.heads["b"] = net.heads["b"], net.heads["a"]


def unshare(net):
    net.shared = nnx.Linear(4, 4, rngs=nnx.Rngs(2))


def share_a_variable(net):
    net.blocks[2].linear.kernel = net.blocks[1].linear.kernel


def static_to_variable(net):
    net.width = nnx.data(nnx.Param(jnp.zeros(3)))


def plain_list(net):
    net.more = nnx.data([nnx.Param(jnp.zeros(1)), nnx.Param(jnp.ones(1))])


def variable_to_plain_value(net):
    net.scale = nnx.data(2.0)  # state, but not a Variable: never remembered (see below)


def static_to_data(net):
    net.width = nnx.data(net.width)  # the very same object: only the data map tells (never remembered either)


NEVER_REMEMBERED = (variable_to_plain_value, static_to_data)


@pytest.mark.parametrize(
    "change",
    [
        change_submodule,
        append_block,
        new_attribute,
        delete_attribute,
        swap_variable,
        swap_modules,
        unshare,
        share_a_variable,
        static_to_variable,
        plain_list,
        variable_to_plain_value,
        static_to_data,
    ],
)
def test_any_change_of_the_graph_goes_through_flax_again(net, change):
    flax = _Counting()
    _check(flax, net, remembered=False)
    change(net)
    _check(flax, net, remembered=False)
    _check(flax, net, remembered=change not in NEVER_REMEMBERED)  # the new graph is remembered
    assert (id(net) in nnx_state._seen) is (change not in NEVER_REMEMBERED)  # else forgotten


def test_a_plain_list_that_grows_in_place_goes_through_flax_again(net):
    net.more = nnx.data([nnx.Param(jnp.zeros(1))])
    flax = _Counting()
    _check(flax, net, remembered=False)
    _check(flax, net, remembered=True)
    net.more.append(nnx.Param(jnp.ones(1)))
    _check(flax, net, remembered=False)


def test_training_steps_of_nnx_jit_keep_the_graph(net):
    optimizer = nnx.Optimizer(net, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(net, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(net)
        optimizer.update(net, grads)

    flax = _Counting()
    _check(flax, net, remembered=False)
    _check(flax, optimizer, remembered=False)
    for _ in range(2):
        step(net, optimizer, jnp.ones((5, 4)))
        _check(flax, net, remembered=True)
        _check(flax, optimizer, remembered=True)


def test_replays_read_the_attributes_of_modules_without_flax_flatten(net, monkeypatch):
    """Each NNX Pytree's children are read from its attributes; Flax's flatten (which sorts and
    wraps them) runs again only for a node whose attributes were set anew, once, as nnx.jit does."""
    flax = _Counting()
    _check(flax, net, remembered=False)
    flattened = []
    real = nnx_state._children

    def spy(flax, node, impl):
        if isinstance(node, nnx.Pytree):  # not the pytrees among them (each Pytree's own PytreeState)
            flattened.append(node)
        return real(flax, node, impl)

    monkeypatch.setattr(nnx_state, "_children", spy)
    _check(flax, net, remembered=True)
    assert flattened == []
    nnx.jit(lambda net, x: net(x))(net, jnp.ones((2, 4)))  # sets every module's attributes anew, in sorted order
    _check(flax, net, remembered=True)
    assert flattened and all(isinstance(x, nnx.Pytree) for x in flattened)
    flattened.clear()
    _check(flax, net, remembered=True)
    assert flattened == []


def test_a_plain_array_attribute_is_never_remembered(net):
    net.counts = nnx.data(jnp.zeros(3))  # state without a Variable: would be kept alive here
    flax = _Counting()
    _check(flax, net, remembered=False)
    _check(flax, net, remembered=False)


def test_what_is_remembered_goes_with_the_object():
    net = Net(nnx.Rngs(0))
    nnx_state.pure_state(nnx, net)
    assert len(nnx_state._seen) == 1
    del net
    gc.collect()
    assert not nnx_state._seen


def test_another_object_at_the_same_address_is_not_taken_for_the_first():
    flax = _Counting()
    for seed in range(4):  # objects made and dropped in turn often reuse an address
        net = Net(nnx.Rngs(seed))
        _check(flax, net, remembered=False)
        del net


def test_saves_of_a_checkpoint_in_a_loop_restore_each_step(tmp_path, net, monkeypatch):
    """The docs' idiom: from the third save on, the flatten is the quick one (no full flatten), from
    what the model and the optimizer replay; and each checkpoint holds its own step."""
    optimizer = nnx.Optimizer(net, optax.adam(1e-2), wrt=nnx.Param)
    ckpt = jaxckpt.Checkpoint(model=net, optimizer=optimizer)
    structure.forget()
    full = []
    monkeypatch.setattr(structure, "flatten", lambda root: full.append(1) or _tree.flatten(root))

    @nnx.jit
    def step(net, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(net)
        optimizer.update(net, grads)

    saved = []
    for i in range(3):
        step(net, optimizer, jnp.ones((5, 4)))
        path = ckpt.save(tmp_path / f"ckpt-{i}", blocking=False)
        params = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(net, nnx.Param)))
        saved.append((path, {k: np.asarray(v) for k, v in params.items()}))
    ckpt.wait_until_finished()
    assert len(nnx_state._seen) == 2  # the model and the optimizer
    assert len(full) == 2  # the first save's walk stops at the objects not yet remembered; the second remembers
    for path, expected in saved:
        restored = jaxckpt.restore(path)["model"]
        for keys, value in expected.items():
            got = restored
            for k in keys:
                got = got[k]
            np.testing.assert_array_equal(got, value)


def test_flax_tree_mode_goes_through_flax_every_time():
    net = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    flax = _Counting()
    _check(flax, net, remembered=False)
    with nnx.set_graph_mode(False):
        _check(flax, net, remembered=False)
        _check(flax, net, remembered=False)
    _check(flax, net, remembered=True)


def _values_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_a_get_value_hook_added_after_remembering_is_called():
    net = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    flax = _Counting()
    _check(flax, net, remembered=False)
    net.bias.set_metadata("on_get_value", lambda variable, value: value + 7)
    _values_equal(nnx_state.pure_state(flax, net), nnx.to_pure_dict(nnx.state(net)))
    assert flax.calls == 1  # the same graph: replayed, with Flax's get_value where a hook is set
    np.testing.assert_array_equal(nnx_state.pure_state(flax, net)["bias"], np.full(4, 7.0, np.float32))


class DoubledParam(nnx.Param):
    def get_value(self, **kwargs):
        return super().get_value(**kwargs) * 2


def test_a_variable_class_of_its_own_get_value_is_read_through_it():
    net = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    net.scale = DoubledParam(jnp.ones(3))
    flax = _Counting()
    for _ in range(2):  # a new array at each call: never the same leaves as Flax's, so never remembered
        got = nnx_state.pure_state(flax, net)
        _values_equal(got, nnx.to_pure_dict(nnx.state(net)))
        np.testing.assert_array_equal(got["scale"], np.full(3, 2.0, np.float32))
    assert flax.calls == 2
