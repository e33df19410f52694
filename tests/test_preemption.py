"""Preemption: SIGTERM becomes a save at the next step boundary, then a clean exit.

In-process tests raise the signal in this process (handlers run in the main thread, where pytest
runs tests); the end-to-end tests send SIGTERM to tests/preemption_worker.py, one process or two on
jax.distributed, once it reports that it is training.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

import jaxckpt

WORKER = Path(__file__).with_name("preemption_worker.py")

main_thread_only = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signal handlers need the main thread"
)


@pytest.fixture
def sigterm_restored():
    """Whatever a test does, SIGTERM's handler is as it was afterwards (a leak would break pytest's exit)."""
    before = signal.getsignal(signal.SIGTERM)
    yield before
    signal.signal(signal.SIGTERM, before)


@main_thread_only
def test_handler_takes_sigterm_and_puts_the_previous_one_back(sigterm_restored):
    calls = []
    signal.signal(signal.SIGTERM, lambda *a: calls.append(a))
    previous = signal.getsignal(signal.SIGTERM)
    with jaxckpt.PreemptionHandler() as preemption:
        assert signal.getsignal(signal.SIGTERM) != previous
        assert not preemption.reached_preemption(1) and not preemption.notified
        signal.raise_signal(signal.SIGTERM)  # the process lives on: only a flag is set
        assert preemption.notified and preemption.reached_preemption(2) and preemption.reached_preemption(3)
    assert signal.getsignal(signal.SIGTERM) is previous
    assert calls == []  # the previous handler is not called: the signal now means "save and exit"
    preemption.close()  # idempotent
    assert signal.getsignal(signal.SIGTERM) is previous


@main_thread_only
def test_close_leaves_a_handler_installed_after_ours_alone(sigterm_restored):
    preemption = jaxckpt.PreemptionHandler()
    later = signal.getsignal(signal.SIGINT)  # any Python handler, installed after ours
    signal.signal(signal.SIGTERM, later)
    preemption.close()
    assert signal.getsignal(signal.SIGTERM) is later


def in_another_thread(fn) -> list[BaseException]:
    """Run ``fn`` in a new thread; the ValueErrors it raised."""
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return errors


def test_handler_refuses_other_threads():
    errors = in_another_thread(jaxckpt.PreemptionHandler)
    assert len(errors) == 1 and "main thread" in str(errors[0])


def make_ckpt(step=0):
    return jaxckpt.Checkpoint(step=step, w=np.full(3, step, np.float32))


@main_thread_only
def test_manager_saves_the_step_and_exits_on_sigterm(tmp_path, sigterm_restored):
    ckpt = make_ckpt()
    manager = jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step", save_on_preemption=True)
    manager.save()  # ckpt-1 at step 0
    for step in range(1, 4):
        ckpt.step, ckpt.w = step, np.full(3, step, np.float32)
        assert not manager.reached_preemption()
        assert manager.save_if_preempted() is None
    signal.raise_signal(signal.SIGTERM)
    assert manager.reached_preemption() and manager.reached_preemption(7)
    with pytest.raises(SystemExit) as exit_info:
        manager.save_if_preempted()
    assert exit_info.value.code == 0
    assert signal.getsignal(signal.SIGTERM) is sigterm_restored  # closed: the handler is put back
    assert not (tmp_path / "checkpoint.lock").exists()
    latest = jaxckpt.latest_checkpoint(tmp_path)
    assert latest == str(tmp_path / "ckpt-2")
    restored = make_ckpt()
    restored.restore(latest).assert_consumed()
    assert restored.step == 3 and restored.w.tolist() == [3, 3, 3]


@main_thread_only
def test_no_second_save_of_a_step_already_saved(tmp_path, sigterm_restored):
    ckpt = make_ckpt(5)
    manager = jaxckpt.CheckpointManager(ckpt, tmp_path, step_counter="step", save_on_preemption=True)
    manager.save()
    signal.raise_signal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        manager.save_if_preempted(exit_code=0)
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1"]


def test_reached_preemption_needs_the_option_and_a_step(tmp_path, sigterm_restored):
    with jaxckpt.CheckpointManager(make_ckpt(), tmp_path / "a", step_counter="step") as manager:
        with pytest.raises(ValueError, match="save_on_preemption=True"):
            manager.reached_preemption(1)
    if threading.current_thread() is threading.main_thread():
        with jaxckpt.CheckpointManager(make_ckpt(), tmp_path / "b", save_on_preemption=True) as manager:
            with pytest.raises(ValueError, match="step_counter"):
                manager.reached_preemption()
            assert manager.reached_preemption(4) is False


def _start(directory: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, str(WORKER), str(directory), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen) -> tuple[int, list[str], str]:
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out.splitlines(), err


def _check_saved(directory: Path, step: int) -> None:
    latest = jaxckpt.latest_checkpoint(directory)
    assert latest is not None, "no checkpoint was recorded"
    saved = jaxckpt.restore(latest)
    assert saved["step"] == step and saved["w"].tolist() == [step] * 4


def _running(proc: subprocess.Popen) -> int:
    """Wait until the worker says it is training; the step it resumed from."""
    line = proc.stdout.readline()
    if not line.startswith("running"):
        proc.kill()
        pytest.fail(f"the worker did not start: {line!r}\n{proc.communicate()[1][-3000:]}")
    return int(line.split()[2])


def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tmp_path):
    directory = tmp_path / "ckpts"
    resumed_at = 0
    for _ in range(2):  # the second job resumes from the first one's preemption checkpoint
        proc = _start(directory)
        assert _running(proc) == resumed_at
        proc.send_signal(signal.SIGTERM)
        code, lines, err = _finish(proc)
        assert code == 0, f"exit {code}: {lines}\n{err[-3000:]}"
        step = int(lines[-1].split()[1])  # "preempted STEP"
        assert step > resumed_at
        _check_saved(directory, step)
        resumed_at = step


def test_two_processes_agree_on_the_step_to_save(tmp_path):
    """SIGTERM to one process of two: JAX's preemption sync tells both, and both save the same step."""
    directory = tmp_path / "ckpts"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_start(directory, str(i), "2", str(port)) for i in range(2)]
    try:
        for proc in procs:
            _running(proc)
        procs[1].send_signal(signal.SIGTERM)  # not the primary: the notice must reach process 0 too
    finally:
        results = [_finish(proc) for proc in procs]
    steps = set()
    for i, (code, lines, err) in enumerate(results):
        assert code == 0, f"process {i} exited {code}: {lines}\n{err[-3000:]}"
        steps.add(int(lines[-1].split()[1]))
    assert len(steps) == 1, f"the processes saved different steps: {steps}"
    _check_saved(directory, steps.pop())


