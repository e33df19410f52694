"""A reader in one process while another process saves: every restore it gets is one whole
checkpoint, never a mix of two saves nor a half-written one; where the checkpoint being read is
replaced in place or deleted by the writer's retention, the error says which.

The writer is a subprocess that saves step after step of a tree of 2,001 leaves (packed small ones
and a 4 MiB array of its own), each leaf filled with its step number. It waits on a pipe until this
process has restored its first save, then saves on without waiting; this process restores in a loop
until the writer is done."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxckpt

LEAVES = 2000
STEPS = 25

WRITER = """
import sys
import numpy as np
import jaxckpt

path, mode, steps, leaves = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def tree(step):
    t = {f"b{i // 10}": {f"w{i % 10}": np.full((16,), step, np.float32)} for i in range(leaves)}
    t["big"] = np.full((1 << 20,), step, np.float32)
    return t

ckpt = jaxckpt.Checkpoint(tree=tree(0))
manager = jaxckpt.CheckpointManager(ckpt, path, max_to_keep=2) if mode == "manager" else None
for step in range(1, steps + 1):
    if manager is None:
        jaxckpt.save(path, tree(step), overwrite=True)
    else:
        ckpt.tree = tree(step)
        manager.save(step)  # Orbax's save(step), asynchronous: the next step's tree is built meanwhile
    if step == 1:
        if manager is not None:
            manager.wait_until_finished()
        print("saved", flush=True)
        sys.stdin.readline()  # the reader has restored step 1: save on while it reads
if manager is not None:
    manager.close()
"""


def _template():
    like = {f"b{i // 10}": {f"w{i % 10}": jax.ShapeDtypeStruct((16,), np.float32)} for i in range(LEAVES)}
    like["big"] = jax.ShapeDtypeStruct((1 << 20,), np.float32)
    return like


def _step_of(tree) -> float:
    """The one step every leaf holds, or an AssertionError naming the mix."""
    steps = {float(np.asarray(x)[0]) for x in jax.tree.leaves(tree)} | {float(np.asarray(tree["big"])[-1])}
    assert len(steps) == 1, f"a restore mixed the leaves of steps {sorted(steps)}"
    return steps.pop()


def _writer(path, mode):
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), mode, str(STEPS), str(LEAVES)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # this checkout's jaxckpt
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _race(path, mode, restore_latest):
    """Restores while the writer saves: the steps read, in order, and the errors met."""
    writer = _writer(path, mode)
    steps, errors = [], []
    try:
        line = writer.stdout.readline()
        assert line == "saved\n", f"{line!r}\n{writer.stderr.read()[-3000:] if not line else ''}"
        steps.append(_step_of(restore_latest()))
        writer.stdin.write("go\n")
        writer.stdin.flush()
        while writer.poll() is None:
            try:
                steps.append(_step_of(restore_latest()))
            except jaxckpt.JaxckptError as e:
                errors.append(e)
        _, err = writer.communicate(timeout=120)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.communicate()
    assert writer.returncode == 0, err[-3000:]
    steps.append(_step_of(restore_latest()))  # after the last save: the last step
    return steps, errors


def test_a_checkpoint_replaced_in_place_reads_whole_or_says_it_was_replaced(tmp_path):
    """``save(path, overwrite=True)`` swaps the new folder with the old one in one step: a reader
    finds one or the other, whole (the steps it reads never go back); where the one it was reading
    is deleted under it, the restore reads the new one, and only if that happens again and again, an
    error says so (never that nothing is at the path)."""
    path = tmp_path / "ckpt"
    like = _template()
    steps, errors = _race(path, "overwrite", lambda: jaxckpt.restore(path, like=like))
    assert steps[0] == 1 and steps[-1] == STEPS
    assert steps == sorted(steps)
    for e in errors:  # replaced under each of four reads in a row (restore reads again by itself)
        assert isinstance(e, jaxckpt.CheckpointReplacedError), repr(e)
        assert "was replaced by another save" in str(e) and "read it again" in str(e), str(e)


def test_an_evaluator_reads_whole_checkpoints_while_retention_deletes_old_ones(tmp_path):
    """A read-only manager restores the latest step while the trainer saves (keeping 2) and deletes
    older ones: each restore is a whole checkpoint of the step asked for, or, where retention
    deleted that step meanwhile, an error that says so (never a corrupted or mixed read)."""
    evaluated = jaxckpt.Checkpoint(tree=_template())
    evaluator = jaxckpt.CheckpointManager(evaluated, tmp_path, read_only=True)

    def restore_latest():
        evaluator.reload()
        step = evaluator.latest_step()
        evaluator.restore(step).assert_consumed()
        assert _step_of(evaluated.tree) == step, f"step {step} read as another step"
        return evaluated.tree

    steps, errors = _race(tmp_path, "manager", restore_latest)
    evaluator.close()
    assert steps[0] == 1 and steps[-1] == STEPS
    assert steps == sorted(steps)
    for e in errors:
        assert isinstance(e, jaxckpt.CheckpointNotFoundError), repr(e)
        assert "was deleted while it was being read" in str(e), str(e)


# --- restore reads a replaced checkpoint again by itself ------------------------------------------


def _tree(step):
    return {"w": np.full((64, 64), step, np.float32), "small": {"b": np.full(3, step, np.float32)}, "step": step}


@pytest.fixture
def replaced_on_read(monkeypatch):
    """Each of the next ``times[0]`` loads first saves the checkpoint anew (``overwrite=True``), as
    another process would between this one's opening of the index and its reading of the data."""
    from jaxckpt.reading.reader import Opened

    real = Opened.load
    times = [0]
    saved = []

    def load(self, wanted, leaves=None):
        if times[0] > 0:
            times[0] -= 1
            step = 100 + len(saved)
            jaxckpt.save(self.path, _tree(step), overwrite=True)
            saved.append(step)
        return real(self, wanted, leaves)

    monkeypatch.setattr(Opened, "load", load)
    return times, saved


