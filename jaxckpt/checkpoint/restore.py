"""Restoring: the one-call ``restore``, ``list_variables`` and ``load_variable``, the restore
status that ``Checkpoint.restore`` returns, and ``key_map``, which renames or changes values first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxckpt._errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    MismatchError,
    MissingKeyError,
    RestoreAssertionError,
)
from jaxckpt._gc_pause import gc_paused
from jaxckpt.checkpoint.foreign_keys import foreign_matches
from jaxckpt.format.keys import CHECKPOINT, DICT, join, unescape_edge
from jaxckpt.format.records import NUMPY, ArrayLeaf, Index, InForeign, Leaf, ValueLeaf, scalar_type
from jaxckpt.interop import formats
from jaxckpt.reading import shared
from jaxckpt.reading.open import ForeignOpened, open_latest
from jaxckpt.reading.reader import Opened
from jaxckpt.reading.templates import NO_TEMPLATE, PLACEHOLDER
from jaxckpt.runtime import background
from jaxckpt.storage import locations
from jaxckpt.storage.locations import PathLike
from jaxckpt.tree.objects import Flat, build, flatten, placeholders_message, rebuild


def summarize(keys: Iterable[str], limit: int = 20) -> str:
    keys = list(keys)
    shown = "\n".join(f"    {k}" for k in keys[:limit])
    more = f"\n    ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return shown + more


class RestoreStatus:
    """What a restore matched, and assertions about it.

    The status is live: values restored later, when a child is assigned to a Checkpoint that was
    waiting for it (a delayed restore), are counted as they happen.

    Unused values: like TensorFlow, a restore that leaves checkpoint values unused (no object took
    them) says so once with an :class:`UnusedValuesWarning`, unless :meth:`expect_partial` was called.
    Unlike TensorFlow, the warning never comes from the garbage collector (which fires at a random
    point, or at exit where warnings cannot be raised or filtered): it is issued by the *next* call
    on the Checkpoint that was restored into (``save``, ``write``, ``restore``, ``read``, or its
    manager's ``save``, ``restore`` or ``close``), and points at that call. So TF's idiom
    ``ckpt.restore(path).expect_partial()`` silences it, and so does ``status.expect_partial()`` at
    any time before that call. Values still waiting for a child to be assigned (a delayed restore)
    may yet be used: every save that leaves them out names them, and so does the manager's
    ``close()``. A restore that raised never warns. :meth:`assert_consumed` checks at once.
    """

    def __init__(self, opened: Opened | None) -> None:
        self._opened = opened
        self._used: set[str] = set()
        self._missing: set[str] = set()
        # Saved Checkpoints restored into more than one object (TF reports this in its assertions).
        self._loaded_twice: set[str] = set()
        self._partial_ok = False
        self._settled = opened is None  # warned (or had nothing to warn about) at the next call
        self._reported: set[str] = set()  # unused keys already named in a warning

    @property
    def matched_keys(self) -> list[str]:
        """Checkpoint keys whose values went into an object."""
        return [k for k in self._all_keys() if k in self._used]

    @property
    def unused_keys(self) -> list[str]:
        """Checkpoint keys that found no object (yet)."""
        return [k for k in self._all_keys() if k not in self._used]

    @property
    def missing_keys(self) -> list[str]:
        """Keys of objects that found no value in the checkpoint."""
        return sorted(self._missing)

    @property
    def mapped_keys(self) -> dict[str, str]:
        """With a ``key_map``: each checkpoint key that the map renamed or kept, and the key it became."""
        source = self._mapped_source()
        return dict(source.mapped) if source else {}

    @property
    def dropped_keys(self) -> list[str]:
        """With a ``key_map``: the checkpoint keys that the map dropped (returned None for)."""
        source = self._mapped_source()
        return list(source.dropped) if source else []

    @property
    def skipped_keys(self) -> list[str]:
        """Values the checkpoint lists that have no numpy form, so are not restored (a TensorFlow
        iterator's ``DT_VARIANT`` state, string tensors)."""
        return sorted(self._opened.skipped) if self._opened else []

    def _mapped_source(self) -> Any:
        if isinstance(self._opened, ForeignOpened):
            return getattr(self._opened.checkpoint.reader, "mapped", None) and self._opened.checkpoint.reader
        return None

    def _all_keys(self) -> list[str]:
        return self._opened.index.keys_under("") if self._opened else []

    @property
    def source(self) -> str:
        """The checkpoint restored from, as messages name it ("" after ``restore(None)``)."""
        return str(self._opened.path) if self._opened else ""

    def _require_restore(self, what: str) -> str:
        """The checkpoint restored from; a restore(None) fails the assertion ``what``."""
        if self._opened is None:
            raise RestoreAssertionError(
                f"{what} failed: nothing was restored (restore(None) starts from scratch and matches nothing)."
            )
        return str(self._opened.path)

    def assert_consumed(self) -> RestoreStatus:
        """Every checkpoint value matched an object, and every object got a value."""
        source = self._require_restore("assert_consumed")
        unused, missing = self.unused_keys, self.missing_keys
        if unused or missing or self._loaded_twice:
            parts = [f"Restore from {source!r} did not match one to one."]
            if unused:
                parts.append(f"  {len(unused)} checkpoint value(s) found no object:\n{summarize(unused)}")
            if missing:
                parts.append(f"  {len(missing)} object(s) found no value in the checkpoint:\n{summarize(missing)}")
            if self._loaded_twice:
                parts.append(self._twice_text())
            raise RestoreAssertionError("\n".join(parts))
        return self

    def assert_existing_objects_matched(self) -> RestoreStatus:
        """Every object present now got a value (unused checkpoint values are fine)."""
        source = self._require_restore("assert_existing_objects_matched")
        if self._loaded_twice:
            raise RestoreAssertionError(f"Restore from {source!r}:\n{self._twice_text()}")
        if self._missing:
            raise RestoreAssertionError(
                f"Restore from {source!r}: {len(self._missing)} object(s) found no value "
                f"in the checkpoint:\n{summarize(self.missing_keys)}"
            )
        return self

    def _twice_text(self) -> str:
        keys = sorted(self._loaded_twice)
        return (
            f"  {len(keys)} saved Checkpoint(s) were restored into more than one object (saved once, as one "
            f"object, and now held by two):\n{summarize(keys)}"
        )

    def assert_nontrivial_match(self) -> RestoreStatus:
        """At least one value was restored."""
        source = self._require_restore("assert_nontrivial_match")
        if not self._used:
            raise RestoreAssertionError(f"Restore from {source!r} matched no object at all.")
        return self

    def expect_partial(self) -> RestoreStatus:
        """Silence the warning about unused checkpoint values."""
        self._partial_ok = True
        return self

    def __repr__(self) -> str:
        if self._opened is None:
            return "RestoreStatus(nothing restored)"
        extra = ""
        if self._mapped_source() is not None:
            extra += f", key_map: {len(self.mapped_keys)} mapped, {len(self.dropped_keys)} dropped"
        if self._opened.skipped:
            extra += f", {len(self._opened.skipped)} skipped (no numpy form)"
        return (
            f"RestoreStatus({str(self._opened.path)!r}: {len(self._used)} matched, "
            f"{len(self.unused_keys)} unused, {len(self._missing)} missing{extra})"
        )


KeyMap = Callable[[str, Any], "tuple[str, Any] | None"]


class _Mapped:
    """A checkpoint seen through a user's ``key_map``: a :class:`~jaxckpt.interop.formats.Foreign` reader
    whose values are the source's, each read once and renamed, changed or dropped by the function."""

    def __init__(self, opened: Opened, key_map: KeyMap) -> None:
        self.name, self.path = opened.format, str(opened.path)
        self.mapped: dict[str, str] = {}  # source key -> key it became
        self.dropped: list[str] = []
        self._entries: list[formats.Entry] = []
        self._values: dict[str, np.ndarray] = {}
        source = opened.index.keys_under("")
        values = opened.load(dict.fromkeys(source, NO_TEMPLATE))
        became: dict[str, str] = {}  # new key -> source key, to name both in a collision
        for key in source:
            value = values.pop(key)  # each value is held once: either dropped here or kept as mapped
            result = key_map(key, value)
            if result is None:
                self.dropped.append(key)
                continue
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str) and result[0]):
                raise TypeError(
                    f"key_map({key!r}, value) returned {type(result).__name__} {result!r:.80}; it must return "
                    "(new_key, new_value) with a non-empty str key, or None to drop the value."
                )
            new_key, new_value = result
            if new_key in became:
                raise ValueError(
                    f"key_map maps both {became[new_key]!r} and {key!r} to {new_key!r}; each key may receive one value."
                )
            became[new_key] = key
            self.mapped[key] = new_key
            self._entries.append(
                formats.Entry(tuple(unescape_edge(e) for e in new_key.split("/")), self._leaf(new_key, new_value))
            )

    def _leaf(self, key: str, value: Any) -> Leaf:
        if value is None:
            return ValueLeaf("none", None)
        kind = scalar_type(value)
        if kind is not None:
            return ValueLeaf(kind, value)
        impl = None
        if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            impl, value = str(jax.random.key_impl(value)), jax.random.key_data(value)  # stored as key data
        data = np.asarray(value)
        self._values[key] = data
        return ArrayLeaf(data.dtype, data.shape, NUMPY, InForeign(key), impl)

    def entries(self) -> list[formats.Entry]:
        return self._entries

    def read(self, key: str, leaf: ArrayLeaf) -> np.ndarray:
        assert isinstance(leaf.at, InForeign)  # every leaf here is made by _leaf
        return self._values[leaf.at.ref]


