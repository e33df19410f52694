"""Buckets that misbehave: transient faults are retried, an endpoint that fails or never answers is a
clear StorageError within the deadline (``JAXCKPT_BUCKET_TIMEOUT``), a bad bucket name is refused
before any request, and nothing from TensorStore's logging reaches stderr.

Every test runs over :data:`SERVERS` (one entry per bucket server the tests start): a fault-injecting
:class:`bucket_proxy.BucketProxy` goes in front of the server, and the client is pointed at the proxy
through the environment the server's users set. Calls that could hang if a deadline regressed run in
a subprocess whose timeout is the hang guard.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.parse
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from bucket_proxy import BucketProxy
from conftest import BUCKET

import jaxckpt
from jaxckpt.storage import kvstore, locations

# Generous: a subprocess imports jax (seconds) and then fails within its short deadline; this only
# turns a hang into a failure.
HANG_GUARD_S = 120


@dataclasses.dataclass(frozen=True)
class Server:
    """A bucket server the tests started: its scheme and bucket, the endpoint it listens on, the
    environment that points a fresh process's jaxckpt (TensorStore) at a given endpoint with working
    credentials (None: unset), and the proxy this process reaches it through (None: a test's own)."""

    scheme: str
    bucket: str
    upstream: str
    env: Callable[[str], dict[str, str | None]]
    endpoint_variable: str  # named in the error when the endpoint fails
    session_proxy: BucketProxy | None = None


def _s3(request: pytest.FixtureRequest) -> Server:
    env = request.getfixturevalue("s3_server")
    return Server("s3", BUCKET, env["AWS_ENDPOINT_URL"], lambda endpoint: {**env, "AWS_ENDPOINT_URL": endpoint},
                  "AWS_ENDPOINT_URL")  # fmt: skip


def _gs(request: pytest.FixtureRequest) -> Server:
    """TensorStore keeps one GCS endpoint per process: this process reaches the emulator through the
    session's proxy (conftest's ``gcs_proxy``) alone. A fresh process is given only
    ``STORAGE_EMULATOR_HOST``, as a user would; jaxckpt sets TensorStore's endpoint and placeholder
    token from it (jaxckpt.storage.locations), so the ones this process has are unset."""
    proxy = request.getfixturevalue("gcs_proxy")
    unset: dict[str, str | None] = {"TENSORSTORE_GCS_HTTP_URL": None, "GOOGLE_AUTH_TOKEN_FOR_TESTING": None}
    return Server("gs", BUCKET, proxy.upstream, lambda endpoint: {**unset, "STORAGE_EMULATOR_HOST": endpoint},
                  "STORAGE_EMULATOR_HOST", proxy)  # fmt: skip


# One entry per bucket server the tests start.
SERVERS: dict[str, Callable[[pytest.FixtureRequest], Server]] = {"s3": _s3, "gs": _gs}


@pytest.fixture(params=sorted(SERVERS))
def server(request: pytest.FixtureRequest) -> Server:
    return SERVERS[request.param](request)


@pytest.fixture
def proxy(server: Server) -> Iterator[BucketProxy]:
    """A proxy in front of the server, of this test alone: for gs://, the session's (cleared)."""
    if server.session_proxy is not None:
        yield server.session_proxy
        return
    with BucketProxy(server.upstream) as p:
        yield p


@pytest.fixture
def own_proxy(server: Server) -> Iterator[BucketProxy]:
    """A proxy in front of the server of this test alone, for a subprocess (any endpoint will do there)."""
    with BucketProxy(server.upstream) as p:
        yield p


@pytest.fixture
def through_proxy(server: Server, proxy: BucketProxy, monkeypatch: pytest.MonkeyPatch, request) -> str:
    """The URL prefix of a fresh folder in the bucket, reached in this process through ``proxy``."""
    if server.session_proxy is None:  # gs://: the session's environment already points at its proxy
        for k, v in server.env(proxy.endpoint).items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)
    monkeypatch.setattr(kvstore, "_MADE", None)  # a context of its own, with this test's settings
    return f"{server.scheme}://{server.bucket}/{request.node.name.replace('[', '-').rstrip(']')}"


def _environ(*envs: dict[str, str | None]) -> dict[str, str]:
    """``os.environ`` updated with ``envs`` in turn, for a fresh process (None: unset)."""
    merged: dict[str, str | None] = dict(os.environ)
    for env in envs:
        merged.update(env)
    return {k: v for k, v in merged.items() if v is not None}


