"""Reading Orbax checkpoints (``orbax.checkpoint``), without Orbax: metadata as JSON, arrays through TensorStore.

What is read
    A PyTree item (``StandardCheckpointer``, ``PyTreeCheckpointer``, a ``StandardSave`` /
    ``PyTreeSave`` item of a ``CheckpointManager`` step): its ``_METADATA`` (JSON: for every leaf
    its tree path, as dict keys and sequence indices, and its value type) and, for each array, the
    zarr array that TensorStore wrote under the leaf's Orbax name (tree path joined by ``.``):
    in one OCDBT database (``manifest.ocdbt`` with its ``ocdbt.process_*`` databases, Orbax's
    default) or as a folder per array (``use_ocdbt=False``); zarr v2 (``.zarray``, the default) or
    zarr3 (``zarr.json``, ``use_zarr3=True``). Arrays that were sharded over many devices are stored
    whole by TensorStore (one zarr chunk per shard), so they are read whole here on any number of
    devices, as plain numpy arrays. ``bfloat16`` and the other ml_dtypes types come back as such.

    Python scalars (value type ``scalar``), strings (``_strings.json``) and ``None`` are
    ``ValueLeaf`` records; numpy and jax arrays, 0-d ones included, are ``ArrayLeaf`` records, whose
    ``sharding`` says how a sharded array was laid out when saved (from ``_sharding``, for listings).
    Empty containers (``{}``, ``[]``) are empty dicts. Orbax stores every other pytree node without
    leaves (optax's ``EmptyState()``) as ``None`` too: such a ``None`` is marked as standing for one
    (``Entry.stands_for_empty``), so that it restores into a template's leafless node. A typed PRNG
    key array is stored as its raw key data, with the implementation in ``array_metadatas/process_<i>``
    (``ext_metadata``): it is a PRNG key ``ArrayLeaf`` of that implementation. A Flax NNX Variable is
    stored with its value under the edge ``value`` (``linear/kernel/value``): the reader says so
    (``variable_value_edge``), for templates that hold Variables there.

    A JSON item (``JsonSave``; the file ``metadata`` in its folder): its values, a dict becoming
    nested keys (lists too, with their indices as edges).

    A data iterator's state saved by grain's checkpoint handler (``grain.checkpoint.CheckpointSave``,
    an item of a step folder): its ``process_<i>-of-<n>.json`` files, each the JSON of one process's
    ``get_state()``, as an object state (one per process where there were several), which restores
    into an iterator through ``set_state`` (a ``DataLoader``'s iterator, whose state is bytes, is given
    the JSON's bytes, as grain's handler does).

    A step folder of Composite items (``run/30``): every item, its keys prefixed by the item's name
    (``state/params/w``, ``meta/step``); items are those that ``_CHECKPOINT_METADATA`` names, or
    without it the subfolders that hold a PyTree or JSON item.

    Tested against checkpoints written by Orbax 0.12.8 (jax 0.10.2, TensorStore 0.1.86). Older
    ``_METADATA`` files without the ``use_ocdbt`` / ``use_zarr3`` flags are read with Orbax's
    defaults of then (OCDBT where there is a ``manifest.ocdbt``, zarr v2).

What is not read
    PyTree items without ``_METADATA`` (older Orbax kept the tree in a msgpack file
    ``checkpoint``): refused with a CheckpointFormatError that says so. Items of other handlers
    (``ArrayCheckpointHandler``, ``ProtoCheckpointHandler``, custom ones), leaves of custom
    ``TypeHandler`` value types and placeholders are listed as skipped with what they are. A JSON
    item opened on its own (``run/30/meta``): open its step folder. Only checkpoints on a local
    file system (paths, not ``gs://`` URLs).

What is checked (a checkpoint is untrusted input)
    ``_METADATA``, ``_CHECKPOINT_METADATA``, JSON items, ``_strings.json`` and every ``.zarray`` /
    ``zarr.json`` are read with a size limit (and only if they are regular files) and must parse;
    every field used is type-checked, and leaf and item names may not leave the checkpoint's
    folder. ``_sharding`` is informational: ignored if it does not parse. A zarr array may only use
    what Orbax writes: a numeric dtype that jaxckpt knows, C order, no filters, no compressor or
    zstd / gzip / zlib / blosc (zarr v2), the ``bytes`` / ``zstd`` / ``gzip`` / ``blosc`` /
    ``crc32c`` codecs, possibly inside one ``sharding_indexed`` codec (zarr3); its rank is at most
    64, its size at most 1 TiB, each chunk at most the array's shape; a ``write_shape`` in
    ``_METADATA`` must fit the array, and a ``scalar`` leaf must be a 0-d number. The array is then
    opened with that very metadata as TensorStore constraints, and TensorStore's view (shape, dtype)
    must equal it before a byte is read; so memory is only ever allocated for the array that the
    metadata declares.

    Not checked: chunk contents, and a shape that is wrong but consistent. zarr v2 chunks carry no
    checksum, so compressed bytes altered into other valid compressed bytes read as wrong values;
    nothing but the ``.zarray`` / ``zarr.json`` records an array's full shape, so one edited to a
    smaller shape that its chunks still fit reads as that part of the array. TensorStore does
    refuse a chunk that does not decompress, or decompresses to the wrong size, and checks the
    crc32c of a zarr3 shard index; a missing chunk is CheckpointCorruptedError when ``_METADATA``
    says that every chunk was stored (``store_array_data_equal_to_fill_value``, which current Orbax
    writes), and reads as the fill value otherwise, as Orbax then does.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, NamedTuple

import numpy as np

from jaxckpt._errors import (
    CheckpointCorruptedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    NotACheckpointError,
)
from jaxckpt.format.records import MAX_DEPTH, NUMPY, ArrayLeaf, InForeign, ValueLeaf
from jaxckpt.interop import zarr_arrays
from jaxckpt.interop.common import EMPTY_DICT, Entry, value_leaf
from jaxckpt.interop.orbax_metadata import (
    METADATA_LIMIT,
    ZARR_METADATA_LIMIT,
    int_tuple,
    leaf_name,
    malformed,
    parse_json,
    prng_impls,
    prng_leaf,
    read_json,
    sharding_table,
    zarr2_array,
    zarr3_array,
)

NAME = "Orbax"

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"  # a step or checkpoint folder: handlers, timestamps
TREE_METADATA = "_METADATA"  # a PyTree item: its tree and value types
JSON_ITEM_FILE = "metadata"  # what JsonCheckpointHandler writes
STRINGS_FILE = "_strings.json"  # StringHandler: every str leaf of an item, by name
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # a folder still being written (Orbax renames it when done)

_STEP = re.compile(r"^(?:[^/]*_)?([0-9]{1,18})$")  # "30", or "checkpoint_30" with a step_prefix
_GRAIN_FILE = re.compile(r"^process_([0-9]{1,6})-of-([0-9]{1,6})\.json$")  # grain's handler, per process
_ARRAY_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})
# Empty containers: nodes of the tree, with no values below. Every node of a foreign checkpoint is a
# dict (a list's edges are its indices), so each is an empty dict.
_EMPTY_TYPES = frozenset({"Dict", "List", "Tuple", "NamedTuple"})


# --- finding checkpoints: names only --------------------------------------------------------------


def _names(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def _is_item(names: set[str]) -> bool:
    """A PyTree item's folder. ``manifest.ocdbt`` alone is not enough: a jaxckpt data store is an
    OCDBT database too, but never has the per-process databases that Orbax writes beside it."""
    if TREE_METADATA in names or "_sharding" in names:
        return True
    return "manifest.ocdbt" in names and any(n.startswith("ocdbt.process_") for n in names)


def detect(path: str) -> bool:
    """An Orbax item, or a step folder of Composite items; never a jaxckpt checkpoint."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return False
    names = _names(path)
    if "index.json" in names:
        return False
    if _is_item(names) or CHECKPOINT_METADATA in names:
        return True
    # A step folder written without _CHECKPOINT_METADATA: look at a few of its item subfolders. Not
    # at numbered ones: those are steps, and this a manager's directory (items have names).
    for name in sorted(_item_folders(names))[:64]:
        sub = os.path.join(path, name)
        if os.path.isdir(sub) and _is_item(_names(sub)):
            return True
    return False


