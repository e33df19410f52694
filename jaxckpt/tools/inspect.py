"""Looking inside checkpoints without the model code: ``jaxckpt.inspect`` and ``jaxckpt ls``.

:func:`inspect` reads only the index (or a manager's state file), never array data, so it is quick
however large the checkpoint. What it returns prints as a tree in a terminal, and displays as a
collapsible HTML tree in Jupyter and Colab::

    jaxckpt.inspect("ckpts/ckpt-10")                         # one checkpoint: keys, dtypes, shapes, sizes
    jaxckpt.inspect("ckpts")                                 # a manager's directory: its checkpoints
    jaxckpt.inspect("ckpts/ckpt-10", "optimizer/**/mu/**")   # only the keys that match

Patterns (:mod:`jaxckpt.tools.describe`): ``*`` matches within one edge, ``**`` any number of edges, ``?``
one character of an edge; a pattern selects the keys it matches and everything below them.
"""

from __future__ import annotations

import concurrent.futures
import html
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from jaxckpt._errors import CheckpointFormatError, JaxckptError
from jaxckpt.format.records import ArrayLeaf, Index, Leaf, ValueLeaf
from jaxckpt.incremental import refs
from jaxckpt.manager import run_metadata
from jaxckpt.reading.open import Probe, after_saves_to, is_manager_directory, open_found, probe
from jaxckpt.reading.reader import Opened
from jaxckpt.reading.templates import NO_TEMPLATE
from jaxckpt.storage import local_tree, locations, statefile
from jaxckpt.storage.locations import PathLike
from jaxckpt.storage.statefile import CheckpointInfo
from jaxckpt.tools.describe import (
    KeyTree,
    build_tree,
    json_value,
    key_matcher,
    leaf_json,
    leaf_nbytes,
    leaf_shape,
    leaf_type,
    node_type,
    plural,
    printable,
    pruned,
    selected,
    short_value,
)
from jaxckpt.tools.progress import human_bytes
from jaxckpt.tree.objects import build

# A node whose subtree holds at most this many values starts unfolded in the HTML view.
_OPEN_LIMIT = 16
# The key column of the text tree never grows wider than this; longer names push their row right.
_NAME_WIDTH = 64