def every(k: int, fault: int | str) -> Callable[[str, str], int | str | None]:
    """A fault on every k-th request (deterministic; a retried request is a new request)."""
    counter = itertools.count(1)
    return lambda method, path: fault if next(counter) % k == 0 else None


def _tree() -> dict[str, object]:
    rng = np.random.default_rng(26)
    return {
        "big": rng.standard_normal((300, 500)).astype(np.float32),  # an array of its own
        "small": rng.integers(0, 1 << 30, 100, dtype=np.int64),  # packed
        "half": rng.standard_normal(7).astype(np.float16),
        "step": 12,
    }


def _assert_same(restored: dict[str, object], tree: dict[str, object]) -> None:
    assert restored.keys() == tree.keys()
    for key, value in tree.items():
        if isinstance(value, np.ndarray):
            got = np.asarray(restored[key])
            assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), key
        else:
            assert restored[key] == value


# --- (a) transient faults on a share of requests: retried, checkpoints whole -------------------


@pytest.mark.parametrize("fault", [503, 429, "reset"])
def test_transient_faults_are_retried_and_checkpoints_stay_whole(through_proxy, proxy, fault):
    tree = _tree()
    proxy.faults = every(3, fault)  # a third of all requests, during save and restore
    path = jaxckpt.save(f"{through_proxy}/c", tree)
    _assert_same(jaxckpt.restore(path), tree)
    assert len(proxy.faulted) >= 3, proxy.requests  # the faults did happen
    proxy.faults = None
    proxy.clear()
    _assert_same(jaxckpt.restore(path), tree)  # what was stored is whole, read without faults too
    assert locations.children(locations.location(through_proxy)) == ["c"]  # a listing works too


def test_a_manager_saves_and_retains_through_faults(through_proxy, proxy):
    ckpt = jaxckpt.Checkpoint(step=0, w=np.zeros(1000, np.float32))
    proxy.faults = every(5, 503)
    with jaxckpt.CheckpointManager(ckpt, f"{through_proxy}/run", max_to_keep=2, step_counter="step") as manager:
        for step in range(1, 4):
            ckpt.step, ckpt.w = step, np.full(1000, step, np.float32)
            manager.save()
        assert [c.rsplit("/", 1)[-1] for c in manager.checkpoints] == ["ckpt-2", "ckpt-3"]
    assert proxy.faulted
    proxy.faults = None
    assert locations.children(locations.location(f"{through_proxy}/run")) == ["checkpoint", "ckpt-2", "ckpt-3"]
    assert jaxckpt.restore(f"{through_proxy}/run/ckpt-3")["w"].tolist() == [3.0] * 1000


@pytest.mark.parametrize("failing", ["index.json", "/data/"])
def test_a_save_whose_writes_keep_failing_publishes_nothing(through_proxy, proxy, monkeypatch, failing):
    """Only index.json commits a save: one that fails writing its data or its index leaves no
    checkpoint, and the next save there takes the place."""
    monkeypatch.setenv("JAXCKPT_BUCKET_TIMEOUT", "5")  # read when the test's context is made, below
    path = f"{through_proxy}/c"
    # Unquoted: a gs:// upload names its object in the query (name=run%2Fc%2Fdata%2F...).
    proxy.faults = lambda method, p: 503 if method in ("PUT", "POST") and failing in urllib.parse.unquote(p) else None
    with pytest.raises(jaxckpt.StorageError, match=r"503"):
        jaxckpt.save(path, _tree())
    proxy.faults = None
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(path)
    tree = _tree()
    _assert_same(jaxckpt.restore(jaxckpt.save(path, tree)), tree)


# --- (b), (c) an endpoint that fails every request, refuses, or never answers -------------------