def _item_folders(names: set[str]) -> list[str]:
    """The names that may be items of a step folder: not steps, not temporary."""
    return [n for n in names if not _STEP.match(n) and TMP_SUFFIX not in n and not n.startswith(".")]


def _steps(directory: str) -> list[tuple[int, str]]:
    """(step, folder) of each finished step folder: Orbax writes a step under a temporary name and
    renames it when done (on local file systems; that rename is what Orbax checks), so a name with
    the temporary suffix is unfinished, and a folder without checkpoint files is not a step."""
    out = []
    for name in _names(directory):
        match = _STEP.match(name)
        if match is None or TMP_SUFFIX in name:
            continue
        folder = os.path.join(directory, name)
        if os.path.isdir(folder) and detect(folder):
            out.append((int(match.group(1)), folder))
    return sorted(out)


def manages(directory: str) -> bool:
    """An Orbax CheckpointManager directory: step folders holding ``_CHECKPOINT_METADATA``."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory) or detect(directory):
        return False
    return any(CHECKPOINT_METADATA in _names(folder) for _, folder in _steps(directory))


def latest(directory: str) -> str | None:
    """The folder of the newest finished step, or None."""
    steps = _steps(os.fspath(directory))
    return steps[-1][1] if steps else None


# --- reading ------------------------------------------------------------------------------------


class _Layout(NamedTuple):
    """How a PyTree item stores its arrays: the flags of its ``_METADATA``, under Orbax's names."""

    use_ocdbt: bool  # in one OCDBT database, not a folder per array
    use_zarr3: bool  # zarr3 (zarr.json), not zarr v2 (.zarray)
    store_array_data_equal_to_fill_value: bool  # every chunk stored: a missing one is damage


