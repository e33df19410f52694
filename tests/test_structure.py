"""A save's quick flatten (jaxckpt.tree.structure): a tree with the structure of the last one flattened in
full gets exactly the keys, nodes and leaves that the full flatten gives it, and every change of
structure is seen. Then the saves a training loop makes, through the one-pass views of its arrays."""

import collections
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import freeze
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._errors import UnsupportedValueError
from jaxckpt.saving import snapshot as _snapshot
from jaxckpt.tree import objects
from jaxckpt.tree import structure as _structure


@pytest.fixture(autouse=True)
def nothing_remembered():
    _structure.forget()
    yield
    _structure.forget()


def arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((3, 2)).astype(np.float32)) for _ in range(n)]


def as_full_flatten(root):
    """The quick flatten of ``root`` twice (the second from what the first remembered) is the full one."""
    full = objects.flatten(root)
    for _ in range(2):
        quick = _structure.flatten_saved(root)
        assert quick.nodes == full.nodes
        assert list(quick.leaves) == list(full.leaves)
        assert all(a is b for a, b in zip(quick.leaves.values(), full.leaves.values()))
        assert quick.aliases == full.aliases
    return quick


Pair = collections.namedtuple("Pair", ["left", "right"])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "n"], meta_fields=["tag"])
@dataclasses.dataclass
class Registered:
    x: object
    n: object
    tag: str


def _apply(*args):
    return None


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)


