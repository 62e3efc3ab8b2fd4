"""SlowLink: a loopback TCP proxy that makes a local S3 server behave like one across a WAN.

* per-request latency: the first client->server bytes of each HTTP request (the first bytes of a
  connection, or the first client bytes after the server started a response) are held back
  ``latency`` seconds before being forwarded;
* one bandwidth cap (bytes/s) shared by all connections in the server->client direction, enforced
  by FIFO reservations on a virtual clock, in chunks of at most 64 KiB so connections share fairly.
  The clock is a token bucket ``BURST`` bytes deep: when the proxy thread was not scheduled in time
  (a busy 2-core machine) the link catches up by at most that much, so a saturated link delivers
  its nominal rate, and no window longer than ``BURST / bandwidth`` (2.6 ms at 50 MB/s) exceeds it;
* metering: ``bytes_down``, ``bytes_up``, ``requests`` (HTTP request starts; ``wait_requests``
  waits for a count), ``gets``;
* fault injection, settable at any time: ``fail_every`` (every Nth request gets an immediate
  ``503 Slow Down`` with an S3 XML body and ``Connection: close``, never reaching the server),
  ``reset_every`` (every Nth request's response is cut by a TCP reset after a few KB),
  ``latency_spike=(N, seconds)`` (every Nth request is delayed that much longer); each injected
  fault increments ``injected``;
* throttle window: ``throttle(seconds)`` cuts every open connection (TCP reset) and answers every
  request started in the next ``seconds`` with ``503 Slow Down`` (an S3 XML error body), like a
  store repartitioning a hot prefix; it returns once the cut is done. ``throttled_at`` lists when
  each such answer was written to a connection still open (seconds since the window began): a
  request held back by ``latency`` whose connection the cut reset is not answered and not listed.
  ``throttling`` says whether the window is open;
* ``retarget(host, port)``: new connections go to another server from then on (a restarted store
  on new ports keeps the same endpoint behind the proxy).

Only enough HTTP/1.1 is parsed to see request starts and methods; it assumes the client sends a
request only after reading the previous response (keep-alive without pipelining).

Everything runs on one asyncio loop in one background thread named ``datacache-slowlink``. The public
attributes and methods are thread-safe: counters are updated under a lock and fault knobs are plain
attributes read by the loop at each request start.

CLI: ``python -m tools.slowlink --target 127.0.0.1:8333 --bandwidth 50MB --latency 20ms``.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import re
import socket
import struct
import sys
import threading
import time
from typing import Any

__all__ = ["SlowLink"]

CHUNK = 64 * 1024
BURST = 2 * CHUNK
STOP_WAIT_S = 30.0  # stop(): the most it waits for the shutdown, then for the loop's thread
RESET_AFTER = 4096  # bytes of a response forwarded before an injected reset


def _slowdown_response(n: int, head_request: bool = False) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        "<Message>Please reduce your request rate.</Message>"
        f"<RequestId>slowlink-{n}</RequestId><HostId>slowlink</HostId></Error>"
    ).encode()
    head = (
        "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: slowlink-{n}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if head_request else head + body  # a HEAD response carries no body


class _Conn:
    """Per-connection state, touched only by the loop thread."""

    __slots__ = ("client_w", "server_w", "expect_request", "awaiting_response", "cut_after")

    def __init__(self, client_w: asyncio.StreamWriter) -> None:
        self.client_w = client_w
        self.server_w: asyncio.StreamWriter | None = None
        self.expect_request = True      # next client bytes start a new request
        self.awaiting_response = False  # a request was forwarded, no final response byte seen yet
        self.cut_after: int | None = None  # injected reset: response bytes still allowed through


class SlowLink:
    """A WAN emulator in front of ``target_host:target_port`` (see module doc). Context manager."""

    def __init__(self, target_host: str, target_port: int, *, bandwidth: float = 50e6, latency: float = 0.02,
                 listen_host: str = "127.0.0.1", listen_port: int = 0, fail_every: int = 0,
                 reset_every: int = 0, latency_spike: tuple[int, float] | None = None) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.bandwidth = bandwidth  # bytes/s; <= 0 or inf means unlimited; may be changed at runtime
        self.latency = latency
        self.listen_host, self.port = listen_host, listen_port
        self.fail_every, self.reset_every, self.latency_spike = fail_every, reset_every, latency_spike
        self._lock = threading.Lock()
        self._counted = threading.Condition(self._lock)  # notified at each request start
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._next_free = 0.0  # virtual clock of the shared downlink
        self._window = (0.0, 0.0)  # throttle window: (start, end) in time.monotonic()
        self._stopped = False
        self.reset_counters()

    # -- counters -----------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero all counters (the request numbering used for fault injection restarts too)."""
        with self._lock:
            self.bytes_down = self.bytes_up = self.requests = self.gets = self.injected = 0
            self.connections = 0
            self.throttled_at: list[float] = []

    def wait_requests(self, n: int, timeout: float) -> bool:
        """Wait until the proxy has seen ``n`` request starts (counted before their latency is
        applied); False after ``timeout`` seconds."""
        with self._counted:
            return self._counted.wait_for(lambda: self.requests >= n, timeout)

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the counters."""
        with self._lock:
            return {"bytes_down": self.bytes_down, "bytes_up": self.bytes_up, "requests": self.requests,
                    "gets": self.gets, "injected": self.injected, "connections": self.connections}

    def _add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def __repr__(self) -> str:
        return (f"SlowLink({self.endpoint_url} -> {self.target_host}:{self.target_port}, "
                f"bandwidth={self.bandwidth:g}, latency={self.latency:g})")

    def retarget(self, host: str, port: int) -> None:
        """Forward connections opened from now on to ``host:port``; open ones keep their server."""
        with self._lock:
            self.target_host, self.target_port = host, port

    def throttle(self, seconds: float) -> None:
        """Cut every open connection now and answer 503 SlowDown to each request for ``seconds``."""
        assert self._loop is not None, "start() the link first"
        done = threading.Event()

        def begin() -> None:  # on the loop: no request start runs between the window and the cut
            now = time.monotonic()
            with self._lock:
                self._window = (now, now + seconds)
            for conn in list(self._conns):
                self._close(conn, reset=True)
            done.set()
        self._loop.call_soon_threadsafe(begin)
        if not done.wait(30):
            raise RuntimeError(f"{self!r}: its loop did not run the throttle's cut within 30 s")

    @property
    def throttling(self) -> bool:
        return time.monotonic() < self._window[1]

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "SlowLink":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "SlowLink":
        """Start listening (returns once ``port`` is known)."""
        if self._thread is not None:
            return self
        if self._stopped:
            raise RuntimeError("a stopped SlowLink cannot be restarted; make a new one")
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, self.listen_host, self.port, limit=CHUNK))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                error.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="datacache-slowlink", daemon=True)
        self._thread.start()
        ready.wait()
        if error:
            self._thread.join()
            self._thread = None
            raise error[0]
        return self

    def stop(self) -> None:
        """Close the listener and every connection, stop the loop, join the thread. Idempotent;
        never raises: where the shutdown has not finished in ``STOP_WAIT_S`` (a busy machine), the
        loop is stopped with it unfinished, and what it had not closed yet is closed when collected."""
        with self._lock:
            if self._stopped or self._thread is None:
                self._stopped = True
                return
            self._stopped = True
        loop, thread = self._loop, self._thread
        assert loop is not None

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for conn in list(self._conns):
                self._close(conn)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        done = asyncio.run_coroutine_threadsafe(shutdown(), loop)
        try:
            done.result(timeout=STOP_WAIT_S)
        except Exception:  # noqa: BLE001 - a slow or failed shutdown (a busy machine): the loop stops anyway
            done.cancel()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=STOP_WAIT_S)

    # -- data path (loop thread only) -----------------------------------------------------------
    def _close(self, conn: _Conn, *, reset: bool = False) -> None:
        if reset:
            sock = conn.client_w.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
        for w in (conn.client_w, conn.server_w):
            if w is not None and not w.is_closing():
                w.close()
        self._conns.discard(conn)

    async def _throttle(self, n: int) -> None:
        """Reserve ``n`` bytes on the shared downlink; sleep until they would have been sent."""
        rate = self.bandwidth
        if not rate or rate <= 0 or math.isinf(rate):
            return
        now = time.monotonic()
        start = max(now - BURST / rate, self._next_free)
        self._next_free = start + n / rate
        if self._next_free > now:
            await asyncio.sleep(self._next_free - now)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = _Conn(client_w)
        self._conns.add(conn)
        self._add(connections=1)
        with self._lock:
            host, port = self.target_host, self.target_port
        try:
            server_r, conn.server_w = await asyncio.open_connection(host, port, limit=CHUNK)
        except OSError:
            self._close(conn)
            return
        up = asyncio.ensure_future(self._pump_up(conn, client_r))
        down = asyncio.ensure_future(self._pump_down(conn, server_r))
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if not down.done():  # the client stopped sending: let the last response drain
                await asyncio.wait({down}, timeout=30)
        except asyncio.CancelledError:
            pass  # stop(): end quietly (Python 3.11's start_server logs handlers that end cancelled)
        finally:
            for task in (up, down):
                task.cancel()
            self._close(conn)
            await asyncio.gather(up, down, return_exceptions=True)

    async def _pump_up(self, conn: _Conn, client_r: asyncio.StreamReader) -> None:
        assert conn.server_w is not None
        try:
            while True:
                data = await client_r.read(CHUNK)
                if not data:
                    return
                if conn.expect_request:
                    conn.expect_request = False
                    conn.awaiting_response = True
                    conn.cut_after = None
                    if not await self._request_start(conn, data, client_r):
                        return
                self._add(bytes_up=len(data))
                conn.server_w.write(data)
                await conn.server_w.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass

    async def _request_start(self, conn: _Conn, data: bytes, client_r: asyncio.StreamReader) -> bool:
        """Count a request, apply latency and faults; False if the connection was failed."""
        with self._lock:
            self.requests += 1
            self._counted.notify_all()
            n = self.requests
            if data.startswith(b"GET "):
                self.gets += 1
        fail, reset, spike = self.fail_every, self.reset_every, self.latency_spike
        delay = self.latency
        if spike and spike[0] > 0 and n % spike[0] == 0:
            delay += spike[1]
            self._add(injected=1)
        if delay > 0:
            await asyncio.sleep(delay)
        if conn.client_w.is_closing():  # cut (by a throttle) while held back: nothing is answered
            return False
        now = time.monotonic()
        with self._lock:
            start, end = self._window
            storm = start <= now < end
            if storm:  # counted only where the answer is written: the client reads every one listed
                self.throttled_at.append(now - start)
        if storm or (fail and n % fail == 0):
            self._add(injected=1)
            conn.client_w.write(_slowdown_response(n, data.startswith(b"HEAD ")))
            await conn.client_w.drain()
            try:  # discard what the client still sends (a request body) so the 503 is read, not reset
                conn.client_w.write_eof()
                while await asyncio.wait_for(client_r.read(CHUNK), timeout=1.0):
                    pass
            except (OSError, asyncio.TimeoutError):
                pass
            self._close(conn)
            return False
        if reset and n % reset == 0:
            conn.cut_after = RESET_AFTER
        return True

    async def _pump_down(self, conn: _Conn, server_r: asyncio.StreamReader) -> None:
        try:
            while True:
                data = await server_r.read(CHUNK)
                if not data:
                    break
                if conn.awaiting_response and not re.match(rb"HTTP/1\.[01] 1\d\d ", data):
                    conn.awaiting_response = False
                    conn.expect_request = True  # the next client bytes begin a new request
                cut = conn.cut_after
                if cut is not None and len(data) >= cut:
                    data = data[:cut]
                await self._throttle(len(data))
                conn.client_w.write(data)
                await conn.client_w.drain()
                self._add(bytes_down=len(data))
                if cut is not None:
                    if len(data) >= cut:
                        self._add(injected=1)
                        await asyncio.sleep(0.02)
                        self._close(conn, reset=True)
                        return
                    conn.cut_after = cut - len(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        self._close(conn)


def _parse_rate(text: str) -> float:
    t = text.strip().lower().removesuffix("/s")
    if t in ("0", "inf", "none", "unlimited"):
        return 0.0
    from datacache.config import parse_size  # only the CLI needs it
    return float(parse_size(t))


def _parse_seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 20ms, 0.5s")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.slowlink", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="HOST:PORT to forward to, e.g. 127.0.0.1:8333")
    p.add_argument("--bandwidth", default="50MB", help="shared downlink cap per second (50MB, 1GiB, 0=off)")
    p.add_argument("--latency", default="20ms", type=_parse_seconds, help="delay per request (20ms, 0.1s)")
    p.add_argument("--port", type=int, default=0, help="listen port (default: a free one)")
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--reset-every", type=int, default=0)
    args = p.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    link = SlowLink(host or "127.0.0.1", int(port), bandwidth=_parse_rate(args.bandwidth), latency=args.latency,
                    listen_port=args.port, fail_every=args.fail_every, reset_every=args.reset_every)
    with link:
        print(f"slowlink {link.endpoint_url} -> {args.target}  (Ctrl-C to stop)", flush=True)
        last, t0 = link.snapshot(), time.monotonic()
        try:
            while True:
                time.sleep(5)
                snap, t1 = link.snapshot(), time.monotonic()
                rate = (snap["bytes_down"] - last["bytes_down"]) / (t1 - t0)
                print(f"down {snap['bytes_down']:,} B ({rate / 1e6:.1f} MB/s)  up {snap['bytes_up']:,} B  "
                      f"requests {snap['requests']}  gets {snap['gets']}  injected {snap['injected']}", flush=True)
                last, t0 = snap, t1
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