class _PendingArray(NamedTuple):
    """An array leaf of a PyTree item, listed until its zarr metadata is read (all at once)."""

    slot: int  # its place among the item's entries
    edges: tuple[str, ...]
    key: str
    name: str  # its Orbax name, which is its folder (or key prefix) in the item
    kind: str  # the value_type: "jax.Array", "np.ndarray" or "scalar"
    value: dict[str, Any]  # its value_metadata in _METADATA
    what: str  # how messages name it


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: the spec is a dict
class ArrayRef:
    """Where an array leaf is: the TensorStore spec that opens it, with its checked metadata as
    constraints, and its Orbax name for messages."""

    spec: dict[str, Any]
    name: str


def _old_layout(folder: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{folder!r} is an Orbax PyTree item without {TREE_METADATA}, written by an older Orbax (its tree is in "
        "the msgpack file 'checkpoint'): jaxckpt does not read that layout. Restore it with that Orbax and save it "
        "again with a current one."
    )


class Reader:
    """An opened Orbax checkpoint: one item, or the items of one step folder."""

    name = NAME
    # Orbax saves a Flax NNX Variable as the pytree JAX flattens it to: its value under the edge "value".
    variable_value_edge = "value"

    def __init__(self, path: str) -> None:
        self.path = path
        self._entries: list[Entry] = []
        names = _names(path)
        if _is_item(names):
            self._pytree_item(path, ())
            return
        handlers = read_json(os.path.join(path, CHECKPOINT_METADATA), METADATA_LIMIT, "Orbax's checkpoint metadata")
        handlers = handlers.get("item_handlers") if isinstance(handlers, dict) else None
        if isinstance(handlers, str):  # one item saved in this folder by its own handler
            self._item(path, (), handlers)
        elif isinstance(handlers, dict):
            for item, handler in handlers.items():
                folder = os.path.join(path, item)
                if not item or item in (".", "..") or "/" in item or "\\" in item:
                    raise malformed(f"{path!r}: {CHECKPOINT_METADATA}", "item names that are folder names", item)
                if not os.path.isdir(folder):
                    raise CheckpointCorruptedError(
                        f"{path!r}: {CHECKPOINT_METADATA} lists the item {item!r}, but its folder {folder!r} is "
                        "missing: the checkpoint is incomplete or was partly deleted."
                    )
                self._item(folder, (item,), handler if isinstance(handler, str) else "")
        else:  # older step folders: every subfolder that holds a PyTree or JSON item
            for item in sorted(_item_folders(names)):
                folder = os.path.join(path, item)
                inside = _names(folder)
                if os.path.isdir(folder) and (_is_item(inside) or JSON_ITEM_FILE in inside):
                    self._item(folder, (item,), "")
        if not self._entries and not handlers:
            raise NotACheckpointError(f"{path!r} holds no Orbax item (no {TREE_METADATA}, no JSON item).")

    # -- items --

    def _item(self, folder: str, prefix: tuple[str, ...], handler: str) -> None:
        names = _names(folder)
        if _is_item(names):
            self._pytree_item(folder, prefix)
        elif "JsonCheckpointHandler" in handler or (not handler and JSON_ITEM_FILE in names):
            value = read_json(os.path.join(folder, JSON_ITEM_FILE), METADATA_LIMIT, "a JSON item of Orbax")
            if value is None:
                raise CheckpointCorruptedError(f"The JSON item {folder!r} has no file {JSON_ITEM_FILE!r}.")
            self._json(value, prefix, f"{folder!r}", 0)
        elif handler.startswith("grain.") or (not handler and any(_GRAIN_FILE.match(n) for n in names)):
            self._grain_item(folder, prefix, names)
        elif "checkpoint" in names:
            raise _old_layout(folder)
        else:
            what = handler.rsplit(".", 1)[-1] or "unknown handler"
            self._entries.append(Entry(prefix or ("item",), None, note=f"Orbax item of {what}"))

    def _grain_item(self, folder: str, prefix: tuple[str, ...], names: set[str]) -> None:
        """A data iterator's state that grain's checkpoint handler saved: one ``process_<i>-of-<n>.json``
        per process, each the JSON of that process's ``get_state()``; an object state (one per process
        where there were several), which restores into an iterator through its ``set_state``."""
        files: dict[int, tuple[int, str]] = {}
        for name in names:
            match = _GRAIN_FILE.match(name)
            if match is not None:
                files[int(match.group(1))] = (int(match.group(2)), name)
        counts = {n for n, _ in files.values()}
        if len(counts) != 1 or set(files) != set(range(next(iter(counts)))):
            found = sorted(name for _, name in files.values())[:8]
            raise CheckpointCorruptedError(
                f"The grain data-iterator item {folder!r} should hold one file process_<i>-of-<n>.json for each "
                f"process i of n; it holds {found or 'none'}. It is incomplete or was partly deleted."
            )
        states = []
        for process in range(len(files)):
            file = os.path.join(folder, files[process][1])
            state = read_json(file, METADATA_LIMIT, "grain's data-iterator state")
            if state is None:
                raise CheckpointCorruptedError(f"{file!r} vanished while the checkpoint was read.")
            states.append(ValueLeaf("state", state))
        leaf = states[0] if len(states) == 1 else ValueLeaf("state_per_process", tuple(states))
        self._entries.append(Entry(prefix or ("iter",), leaf))

    def _json(self, value: Any, edges: tuple[str, ...], what: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise CheckpointFormatError(f"{what}: values nested more than {MAX_DEPTH} levels deep.")
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            if not value:
                self._entries.append(Entry(edges, None, note=EMPTY_DICT))
            for k, v in items:
                self._json(v, (*edges, str(k)), what, depth + 1)
            return
        if not edges:
            raise CheckpointFormatError(f"{what}: the JSON item is a single value; open the step folder instead.")
        leaf = value_leaf(value)
        if leaf is None:  # json.loads makes no other type
            raise CheckpointFormatError(f"{what}: a value of type {type(value).__name__} in the JSON item.")
        self._entries.append(Entry(edges, leaf))

    def _pytree_item(self, folder: str, prefix: tuple[str, ...]) -> None:
        file = os.path.join(folder, TREE_METADATA)
        where = f"{file!r}"
        meta = read_json(file, METADATA_LIMIT, "Orbax's tree metadata")
        if meta is None:
            if "checkpoint" in _names(folder):
                raise _old_layout(folder)
            raise CheckpointCorruptedError(f"The Orbax item {folder!r} has no {TREE_METADATA} file.")
        if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
            raise malformed(where, "a JSON object with 'tree_metadata'", meta)
        # Absent from _METADATA of older Orbax versions: their defaults then, OCDBT where its manifest is.
        defaults = {"use_ocdbt": "manifest.ocdbt" in _names(folder), "use_zarr3": False}
        flags = {k: meta.get(k, defaults.get(k, False)) for k in _Layout._fields}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise malformed(where, "use_ocdbt, use_zarr3 and store_array_data_equal_to_fill_value as booleans", flags)
        layout = _Layout(**flags)
        absolute = os.path.abspath(folder) + "/"
        if layout.use_ocdbt:
            if not os.path.isfile(os.path.join(folder, "manifest.ocdbt")):
                raise CheckpointCorruptedError(
                    f"The Orbax item {folder!r} keeps its arrays in an OCDBT database (use_ocdbt in {TREE_METADATA}) "
                    "but has no manifest.ocdbt: it is incomplete or was partly deleted."
                )
            kvstore: dict[str, Any] = zarr_arrays.foreign_ocdbt(absolute)
        else:
            kvstore = {"driver": "file", "path": absolute}
        strings: dict[str, Any] | None = None
        # Arrays are listed first and their zarr metadata read all at once, then made entries in place.
        slots: list[Entry | None] = []
        arrays: list[_PendingArray] = []
        for tree_key, record in meta["tree_metadata"].items():
            what = f"{where}, leaf {tree_key[:200]!r}"
            if not isinstance(record, dict) or not isinstance(record.get("value_metadata"), dict):
                raise malformed(what, "key_metadata and value_metadata", record)
            path = record.get("key_metadata")
            if not isinstance(path, list) or not path or len(path) > MAX_DEPTH:
                raise malformed(what, f"key_metadata as a list of 1 to {MAX_DEPTH} keys", path)
            edges = []
            for part in path:
                if (
                    not isinstance(part, dict)
                    or not isinstance(part.get("key"), str)
                    or part.get("key_type") not in (1, 2)
                ):
                    raise malformed(what, "keys as {'key': str, 'key_type': 1 or 2}", part)
                edges.append(part["key"])
            key = "/".join((*prefix, *edges))
            what = f"{key!r} of the Orbax checkpoint {self.path!r}"
            value = record["value_metadata"]
            kind = value.get("value_type")
            if not isinstance(kind, str):
                raise malformed(f"{what} ({file!r})", "a value_type", kind)
            full = (*prefix, *edges)
            # None and empty containers are saved as skip_deserialize: their value type is all there is.
            if kind == "None":  # None, and every node without leaves (optax's EmptyState()) too
                slots.append(Entry(full, ValueLeaf("none", None), stands_for_empty=True))
            elif kind in _EMPTY_TYPES:
                slots.append(Entry(full, None, note=EMPTY_DICT))
            elif value.get("skip_deserialize") is True:
                slots.append(Entry(full, None, note="not saved (skip_deserialize)"))
            elif kind in _ARRAY_TYPES:
                name = leaf_name(edges, f"{what} ({file!r})")
                arrays.append(_PendingArray(len(slots), full, key, name, kind, value, what))
                slots.append(None)
            elif kind == "string":
                if strings is None:
                    strings = read_json(os.path.join(folder, STRINGS_FILE), METADATA_LIMIT, "Orbax's strings")
                    if not isinstance(strings, dict):
                        raise malformed(f"{what}: {os.path.join(folder, STRINGS_FILE)!r}", "a JSON object", strings)
                text = strings.get(".".join(edges))
                if not isinstance(text, str):
                    raise CheckpointCorruptedError(f"{what}: its string is missing from {STRINGS_FILE} in {folder!r}.")
                slots.append(Entry(full, ValueLeaf("str", text)))
            else:
                slots.append(Entry(full, None, note=f"Orbax value type {kind[:100]!r}"))
        metadata_file = "zarr.json" if layout.use_zarr3 else ".zarray"
        raws = zarr_arrays.read_foreign_files(
            kvstore,
            [(f"{a.name}/{metadata_file}", f"{a.what} ({a.name + '/' + metadata_file!r})") for a in arrays],
            ZARR_METADATA_LIMIT,
        )
        shardings = sharding_table(folder) if arrays else {}
        key_impls = prng_impls(folder) if arrays else {}
        for (slot, full, key, name, kind, value, what), raw in zip(arrays, raws):
            entry = self._array(full, key, name, kind, value, kvstore, layout, what, raw, shardings.get(name))
            impl = key_impls.get(name)
            if impl is not None and isinstance(entry.leaf, ArrayLeaf):
                entry = Entry(entry.edges, prng_leaf(entry.leaf, impl, what))
            slots[slot] = entry
        self._entries.extend(entry for entry in slots if entry is not None)

    def _array(
        self,
        edges: tuple[str, ...],
        key: str,
        name: str,
        kind: str,
        value: dict[str, Any],
        kvstore: dict[str, Any],
        layout: _Layout,
        what: str,
        raw: bytes | None,
        sharding: str | None,
    ) -> Entry:
        """The entry of an array leaf, from ``raw``, its zarr metadata."""
        zarr3 = layout.use_zarr3
        file = f"{name}/{'zarr.json' if zarr3 else '.zarray'}"
        where = f"{what} ({file!r})"
        if raw is None:
            raise CheckpointCorruptedError(f"{what}: its array metadata {file!r} is missing from the checkpoint.")
        meta = parse_json(raw, where)
        dtype, shape = zarr3_array(meta, where) if zarr3 else zarr2_array(meta, where)
        if "write_shape" in value:
            write = int_tuple(value["write_shape"], f"{what} (write_shape in {TREE_METADATA})", "write_shape")
            if len(write) != len(shape) or any(w > max(1, n) for w, n in zip(write, shape)):
                raise CheckpointFormatError(
                    f"{what}: {TREE_METADATA} says it was written in shards of shape {write}, which do not fit "
                    f"its array of shape {shape} in {file!r}. It is damaged or crafted."
                )
        if kind == "scalar" and (shape != () or dtype.kind not in "biuf"):
            raise CheckpointFormatError(
                f"{what}: {TREE_METADATA} says it is a Python scalar, but its array in {file!r} has shape {shape} "
                f"and dtype {dtype.name}. It is damaged or crafted."
            )
        spec = {
            "driver": "zarr3" if zarr3 else "zarr",
            "kvstore": {**kvstore, "path": kvstore.get("path", "") + name + "/"},  # in the database, or the folder
            "metadata": meta,  # what was checked is what TensorStore must find
            "fill_missing_data_reads": not layout.store_array_data_equal_to_fill_value,
        }
        leaf = ArrayLeaf(dtype, shape, NUMPY, InForeign(ArrayRef(spec, name)), sharding=sharding)
        if kind == "scalar":  # a Python int or float: read now, for its ValueLeaf
            number = self.read(key, leaf).item()
            scalar = value_leaf(number)
            if scalar is None:  # dtype kinds b, i, u, f (checked above) give bool, int or float
                raise CheckpointFormatError(f"{what}: a Python scalar of type {type(number).__name__}.")
            return Entry(edges, scalar)
        return Entry(edges, leaf)

    # -- the Foreign protocol --

    def entries(self) -> list[Entry]:
        return list(self._entries)

    def read(self, key: str, leaf: ArrayLeaf) -> np.ndarray:
        ref = leaf.at.ref if isinstance(leaf.at, InForeign) else None
        if not isinstance(ref, ArrayRef):
            raise CheckpointFormatError(f"{self.path!r}: {key!r} is not a value of this Orbax checkpoint")
        what = f"{key!r} of the Orbax checkpoint {self.path!r} (array {ref.name!r})"
        store = zarr_arrays.open_foreign_array(ref.spec, what)
        if tuple(store.shape) != leaf.shape or store.dtype.name != leaf.dtype.name:
            raise CheckpointFormatError(
                f"{what}: TensorStore opens it with shape {tuple(store.shape)} and dtype {store.dtype.name}, but its "
                f"metadata says {leaf.shape} and {leaf.dtype.name}. It is damaged or crafted."
            )
        return zarr_arrays.read_foreign(store, leaf.dtype, what)


def open(path: str) -> Reader:
    """Open the Orbax checkpoint (an item, or a step folder of Composite items) at ``path``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"No Orbax checkpoint at {path!r}: nothing is there.")
    if not detect(path):
        if manages(path):
            raise NotACheckpointError(
                f"{path!r} is the directory of an Orbax CheckpointManager, not one checkpoint: open one of its step "
                f"folders, such as the latest, {latest(path)!r}."
            )
        raise NotACheckpointError(f"{path!r} is not an Orbax checkpoint (no {TREE_METADATA} or {CHECKPOINT_METADATA}).")
    return Reader(path)