class Model(nnx.Module):
    """Submodules in an ``nnx.List`` (integer keys), a head, a BatchStat and a static attribute."""

    def __init__(self, rngs, blocks=2):
        self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
        self.head = nnx.Linear(4, 2, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.name = "model"

    def __call__(self, x):
        for block in self.blocks:
            x = block.norm(block.lin(x))
        return self.head(x)


def trees():
    a = arrays(8)
    params = {"l1": {"kernel": a[0], "bias": a[1]}, "l2": {"kernel": a[2], "bias": a[3]}}
    yield "dicts", params
    yield (
        "training state",
        {
            "params": params,
            "opt_state": optax.adam(1e-3).init(params),  # a tuple of namedtuples, with an EmptyState
            "step": 7,
            "note": "text",
            "lr": 0.5,
            "done": False,
            "nothing": None,
            "host": np.arange(3.0),
            "scalar": np.float32(2.0),
            "key": jax.random.key(1),
        },
    )
    yield "lists and tuples", [a[0], (a[1], [a[2]], ()), [], {}, Pair(a[3], (a[4],))]
    yield "int keys", {0: a[0], "0": a[1], 1: {"x": a[2]}, "~/": a[3], "": a[4]}
    yield "nnx.State", nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    yield "nnx.Variable", {"w": nnx.Param(a[5]), "tree": nnx.Param({"u": a[6]})}
    yield "Checkpoint", jaxckpt.Checkpoint(params=params, step=3, inner=jaxckpt.Checkpoint(w=a[7]))
    yield "TrainState", train_state.TrainState.create(apply_fn=_apply, params=params, tx=optax.adam(1e-3))
    yield "FrozenDict", {"frozen": freeze(params), "data": Registered(a[4], 2, "static")}
    model = Model(nnx.Rngs(0))
    yield "nnx.Module", {"model": model, "step": 1}
    yield "nnx.Optimizer", nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    yield "NNX in a Checkpoint", jaxckpt.Checkpoint(model=model, optimizer=optimizer, step=3)


@pytest.mark.parametrize(("name", "root"), list(trees()), ids=[name for name, _ in trees()])
def test_a_tree_seen_before_flattens_as_in_full(name, root):
    quick = as_full_flatten(root)
    assert _structure._last is not None, "the structure was not remembered"
    expected = [k for k, x in quick.leaves.items() if type(x).__name__ != "ArrayImpl"]
    assert quick.not_arrays == expected


def test_the_same_keys_in_another_order_give_that_order():
    a = arrays(3)
    first = {"b": a[0], "a": {"y": a[1], "x": a[2]}}
    as_full_flatten(first)
    again = jax.tree.map(lambda x: x + 1, first)  # jax rebuilds dicts with sorted keys
    assert list(again) == ["a", "b"]
    flat = as_full_flatten(again)
    assert flat.nodes[""].keys == ("a", "b") and flat.nodes["a"].keys == ("x", "y")


@pytest.mark.parametrize(
    "change",
    [
        lambda t: {**t, "new": t["w"]},  # a key more
        lambda t: {"renamed": t["w"], "sub": t["sub"]},  # a key renamed
        lambda t: {"w": {"inner": t["w"]}, "sub": t["sub"]},  # a leaf became a dict
        lambda t: {"w": t["w"], "sub": tuple(t["sub"])},  # a list became a tuple
        lambda t: {"w": t["w"], "sub": Pair(*t["sub"])},  # a tuple became a namedtuple
        lambda t: {"w": t["w"], "sub": [*t["sub"], 1]},  # a list grew
        lambda t: {"w": 3, "sub": t["sub"]},  # an array became an int
    ],
    ids=[
        "key added",
        "key renamed",
        "leaf to dict",
        "list to tuple",
        "tuple to namedtuple",
        "list grew",
        "array to int",
    ],
)
def test_a_changed_structure_is_flattened_in_full(change):
    a = arrays(3)
    tree = {"w": a[0], "sub": [a[1], a[2]]}
    as_full_flatten(tree)
    changed = change(tree)
    assert as_full_flatten(changed).nodes == objects.flatten(changed).nodes


@pytest.mark.parametrize("key", [True, 1.0], ids=["bool", "float"])
def test_a_key_equal_to_a_remembered_int_key_is_still_refused(key):
    a = arrays(1)
    as_full_flatten({"d": {1: a[0]}})
    with pytest.raises(UnsupportedValueError, match="key"):
        _structure.flatten_saved({"d": {key: a[0]}})


def test_a_cycle_in_a_tree_like_a_remembered_one_is_refused_as_a_cycle():
    a = arrays(1)
    as_full_flatten({"a": {"b": {"c": a[0]}}})
    inner = {"c": a[0]}
    inner["c"] = inner
    with pytest.raises(UnsupportedValueError, match="contains itself"):
        _structure.flatten_saved({"a": {"b": inner}})


def test_a_checkpoint_met_twice_is_an_alias_as_in_full():
    shared = jaxckpt.Checkpoint(w=arrays(1)[0])
    flat = as_full_flatten(jaxckpt.Checkpoint(x=shared, y=shared))
    assert flat.aliases == {"y": "x"}


# --- the saves of a training loop ---------------------------------------------------------------


@pytest.fixture
def views(monkeypatch):
    """How often the snapshot viewed every array in one pass (Taker._views gave views)."""
    seen = []
    real = _snapshot.Taker._views

    def spy(leaves, not_arrays):
        out = real(leaves, not_arrays)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(_snapshot.Taker, "_views", staticmethod(spy))
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "mixed"])
def test_a_second_async_save_holds_what_the_call_saw(tmp_path, held_background, views, dtype):
    """The quick flatten and the one-pass views (bfloat16 has no Python buffer: jax's own view of
    each, one by one; "mixed": bfloat16 kernels, float32 and float8 vectors, one by one too) hold
    the state as it was at the call, though the train step donates it and the loop changes the dict."""
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    kernel, bias = ("bfloat16", "float32") if dtype == "mixed" else (dtype, dtype)
    params = {f"l{i}": {"w": jnp.full((4, 3), i, kernel), "b": jnp.full((3,), -i, bias)} for i in range(20)}
    if dtype == "mixed":
        params["scale"] = jnp.full((5,), 0.5, jnp.float8_e4m3fn)
    state = {"params": params, "step": 0, "host": np.zeros(2)}
    held_background.set()  # the first save goes through
    jaxckpt.save(tmp_path / "first", state)
    held_background.clear()
    assert _structure._last is not None and views == [dtype == "float32"]

    state = {"params": step(params), "step": 1, "host": np.ones(2)}
    expected = jax.tree.map(np.array, state)
    path = jaxckpt.save(tmp_path / "second", state, blocking=False)
    state["params"] = step(state["params"])  # donated: the saved arrays are gone
    state["step"] = 2
    state["host"][:] = 5
    state["new"] = 1
    held_background.set()
    jaxckpt.wait_until_finished()
    assert views == [dtype == "float32"] * 2

    restored = jaxckpt.restore(path)
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for (where, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(where))
        assert np.asarray(got).dtype == np.asarray(want).dtype


