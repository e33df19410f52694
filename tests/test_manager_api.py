"""The manager as help(), IDEs and the API reference see it: one class, one explicit typed signature,
every public call documented on it, the same surface with one tier or two."""

import contextlib
import inspect
import io
import os

import numpy as np
import pytest

import jaxckpt

# Every parameter of CheckpointManager, in order, with its default (``EMPTY``: none).
EMPTY = inspect.Parameter.empty
PARAMETERS = {
    "checkpoint": EMPTY,
    "directory": EMPTY,
    "max_to_keep": None,
    "keep_checkpoint_every_n_hours": None,
    "checkpoint_name": "ckpt",
    "step_counter": None,
    "checkpoint_interval": None,
    "last_checkpoint_step": None,
    "save_interval_steps": None,
    "save_interval_secs": None,
    "save_continuously": False,
    "init_fn": None,
    "policies": (),
    "async_save": True,
    "save_on_preemption": False,
    "read_only": False,
    "clock": "time.time",
    "local_directory": None,
    "local_policies": (),
    "durable_interval_steps": None,
    "preemption_grace_s": 30.0,
    "metadata": None,
    "incremental": True,
    "save_dtypes": None,
    "local_replicas": None,
}

# The public calls and attributes, on a manager of one tier or two alike.
PUBLIC = {
    "all_steps",
    "best_step",
    "checkpoint",
    "checkpoint_infos",
    "checkpoint_interval",
    "checkpoints",
    "close",
    "copied",
    "delete",
    "directory",
    "latest_checkpoint",
    "latest_step",
    "local_checkpoint_infos",
    "local_directory",
    "metadata",
    "reached_preemption",
    "read_only",
    "reload",
    "restore",
    "restore_or_initialize",
    "save",
    "save_if_preempted",
    "should_save",
    "wait_until_finished",
}


def _ckpt() -> jaxckpt.Checkpoint:
    return jaxckpt.Checkpoint(step=0, w=np.zeros(3, np.float32))


def test_the_signature_lists_every_parameter_typed_with_its_default():
    sig = inspect.signature(jaxckpt.CheckpointManager)
    assert list(sig.parameters) == list(PARAMETERS)
    for name, param in sig.parameters.items():
        assert param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD), name
        assert param.annotation is not EMPTY, f"{name} has no annotation"
        want = PARAMETERS[name]
        if want == "time.time":
            import time

            assert param.default is time.time
        else:
            assert param.default == want, name
    first_keyword = list(PARAMETERS).index("keep_checkpoint_every_n_hours")
    kinds = [p.kind for p in sig.parameters.values()]
    assert all(k is inspect.Parameter.POSITIONAL_OR_KEYWORD for k in kinds[:first_keyword])
    assert all(k is inspect.Parameter.KEYWORD_ONLY for k in kinds[first_keyword:])
    assert sig.return_annotation in (EMPTY, None, "None")  # what Python shows for any class: __init__'s


def test_the_signature_is_the_init_itself_with_no_new_or_patched_signature():
    """No ``__new__`` that picks a class, and no ``__signature__`` patched over it: the signature
    that tools read is ``__init__``'s own."""
    cls = jaxckpt.CheckpointManager
    assert "__new__" not in vars(cls)
    assert "__signature__" not in vars(cls)
    init = inspect.signature(cls.__init__)
    assert inspect.signature(cls) == init.replace(parameters=list(init.parameters.values())[1:])


def test_help_shows_the_parameters_and_the_calls():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        help(jaxckpt.CheckpointManager)
    text = out.getvalue()
    for name in PARAMETERS:
        assert f"{name}:" in text or f"{name}," in text or f"{name})" in text, name
    assert "local_directory: 'PathLike | None' = None" in text or "local_directory: PathLike | None = None" in text
    for name in PUBLIC:
        assert name in text, name
    assert "Two tiers" in text  # the class's documentation, not a part's


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_call_is_documented_on_the_class(name):
    """The API reference is generated from these docstrings: each public call has its own."""
    attribute = inspect.getattr_static(jaxckpt.CheckpointManager, name)
    assert inspect.getdoc(attribute), f"CheckpointManager.{name} has no docstring"


def test_the_class_documents_itself():
    doc = inspect.getdoc(jaxckpt.CheckpointManager)
    assert doc and "max_to_keep" in doc and "local_directory" in doc