class CheckpointView:
    """What one checkpoint holds, from its index alone: displayed as a tree of keys.

    ``print(view)`` (or ``repr``) gives the same tree as ``jaxckpt ls``; in Jupyter and Colab the
    view displays as collapsible HTML. ``view.keys()`` lists the selected keys, ``view[key]`` reads
    one value (arrays as numpy), :meth:`to_json` is what ``jaxckpt ls --json`` prints, and
    :meth:`abstract_tree` is the saved structure with ``jax.ShapeDtypeStruct`` leaves (to look at with
    treescope, or to add shardings to and restore with as a template).
    """

    def __init__(
        self, path: PathLike | locations.Location, patterns: Sequence[str] = (), *, found: Probe | None = None
    ) -> None:
        """``found``: what :func:`jaxckpt.reading.open.probe` found at ``path``, if it looked already."""
        location = locations.location(path)
        self.path = location.text
        self.patterns = tuple(patterns)
        # A manager's directory, a foreign one's too: its latest checkpoint.
        self._opened: Opened = open_found(found if found is not None else probe(location))
        if self._opened.format != "jaxckpt":
            self.path = str(self._opened.path)
        self.index: Index = self._opened.index
        match = key_matcher(self.patterns)
        self._tree = build_tree(self.index, match)
        self._keys = [k for k in self.index.keys_under("") if match is None or selected(k, match)]

    def keys(self) -> list[str]:
        """The keys of the selected values, in graph order."""
        return list(self._keys)

    @property
    def leaves(self) -> dict[str, Leaf]:
        """The index records of the selected values."""
        return {k: self.index.leaves[k] for k in self._keys}

    @property
    def nbytes(self) -> int:
        """Bytes of the selected arrays (as in memory, uncompressed)."""
        return sum(leaf_nbytes(leaf) for leaf in self.leaves.values())

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        """Let go of the checkpoint's folder, which the view holds open; reading a value after this
        opens its files by their paths again. ``with jaxckpt.inspect(path) as view:`` closes it."""
        self._opened.close()

    def __enter__(self) -> CheckpointView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, key: str) -> Any:
        """One value, read from the checkpoint: arrays as numpy, Python values as saved."""
        self._opened.leaf(key)  # a clear MissingKeyError for a wrong key
        return self._opened.load({key: NO_TEMPLATE})[key]

    def filter(self, *patterns: str) -> CheckpointView:
        """The same checkpoint, showing only the keys that match any of ``patterns``."""
        return CheckpointView(self.path, patterns)

    def abstract_tree(self) -> Any:
        """The saved structure rebuilt without reading data: arrays as ``jax.ShapeDtypeStruct``."""
        import jax

        def abstract(leaf: Leaf) -> Any:
            if isinstance(leaf, ValueLeaf):
                return leaf.value
            if leaf.prng_impl:
                return jax.ShapeDtypeStruct(leaf_shape(leaf), jax.random.key(0, impl=leaf.prng_impl).dtype)
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)

        values = {k: abstract(self.index.leaves[k]) for k in self._keys}
        if len(self._keys) == len(self.index.leaves):
            return build(self.index.nodes, values)
        return pruned(self.index.nodes, values)

    # --- display -------------------------------------------------------------------------------

    def summary(self) -> str:
        """``13 values: 9 arrays (188 B), 4 Python values`` (of the selection, when filtered)."""
        leaves = self.leaves
        arrays = sum(isinstance(v, ArrayLeaf) for v in leaves.values())
        others = len(leaves) - arrays
        text = f"{plural(len(leaves), 'value')}: {plural(arrays, 'array')} ({human_bytes(self.nbytes)})"
        if others:
            text += f", {plural(others, 'Python value')}"
        if self.patterns:
            text += f" matching {' or '.join(map(repr, self.patterns))}, of {len(self.index.leaves)} in all"
        return text

    @property
    def format(self) -> str:
        """The format on disk: ``"jaxckpt"``, or the other library's (``"TensorFlow (tf.train.Checkpoint)"``, ``"Orbax"``)."""
        return self._opened.format

    @property
    def skipped(self) -> dict[str, str]:
        """Values listed that have no numpy form (TensorFlow iterator state, strings): key -> what it holds."""
        return {k: f"{e.note} {e.shape}" for k, e in self._opened.skipped.items()}

    def _header(self) -> str:
        if self.format != "jaxckpt":
            return f"{self.path}  ({self.format} checkpoint, read-only)"
        writer = self.index.metadata.get("writer")
        return f"{self.path}  (jaxckpt checkpoint{f', written by {writer}' if isinstance(writer, str) else ''})"

    def _rows(self) -> list[tuple[str, str, str, str]]:
        """(tree name, type, shape or value, size) for every displayed row."""
        rows: list[tuple[str, str, str, str]] = []

        def visit(t: KeyTree, prefix: str, last: bool, top: bool) -> None:
            branch = "" if top else ("└── " if last else "├── ")
            name = prefix + branch + (printable(t.label) if t.label or not top else "(root)")
            if t.info is not None:  # a node
                if not top:
                    rows.append((name, node_type(t.info), plural(t.count, "value"), human_bytes(t.nbytes)))
            elif isinstance(t.leaf, ValueLeaf):
                rows.append((name, leaf_type(t.leaf), short_value(t.leaf), ""))
            elif t.leaf is not None:
                rows.append((name, leaf_type(t.leaf), str(leaf_shape(t.leaf)), human_bytes(t.nbytes)))
            inner = "" if top else prefix + ("    " if last else "│   ")
            for i, child in enumerate(t.children):
                visit(child, inner, i == len(t.children) - 1, False)

        if self._tree is not None:
            visit(self._tree, "", True, True)
        return rows

    def text(self, *, ascii: bool = False) -> str:
        """The tree as ``jaxckpt ls`` prints it; ``ascii`` draws it with ``|--`` for narrow encodings."""
        rows = self._rows()
        lines = [self._header()]
        if rows:
            name_w = min(_NAME_WIDTH, max(len(r[0]) for r in rows))
            type_w = max(len(r[1]) for r in rows)
            shape_w = max(len(r[2]) for r in rows)
            size_w = max(len(r[3]) for r in rows)
            for name, kind, shape, size in rows:
                line = f"{name:<{name_w}}  {kind:<{type_w}}  {shape:<{shape_w}}  {size:>{size_w}}"
                lines.append(line.rstrip())
        lines.append(self.summary())
        if self.skipped:
            lines.append(f"not restorable (no numpy form), {len(self.skipped)}:")
            lines.extend(f"  {k}  {what}" for k, what in self.skipped.items())
        text = "\n".join(lines)
        if ascii:
            text = text.replace("├── ", "|-- ").replace("└── ", "`-- ").replace("│   ", "|   ")
        return text

    def __repr__(self) -> str:
        return self.text()

    def to_json(self) -> dict[str, Any]:
        """A plain-JSON description: what ``jaxckpt ls --json`` prints."""
        leaves = self.leaves
        return {
            "kind": "checkpoint",
            "path": self.path,
            "format": self.format,
            "skipped": self.skipped,
            "metadata": json_value(self.index.metadata),
            "patterns": list(self.patterns),
            "values": len(leaves),
            "arrays": sum(isinstance(v, ArrayLeaf) for v in leaves.values()),
            "nbytes": self.nbytes,
            "leaves": [leaf_json(k, v) for k, v in leaves.items()],
        }

    def _repr_html_(self) -> str:
        total = len(self.index.leaves)

        def leaf_html(leaf: Leaf, t: KeyTree) -> str:
            title = ""
            if isinstance(leaf, ValueLeaf):
                detail = f"{leaf_type(leaf)} = {short_value(leaf, 80)}"
            else:
                detail = f"{leaf_type(leaf)} {leaf_shape(leaf)} · {human_bytes(t.nbytes)}"
                if leaf.sharding:
                    title = f' title="sharding: {html.escape(leaf.sharding)}"'
            return (
                f'<div class="jx-leaf"{title}><span class="jx-key">{html.escape(t.label)}</span> '
                f'<span class="jx-dim">{html.escape(detail)}</span></div>'
            )

        def node_html(t: KeyTree, depth: int) -> str:
            if t.info is None:
                assert t.leaf is not None  # a KeyTree is a node (info) or a value (leaf)
                return leaf_html(t.leaf, t)
            inner = "".join(node_html(c, depth + 1) for c in t.children)
            if depth == 0:
                return inner
            is_open = t.count <= _OPEN_LIMIT or (depth == 1 and total <= 4 * _OPEN_LIMIT)
            detail = f"{node_type(t.info)} · {plural(t.count, 'value')} · {human_bytes(t.nbytes)}"
            return (
                f"<details{' open' if is_open else ''}><summary><span class='jx-key'>{html.escape(t.label)}</span> "
                f"<span class='jx-dim'>{html.escape(detail)}</span></summary>{inner}</details>"
            )

        body = node_html(self._tree, 0) if self._tree is not None else ""
        return (
            f"<div class='jx'>{_STYLE}<div class='jx-head'><b>{html.escape(self.path)}</b> "
            f"<span class='jx-dim'>{html.escape(self.summary())}</span></div>{body}</div>"
        )