def mapped(opened: Opened, key_map: KeyMap) -> ForeignOpened:
    """``opened`` with its keys and values as ``key_map`` makes them (see :func:`jaxckpt.restore`)."""
    view = ForeignOpened(formats.ForeignCheckpoint(_Mapped(opened, key_map)), opened.location)
    view.skipped = opened.skipped
    return view


@gc_paused
def restore(
    path: PathLike,
    like: Any = NO_TEMPLATE,
    *,
    partial: bool = False,
    key_map: KeyMap | None = None,
    share_reads: bool | None = None,
) -> Any:
    """Restore the checkpoint at ``path``.

    With ``like`` (what you hold now), values come back with its structure, container types, dtypes
    and shardings; NNX modules and state objects in it are updated in place. Keys must match one to
    one unless ``partial=True`` (then unmatched leaves of ``like`` keep their values). Without
    ``like``, containers are rebuilt as saved and arrays come back as numpy. ``path`` may be a
    manager's directory: its latest checkpoint (read again, up to three times, where the manager's
    retention deletes the one being read). A checkpoint that another save replaces while it is read
    (``overwrite=True``) is read again too; then :class:`CheckpointReplacedError`.

    ``path`` may also be a checkpoint that another library wrote, recognized from what is on disk: a
    TensorFlow prefix (``tf_ckpts/ckpt-5``) or its manager's directory, an Orbax checkpoint, item or
    manager directory, a Flax msgpack file, or a ``.safetensors`` file.

    ``key_map(key, value) -> (new_key, new_value) | None`` is called once for every value of the
    checkpoint (arrays as numpy) before matching: rename, transpose, reshape or cast it, or return
    None to drop it. So a Hugging Face or TensorFlow checkpoint loads into an NNX module in one call::

        def hf_to_nnx(key, value):
            if key.endswith(".weight"):   # torch Linear (out, in) -> NNX kernel (in, out)
                return key.replace(".", "/").replace("/weight", "/kernel"), value.T
            return key.replace(".", "/"), value

        jaxckpt.restore("model.safetensors", like=model, key_map=hf_to_nnx, partial=True)

    With several processes (``jax.distributed``), an array that several of them need (replicated
    over processes) is read once: each process reads an equal part and JAX's collectives bring the
    rest. jaxckpt does so for checkpoints in buckets, not on local paths; ``share_reads=True`` or
    ``False`` forces either (``JAXCKPT_SHARE_READS`` does for every restore). See the sharding guide.
    """
    share_reads = shared.check_setting(share_reads)
    if path is None:  # what latest_checkpoint returns for a directory without checkpoints
        raise CheckpointNotFoundError(
            "restore(None): there is no checkpoint to restore. jaxckpt.latest_checkpoint returns None when a "
            "directory holds none; check for None before restoring, or use CheckpointManager.restore_or_initialize()."
        )
    background.SAVES.wait()
    where = locations.location(path)
    for retries_left in range(REREADS, -1, -1):
        opened = open_latest(where)
        if isinstance(opened, Opened):
            opened.share_reads = share_reads
        try:
            with opened:
                return _restore_from(opened, like, partial, key_map)
        except CheckpointReplacedError:  # saved over while read (nothing of it returned): read the new one
            if not retries_left:
                raise
        except CheckpointNotFoundError:
            # A directory's latest checkpoint, deleted by its manager's retention while read: the latest again.
            latest = isinstance(opened, Opened) and opened.location != where
            if not retries_left or not latest:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