@pytest.mark.parametrize("tiers", [1, 2])
def test_one_tier_or_two_is_one_class_with_one_surface(tmp_path, tiers):
    local = tmp_path / "local" if tiers == 2 else None
    with jaxckpt.CheckpointManager(_ckpt(), tmp_path / "ckpts", local_directory=local) as manager:
        assert type(manager) is jaxckpt.CheckpointManager
        assert isinstance(manager, jaxckpt.CheckpointManager)
        assert {n for n in dir(manager) if not n.startswith("_")} == PUBLIC
        assert manager.save(step=1) is not None
        manager.wait_until_finished()
        assert manager.all_steps() == [1]  # with two tiers, durable_interval_steps=None copies every save
        assert manager.directory == str(tmp_path / "ckpts")
        if tiers == 1:
            assert manager.local_directory is None
            assert manager.local_checkpoint_infos == [] and manager.copied == []
        else:
            assert manager.local_directory == str(tmp_path / "local")
            assert [c.step for c in manager.local_checkpoint_infos] == [1]
            assert manager.copied == [str(tmp_path / "ckpts" / "ckpt-1")]
        assert "CheckpointManager(" in repr(manager)


def test_tier_options_are_refused_before_the_directory_is_touched(tmp_path):
    with pytest.raises(ValueError, match="durable_interval_steps"):
        jaxckpt.CheckpointManager(
            _ckpt(), tmp_path / "ckpts", local_directory=tmp_path / "local", durable_interval_steps=0
        )
    assert not (tmp_path / "ckpts").exists()


@pytest.mark.parametrize("tiers", [1, 2])
def test_the_managers_warnings_point_at_the_users_call(tmp_path, tiers):
    """A warning names the line of the caller's code (``warnings`` filters and messages use it),
    not a line of jaxckpt, however many of its frames lie between, with one tier or two."""
    local = {"local_directory": tmp_path / "local"} if tiers == 2 else {}
    jaxckpt.CheckpointManager(_ckpt(), tmp_path / "ckpts", metadata={"lr": 1}, **local).close()
    with pytest.warns(UserWarning, match="keeps the metadata it has") as rec:
        jaxckpt.CheckpointManager(_ckpt(), tmp_path / "ckpts", metadata={"lr": 2}, **local).close()
    assert [w.filename for w in rec] == [__file__]

    clock = [10000.0]
    with jaxckpt.CheckpointManager(
        _ckpt(), tmp_path / "kept", max_to_keep=1, keep_checkpoint_every_n_hours=1.0, clock=lambda: clock[0]
    ) as manager:
        for _ in range(3):
            manager.save(force=True)
            manager.wait_until_finished()
            clock[0] += 3600.0
    clock[0] = 5000.0  # the clock went back
    with pytest.warns(UserWarning, match="behind the last preserved checkpoint") as rec:
        jaxckpt.CheckpointManager(_ckpt(), tmp_path / "kept", max_to_keep=1, clock=lambda: clock[0], **local).close()
    assert [w.filename for w in rec] == [__file__]


@pytest.mark.parametrize(
    "option", [{"local_policies": [jaxckpt.KeepLatest(3)]}, {"durable_interval_steps": 10}, {"preemption_grace_s": 5.0}]
)
def test_a_two_tier_option_without_local_directory_is_refused(tmp_path, option):
    """An option of two tiers given to a manager of one tier is a mistake (a forgotten
    local_directory): refused before the directory is touched, naming the option, not ignored."""
    (name,) = option
    with pytest.raises(ValueError, match=f"{name}.*local_directory"):
        jaxckpt.CheckpointManager(jaxckpt.Checkpoint(x=np.zeros(2)), tmp_path / "ckpts", **option)
    assert not (tmp_path / "ckpts").exists()


def test_best_step_follows_the_keep_best_policy(tmp_path):
    """Orbax's best_step(): by the KeepBest policy's metric and mode (ties: the older); the latest without one."""
    policies = [jaxckpt.KeepLatest(1) | jaxckpt.KeepBest(2, metric="acc", mode="max")]
    with jaxckpt.CheckpointManager(_ckpt(), str(tmp_path / "best"), policies=policies) as manager:
        assert manager.best_step() is None
        manager.save(1)  # no metric: never the best
        assert manager.best_step() is None
        for step, acc in ((2, 0.5), (3, 0.9), (4, 0.9), (5, 0.1)):
            manager.save(step, metrics={"acc": acc})
        assert manager.all_steps() == [3, 4, 5] and manager.best_step() == 3
    with jaxckpt.CheckpointManager(_ckpt(), str(tmp_path / "latest"), max_to_keep=2) as manager:
        assert manager.best_step() is None
        manager.save(1, metrics={"loss": 0.1})
        manager.save(2, metrics={"loss": 0.9})
        assert manager.best_step() == 2  # no KeepBest: the latest, as Orbax's without best_fn


