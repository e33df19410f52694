"""jaxckpt: checkpoints for JAX and Flax, with named edges, stored by TensorStore.

path = jaxckpt.save("easy_checkpoint", net)
jaxckpt.restore(path, like=net)

ckpt = jaxckpt.Checkpoint(step=1, optimizer=optimizer, net=net, iterator=iterator)
path = ckpt.save("ckpts/ckpt")
ckpt.restore(path).assert_consumed()
"""

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
from jaxckpt._version import __version__ as __version__
from jaxckpt.checkpoint.checkpoint import Checkpoint, save, wait_until_finished
from jaxckpt.checkpoint.restore import RestoreStatus, list_variables, load_variable, restore
from jaxckpt.checkpoint.slots import SlotReport, restore_slots
from jaxckpt.format.records import FORMAT_VERSION
from jaxckpt.manager.checkpoint_manager import CheckpointManager
from jaxckpt.manager.policies import (
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLatest,
    KeepMultiplesOf,
    KeepSpaced,
    RetentionPolicy,
)
from jaxckpt.manager.preemption import PreemptionHandler
from jaxckpt.reading.follow import checkpoints_iterator
from jaxckpt.reading.open import latest_checkpoint
from jaxckpt.reading.templates import PLACEHOLDER
from jaxckpt.storage.statefile import CheckpointInfo
from jaxckpt.tools.inspect import CheckpointView, ManagerView, inspect

__all__ = [
    "FORMAT_VERSION",
    "PLACEHOLDER",
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
    "KeepMultiplesOf",
    "KeepSpaced",
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
    "checkpoints_iterator",
    "inspect",
    "latest_checkpoint",
    "list_variables",
    "load_variable",
    "restore",
    "restore_slots",
    "save",
    "wait_until_finished",
]
