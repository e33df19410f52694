"""A small HTTP proxy on loopback in front of a bucket server (moto for ``s3://``, the GCS emulator
for ``gs://``): it records every request it forwards, and it can answer some of them with a fault
instead (an HTTP status such as 503, or a connection reset) to show what jaxckpt does when the
network misbehaves. For the tests and for ``benchmarks/buckets.py``.

    proxy = BucketProxy("http://127.0.0.1:5000")   # the server's endpoint
    proxy.endpoint                                 # point the client here
    proxy.requests                                 # [("GET", "/bucket/run/index.json"), ...]
    proxy.bytes_read, proxy.bytes_written          # bodies of answers to GETs, of PUTs and POSTs
    proxy.faults = lambda method, path: 503 if ... else None   # or "reset"
    BucketProxy(endpoint, rate=200 * 2**20)        # answers to GETs at most 200 MiB/s in all (a host's share of a bucket)
    proxy.close()
"""

from __future__ import annotations

import http.client
import http.server
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable

# What a fault rule answers for one request: None (forward it), an HTTP status to answer with
# instead, or "reset" (close the connection with a TCP reset, without a response).
Fault = int | str | None
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}


class BucketProxy:
    def __init__(
        self, upstream: str, faults: Callable[[str, str], Fault] | None = None, rate: float | None = None
    ) -> None:
        self.upstream = upstream
        self.rate = rate  # bytes per second of GET answers' bodies, over all connections (None: as fast as it goes)
        self._free_at = 0.0  # when the bodies sent so far have had their time at that rate
        target = urllib.parse.urlsplit(upstream)
        self.upstream_host = target.hostname or "127.0.0.1"
        self.upstream_port = target.port or 80
        self.faults = faults
        self.requests: list[tuple[str, str]] = []
        self.faulted: list[tuple[str, str, Fault]] = []
        self.bytes_read = 0  # the bodies of the server's answers to GETs
        self.bytes_written = 0  # the bodies of PUTs and POSTs forwarded
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        # A short poll: close() waits for the serving loop to see the request to stop.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.faulted.clear()
            self.bytes_read = self.bytes_written = 0

    def count(self, method: str | None = None, contains: str = "") -> int:
        """How many requests were forwarded or faulted (of ``method``, with ``contains`` in the path)."""
        with self._lock:
            return sum(1 for m, p in self.requests if (method is None or m == method) and contains in p)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> BucketProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, method: str, sent: int, received: int) -> None:
        with self._lock:
            if method in ("PUT", "POST"):
                self.bytes_written += sent
            elif method == "GET":
                self.bytes_read += received

    def _throttle(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more of answers fit the rate (one queue for all connections)."""
        if self.rate is None or nbytes == 0:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / self.rate
            wait = self._free_at - now
        time.sleep(wait)

    def _record(self, method: str, path: str) -> Fault:
        with self._lock:
            self.requests.append((method, path))
            fault = self.faults(method, path) if self.faults is not None else None
            if fault is not None:
                self.faulted.append((method, path, fault))
            return fault


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _handler(proxy: BucketProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # An answer's headers and body go out in two writes: with Nagle's algorithm, the body of each
        # answer on a kept-alive connection would wait for the client's delayed ACK (40 ms).
        disable_nagle_algorithm = True
        upstream: http.client.HTTPConnection | None = None

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            fault = proxy._record(self.command, self.path)
            if fault == "reset":
                # SO_LINGER with a zero timeout: close() sends a RST, as a dropped connection does.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                return
            if isinstance(fault, int):
                message = b"injected fault"
                self.send_response(fault)
                self.send_header("Content-Length", str(len(message)))
                self.end_headers()
                self.wfile.write(message)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            response, data = self._upstream_exchange(body, headers)
            proxy._count(self.command, len(body), len(data))
            self.send_response(response.status, response.reason)
            head = self.command == "HEAD"  # its Content-Length is the object's, with no body
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP and (head or key.lower() != "content-length"):
                    self.send_header(key, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                if self.command == "GET":
                    proxy._throttle(len(data))
                self.wfile.write(data)

        def _upstream_exchange(self, body: bytes, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, bytes]:
            """Forward this request on this connection's own upstream connection, kept alive from one
            request to the next (a connection per request would cost the server a thread each)."""
            reused = self.upstream is not None
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=120)
                self.upstream.connect()
                # http.client sends a request's headers and body in two writes: the same wait, upstream.
                self.upstream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self.upstream.request(self.command, self.path, body=body, headers=headers)
                response = self.upstream.getresponse()
                data = response.read()
            except (ConnectionError, http.client.BadStatusLine):
                self._close_upstream()
                if not reused:
                    raise
                return self._upstream_exchange(body, headers)  # the server closed it while idle: once more
            if response.will_close:
                self._close_upstream()
            return response, data

        def _close_upstream(self) -> None:
            if self.upstream is not None:
                self.upstream.close()
                self.upstream = None

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                self._close_upstream()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

    return Handler