@pytest.mark.parametrize(
    "dtype", ["bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32", "complex64"]
)
def test_every_dtype_a_view_holds_saves_as_it_was(tmp_path, views, dtype):
    value = jnp.asarray((np.arange(12) % 3).reshape(3, 4).astype(dtype))
    tree = {"x": value, "scalar": jnp.asarray(np.ones((), dtype)), "empty": jnp.zeros((0, 2), dtype)}
    jaxckpt.save(tmp_path / "a", tree)
    path = jaxckpt.save(tmp_path / "b", tree, blocking=False)
    jaxckpt.wait_until_finished()
    assert views == [True, True]
    restored = jaxckpt.restore(path)
    for k, v in tree.items():
        assert restored[k].dtype == np.dtype(dtype) and restored[k].shape == v.shape, k
        np.testing.assert_array_equal(restored[k], np.asarray(v), err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # viewed in one pass; one by one
def test_a_deleted_array_in_a_tree_seen_before_is_refused_by_the_call(tmp_path, dtype):
    tree = {"a": {k: x.astype(dtype) for k, x in zip("xyz", arrays(3))}, "b": jnp.zeros(3)}
    jaxckpt.save(tmp_path / "first", tree)
    tree["a"]["y"].delete()
    with pytest.raises(UnsupportedValueError, match=r"'a/y'.*deleted"):
        jaxckpt.save(tmp_path / "second", tree, blocking=False)
    jaxckpt.wait_until_finished()
    assert not (tmp_path / "second").exists()


@pytest.mark.parametrize(
    "change",
    [
        lambda t: {**t, "state": t["state"].replace(tx=optax.sgd(0.1))},  # another static field
        lambda t: {**t, "frozen": freeze({**t["frozen"], "more": t["data"].x})},  # a key more
        lambda t: {**t, "frozen": freeze({"other": t["frozen"]["a"]})},  # keys renamed
        lambda t: {**t, "data": Registered(t["data"].x, 2, "another tag")},  # other aux data
        lambda t: {**t, "data": Registered(t["data"].x, {"n": 2}, "static")},  # a leaf became a dict
    ],
    ids=["static field", "frozen key added", "frozen keys renamed", "aux data", "leaf to dict"],
)
def test_a_changed_registered_node_is_flattened_in_full(change):
    a = arrays(3)
    tree = {
        "state": train_state.TrainState.create(apply_fn=_apply, params={"w": a[0]}, tx=optax.adam(1e-3)),
        "frozen": freeze({"a": a[1]}),
        "data": Registered(a[2], 2, "static"),
    }
    as_full_flatten(tree)
    remembered = _structure._last
    changed = change(tree)
    as_full_flatten(changed)
    assert _structure._last is not remembered  # flattened in full, and that structure remembered


def _replace_head(model):
    model.head = nnx.Linear(4, 2, use_bias=False, rngs=nnx.Rngs(1))


class Head(nnx.Linear):
    pass


def _head_of_another_class(model):  # a pure dict holds no classes: the same structure
    model.head = Head(4, 2, rngs=nnx.Rngs(1))


def _add_attribute(model):
    model.extra = nnx.Param(jnp.ones(2))


def _drop_block(model):
    model.blocks.pop()


def _swap_blocks(model):  # the same structure, the values of other Variables at each place
    model.blocks[0], model.blocks[1] = model.blocks[1], model.blocks[0]


def _new_variable(model):
    model.head.kernel = nnx.Param(jnp.zeros((4, 2)))


def _set_value(model):
    model.head.kernel.set_value(jnp.zeros((4, 2)))


@pytest.mark.parametrize(
    ("change", "same_structure"),
    [
        (_replace_head, False),
        (_head_of_another_class, True),
        (_add_attribute, False),
        (_drop_block, False),
        (_swap_blocks, True),
        (_new_variable, True),
        (_set_value, True),
    ],
    ids=[
        "layer without bias",
        "head of another class",
        "attribute added",
        "block dropped",
        "blocks swapped",
        "Variable replaced",
        "value set",
    ],
)
def test_a_changed_nnx_module_flattens_as_in_full(change, same_structure):
    """A module changed between two saves: its pure dict's keys decide whether the remembered
    structure still holds, and the leaves are the Variables' values now, each at its own key."""
    model = Model(nnx.Rngs(0))
    root = jaxckpt.Checkpoint(model=model, step=1)
    as_full_flatten(root)
    remembered = _structure._last
    change(model)
    flat = as_full_flatten(root)
    assert (_structure._last is remembered) == same_structure
    assert flat.leaves["model/head/kernel"] is model.head.kernel.get_value()
    assert flat.leaves["model/blocks/0/lin/kernel"] is model.blocks[0].lin.kernel.get_value()


class OtherModel(Model):
    pass


def test_a_module_of_another_class_with_the_same_state_is_another_structure():
    """The index records the class of each module saved (not of those inside its pure dict)."""
    root = jaxckpt.Checkpoint(model=Model(nnx.Rngs(0)))
    as_full_flatten(root)
    remembered = _structure._last
    root.model = OtherModel(nnx.Rngs(0))
    flat = as_full_flatten(root)
    assert _structure._last is not remembered
    assert flat.nodes["model"].cls.endswith("OtherModel")


def test_a_module_whose_state_flax_cannot_read_is_refused_as_in_full(monkeypatch):
    model = Model(nnx.Rngs(0))
    as_full_flatten({"model": model})
    _add_attribute(model)  # the graph changed: Flax's own calls, which fail

    def fails(*args, **kwargs):
        raise ValueError("no state here")

    monkeypatch.setattr(nnx, "state", fails)
    with pytest.raises(UnsupportedValueError, match="no state here") as full:
        objects.flatten({"model": model})
    with pytest.raises(UnsupportedValueError) as quick:
        _structure.flatten_saved({"model": model})
    assert str(quick.value) == str(full.value)


def test_a_registered_node_with_keys_that_are_not_names_is_not_remembered():
    a = arrays(2)
    tree = {"f": freeze({1: a[0], 2: a[1]})}
    as_full_flatten(tree)
    assert _structure._last is None


def test_a_train_state_saved_in_a_loop_restores_as_saved(tmp_path):
    params = {"l1": {"kernel": arrays(1)[0]}, "l2": {"bias": arrays(1, seed=1)[0]}}
    state = train_state.TrainState.create(apply_fn=_apply, params=params, tx=optax.adam(1e-3))
    for step in range(3):
        state = state.apply_gradients(grads=jax.tree.map(jnp.ones_like, state.params))
        jaxckpt.save(tmp_path / str(step), state, blocking=False)
    jaxckpt.wait_until_finished()
    assert _structure._last is not None
    restored = jaxckpt.restore(tmp_path / "2", like=state)
    assert restored.step == 3
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(x, y)
    assert set(jaxckpt.restore(tmp_path / "2")) == {"step", "params", "opt_state"}


def _bfloat16_tree():
    return {f"l{i}": {"w": jnp.full((4, 3), i, jnp.bfloat16), "b": jnp.full((3,), -i, jnp.float32)} for i in range(4)}


@pytest.mark.parametrize(
    "odd",
    [
        lambda: jax.device_put(jnp.arange(16.0, dtype=jnp.bfloat16), NamedSharding(_mesh(), P("x"))),  # sharded
        lambda: jax.device_put(jnp.arange(8.0, dtype=jnp.bfloat16), NamedSharding(_mesh(), P())),  # replicated
        lambda: jax.random.key(3),  # a typed PRNG key: no ArrayImpl to the walk, so taken aside
    ],
    ids=["sharded bfloat16", "replicated bfloat16", "PRNG key"],
)
def test_arrays_a_view_cannot_stand_for_are_taken_one_by_one(tmp_path, views, odd):
    """Among bfloat16 arrays (viewed one by one), an array of several devices is gathered and a
    PRNG key's data taken; each saved as it was, a sharded one with its sharding recorded."""
    tree = {**_bfloat16_tree(), "odd": odd()}
    expected = jax.tree.map(np.asarray, jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree))
    jaxckpt.save(tmp_path / "a", tree)
    path = jaxckpt.save(tmp_path / "b", tree, blocking=False)
    jaxckpt.wait_until_finished()
    assert views == [False, False]
    restored = jaxckpt.restore(path, like=tree)
    assert restored["odd"].sharding == tree["odd"].sharding
    got = jax.tree.map(np.asarray, jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, restored))
    for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(where))
    if tree["odd"].ndim and len(tree["odd"].sharding.device_set) > 1:  # recorded as saved, not as one device
        index = json.loads((tmp_path / "b" / "index.json").read_text())
        assert index["leaves"]["odd"]["sharding"].startswith("NamedSharding(")


def _mesh():
    return jax.make_mesh((8,), ("x",))


def _is_key(x):
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
