"""A Google Cloud Storage emulator on loopback, with a bucket made: for the tests' ``gcs_server``
fixture, as :mod:`moto_server` is for ``s3://``.

It is the ``gcp-storage-emulator`` package, in memory, in a subprocess (``python gcs_server.py BUCKET``
prints its port, then serves until terminated), with a thin layer of fixes for what TensorStore's
``gcs`` driver relies on and the emulator (2026.7.19) gets wrong or lacks. Each was found by running
TensorStore against it; without them a save hangs, deletes under the wrong prefix, or a size check
reads garbage:

- a listing ignores ``startOffset``/``endOffset``: TensorStore lists (and deletes) by key range, with
  no ``prefix``, so it got every object of the bucket and deleted other checkpoints' objects;
- a media upload of an empty value (``Content-Length: 0``) fails in the handler (the body reads as
  None), the connection closes without an answer, and TensorStore retries for minutes;
- a range that starts past the end is answered with a malformed 206 (``bytes 10-4/5``) instead of
  416, and a suffix range (``bytes=-N``, how a shard's index is read) is ignored (the whole object);
- the preconditions ``ifGenerationMatch``/``ifGenerationNotMatch`` are ignored on uploads, reads
  and deletes (TensorStore's conditional writes, ``ifGenerationMatch=0``: create only if absent);
- a download carries no ``x-goog-generation`` header, where TensorStore reads a range's generation;
- a request to a bucket that does not exist is answered 404 with no body, where GCS says "The specified
  bucket does not exist." (TensorStore failed to parse the empty listing: INTERNAL, not a missing bucket);
- every write serializes the metadata of every object to an in-memory JSON file nobody reads
  (quadratic over a test session), and deleted objects are kept 7 days (soft delete).

- it speaks HTTP/1.0, so curl waits a second for the ``100 Continue`` it asks before an upload
  over 1 MiB; and with HTTP/1.1's kept-alive connections, one thread serving them would wait on
  an idle one. So it serves HTTP/1.1 with a thread per connection, and handles one request at a
  time under a lock: the emulator's storage is not thread-safe, and a conditional write's check and
  write must be atomic. Each request's body is read whole before it is handled, so that a handler
  that answers without reading it leaves the connection at the next request.
"""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import re
import subprocess
import sys
import threading
from http import HTTPStatus
from typing import Any

from moto_server import wait_until_answering


def start(bucket: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """Start the emulator on 127.0.0.1 with ``bucket`` made; returns the process and the environment
    that points jaxckpt at it (``STORAGE_EMULATOR_HOST``, as Google's client libraries read it)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, bucket],
        stdin=subprocess.PIPE,  # closed when this process ends, however it ends: the server then exits
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the port, once it listens; "" if it died first
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"the GCS emulator did not start (it printed {line!r})")
    endpoint = f"http://127.0.0.1:{int(line)}"
    wait_until_answering(proc, f"{endpoint}/storage/v1/b/{bucket}", "the GCS emulator did not answer")
    return proc, {"STORAGE_EMULATOR_HOST": endpoint}


# --- the server, in its own process ---------------------------------------------------------------


def _generation_failure(request: Any, obj: dict[str, Any] | None, *, read: bool) -> HTTPStatus | None:
    """The status GCS answers when a request's preconditions do not hold for ``obj`` (the live object,
    None if absent): 412 for ``ifGenerationMatch``, 304 (reads) or 412 for ``ifGenerationNotMatch``.
    Generation 0 means "no live object"."""
    current = int(obj["generation"]) if obj is not None else 0
    match = request.query.get("ifGenerationMatch")
    if match and int(match[0]) != current:
        return HTTPStatus.PRECONDITION_FAILED
    not_match = request.query.get("ifGenerationNotMatch")
    if not_match and int(not_match[0]) == current:
        return HTTPStatus.NOT_MODIFIED if read else HTTPStatus.PRECONDITION_FAILED
    return None


def _byte_range(header: str, size: int) -> tuple[int, int] | bool | None:
    """``[start, stop)`` of a ``Range`` header over ``size`` bytes; None if it cannot be satisfied
    (416), False if it is not a single byte range (then it is ignored, as HTTP says)."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if m is None or not (m[1] or m[2]):
        return False
    if not m[1]:  # a suffix: the last N bytes
        n = int(m[2])
        return (size - min(n, size), size) if n and size else None
    start = int(m[1])
    if start >= size:
        return None
    stop = min(size, int(m[2]) + 1) if m[2] else size
    return (start, stop) if stop > start else False