_STYLE = (
    "<style>"
    ".jx{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;line-height:1.5}"
    ".jx details,.jx .jx-leaf{margin-left:1.2em}"
    ".jx summary{cursor:pointer;margin-left:-1.2em}"
    ".jx .jx-head{margin-bottom:.3em}"
    ".jx .jx-key{font-weight:600}"
    ".jx .jx-dim{opacity:.65}"
    ".jx table{border-collapse:collapse}.jx td,.jx th{padding:0 .8em 0 0;text-align:left}"
    "</style>"
)


# --- a manager's directory ---------------------------------------------------------------------


def disk_bytes(path: PathLike | locations.Location) -> int | None:
    """Bytes of every file under ``path`` (as ``du --apparent-size``); in an object store, the bytes
    its index records (see :func:`_recorded_bytes`); None if there is no checkpoint there."""
    location = locations.location(path)
    if location.local is None:
        return refs.bucket_usage(location)[0]
    return local_tree.total_bytes(location)


def _usage(location: locations.Location) -> tuple[int | None, int | None, dict[tuple[int, int], int]]:
    """A checkpoint's bytes, those in files shared with other checkpoints (hard links; in a bucket, the
    arrays it refers to: jaxckpt.incremental.refs), and those files (arrays)."""
    if location.local is None:
        return refs.bucket_usage(location)
    found = local_tree.usage(location)
    return (disk_bytes(location), None, {}) if found is None else (found.apparent, found.shared, found.linked)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _metrics_text(metrics: Any) -> str:
    return " ".join(f"{k}={'nan' if v is None else f'{v:.6g}'}" for k, v in metrics.items())


def same_place(location: locations.Location, text: str) -> bool:
    """Whether ``location`` is the folder ``text`` names, however each is spelt (a relative path,
    ``file://``, a symlink, a trailing slash): tells which tier of a two-tier run ``ls`` was given."""
    try:
        other = locations.location(text)
    except JaxckptError:
        return False
    if location.local is not None and other.local is not None:
        return os.path.realpath(location.local) == os.path.realpath(other.local)
    if location.kv is not None and other.kv is not None:
        keys = ("driver", "bucket", "path")
        return all(location.kv.get(k, "").rstrip("/") == other.kv.get(k, "").rstrip("/") for k in keys)
    return False