REREADS = 3  # of a checkpoint saved over, or of a directory's latest deleted, while read, before the error


def _restore_from(opened: Opened | ForeignOpened, like: Any, partial: bool, key_map: KeyMap | None) -> Any:
    if key_map is not None:
        opened = mapped(opened, key_map)
    index = opened.index
    if like is NO_TEMPLATE:
        return build(index.nodes, opened.load(dict.fromkeys(index.leaves, NO_TEMPLATE)))
    flat = flatten(like)
    templates = flat.leaves
    # Left out of the restore (PLACEHOLDER), with whatever the checkpoint holds under their keys.
    held_out = [k for k, t in templates.items() if t is PLACEHOLDER]
    if held_out:
        flat.leaves = templates = {k: t for k, t in templates.items() if t is not PLACEHOLDER}
    # One pass over the keys: each lookup in a table of a million leaves is a cache miss.
    saved = index.leaves
    wanted: dict[str, Any] = {}  # by checkpoint key
    leaves: list[Leaf] = []  # wanted's, handed to load
    missing: list[str] = []
    for k, t in templates.items():
        leaf = saved.get(k)
        if leaf is not None:
            wanted[k] = t
            leaves.append(leaf)
        else:
            missing.append(k)
    # Orbax's NNX Variables, stored as `<key>/value`, and its None for leafless nodes (see foreign_keys).
    renamed, empties = foreign_matches(opened, flat, missing)
    if renamed:
        for k, stored in renamed.items():
            wanted[stored] = templates[k]
            leaves.append(saved[stored])
        missing = [k for k in missing if k not in renamed]
    # A template's `{}` where the checkpoint holds a dict of Python values (a JSON child): that dict, as saved.
    json_nodes = json_children(index, flat)
    for keys in json_nodes.values():
        wanted.update(dict.fromkeys(keys, NO_TEMPLATE))
        leaves.extend(saved[k] for k in keys)
    placeholders = [k for k in missing if isinstance(templates[k], jax.ShapeDtypeStruct)]
    if partial and placeholders:  # before reading anything: this restore cannot succeed
        raise MissingKeyError(placeholders_message(placeholders))
    if not partial:
        # None unused where `like` has every key (the common case): the index's graph need not be walked.
        fits = not missing and len(wanted) == len(index.leaves)
        left_out = {key for k in held_out for key in index.keys_under(k)}
        unused = [] if fits else _unused(opened, wanted, {*empties, *save_counters(index), *left_out})
        if missing or unused:
            parts = [f"The checkpoint {str(opened.path)!r} does not match the structure of `like`."]
            if missing:
                parts.append(f"  In `like` but not in the checkpoint ({len(missing)}):\n{summarize(missing)}")
            if unused:
                parts.append(f"  In the checkpoint but not in `like` ({len(unused)}):\n{summarize(unused)}")
            parts.append("Pass partial=True to restore only the keys in common.")
            raise MismatchError("\n".join(parts))
    values = opened.load(wanted, leaves)
    for k, stored in renamed.items():
        values[k] = values.pop(stored)
    for node in json_nodes:
        values[node] = build(index.nodes, values, node)
    return rebuild(like, values)


