"""SIGKILL at any instant of a training job that saves through a CheckpointManager loses nothing.

tests/crash_worker.py saves in a loop (asynchronously; one leaf in 20 large and sharded, the rest
packed). It is killed at random instants, and at exact instants by hooks inside it: mid-deletion by
retention and at each point of the state file's rewrite. After every kill:

- every checkpoint the state file lists restores whole, every leaf holding the values of the step
  the state file records for it (leaves encode their step, so a mix of steps is caught);
- nothing is lost: the latest step never goes back, and a checkpoint leaves the list only when
  ``max_to_keep`` newer ones are listed;
- the next job's manager removes every leftover (staging folders, half-deleted checkpoints, temp
  state files, a dead process's lock) before it saves, and continues from the latest step.

Synchronization is by the worker's stdout lines. The random delay before a kill only picks the
instant. Counts are printed (``pytest -s``); ``JAXCKPT_TEST_SEED`` replays a run's choices.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from crash_worker import frozen, layout, leaf_base, leaf_value, step_of

import jaxckpt
from jaxckpt.storage import locations, statefile
from jaxckpt.storage.statefile import CheckpointInfo

WORKER = Path(__file__).with_name("crash_worker.py")
HOOKS = ["retention", "state-mid", "state-before-rename", "state-after-rename"]


def _seed() -> int:
    return int(os.environ.get("JAXCKPT_TEST_SEED", random.randrange(2**32)))


@dataclasses.dataclass
class Run:
    """One run of the worker: how it ended and what it printed."""

    returncode: int
    lines: list[str]
    stderr: str
    times: dict[str, float]  # seconds after "ready" at which a line was read (read line by line only)

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL

    def first(self, word: str) -> list[str] | None:
        return next((line.split(" ", 2)[1:] for line in self.lines if line.split(" ", 1)[0] == word), None)


class Job:
    """A directory that worker runs save into, one after another, and what the last check found there."""

    def __init__(
        self,
        directory: Path | str,
        *,
        leaves: int,
        mbytes: float,
        keep: int,
        seed: int,
        frozen: bool = False,
        logs: Path | None = None,
    ) -> None:
        self.directory, self.leaves, self.mbytes, self.keep = directory, leaves, mbytes, keep
        self.logs = logs or Path(directory).parent  # the workers' stderr
        self.bucket = isinstance(directory, str)  # s3://...: its checkpoints share data by reference
        self.frozen = frozen  # frozen leaves (see crash_worker.frozen) keep step 0's values
        self.bases = [leaf_base(i, shape) for i, shape in enumerate(layout(leaves, mbytes))]
        self.listed: list[CheckpointInfo] = []  # what the state file listed at the last check
        self.rng = random.Random(seed)
        self.seed = seed
        self.runs = self.kills = self.verified = 0
        self.phases: collections.Counter[str] = collections.Counter()  # the last line before each kill

    def start(self, steps: int, hook: str = "none") -> subprocess.Popen:
        args = [sys.executable, str(WORKER), str(self.directory), "--leaves", str(self.leaves)]
        args += ["--mbytes", str(self.mbytes), "--keep", str(self.keep), "--steps", str(steps)]
        args += ["--hook", hook, "--hook-at", "1", "--seed", str(self.rng.randrange(2**32))]
        args += ["--frozen"] if self.frozen else []
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        stderr = open(self.logs / f"stderr-{self.runs}.txt", "w+")  # closed at the end of run()
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1, env=env)
        proc.stderr_file = stderr
        # A watchdog, so that a hung worker fails the test instead of hanging it.
        watchdog = threading.Timer(300, proc.kill)
        watchdog.daemon = True
        watchdog.start()
        proc.watchdog = watchdog
        return proc

    def run(self, steps: int, *, hook: str = "none", kill_after: tuple[str, float] | None = None) -> Run:
        """Run the worker; with ``kill_after=(line, seconds)``, SIGKILL it that long after it printed
        ``line`` ("ready" or "resumed"), if it is still running."""
        proc = self.start(steps, hook)
        self.runs += 1
        try:
            first = proc.stdout.readline()
            assert first == "ready\n", f"the worker did not start: {first!r}\n{self._stderr(proc)}"
            ready = time.monotonic()
            lines, times = [first.strip()], {}
            if kill_after is None:  # read line by line, timing each (to pick kill instants later)
                for line in proc.stdout:
                    lines.append(line.strip())
                    times.setdefault(lines[-1].split(" ", 1)[0], time.monotonic() - ready)
                proc.wait()
            else:
                anchor, delay = kill_after
                while lines[-1].split(" ", 1)[0] != anchor:
                    line = proc.stdout.readline()
                    assert line, f"the worker ended before {anchor!r}:\n{self._stderr(proc)}"
                    lines.append(line.strip())
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
                out, _ = proc.communicate()
                lines += out.splitlines()
            return Run(proc.returncode, lines, self._stderr(proc), times)
        finally:
            proc.watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr_file.close()

    @staticmethod
    def _stderr(proc: subprocess.Popen) -> str:
        proc.stderr_file.seek(0)
        return proc.stderr_file.read()[-4000:]

    def check(self, run: Run, what: str) -> None:
        """Everything the module docstring promises, after ``run``; then remember what is listed."""
        context = f"{what} (seed {self.seed}, run {self.runs}, exit {run.returncode})"
        if run.returncode not in (0, -signal.SIGKILL):
            pytest.fail(f"{context}: the worker failed\n{run.stderr}")
        if run.killed:
            self.kills += 1
            self.phases[run.lines[-1].split(" ", 1)[0]] += 1
        # The manager that started removed every leftover and resumed from the latest checkpoint.
        resumed = run.first("resumed")
        if resumed is not None:
            step, listing = int(resumed[0]), json.loads(resumed[1])
            expected = {os.path.basename(c.path) for c in self.listed} | {"checkpoint", "checkpoint.lock"}
            if self.bucket:  # no lock; the data of dropped checkpoints that listed ones use stays
                expected = expected - {"checkpoint.lock"} | {u for c in self.listed for u in c.uses}
            if self.bucket:
                # A bucket save marks nothing unlisted: one published just before the kill, which the state
                # file did not list yet, is complete and adopted (numbered after the listed ones), with the
                # data it refers to.
                last = max((int(os.path.basename(c.path).split("-")[1]) for c in self.listed), default=0)
                adopted = {n for n in set(listing) - expected if int(n.split("-")[1]) > last}
                later = statefile.read_state(str(self.directory)) or []
                held = {u for c in [*self.listed, *later] for u in c.uses}  # may be there, or not yet
                assert {u for c in self.listed for u in c.uses} <= set(listing), f"{context}: held data lost"
                expected = (expected | adopted | held) & set(listing) | (expected - held)
            assert set(listing) == expected, f"{context}: leftovers after the manager started: {listing}"
            assert self.bucket or step == (self.listed[-1].step if self.listed else 0), context
        listed = statefile.read_state(str(self.directory)) or []
        for info in listed:
            self._check_whole(info, context)
        self._check_nothing_lost(listed, context)
        self.listed = listed

    def _check_whole(self, info: CheckpointInfo, context: str) -> None:
        tree = jaxckpt.restore(info.path)
        assert tree["step"] == info.step, f"{context}: {info.path} holds step {tree['step']}, listed as {info.step}"
        params = tree["params"]
        assert sorted(params) == sorted(f"l{i}" for i in range(len(self.bases))), context
        for i, base in enumerate(self.bases):
            value = params[f"l{i}"]
            if not np.array_equal(value, leaf_value(base, 0 if self.frozen and frozen(i) else info.step)):
                pytest.fail(
                    f"{context}: {info.path} is listed at step {info.step}, but leaf l{i} holds the values of "
                    f"step {step_of(base, value)}"
                )
        self.verified += 1

    def _check_nothing_lost(self, listed: list[CheckpointInfo], context: str) -> None:
        steps = [c.step for c in listed]
        assert steps == sorted(steps), f"{context}: listed out of order: {steps}"
        if not self.listed:
            return
        assert listed, f"{context}: the state file lists nothing any more"
        assert steps[-1] >= self.listed[-1].step, f"{context}: the latest step went back from {self.listed[-1].step}"
        kept = {c.path for c in listed}
        for gone in (c for c in self.listed if c.path not in kept):
            newer = [c for c in listed if c.step > gone.step]
            assert len(newer) >= self.keep, f"{context}: {gone.path} left the list with only {len(newer)} newer"

    def finish(self) -> None:
        """A last run to the end: the next job continues; afterwards only the kept checkpoints remain."""
        run = self.run(steps=2)
        assert run.returncode == 0 and run.lines[-1] == "done", run.stderr
        self.check(run, "final run")
        names = {os.path.basename(c.path) for c in self.listed}
        held = {u for c in self.listed for u in c.uses} - names
        assert locations.children(locations.location(str(self.directory))) == sorted(names | held | {"checkpoint"})
        assert len(names) == self.keep
        if self.frozen and self.bucket:  # the later ones refer to the frozen leaves' data
            assert all(c.uses for c in self.listed[1:]), [c.uses for c in self.listed]
        elif self.frozen:  # the kept checkpoints share the frozen leaves' files: the kills hit saves that link
            for i in (i for i in range(len(self.bases)) if frozen(i)):
                files = [self._files(info, f"params/l{i}") for info in self.listed]
                assert all(f == files[0] and f for f in files), f"leaf l{i} is not shared: {files}"

    @staticmethod
    def _files(info: CheckpointInfo, key: str) -> dict[str, int]:
        """The shard files of an array leaf: path in its folder -> inode."""
        index = json.loads(Path(info.path, "index.json").read_text())
        folder = Path(info.path, "data", index["leaves"][key]["at"]["array"], "c")
        return {str(p.relative_to(folder)): p.stat().st_ino for p in folder.rglob("*") if p.is_file()}


def random_kills(
    tmp_path: Path, *, trials: int, leaves: int, mbytes: float, frozen: bool = False, directory: str | None = None
) -> Job:
    where = directory or tmp_path / "ckpts"
    job = Job(where, leaves=leaves, mbytes=mbytes, keep=3, seed=_seed(), frozen=frozen, logs=tmp_path)
    first = job.run(steps=3)
    job.check(first, "first run")
    assert first.returncode == 0, first.stderr
    # One kill in four lands in the manager's start-up (leftover removal) or restore, the others in
    # the first few saves. The first run restored nothing, so a restore takes longer than its start-up.
    step_time = (first.times["done"] - first.times["resumed"]) / 3
    for trial in range(trials):
        anchor = "ready" if trial % 4 == 0 else "resumed"
        delay = job.rng.uniform(0, 2 * first.times["resumed"] if anchor == "ready" else 4 * step_time)
        run = job.run(steps=100, kill_after=(anchor, delay))
        job.check(run, f"random kill {trial}, {delay:.2f} s after {anchor!r}")
    job.finish()
    print(
        f"\ncrash: {job.runs} runs of {leaves} leaves / {mbytes:g} MB, {job.kills} killed at random instants, "
        f"{job.verified} listed checkpoints restored whole, nothing lost (seed {job.seed}); killed after: "
        + ", ".join(f"{n} x {phase!r}" for phase, n in sorted(job.phases.items()))
    )
    assert job.kills >= trials // 2, "most kills should land before the worker finishes"
    return job


def exact_kills(
    tmp_path: Path, *, rounds: int, frozen: bool = False, directory: str | None = None, hooks: list[str] | None = None
) -> Job:
    where = directory or tmp_path / "ckpts"
    job = Job(where, leaves=40, mbytes=4, keep=2, seed=_seed(), frozen=frozen, logs=tmp_path)
    job.check(job.run(steps=3), "first run")  # so that the next save's retention deletes one
    if hooks is None:
        hooks = ["link", *HOOKS] if frozen else HOOKS
    for _ in range(rounds):
        for hook in hooks:
            run = job.run(steps=3, hook=hook)
            assert run.killed, f"the {hook} hook did not fire:\n{run.stderr}"
            job.check(run, f"kill at {hook}")
    job.finish()
    print(f"\ncrash: {job.kills} kills at exact instants ({', '.join(hooks)}), nothing lost (seed {job.seed})")
    return job


def test_random_kills_while_saving(tmp_path):
    random_kills(tmp_path, trials=4, leaves=200, mbytes=50)


def test_kills_during_retention_and_state_file_rewrite(tmp_path):
    exact_kills(tmp_path, rounds=1)


def test_random_kills_while_saving_and_deleting_shared_data(tmp_path):
    """Incremental saves: frozen leaves hard-linked from the previous checkpoint at every save, and
    retention deleting the checkpoints that first wrote them."""
    random_kills(tmp_path, trials=4, leaves=200, mbytes=50, frozen=True)


def test_kills_while_linking_and_while_deleting_shared_data(tmp_path):
    exact_kills(tmp_path, rounds=1, frozen=True)


@pytest.mark.stress
def test_random_kills_while_saving_stress(tmp_path, stress_scale):
    random_kills(tmp_path, trials=24 * stress_scale, leaves=400, mbytes=200)


@pytest.mark.stress
def test_kills_during_retention_and_state_file_rewrite_stress(tmp_path, stress_scale):
    exact_kills(tmp_path, rounds=4 * stress_scale)


@pytest.mark.stress
def test_kills_while_saving_and_deleting_shared_data_stress(tmp_path, stress_scale):
    random_kills(tmp_path, trials=24 * stress_scale, leaves=400, mbytes=200, frozen=True)


@pytest.mark.stress
def test_kills_while_linking_and_while_deleting_shared_data_stress(tmp_path, stress_scale):
    exact_kills(tmp_path, rounds=4 * stress_scale, frozen=True)


def test_the_check_catches_a_checkpoint_of_mixed_steps(tmp_path):
    """The checks above are not vacuous: a listed checkpoint with one leaf from another step fails them."""
    job = Job(tmp_path / "ckpts", leaves=8, mbytes=0.1, keep=2, seed=0)
    params = {f"l{i}": leaf_value(base, 1 if i == 3 else 2) for i, base in enumerate(job.bases)}
    with jaxckpt.CheckpointManager(jaxckpt.Checkpoint(step=2, params=params), job.directory, step_counter="step") as m:
        m.save()
    with pytest.raises(pytest.fail.Exception, match="leaf l3 holds the values of step 1"):
        job.check(Run(0, [], "", {}), "a crafted checkpoint")


def test_random_kills_on_a_bucket_while_saving_and_deleting_shared_data(s3, tmp_path):
    """Incremental saves on a bucket (moto): frozen leaves stored by reference to the checkpoint that
    holds them, and retention deleting the checkpoints whose data kept ones use."""
    random_kills(tmp_path, trials=4, leaves=40, mbytes=8, frozen=True, directory=s3)


def test_kills_on_a_bucket_while_deleting_shared_data(s3, tmp_path):
    exact_kills(tmp_path, rounds=6, frozen=True, directory=s3, hooks=["bucket-delete"])