# Runs save, restore and ls (each a step) and prints, per step, the exception's class and message.
_STEPS = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import numpy as np
    import jaxckpt
    from jaxckpt.tools import cli as _cli


    def ls(prefix):  # the command line prints its error: returned as the exception's message
        with contextlib.redirect_stderr(io.StringIO()) as err:
            if _cli.main(["ls", prefix]) != 0:
                raise jaxckpt.StorageError(err.getvalue())


    prefix = sys.argv[1]
    steps = {
        "save": lambda: jaxckpt.save(prefix + "/c", {"w": np.arange(1000.0)}),
        "restore": lambda: jaxckpt.restore(prefix + "/old"),
        "ls": lambda: ls(prefix),
    }
    out = {}
    for name in sys.argv[2:]:
        try:
            steps[name]()
            out[name] = None
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    print(json.dumps(out))
    """
)


def _run_steps(env: dict[str, str | None], prefix: str, *steps: str) -> tuple[dict[str, list[str] | None], str]:
    """Run ``steps`` of :data:`_STEPS` in a fresh process; their outcomes, and its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", _STEPS, prefix, *steps],
        capture_output=True,
        text=True,
        env=_environ({"JAX_PLATFORMS": "cpu"}, env),
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _refused_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_clear(outcome: list[str] | None, *needles: str) -> None:
    assert outcome is not None, "the call succeeded"
    kind, message = outcome
    assert kind == "StorageError", outcome
    for needle in needles:
        assert needle in message, (needle, message)


def test_every_request_failing_is_a_storage_error_within_the_deadline(server, own_proxy):
    proxy = own_proxy
    proxy.faults = lambda method, path: 503
    prefix = f"{server.scheme}://{server.bucket}/down"
    # A short deadline and 3 attempts a request, for a fast test: still retried, then its own cause.
    env = {**server.env(proxy.endpoint), "JAXCKPT_BUCKET_TIMEOUT": "5", "JAXCKPT_BUCKET_RETRIES": "3"}
    outcomes, _ = _run_steps(env, prefix, "save", "restore", "ls")
    for step in ("save", "restore", "ls"):
        _assert_clear(outcomes[step], prefix, "503", server.endpoint_variable)
    assert proxy.count() >= 6  # retried, not given up at once


def test_a_port_that_refuses_connections_is_a_storage_error_naming_the_url(server):
    endpoint = f"http://127.0.0.1:{_refused_port()}"
    prefix = f"{server.scheme}://{server.bucket}/refused"
    env = {**server.env(endpoint), "JAXCKPT_BUCKET_TIMEOUT": "5", "JAXCKPT_BUCKET_RETRIES": "3"}  # a fast test
    outcomes, _ = _run_steps(env, prefix, "save", "restore", "ls")
    for step in ("save", "restore", "ls"):
        _assert_clear(outcomes[step], prefix, endpoint, server.endpoint_variable)