@main_thread_only
def test_a_manager_that_fails_to_start_leaves_sigterm_alone(tmp_path, sigterm_restored):
    (tmp_path / "checkpoint").write_text("not a state file")
    with pytest.raises(jaxckpt.CheckpointFormatError):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path, save_on_preemption=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(jaxckpt.CheckpointExistsError):
        jaxckpt.CheckpointManager(make_ckpt(), tmp_path / "file", save_on_preemption=True)
    assert signal.getsignal(signal.SIGTERM) is sigterm_restored
    assert not (tmp_path / "checkpoint.lock").exists()


def test_a_manager_in_another_thread_refuses_save_on_preemption(tmp_path):
    errors = in_another_thread(lambda: jaxckpt.CheckpointManager(make_ckpt(), tmp_path, save_on_preemption=True))
    assert len(errors) == 1 and "main thread" in str(errors[0])
    assert not (tmp_path / "checkpoint.lock").exists()  # the refused manager released its lock


ORBAX_WORKER = Path(__file__).with_name("orbax_preemption_worker.py")


def _orbax_loop(directory: Path, last_step: int, signal_step: int = -1) -> tuple[list[int], list[str]]:
    """Run Orbax's preemption loop (tests/orbax_preemption_worker.py) to ``last_step``; with
    ``signal_step``, send it SIGTERM during that step. The steps of its "resumed" line and its last line."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ORBAX_WORKER.parent.parent), env.get("PYTHONPATH", "")])  # this checkout
    cmd = [sys.executable, str(ORBAX_WORKER), str(directory), str(last_step), str(signal_step)]
    # stdout is read through its buffered file object only: communicate() reads the pipe itself, and
    # would miss lines that a readline() had buffered already. stderr goes to a file (no pipe to fill).
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
        try:
            resumed = proc.stdout.readline().split()
            if resumed[:1] != ["resumed"]:
                proc.kill()
                proc.wait()
                errors.seek(0)
                raise AssertionError(f"the worker did not start: {resumed}\n{errors.read()[-3000:]}")
            if signal_step >= 0:
                line = proc.stdout.readline()
                assert line.split() == ["in", "step", str(signal_step)], line
                proc.send_signal(signal.SIGTERM)  # during the step: before its save(step)
            proc.stdin.write("go\n")
            proc.stdin.close()
            out = proc.stdout.read()
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        errors.seek(0)
        err = errors.read()
    assert proc.returncode == 0, f"exit {proc.returncode}: {out}\n{err[-3000:]}"
    return [int(s) for s in resumed[1:]], out.splitlines()


def test_orbax_preemption_loop_saves_the_step_the_notice_came_in(tmp_path):
    """Orbax's guide: ``mngr.save(step)`` every step, ``break`` once ``mngr.reached_preemption(step)``.
    With save_interval_steps=4, SIGTERM during step 6 must make save(6) save, so that the restart
    resumes from step 6 (not 4), and the next regular save keeps to the interval."""
    directory = tmp_path / "ckpts"
    resumed, lines = _orbax_loop(directory, last_step=20, signal_step=6)
    assert resumed == [-1] and lines[-1] == "preempted 6"
    resumed, lines = _orbax_loop(directory, last_step=8)  # the restart
    assert resumed == [6, 0, 4, 6], f"resumed from {resumed[0]}, kept steps {resumed[1:]}"
    assert lines[-1] == "done 8"
    restored = jaxckpt.restore(jaxckpt.latest_checkpoint(directory))
    assert restored["w"].tolist() == [9] * 4  # steps 0..8, each trained once: no step lost or repeated


@main_thread_only
@pytest.mark.parametrize("tiers", [False, True], ids=["one-tier", "two-tier"])
def test_save_by_step_saves_at_a_preemption_notice_as_should_save_says(tmp_path, sigterm_restored, tiers):
    ckpt = make_ckpt()
    local = {"local_directory": tmp_path / "local"} if tiers else {}
    with jaxckpt.CheckpointManager(
        ckpt, tmp_path / "ckpts", save_interval_steps=4, save_on_preemption=True, async_save=False, **local
    ) as manager:
        assert [s for s in range(6) if manager.save(step=s) is not None] == [0, 4]
        signal.raise_signal(signal.SIGTERM)
        assert manager.should_save(6) and manager.reached_preemption(6)
        assert manager.save(step=6) == str(tmp_path / ("local" if tiers else "ckpts") / "ckpt-6")
        # Not past the latest step: neither should_save nor save, notice or not.
        assert not manager.should_save(6) and manager.save(step=6) is None
        assert manager.all_steps() == [0, 4, 6]
