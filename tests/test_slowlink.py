"""tools.slowlink (WAN emulator) against a tiny local HTTP/1.1 server, plus the tools' CLIs."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from tools.s3server import SeaweedServer
from tools.slowlink import SlowLink

ROOT = Path(__file__).resolve().parents[1]


class _Handler(BaseHTTPRequestHandler):
    """GET/HEAD /<n> -> n bytes; PUT reads the body. Keep-alive HTTP/1.1."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, body: bytes, send_body: bool = True) -> None:
        self.server.seen += 1  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._reply(b"x" * int(self.path.strip("/")))

    def do_HEAD(self) -> None:
        self._reply(b"x" * int(self.path.strip("/")), send_body=False)

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(b"")


class _Origin(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients cut by injected resets are expected; socketserver would print a traceback


@pytest.fixture(scope="module")
def origin() -> Iterator[ThreadingHTTPServer]:
    server = _Origin(("127.0.0.1", 0), _Handler)
    server.seen = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name="test-origin", daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def link(origin: ThreadingHTTPServer) -> Iterator[Any]:
    links: list[SlowLink] = []

    def make(**kw: Any) -> SlowLink:
        kw.setdefault("bandwidth", 0)
        kw.setdefault("latency", 0.0)
        made = SlowLink("127.0.0.1", origin.server_address[1], **kw).start()
        links.append(made)
        return made

    yield make
    for made in links:
        made.stop()


def exchange(sock: socket.socket, method: str, path: str, body: bytes = b"") -> tuple[bytes, bytes, int, int]:
    """Send one request, read one full response: (head, body, bytes sent, raw bytes received)."""
    req = f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    sock.sendall(req)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before headers")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    if method == "HEAD":
        length = 0
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {len(rest)} of {length} body bytes")
        rest += chunk
    return head, rest, len(req), len(head) + 4 + len(rest)


def eventually(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_metering_and_request_counts(link: Any) -> None:
    lk = link()
    sent = received = 0
    with socket.create_connection(("127.0.0.1", lk.port)) as s:
        for method, path, body in [("GET", "/1000", b""), ("HEAD", "/5", b""), ("PUT", "/x", b"p" * 3000),
                                   ("GET", "/300000", b"")]:
            head, data, n_sent, n_recv = exchange(s, method, path, body)
            assert head.startswith(b"HTTP/1.1 200")
            sent, received = sent + n_sent, received + n_recv
        assert len(data) == 300000
    assert eventually(lambda: lk.bytes_down == received and lk.bytes_up == sent)
    snap = lk.snapshot()
    assert snap["requests"] == 4 and snap["gets"] == 2 and snap["injected"] == 0
    with socket.create_connection(("127.0.0.1", lk.port)) as s:
        exchange(s, "GET", "/10")
    assert lk.requests == 5 and lk.gets == 3 and lk.snapshot()["connections"] == 2
    lk.reset_counters()
    assert lk.snapshot() == dict.fromkeys(snap, 0)


def test_bandwidth_cap_is_shared(link: Any) -> None:
    cap, size = 3e6, 1_500_000
    lk = link(bandwidth=cap)
    sizes: list[int] = []

    def download() -> None:
        with socket.create_connection(("127.0.0.1", lk.port)) as s:
            sizes.append(len(exchange(s, "GET", f"/{size}")[1]))

    threads = [threading.Thread(target=download, name=f"test-dl-{i}") for i in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # a hang guard
    elapsed = time.monotonic() - t0
    assert sizes == [size, size]
    rate = lk.bytes_down / elapsed  # a busy machine only lowers it: no lower bound (was > 0.2 x cap)
    assert rate < 1.5 * cap, f"aggregate {rate:.0f} B/s exceeds the {cap:.0f} B/s cap"


def test_latency_per_request_and_spike(link: Any) -> None:
    lk = link(latency=0.1, latency_spike=(2, 0.3))
    with socket.create_connection(("127.0.0.1", lk.port)) as s:
        times = []
        for _ in range(3):
            t0 = time.monotonic()
            exchange(s, "GET", "/100")
            times.append(time.monotonic() - t0)
    assert all(t >= 0.09 for t in times)
    assert times[1] >= 0.38  # the 2nd request got the spike
    assert lk.injected == 1 and lk.requests == 3


def test_fail_every_answers_503_without_reaching_the_server(link: Any, origin: Any) -> None:
    lk = link(fail_every=2)
    before = origin.seen
    with socket.create_connection(("127.0.0.1", lk.port)) as s:
        assert exchange(s, "GET", "/10")[0].startswith(b"HTTP/1.1 200")
        head, body, _, _ = exchange(s, "GET", "/10")
        assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower()
        assert b"<Code>SlowDown</Code>" in body
        assert s.recv(10) == b""  # closed
    assert origin.seen == before + 1 and lk.injected == 1
    lk.fail_every = 0  # knobs are live
    with socket.create_connection(("127.0.0.1", lk.port)) as s:
        assert exchange(s, "GET", "/10")[0].startswith(b"HTTP/1.1 200")


def test_throttle_window_cuts_open_connections_and_answers_503_until_it_ends(link: Any, origin: Any) -> None:
    lk = link()
    held = socket.create_connection(("127.0.0.1", lk.port))
    assert exchange(held, "GET", "/10")[0].startswith(b"HTTP/1.1 200")
    before = origin.seen
    lk.throttle(3.0)
    assert lk.throttling
    held.settimeout(10)
    try:  # the open connection is cut when the window begins (a reset; EOF if the RST raced)
        assert held.recv(10) == b""
    except ConnectionResetError:
        pass
    held.close()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", lk.port)) as s:
            head, body, _, _ = exchange(s, "GET", "/10")
            assert head.startswith(b"HTTP/1.1 503") and b"<Code>SlowDown</Code>" in body
    assert origin.seen == before and len(lk.throttled_at) >= 3  # nothing reached the server
    assert lk.throttled_at == sorted(lk.throttled_at) and lk.throttled_at[-1] < 3.0
    deadline = time.monotonic() + 30
    while lk.throttling:  # the window ends by itself
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with socket.create_connection(("127.0.0.1", lk.port)) as s:
        assert exchange(s, "GET", "/10")[0].startswith(b"HTTP/1.1 200")
    assert origin.seen == before + 1


def test_a_request_held_back_when_the_window_begins_is_cut_and_not_listed_as_answered(link: Any) -> None:
    lk = link(latency=0.3)
    held = socket.create_connection(("127.0.0.1", lk.port))
    held.sendall(b"GET /10 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert lk.wait_requests(1, timeout=30)  # the proxy has it, and holds it back for its latency
    lk.throttle(30.0)  # returns once the cut is done
    held.settimeout(10)
    try:
        assert held.recv(10) == b""
    except ConnectionResetError:
        pass
    held.close()
    with socket.create_connection(("127.0.0.1", lk.port)) as s:  # held back after the first one: answered later
        assert exchange(s, "GET", "/10")[0].startswith(b"HTTP/1.1 503")
    # only the answer a client could read is listed (the node's count of throttling answers is compared to it)
    assert len(lk.throttled_at) == 1 and lk.requests == 2


def test_reset_every_cuts_the_response_mid_body(link: Any) -> None:
    lk = link(reset_every=1)
    with socket.create_connection(("127.0.0.1", lk.port)) as s:
        with pytest.raises((ConnectionError, OSError)):
            exchange(s, "GET", "/500000")
    assert lk.injected == 1 and 0 < lk.bytes_down < 500000


def test_stop_is_idempotent_and_closes_connections(link: Any) -> None:
    lk = link()
    s = socket.create_connection(("127.0.0.1", lk.port))
    exchange(s, "GET", "/10")
    lk.stop()
    lk.stop()
    assert not lk._thread.is_alive()
    s.settimeout(5)
    try:
        assert s.recv(10) == b""
    except ConnectionError:
        pass
    finally:
        s.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", lk.port), timeout=2).close()


def _start_cli(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_slowlink_cli(origin: Any) -> None:
    proc = _start_cli(["-m", "tools.slowlink", "--target", f"127.0.0.1:{origin.server_address[1]}",
                       "--bandwidth", "50MB", "--latency", "5ms"])
    try:
        line = proc.stdout.readline()
        assert line.startswith("slowlink http://127.0.0.1:")
        port = int(line.split()[1].rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            assert len(exchange(s, "GET", "/1000")[1]) == 1000
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0  # generous: a loaded CI machine; a hang still fails


def test_s3server_cli_starts_a_second_server_and_stops_on_sigterm() -> None:
    proc = _start_cli(["-m", "tools.s3server", "--bucket", "cli-bucket"])
    try:
        line = proc.stdout.readline()
        assert line.startswith("S3 endpoint: http://127.0.0.1:"), line + proc.stdout.read(2000)
        logline = [proc.stdout.readline() for _ in range(2)][-1]
        log_dir = os.path.dirname(logline.split("log:")[1].split()[0])
        assert os.path.isdir(log_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not os.path.exists(log_dir)


def test_s3server_reports_a_failed_start() -> None:
    server = SeaweedServer(binary="/bin/false", startup_timeout=10)
    with pytest.raises(RuntimeError, match="did not become ready") as info:
        server.start()
    assert "exited" in str(info.value) and server.dir is None
    server.stop()  # idempotent