class ManagerView:
    """The checkpoints a ``CheckpointManager`` keeps in ``directory``, as its state file lists them.

    Prints as the table ``jaxckpt ls DIR`` shows (step, save time, size on disk, metrics); displays
    as an HTML table in Jupyter. ``view.latest`` is a :class:`CheckpointView` of the latest one.
    """

    def __init__(
        self, directory: PathLike | locations.Location, *, other_tier: bool = True, state: bytes | None = None
    ) -> None:
        """``state``: the bytes of its state file, if read already (see :func:`jaxckpt.reading.open.probe`)."""
        location = locations.location(directory)
        self.directory = location.text
        self._views: list[CheckpointView] = []  # what latest gave, closed with this view
        data = state if state is not None else statefile.read_state_file(location)
        found = statefile.parse_full_state(location, data, tensorflow_is_none=True)
        self.checkpoints: list[CheckpointInfo] = found[0] if found is not None else []
        # Each checkpoint measured at once (in an object store, its index read): a request's latency each, overlapped.
        names = [os.path.basename(c.path) for c in self.checkpoints]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(names)))) as pool:
            sizes = list(pool.map(lambda name: _usage(location / name), names))
        self.disk_bytes: dict[str, int | None] = {c.path: size[0] for c, size in zip(self.checkpoints, sizes)}
        # On a local disk, the bytes of each checkpoint's files that have other hard links (shared with
        # other checkpoints by incremental saves), and the bytes of all of them with each file once.
        self.shared_bytes: dict[str, int | None] = {c.path: size[1] for c, size in zip(self.checkpoints, sizes)}
        # Bucket references to a listed checkpoint are in its size already; to held data, not.
        linked = {k: v for _, _, files in sizes for k, v in files.items() if str(k[0]) not in names}
        held = [(size, shared) for size, shared, _ in sizes if size is not None and shared is not None]
        self.unique_bytes = sum(a - b for a, b in held) + sum(linked.values()) if location.local or held else None
        # The run's metadata (None: none recorded) is an aside: damage to it is named, not fatal here.
        self.metadata_problem: str | None = None
        try:
            self.metadata = run_metadata.read(location)
        except CheckpointFormatError as e:
            self.metadata, self.metadata_problem = None, str(e)
        # A two-tier manager's directory (jaxckpt.manager.tiers): which tier this is, and the other one's view.
        self.tiers = statefile.read_tiers(location)
        self.tier: str | None = None
        self.other: ManagerView | None = None
        # The other tier's own view is nested in this one's and says nothing about a third.
        self._with_other = other_tier
        if self.tiers is not None:
            local = same_place(location, self.tiers["local"])
            self.tier = "local" if local else "durable"
            there = locations.location(self.tiers["durable" if local else "local"])
            if other_tier:
                there_state = statefile.read_state_file(there)
                if statefile.parse_full_state(there, there_state, tensorflow_is_none=True) is not None:
                    self.other = ManagerView(there, other_tier=False, state=there_state)

    @property
    def latest(self) -> CheckpointView | None:
        """A :class:`CheckpointView` of the latest checkpoint, or None if the directory lists none
        (closed with this view, or by itself)."""
        if not self.checkpoints:
            return None
        view = CheckpointView(self.checkpoints[-1].path)
        self._views.append(view)
        return view

    def close(self) -> None:
        """Close the checkpoint views that :attr:`latest` gave (the state file is read whole, at once:
        nothing else is held open). ``with jaxckpt.inspect(directory) as view:`` closes them."""
        views, self._views = self._views, []
        for view in views:
            view.close()

    def __enter__(self) -> ManagerView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.checkpoints)

    def summary(self) -> str:
        """``"3 checkpoints, latest ckpt-30"``."""
        latest = os.path.basename(self.checkpoints[-1].path) if self.checkpoints else None
        shared = f", {human_bytes(self.unique_bytes or 0)} on disk" if any(self.shared_bytes.values()) else ""
        return f"{plural(len(self.checkpoints), 'checkpoint')}" + (f", latest {latest}" if latest else "") + shared

    def _rows(self) -> list[tuple[str, str, str, str, str]]:
        rows = []
        for i, c in enumerate(self.checkpoints):
            size, shared = self.disk_bytes[c.path], self.shared_bytes[c.path]
            note = f" ({human_bytes(shared)} shared)" if shared else ""  # in files other checkpoints hold too
            mark = "* " if i == len(self.checkpoints) - 1 else "  "
            rows.append(
                (
                    mark + os.path.basename(c.path),
                    str(c.step),
                    _when(c.time),
                    "missing" if size is None else human_bytes(size) + note,
                    _metrics_text(c.metrics),
                )
            )
        return rows

    def text(self) -> str:
        """The table as ``jaxckpt ls DIR`` prints it; a two-tier manager's other tier follows."""
        what = f"{self.tier} tier of a two-tier " if self.tier else ""
        lines = [f"{self.directory}  ({what}CheckpointManager directory: {self.summary()})"]
        if self.metadata_problem:
            lines.append(f"  metadata: damaged ({self.metadata_problem})")
        if self.metadata:
            text = json.dumps(self.metadata, ensure_ascii=False)
            lines.append(f"  metadata: {text if len(text) <= 200 else text[:197] + '...'}")
        rows = self._rows()
        if rows:
            head = ("  CHECKPOINT", "STEP", "SAVED", "SIZE", "METRICS")
            widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
            for r in [head, *rows]:
                line = f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}"
                lines.append(line.rstrip())
        if self.other is not None:
            lines += ["", self.other.text()]
        elif self.tiers is not None and self._with_other:
            lines += [
                "",
                f"{self.tiers['durable' if self.tier == 'local' else 'local']}  (the other tier: no checkpoints)",
            ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def to_json(self) -> dict[str, Any]:
        """A plain-JSON description: what ``jaxckpt ls --json DIR`` prints."""
        return {
            "kind": "manager",
            "directory": self.directory,
            "tier": self.tier,
            "tiers": self.tiers,
            "metadata": self.metadata,
            "metadata_problem": self.metadata_problem,
            "other_tier": self.other.to_json() if self.other is not None else None,
            "latest": self.checkpoints[-1].path if self.checkpoints else None,
            "unique_bytes": self.unique_bytes,
            "checkpoints": [
                {
                    "name": os.path.basename(c.path),
                    "path": c.path,
                    "step": c.step,
                    "time": c.time,
                    "metrics": dict(c.metrics),
                    "disk_bytes": self.disk_bytes[c.path],
                    "shared_bytes": self.shared_bytes[c.path],
                }
                for c in self.checkpoints
            ],
        }

    def _repr_html_(self) -> str:
        cells = "".join(
            "<tr>" + "".join(f"<td>{html.escape(x.strip())}</td>" for x in row) + "</tr>" for row in self._rows()
        )
        head = "".join(f"<th>{h}</th>" for h in ("checkpoint", "step", "saved", "size", "metrics"))
        latest = self.latest
        tree = (
            f"<details><summary>latest: {html.escape(latest.path)}</summary>{latest._repr_html_()}</details>"
            if latest is not None
            else ""
        )
        return (
            f"<div class='jx'>{_STYLE}<div class='jx-head'><b>{html.escape(self.directory)}</b> "
            f"<span class='jx-dim'>CheckpointManager directory: {html.escape(self.summary())}</span></div>"
            f"<table><tr>{head}</tr>{cells}</table>{tree}</div>"
        )


def inspect(path: PathLike, *patterns: str) -> CheckpointView | ManagerView:
    """What a checkpoint, or a manager's directory, holds; reads only the index or the state file.

    In Jupyter and Colab the result displays as a collapsible HTML tree of keys with their dtypes,
    shapes and sizes; ``print(...)`` gives the same tree as ``jaxckpt ls`` in a terminal. For a
    directory that a :class:`~jaxckpt.CheckpointManager` keeps, it lists the checkpoints (step, save
    time, size, metrics). ``patterns`` (``"optimizer/**/mu/**"``) keep only the keys that match::

        view = jaxckpt.inspect("ckpts/ckpt-10")
        view.keys()                     # ["step", "net/l1/bias", ...]
        view["net/l1/bias"]             # the value, as numpy
    """
    location = locations.location(path)
    with after_saves_to(location):
        found = probe(location)
        if is_manager_directory(found):
            if patterns:
                raise ValueError(
                    f"{found.location.text!r} is a manager's directory; patterns select keys of one checkpoint. "
                    f"Pass one of its checkpoints, e.g. {_latest_listed(found)!r}."
                )
            return ManagerView(found.location, state=found.state)
        return CheckpointView(found.location, patterns, found=found)


def _latest_listed(found: Probe) -> str | None:
    """The latest checkpoint the state file that :func:`jaxckpt.reading.open.probe` read lists, or None."""
    state = statefile.parse_full_state(found.location, found.state, tensorflow_is_none=True)
    return state[0][-1].path if state is not None and state[0] else None
