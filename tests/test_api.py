"""The public surface is exactly what is meant to be public."""

import jaxckpt

PUBLIC = {
    # saving and restoring
    "Checkpoint", "RestoreStatus", "save", "restore", "wait_until_finished", "list_variables", "load_variable",
    "FORMAT_VERSION", "PLACEHOLDER",
    # training loops
    "CheckpointManager", "latest_checkpoint", "checkpoints_iterator", "CheckpointInfo", "RetentionPolicy",
    "KeepLatest", "KeepEvery", "KeepMultiplesOf", "KeepSpaced", "KeepBest", "KeepAny", "restore_slots", "SlotReport",
    "PreemptionHandler",
    # inspection
    "inspect", "CheckpointView", "ManagerView",
    # errors and warnings
    "JaxckptError", "CheckpointNotFoundError", "NotACheckpointError", "CheckpointReplacedError",
    "CheckpointExistsError", "ManagerLockedError",
    "CheckpointFormatError", "UnsupportedVersionError", "CheckpointCorruptedError", "MismatchError",
    "MissingKeyError", "UnsupportedValueError", "RestoreAssertionError", "UnusedValuesWarning", "StorageError",
}  # fmt: skip


def test_all_is_exactly_the_public_surface():
    assert set(jaxckpt.__all__) == PUBLIC
    assert jaxckpt.__all__ == sorted(jaxckpt.__all__, key=lambda n: (not n.isupper(), n))
    for name in jaxckpt.__all__:
        assert getattr(jaxckpt, name) is not None


def test_version_is_one_string():
    from jaxckpt._version import __version__

    assert jaxckpt.__version__ == __version__ and __version__.count(".") == 2


def test_the_manager_shows_its_parameters():
    """help(), IDEs and the API reference read the signature: every parameter, typed, not the
    ``(*args, local_directory=None, **kwargs)`` of the ``__new__`` that picks the two-tier class."""
    import inspect

    sig = inspect.signature(jaxckpt.CheckpointManager)
    names = list(sig.parameters)
    assert names[:3] == ["checkpoint", "directory", "max_to_keep"]
    for name in ("local_directory", "save_interval_steps", "metadata", "read_only", "policies"):
        assert name in names and sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["max_to_keep"].annotation in ("int | None", int | None)
    assert "**kwargs" not in str(sig) and sig.return_annotation in (inspect.Signature.empty, None, "None")
