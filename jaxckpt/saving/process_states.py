"""Each process's object states (data iterators) in a multi-process save.

Every process takes its own ``get_state()``, and data iterators differ per process (each reads its
own shard), so process 0's alone would resume every other process at process 0's position. Before
the data is declared written, each process hands its states to process 0 through the key-value
store of ``jax.distributed`` (no device collectives: this may run on the background save thread),
and process 0's index records, per key, one state where all processes agree and otherwise each
process's own (``state_per_process``, see :mod:`jaxckpt.format.records`).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from jaxckpt._errors import JaxckptError
from jaxckpt.format.keys import describe
from jaxckpt.format.records import STATE_TYPES, Index, ValueLeaf
from jaxckpt.runtime import multihost


def _encoded(leaf: ValueLeaf) -> list[Any]:
    value = base64.b64encode(leaf.value).decode("ascii") if leaf.type == "state_bytes" else leaf.value
    return [leaf.type, value]


def _decoded(row: list[Any]) -> ValueLeaf:
    kind, value = row
    return ValueLeaf(kind, base64.b64decode(value) if kind == "state_bytes" else value)


def gather(token: str, index: Index) -> bool:
    """Every process: hand this process's states to process 0; process 0: record every process's
    in ``index``. Nothing with one process. Called once per save (or copy), by every process, with
    its token. Whether ``index`` changed (only ever on process 0)."""
    if multihost.process_count() == 1:
        return False
    mine = {k: _encoded(v) for k, v in index.leaves.items() if isinstance(v, ValueLeaf) and v.type in STATE_TYPES}
    gathered = multihost.to_primary(f"states/{token}", json.dumps(mine, ensure_ascii=False))
    if gathered is None:  # not the primary
        return False
    rows, changed = [json.loads(text) for text in gathered], False
    for key in mine:
        missing = next((p for p, states in enumerate(rows) if key not in states), None)
        if missing is not None:
            raise JaxckptError(
                f"Cannot save {describe(key)}: process 0 holds an object state there and process {missing} does "
                "not. Every process must save the same structure; hold the same kind of object at that key everywhere."
            )
        # Compared as encoded (JSON's 1, 1.0 and true are different states); one when all agree.
        encoded = [json.dumps(states[key], sort_keys=True) for states in rows]
        if any(e != encoded[0] for e in encoded):
            index.leaves[key] = ValueLeaf("state_per_process", tuple(_decoded(states[key]) for states in rows))
            changed = True
    return changed