def _unused(opened: Opened, wanted: Mapping[str, Any], taken: set[str]) -> list[str]:
    """The checkpoint's keys that the template does not take: not ``wanted`` (by its own name or another,
    see foreign_keys), nor ``taken`` (Orbax's None as a leafless node, a Checkpoint's save counter)."""
    return [k for k in opened.index.keys_under("") if k not in wanted and k not in taken]


SAVE_COUNTER = "save_counter"  # a Checkpoint's count of its saves, stored beside its children
_JSON_TYPES = frozenset({"int", "float", "bool", "str", "none"})


def save_counters(index: Index) -> list[str]:
    """The keys of the save counters of the Checkpoints that were saved (a manager saves one): a
    template that is a plain pytree has none, and needs none restored."""
    keys = (join(k, SAVE_COUNTER) for k, info in index.nodes.items() if info.kind == CHECKPOINT)
    return [k for k in keys if k in index.leaves]


def json_children(index: Index, flat: Flat) -> dict[str, list[str]]:
    """The template's empty dicts (``{}``) where the checkpoint holds a dict of Python values only (a
    JSON child, as a run's configuration): node key -> the checkpoint's keys below it, restored as
    saved. A dict with arrays below it is no JSON child: its arrays need a template."""
    out: dict[str, list[str]] = {}
    for key, info in flat.nodes.items():
        if info.kind != DICT or info.keys:
            continue
        stored = index.nodes.get(key)
        if stored is None or stored.kind != DICT or not stored.keys:
            continue
        keys = index.keys_under(key)
        if all(isinstance(leaf := index.leaves[k], ValueLeaf) and leaf.type in _JSON_TYPES for k in keys):
            out[key] = keys
    return out