def _patch_emulator() -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects
    from gcp_storage_emulator.storage import Storage

    def live(storage: Any, request: Any, name: str) -> dict[str, Any] | None:
        try:
            return dict(storage.get_file_obj(request.params["bucket_name"], name))
        except NotFound:
            return None

    def download(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        bucket, name = request.params["bucket_name"], request.params["object_id"]
        obj = live(storage, request, name)
        if obj is None:
            response.status = HTTPStatus.NOT_FOUND
            return
        failed = _generation_failure(request, obj, read=True)
        if failed is not None:
            response.status = failed
            return
        data = storage.get_file(bucket, name)
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]
        response["x-goog-hash"] = f"crc32c={obj['crc32c']},md5={obj['md5Hash']}"
        span = _byte_range(request.get_header("range") or "", len(data))
        if span is None:
            response.status = HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE
            response["Content-Range"] = f"bytes */{len(data)}"
            return
        if span:
            start, stop = span
            response.status = HTTPStatus.PARTIAL_CONTENT
            response["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            data = data[start:stop]
        response.write_file(data, content_type=obj.get("contentType") or "application/octet-stream")

    original_get, original_insert, original_delete, original_ls = (
        objects.get,
        objects.insert,
        objects.delete,
        objects.ls,
    )

    def get(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        if request.query.get("alt") == ["media"]:
            return download(request, response, storage)
        failed = _generation_failure(request, live(storage, request, request.params["object_id"]), read=True)
        if failed is not None and "softDeleted" not in request.query:
            response.status = failed
            return
        return original_get(request, response, storage)

    def insert(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        data = request.data  # read before any answer (see the module's docstring)
        name = (request.query.get("name") or [None])[0]
        if name is not None:
            failed = _generation_failure(request, live(storage, request, name), read=False)
            if failed is not None:
                response.status = failed
                return
        if request.query.get("uploadType") == ["media"] and data is None:
            request._data = b""  # an empty body: the emulator reads it as None and fails on len(None)
        return original_insert(request, response, storage)

    def delete(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        obj = live(storage, request, request.params["object_id"])
        failed = _generation_failure(request, obj, read=False) if obj is not None else None
        if failed is not None:
            response.status = failed
            return
        return original_delete(request, response, storage)

    def ls(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        original_ls(request, response, storage)
        start = (request.query.get("startOffset") or [""])[0]
        end = (request.query.get("endOffset") or [None])[0]
        if response.status != HTTPStatus.OK or not (start or end):
            return

        def within(name: str) -> bool:
            return start <= name and (end is None or name < end)

        listing = json.loads(response._content)  # what the emulator's ls answered, filtered
        listing["items"] = [item for item in listing["items"] if within(item["name"])]
        listing["prefixes"] = [p for p in listing["prefixes"] if within(p)]
        response.json(listing)

    def bucket_checked(handle: Any) -> Any:
        @functools.wraps(handle)
        def checked(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
            if request.params.get("bucket_name") not in storage.buckets:
                response.status = HTTPStatus.NOT_FOUND
                error = {"code": 404, "message": "The specified bucket does not exist."}
                response.json({"error": {**error, "errors": [{**error, "domain": "global", "reason": "notFound"}]}})
                return None
            return handle(request, response, storage, *args, **kwargs)

        return checked

    get, download, insert, delete, ls = map(bucket_checked, (get, download, insert, delete, ls))
    replaced = {original_get: get, objects.download: download, original_insert: insert, original_delete: delete}
    replaced |= {original_ls: ls}
    for name, fn in (("get", get), ("download", download), ("insert", insert), ("delete", delete), ("ls", ls)):
        setattr(objects, name, fn)  # the router's fallback for uploads looks up objects.insert
    server.HANDLERS = tuple(
        (regex, {method: replaced.get(fn, fn) for method, fn in handlers.items()})
        for regex, handlers in server.HANDLERS
    )
    # In memory, the "config file" is written on every change and read only at start: skip it.
    Storage._write_config_to_file = lambda self: None


def _handler_class() -> type[http.server.BaseHTTPRequestHandler]:
    from gcp_storage_emulator import server

    lock = threading.Lock()

    class Handler(server.RequestHandler):  # type: ignore[misc]
        protocol_version = "HTTP/1.1"
        # The headers and the body go out in two writes: with Nagle's algorithm, the body of each
        # answer on a kept-alive connection would wait for the client's delayed ACK (40 ms).
        disable_nagle_algorithm = True

        def _one_at_a_time(self, handle: Any) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            connection = self.rfile
            self.rfile = io.BytesIO(connection.read(length))
            try:
                with lock:
                    handle(self)
            finally:
                self.rfile = connection

        def do_GET(self) -> None:
            self._one_at_a_time(server.RequestHandler.do_GET)

        def do_POST(self) -> None:
            self._one_at_a_time(server.RequestHandler.do_POST)

        def do_PUT(self) -> None:
            self._one_at_a_time(server.RequestHandler.do_PUT)

        def do_DELETE(self) -> None:
            self._one_at_a_time(server.RequestHandler.do_DELETE)

        def do_PATCH(self) -> None:
            self._one_at_a_time(server.RequestHandler.do_PATCH)

    return Handler


def _serve(bucket: str) -> None:
    import logging

    from gcp_storage_emulator.handlers import buckets
    from gcp_storage_emulator.storage import Storage

    logging.disable(logging.CRITICAL)  # the emulator logs every request
    _patch_emulator()
    storage = Storage(use_memory_fs=True)
    buckets.create_bucket(bucket, storage)
    storage.buckets[bucket]["softDeletePolicy"] = {"retentionDurationSeconds": "0"}  # delete is delete
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_handler_class(), storage))
    print(httpd.server_address[1], flush=True)
    # No server left behind by a test run that was killed: its end closes our stdin.
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    httpd.serve_forever()


if __name__ == "__main__":
    _serve(sys.argv[1])