def test_an_endpoint_that_never_answers_fails_at_the_deadline(server):
    """A server that accepts connections and never answers: only the deadline ends the wait."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes handshakes; nobody reads or answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        prefix = f"{server.scheme}://{server.bucket}/silent"
        env = {**server.env(endpoint), "JAXCKPT_BUCKET_TIMEOUT": "3"}
        outcomes, _ = _run_steps(env, prefix, "save", "restore")
    for step in ("save", "restore"):
        _assert_clear(outcomes[step], prefix, "JAXCKPT_BUCKET_TIMEOUT")


def test_missing_credentials_name_how_to_set_them(s3_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_ENDPOINT_URL=s3_server["AWS_ENDPOINT_URL"], AWS_REGION="us-east-1")
    proc = subprocess.run(
        [sys.executable, "-c", _STEPS, f"s3://{BUCKET}/nocreds", "save"],
        capture_output=True,
        text=True,
        env={**env, "JAX_PLATFORMS": "cpu"},
        timeout=HANG_GUARD_S,
    )
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])["save"]
    if outcome is None:
        pytest.skip("this moto accepts anonymous writes")
    _assert_clear(outcome, f"s3://{BUCKET}/nocreds", "AWS_ACCESS_KEY_ID")


def test_a_bucket_that_does_not_exist_is_not_called_damage(through_proxy, server):
    prefix = f"{server.scheme}://no-such-bucket-26/x"
    with pytest.raises(jaxckpt.StorageError, match=r"no-such-bucket-26.*does not exist"):
        jaxckpt.save(prefix, {"x": 1})
    if server.scheme == "gs":
        # TensorStore's gcs driver reads a missing bucket's objects as missing and its listings as
        # empty (a 404 there is "nothing"), so a restore, which only reads and lists, finds nothing;
        # the message says that the bucket may be missing.
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"no-such-bucket-26.*nothing is stored.*bucket"):
            jaxckpt.restore(prefix)
        return
    with pytest.raises(jaxckpt.StorageError, match=r"no-such-bucket-26.*does not exist"):
        jaxckpt.restore(prefix)


def test_the_deadline_setting_is_checked():
    for bad in ("0", "-1", "soon", "nan"):
        env = {"JAXCKPT_BUCKET_TIMEOUT": bad}
        with pytest.raises(ValueError, match="JAXCKPT_BUCKET_TIMEOUT"):
            kvstore.settings(env)
    assert kvstore.settings({}).timeout == 60
    assert kvstore.settings({"JAXCKPT_BUCKET_TIMEOUT": "2.5"}).timeout == 2.5


# --- (d) invalid bucket names: refused before any request ----------------------------------------


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("s3://b/x", "3 to 63"),
        ("s3://ab/x", "3 to 63"),
        (f"s3://{'a' * 64}/x", "3 to 63"),
        ("s3://Bad-Bucket/x", "lowercase"),
        ("s3://bad_bucket/x", "lowercase"),
        ("s3://-bucket/x", "begin and end"),
        ("s3://bucket-/x", "begin and end"),
        ("s3://my..bucket/x", "two dots"),
        ("s3://192.168.5.4/x", "IP address"),
        ("gs://b/x", "3 to 63"),
        ("gs://Bucket/x", "lowercase"),
        ("gs://_bucket/x", "begin and end"),
        (f"gs://{'a' * 64}/x", "3 to 63"),
        (f"gs://{'a' * 64}.b/x", "63"),
        (f"gs://{'.'.join(['a' * 60] * 4)}/x", "222"),
        ("gs://goog-bucket/x", "goog"),
        ("gs://my-google-bucket/x", "google"),
    ],
)
def test_invalid_bucket_names_are_refused_naming_the_rule(url, rule):
    with pytest.raises(jaxckpt.UnsupportedValueError, match=rule):
        locations.location(url)
    with pytest.raises(jaxckpt.UnsupportedValueError, match=rule):
        jaxckpt.restore(url)  # at the public call, before any request: not reported as damage


@pytest.mark.parametrize(
    "url",
    [
        "s3://abc/x",
        "s3://my.bucket-1/x",
        f"s3://{'a' * 63}/x",
        "gs://my_bucket-1/x",
        f"gs://{'.'.join(['a' * 54] * 4)}/x",
    ],
)
def test_valid_bucket_names_are_taken(url):
    assert locations.location(url).spec()["bucket"] == url.split("/")[2]


# --- (e) quiet: nothing from TensorStore's logging on stderr -------------------------------------

_QUIET = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jaxckpt
    from jaxckpt.tools import cli as _cli
    prefix = sys.argv[1]
    path = jaxckpt.save(prefix + "/one", {"w": np.arange(100_000.0), "b": np.ones(3), "step": 1})
    assert jaxckpt.restore(path)["step"] == 1
    ckpt = jaxckpt.Checkpoint(w=np.zeros(10))
    with jaxckpt.CheckpointManager(ckpt, prefix + "/run", max_to_keep=1) as manager:
        manager.save()
        manager.save()
    assert _cli.main(["ls", prefix + "/run"]) == 0
    assert _cli.main(["ls", path]) == 0
    print("done")
    """
)


def test_save_restore_and_ls_print_nothing_to_stderr(server, tmp_path):
    """With the credentials in the environment and no ~/.aws (a fresh HOME), as on a CI machine."""
    proc = subprocess.run(
        [sys.executable, "-c", _QUIET, f"{server.scheme}://{server.bucket}/quiet"],
        capture_output=True,
        text=True,
        env=_environ(server.env(server.upstream), {"HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}),
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("done")
    lines = proc.stderr.splitlines()
    if server.scheme == "gs":
        # TensorStore (0.1.86) logs this at INFO, unconditionally, once per process, when it takes
        # GOOGLE_AUTH_TOKEN_FOR_TESTING (jaxckpt's placeholder for an emulator). Nothing of its own turns
        # that off: absl's log flags are not in it (parse_tensorstore_flags ignores --minloglevel and
        # --stderrthreshold) and TENSORSTORE_VERBOSE_LOGGING governs other logs. An emulator only.
        token = [line for line in lines if line.endswith("] Using GOOGLE_AUTH_TOKEN_FOR_TESTING")]
        assert len(token) <= 1, proc.stderr
        lines = [line for line in lines if line not in token]
    assert lines == [], proc.stderr