def list_variables(path: PathLike) -> list[tuple[str, tuple[int, ...]]]:
    """``(key, shape)`` of every value in the checkpoint, sorted by key, without the model code.

    Python values and object states have shape ``()``; a PRNG key array has its key shape. ``path``
    may be a manager's directory: its latest checkpoint.
    """
    with open_latest(locations.location(path)) as opened:
        index, skipped = opened.index, opened.skipped
    out = [(key, entry.shape) for key, entry in skipped.items()]
    for key, leaf in index.leaves.items():
        if isinstance(leaf, ValueLeaf):
            out.append((key, ()))
        else:
            out.append((key, leaf.value_shape))
    return sorted(out)


def load_variable(path: PathLike, key: str) -> Any:
    """One value of the checkpoint: arrays as numpy, Python values and object states as saved.

    The key of a node (``"optimizer/opt_state"``, ``"config"``) gives its whole subtree as saved:
    dicts, lists, tuples and namedtuples of those values. ``path`` may be a manager's directory.
    """
    with open_latest(locations.location(path)) as opened:
        index = opened.index
        if key in index.nodes:
            return build(index.nodes, opened.load(dict.fromkeys(index.keys_under(key), NO_TEMPLATE)), key)
        opened.leaf(key)
        return opened.load({key: NO_TEMPLATE})[key]
