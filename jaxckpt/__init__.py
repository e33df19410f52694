"""jaxckpt: checkpoints for JAX and Flax, with named edges, stored by TensorStore.

path = jaxckpt.save("easy_checkpoint", net)
jaxckpt.restore(path, like=net)

ckpt = jaxckpt.Checkpoint(step=1, optimizer=optimizer, net=net, iterator=iterator)
path = ckpt.save("ckpts/ckpt")
ckpt.restore(path).assert_consumed()
"""

from jaxckpt._checkpoint import Checkpoint, save, wait_until_finished
from jaxckpt._checkpoint_manager import CheckpointManager
from jaxckpt._errors import (
    CheckpointCorruptedError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    JaxckptError,
    ManagerLockedError,
    MismatchError,
    MissingKeyError,
    NotACheckpointError,
    RestoreAssertionError,
    StorageError,
    UnsupportedValueError,
    UnsupportedVersionError,
    UnusedValuesWarning,
)
from jaxckpt._format import FORMAT_VERSION
from jaxckpt._inspect import CheckpointView, ManagerView, inspect
from jaxckpt._open import latest_checkpoint
from jaxckpt._policies import CheckpointInfo, KeepAny, KeepBest, KeepEvery, KeepLatest, RetentionPolicy
from jaxckpt._preemption import PreemptionHandler
from jaxckpt._restore import RestoreStatus, list_variables, load_variable, restore
from jaxckpt._slots import SlotReport, restore_slots
from jaxckpt._version import __version__ as __version__

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointCorruptedError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReplacedError",
    "CheckpointView",
    "JaxckptError",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "ManagerLockedError",
    "ManagerView",
    "MismatchError",
    "MissingKeyError",
    "NotACheckpointError",
    "PreemptionHandler",
    "RestoreAssertionError",
    "RestoreStatus",
    "RetentionPolicy",
    "SlotReport",
    "StorageError",
    "UnsupportedValueError",
    "UnsupportedVersionError",
    "UnusedValuesWarning",
    "inspect",
    "latest_checkpoint",
    "list_variables",
    "load_variable",
    "restore",
    "restore_slots",
    "save",
    "wait_until_finished",
]