def test_restore_of_a_managers_directory_into_a_plain_tree(tmp_path):
    """The save counter that a manager's Checkpoint records is its own: a pytree template needs none."""
    ckpt = jaxckpt.Checkpoint(state={"w": np.ones(2, np.float32)}, meta={"lr": 0.1, "name": "run"})
    with jaxckpt.CheckpointManager(ckpt, str(tmp_path / "run")) as manager:
        manager.save(1)
    like = {"state": {"w": np.zeros(2, np.float32)}, "meta": {"lr": 0.0, "name": ""}}
    restored = jaxckpt.restore(str(tmp_path / "run"), like=like)
    assert restored["meta"] == {"lr": 0.1, "name": "run"} and restored["state"]["w"].tolist() == [1.0, 1.0]
    with pytest.raises(jaxckpt.MismatchError, match=r"not in `like` \(1\):\n    state/w\n"):
        jaxckpt.restore(str(tmp_path / "run"), like={"meta": like["meta"]})  # a value is still a value


def test_json_child_into_an_empty_dict(tmp_path):
    """A `{}` where the checkpoint holds a dict of Python values takes that dict, as saved."""
    meta = {"lr": 0.1, "name": "run", "layers": [4, 2], "extra": {"seed": None}}
    path = jaxckpt.Checkpoint(w=np.ones(2, np.float32), meta=meta).save(tmp_path / "ckpt")
    ckpt = jaxckpt.Checkpoint(w=np.zeros(2, np.float32), meta={})
    ckpt.restore(path).assert_consumed()
    assert ckpt.meta == meta
    assert jaxckpt.restore(path, like={"w": np.zeros(2, np.float32), "meta": {}, "save_counter": 0})["meta"] == meta
    # Arrays need a template: a dict holding one is no JSON child.
    arrays = jaxckpt.Checkpoint(w=np.ones(2, np.float32), meta={"table": np.ones(3)}).save(tmp_path / "arrays")
    status = jaxckpt.Checkpoint(w=np.zeros(2, np.float32), meta={}).restore(arrays)
    assert status.unused_keys == ["meta/table"]
    status.expect_partial()


def test_checkpoints_iterator_follows_a_trainer(tmp_path):
    """An evaluator beside a trainer thread: each checkpoint is yielded once the trainer saved it.
    The trainer saves the next only after the evaluator took the last (a queue, not a sleep)."""
    import queue
    import threading

    directory = str(tmp_path / "run")
    taken: queue.Queue[str] = queue.Queue()
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            with jaxckpt.CheckpointManager(_ckpt(), directory, max_to_keep=5) as manager:
                for step in (1, 2, 3):
                    manager.save(step)
                    manager.wait_until_finished()
                    taken.get(timeout=60)  # the evaluator has seen it
        except BaseException as e:  # surfaced by the test's thread
            errors.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    seen = []
    try:
        for path in jaxckpt.checkpoints_iterator(directory, timeout=60, poll_interval_secs=0.01):
            seen.append(os.path.basename(path))
            taken.put(path)
            if len(seen) == 3:
                break
    finally:
        thread.join(timeout=60)
    assert not errors and not thread.is_alive()
    assert seen == ["ckpt-1", "ckpt-2", "ckpt-3"]


def test_checkpoints_iterator_timeout(tmp_path):
    with jaxckpt.CheckpointManager(_ckpt(), str(tmp_path / "run")) as manager:
        manager.save(7)
    asked = []

    def done() -> bool:
        asked.append(True)
        return len(asked) == 2  # wait once more, then end

    found = list(
        jaxckpt.checkpoints_iterator(str(tmp_path / "run"), timeout=0, timeout_fn=done, poll_interval_secs=0.01)
    )
    assert [os.path.basename(p) for p in found] == ["ckpt-7"] and len(asked) == 2
    assert list(jaxckpt.checkpoints_iterator(str(tmp_path / "nothing-yet"), timeout=0, poll_interval_secs=0.01)) == []
    with pytest.raises(ValueError, match="poll_interval_secs must be above 0"):
        next(jaxckpt.checkpoints_iterator(str(tmp_path / "run"), poll_interval_secs=0))