@pytest.mark.parametrize("like", [False, True], ids=["as saved", "into a template"])
def test_a_restore_of_a_checkpoint_replaced_while_read_reads_the_new_one(tmp_path, replaced_on_read, like):
    times, saved = replaced_on_read
    path = jaxckpt.save(tmp_path / "c", _tree(1))
    times[0] = 2  # replaced under the first two reads: the third reads the checkpoint saved last
    restored = jaxckpt.restore(path, **({"like": _tree(0)} if like else {}))
    assert saved == [100, 101] and times[0] == 0
    assert restored["step"] == 101
    np.testing.assert_array_equal(restored["w"], np.full((64, 64), 101, np.float32))
    np.testing.assert_array_equal(restored["small"]["b"], np.full(3, 101, np.float32))


def test_a_checkpoint_replaced_under_every_read_is_an_error_that_says_so(tmp_path, replaced_on_read):
    times, saved = replaced_on_read
    path = jaxckpt.save(tmp_path / "c", _tree(1))
    times[0] = 100
    with pytest.raises(jaxckpt.CheckpointReplacedError, match="replaced by another save") as raised:
        jaxckpt.restore(path)
    assert isinstance(raised.value, jaxckpt.CheckpointNotFoundError)  # what it was before it had a class
    assert len(saved) == 4  # read four times, then the error
    times[0] = 0  # the saves stop
    assert jaxckpt.restore(path)["step"] == saved[-1]  # nothing was left half done


@pytest.fixture
def trainer_saves_on_read(monkeypatch, tmp_path):
    """A trainer's manager keeping one checkpoint; each of the next ``times[0]`` loads first lets it
    save the next step, which deletes the checkpoint being read (as another process would)."""
    from jaxckpt.reading.reader import Opened

    ckpt = jaxckpt.Checkpoint(tree=_tree(1))
    trainer = jaxckpt.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=1)
    trainer.save(1)
    trainer.wait_until_finished()
    real = Opened.load
    times = [0]

    def load(self, wanted, leaves=None):
        if times[0] > 0:
            times[0] -= 1
            step = trainer.latest_step() + 1
            ckpt.tree = _tree(step)
            trainer.save(step)
            trainer.wait_until_finished()
        return real(self, wanted, leaves)

    monkeypatch.setattr(Opened, "load", load)
    yield trainer, times
    trainer.close()


def test_the_latest_of_a_directory_deleted_while_read_is_read_again(tmp_path, trainer_saves_on_read):
    """``restore(directory)`` means its latest checkpoint: where the trainer's retention deletes the one
    being read, the restore reads the latest again (an evaluator following a trainer that keeps one)."""
    trainer, times = trainer_saves_on_read
    times[0] = 2
    restored = jaxckpt.restore(tmp_path / "run")
    assert times[0] == 0 and trainer.all_steps() == [3]
    assert restored["tree"]["step"] == 3
    np.testing.assert_array_equal(restored["tree"]["w"], np.full((64, 64), 3, np.float32))


def test_a_directory_whose_latest_is_deleted_under_every_read_is_an_error(tmp_path, trainer_saves_on_read):
    _, times = trainer_saves_on_read
    times[0] = 100
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="deleted while it was being read"):
        jaxckpt.restore(tmp_path / "run")
    assert times[0] == 96  # four reads, each of the latest then


@pytest.mark.parametrize("spelled", [str, lambda p: p + "/", lambda p: p.replace("/ckpt-", "/./ckpt-")])
def test_a_checkpoint_named_by_its_path_deleted_while_read_is_an_error(tmp_path, trainer_saves_on_read, spelled):
    """A checkpoint asked for by its own path (however written) is that one: deleted under the
    read, it is an error, not the directory's next checkpoint."""
    trainer, times = trainer_saves_on_read
    times[0] = 1
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="deleted while it was being read"):
        jaxckpt.restore(spelled(str(trainer.latest_checkpoint)))
    assert trainer.all_steps() == [2]


def test_an_evaluator_s_latest_deleted_while_read_is_read_again(tmp_path, trainer_saves_on_read):
    """A read-only manager's ``restore()`` (its latest) reads the state file and the latest again
    where the trainer's retention deletes the one being read; ``restore(step)`` of that step is an error."""
    trainer, times = trainer_saves_on_read
    evaluated = jaxckpt.Checkpoint(tree=_tree(0))
    evaluator = jaxckpt.CheckpointManager(evaluated, tmp_path / "run", read_only=True)
    times[0] = 2
    evaluator.restore().assert_consumed()
    assert evaluated.tree["step"] == 3 and evaluator.latest_step() == 3 == trainer.latest_step()
    np.testing.assert_array_equal(evaluated.tree["w"], np.full((64, 64), 3, np.float32))
    times[0] = 1
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="deleted while it was being read"):
        evaluator.restore(3)
    assert evaluated.tree["step"] == 3  # the failed restore changed nothing
    evaluator.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
