"""Reading every byte of a checkpoint and checking every checksum: what ``jaxckpt verify`` reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxckpt._errors import CheckpointFormatError, JaxckptError, StorageError, UnsupportedVersionError
from jaxckpt.format.records import ArrayLeaf
from jaxckpt.reading.open import ForeignOpened, open_latest
from jaxckpt.reading.reader import Opened
from jaxckpt.storage import locations
from jaxckpt.tools.progress import Progress
from jaxckpt.tools.scan import array_leaf, batches, one_large, pieces, read_arrays


@dataclasses.dataclass
class Verified:
    path: str
    values: int = 0
    nbytes: int = 0
    checked: str = "every checksum matches"  # what an OK means for this format
    damaged: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # key ("" for the index), message
    # Values the storage refused to give (permissions, a network error): not known to be damaged.
    unreadable: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.unreadable


def verify(path: str, progress: Progress | None = None, *, opened: Opened | None = None) -> Verified:
    """Read every value of the checkpoint at ``path``, checking every checksum; damage is collected, not raised.

    The index's own checksum is checked when it is opened; packed leaves carry a CRC-32C each (a
    CRC-32 up to format version 3), and every chunk of a large array a CRC-32C, checked as it is read;
    a missing chunk and a ``zarr.json`` that differs from what the index implies are damage too. What
    the storage refuses to read (permissions, a network error) is collected apart, as ``unreadable``.
    """
    result = Verified(path)
    try:
        opened = (
            opened if opened is not None else open_latest(locations.location(path))
        )  # ``opened``: already, at ``path``
    except UnsupportedVersionError:
        raise  # not damage: a newer jaxckpt wrote it
    except CheckpointFormatError as e:  # a damaged index: nothing in it can be trusted
        result.damaged.append(("", str(e)))
        return result
    except StorageError as e:
        result.unreadable.append(("", str(e)))
        return result
    opened.check_zarr_json = True  # what TensorStore and zarr-python read must match the index too
    leaves = opened.index.leaves
    result.values = len(leaves)
    if isinstance(opened, ForeignOpened) and not getattr(opened.checkpoint.reader, "checksums", False):
        result.checked = f"every size and offset checked ({opened.format} stores no checksums)"
    progress = progress or Progress(0, "", enabled=False)
    arrays = [k for k, v in leaves.items() if isinstance(v, ArrayLeaf)]

    def read(keys: Sequence[str]) -> None:
        if one_large(opened, keys):
            for _ in pieces(opened, keys[0]):  # piece by piece, never whole
                pass
        else:
            read_arrays(opened, keys)

    def record(key: str, error: JaxckptError) -> None:
        (result.unreadable if isinstance(error, StorageError) else result.damaged).append((key, str(error)))

    for batch in batches(opened, arrays):
        try:
            read(batch)
        except (CheckpointFormatError, StorageError) as e:
            if len(batch) == 1:
                record(batch[0], e)
            for key in batch if len(batch) > 1 else ():  # which of them are damaged
                try:
                    read([key])
                except (CheckpointFormatError, StorageError) as each:
                    record(key, each)
        size = sum(array_leaf(opened, k).nbytes for k in batch)
        result.nbytes += size
        progress.update(size)
    return result
