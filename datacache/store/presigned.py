"""Ranged GETs of S3 objects over presigned URLs, read with ``http.client`` straight into one buffer.

Through s3fs a ranged GET costs the fetching process botocore's request building, signing, events
and response parsing before its first byte and, on fsspec's event loop, a coroutine wake-up for
every chunk the socket delivers. ``PresignedRanges`` signs each object's URL once (``sign(path,
seconds)``: s3fs's ``S3FileSystem.sign``, the same credentials, endpoint and addressing), splits
it once, and reads every range of it with a plain HTTP GET and a ``Range`` header on a kept-alive
``http.client`` connection of this process's own (``_Conns``: urllib3, which this path used
before, parses and re-encodes the long signed URL character by character on every request). The
body is read in the calling thread with the HTTP response's own ``readinto`` straight into the
``bytes`` returned (``datacache._bytes.fresh``: no zero-filled buffer, no copy after). On by
default for S3 where ``usable`` (``TransferConfig.presigned``).

What it answers itself: ``206`` (the bytes), ``416`` (an error whose S3 code is ``InvalidRange``,
as s3fs raises it), ``429``/``5xx`` (an error carrying the status and the S3 code of the body, so
the retry policy sees a throttling or transient answer as it does through s3fs), and transport
failures (``ConnectionError`` or ``TimeoutError`` from the socket's or ``http.client``'s error:
transient; a kept connection the server closed while idle is replaced at once). Anything else
(``403``: a URL whose credentials expired; ``404``, redirects, a ``200`` that ignored the range)
returns None after dropping the URL: the caller makes that request through s3fs, which re-signs
and raises its precise error. So the errors a caller sees are s3fs's, or the same kinds.

A store that will not serve presigned GETs (a bucket policy that denies query-string
authentication, a store without them, credentials that cannot sign) is left to s3fs for good:
after ``GIVE_UP`` such answers in a row from a store that has not served one presigned GET in
this process, or at the first signing failure, ``get`` returns None at once (``off``), with one
INFO log line saying why. So a store that refuses costs a few wasted round trips per process, not
one per GET. A ``403`` from a store that did serve them (temporary credentials renewed since the
URLs were signed) drops every URL kept, so each is signed again with the current credentials.

Cancellation: a watcher thread (``datacache-presigned-cancel``) looks at every GET in flight every
``POLL`` seconds and shuts the socket of one whose ``cancelled()`` is true, from the moment its
connection is up (the request sent, the answer's head awaited, the body read: the GET tells its
``_Socket`` which socket its connection uses), so the reading thread's
blocked read returns at once and the GET raises ``ReadCancelledError``. ``close`` shuts every GET
in flight likewise (each raises), so a closed store leaves no transfer running unwatched. Only the
connect itself is not interrupted: ``connect_timeout`` bounds it. Thread-safe; fork-safe (a forked
child makes its own connections and watcher on first use; the URLs are kept: plain strings).
"""
from __future__ import annotations

import functools
import http.client
import logging
import os
import re
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, NamedTuple

from .._bytes import fresh
from ..errors import ReadCancelledError

__all__ = ["PresignedRanges", "RangeAnswerError", "POLL", "GIVE_UP", "usable"]

log = logging.getLogger("datacache.store")

POLL = 0.05  # seconds between the watcher's looks at the cancel flags
EXPIRES = 3600  # a URL's validity, in seconds
REUSE = EXPIRES / 2  # a URL is signed again after this many seconds
_PIECE = 1 << 20  # bytes read per readinto call
GIVE_UP = 8  # refusals by a store that never served this process after which its GETs go to s3fs
_CODE = re.compile(rb"<Code>([A-Za-z0-9]{1,64})</Code>")


class RangeAnswerError(Exception):
    """An S3 error answer to a presigned ranged GET; ``response`` as botocore's ClientError has it
    (``datacache.store.retry`` classifies it by code and status)."""

    def __init__(self, status: int, code: str, path: str) -> None:
        super().__init__(f"HTTP {status} {code or ''}".rstrip() + f" for a ranged GET of {path}")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


class _Socket:
    """The socket one GET uses, once its connection is up (``note``, in the GET's thread);
    ``shutdown`` shuts it, until ``done`` (the GET over: its connection may serve another GET)."""

    __slots__ = ("sock", "over", "shut", "lock")

    def __init__(self) -> None:
        self.sock: Any = None
        self.over = False
        self.shut = False  # shut down: a socket noted later is shut at once
        self.lock = threading.Lock()

    def shutdown(self) -> None:
        with self.lock:
            self.shut = True
            self._shut()

    def _shut(self) -> None:  # with the lock held
        if self.sock is not None and not self.over:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile: the GET has ended anyway
                pass

    def note(self, sock: Any) -> None:
        """The socket the GET now uses (its connection's, new or kept)."""
        with self.lock:
            if not self.over:
                self.sock = sock
                if self.shut:
                    self._shut()

    def done(self) -> None:
        with self.lock:
            self.over, self.sock = True, None


class _Target(NamedTuple):
    """A signed URL, split once: (scheme, host, port) and the request target (path and query)."""

    key: tuple[str, str, int]
    path: str


class _Conns:
    """This process's idle keep-alive connections (``http.client``), at most ``size`` kept per
    (scheme, host, port). ``take`` gives an idle one that the server has not closed meanwhile
    (a readable idle socket is an end or an answer nobody asked for: it is closed), else a new
    one, connected within ``connect_timeout`` and then reading within ``read_timeout``; ``give``
    takes back one whose answer was read to its end. Thread-safe; no lock is held while
    connecting."""

    def __init__(self, size: int, connect_timeout: float, read_timeout: float,
                 context: Callable[[], ssl.SSLContext]) -> None:
        self._size, self._connect, self._read = size, connect_timeout, read_timeout
        self._context = context
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple[str, str, int]) -> tuple[http.client.HTTPConnection, bool]:
        """(connection, whether it served a GET before)."""
        while True:
            with self._lock:
                idle = self._idle.get(key)
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if not _dropped(conn):
                return conn, True
            conn.close()
        scheme, host, port = key
        conn = http.client.HTTPSConnection(host, port, timeout=self._connect, context=self._context()) \
            if scheme == "https" else http.client.HTTPConnection(host, port, timeout=self._connect)
        try:
            conn.connect()
            conn.sock.settimeout(self._read)
        except BaseException:
            conn.close()
            raise
        return conn, False

    def give(self, key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if conn.sock is not None and len(idle) < self._size:
                idle.append(conn)
                return
        conn.close()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = [c for cs in self._idle.values() for c in cs], {}
        for conn in idle:
            conn.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection's socket is gone or readable (closed by the server)."""
    if conn.sock is None:
        return True
    try:
        poll = select.poll()
        poll.register(conn.sock, select.POLLIN)
        return bool(poll.poll(0))
    except (OSError, ValueError):
        return True


class _Watcher:
    """The GETs in flight of this process (their ``_Socket`` and cancel flag) and the thread that
    shuts the cancelled ones' sockets; the thread sleeps on a condition while none is in flight."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.inflight: dict[int, tuple[_Socket, Callable[[], bool]]] = {}
        self.tickets = 0
        self.thread: threading.Thread | None = None
        self.closed = False

    def add(self, slot: _Socket, cancelled: Callable[[], bool]) -> int:
        with self.cond:
            if self.closed:  # a GET that began as the store closed: shut as soon as it has a socket
                slot.shutdown()
            self.tickets += 1
            self.inflight[self.tickets] = (slot, cancelled)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="datacache-presigned-cancel", daemon=True)
                self.thread.start()
            self.cond.notify()
            return self.tickets

    def remove(self, ticket: int) -> None:
        with self.cond:
            self.inflight.pop(ticket, None)

    def close(self) -> None:
        """Shut the socket of every GET in flight (its reading thread's ``readinto`` returns at
        once and the GET raises, so a store's ``close`` leaves no transfer running unwatched, nor its
        temp file behind) and end the thread at its next look. Idempotent."""
        with self.cond:
            self.closed = True
            watched, self.inflight = list(self.inflight.values()), {}
            self.cond.notify()
        for slot, _ in watched:
            slot.shutdown()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.inflight and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                watched = list(self.inflight.values())
            for slot, cancelled in watched:
                try:
                    stop = cancelled()
                except Exception:  # noqa: BLE001 - a failing flag: the GET ends on its own
                    stop = False
                if stop:
                    slot.shutdown()
            with self.cond:
                self.cond.wait(POLL)  # a cancel flag is a function: looked at every POLL seconds


class PresignedRanges:
    """Ranged GETs by presigned URL (see the module docstring). ``sign(path, seconds)``: a URL for
    a GET of ``path`` valid that long; ``connect_timeout``, ``read_timeout``: per connection and
    per read, in seconds; ``pool_size``: connections kept per host. Thread-safe."""

    def __init__(self, sign: Callable[[str, int], str], *, connect_timeout: float, read_timeout: float,
                 pool_size: int, verify: bool | str | None = None) -> None:
        self._sign = sign
        self._timeouts = (connect_timeout, read_timeout)
        self._pool_size = pool_size
        self._verify = verify
        self._urls: dict[str, tuple[_Target, float]] = {}
        self._lock = threading.Lock()
        self._pool: tuple[int, _Conns, _Watcher] | None = None
        self._refusals = 0  # answers left to s3fs
        self._served = False  # whether a presigned GET was ever answered with its range
        self._closed = False
        self.off = False  # every GET left to s3fs from now on (see the module docstring)

    def _give_up(self, why: str) -> None:
        with self._lock:
            was, self.off = self.off, True
        if not was:
            log.info("datacache: ranged GETs go through s3fs from now on: %s", why)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_lock=None, _pool=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _process(self) -> tuple[int, _Conns, _Watcher]:
        """This process's connections and watcher (a forked child makes its own: its own sockets,
        and the parent's watcher thread does not exist there)."""
        with self._lock:
            if self._closed:  # a GET that raced with close(): no new pool and watcher (a transient error)
                raise ConnectionAbortedError("presigned GETs are closed (the store was closed)")
            if self._pool is None or self._pool[0] != os.getpid():
                verify = self._verify
                context = functools.lru_cache(maxsize=1)(lambda: _tls(verify))  # made at the first https connect
                self._pool = (os.getpid(), _Conns(self._pool_size, *self._timeouts, context), _Watcher())
            return self._pool

    def _url(self, path: str) -> _Target:
        now = time.monotonic()
        with self._lock:
            got = self._urls.get(path)
        if got is not None and now - got[1] < REUSE:
            return got[0]
        url = self._sign(path, EXPIRES)  # no lock held: signing may wait on the filesystem's loop; may raise
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a presigned URL that is not http(s) ({parts.scheme}://)")
        target = _Target((parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                         f"{parts.path or '/'}?{parts.query}" if parts.query else (parts.path or "/"))
        with self._lock:
            self._urls[path] = (target, now)
        return target

    def close(self) -> None:
        """Stop this process's watcher thread and drop its pool's connections. Idempotent; never
        waits for a GET in flight."""
        with self._lock:
            mine, self._pool, self._closed = self._pool, None, True
        if mine is not None and mine[0] == os.getpid():
            mine[2].close()
            mine[1].clear()  # the idle connections: those in flight are shut by the watcher

    def forget(self, path: str) -> None:
        """Sign ``path``'s URL again on its next GET."""
        with self._lock:
            self._urls.pop(path, None)

    def get(self, path: str, start: int, end: int, cancelled: Callable[[], bool] | None = None) -> bytes | None:
        """Bytes ``[start, end)`` of object ``path`` (fewer where the object ends first), or None
        where the answer is left to s3fs (see the module docstring)."""
        if cancelled is not None and cancelled():
            raise ReadCancelledError("read: cancelled by its caller", url=path)
        if self.off:
            return None
        try:
            target = self._url(path)
        except Exception as exc:  # noqa: BLE001 - s3fs makes the request, and raises what is wrong
            self._give_up(f"cannot presign a GET of {path} ({type(exc).__name__})")
            return None
        _, conns, watcher = self._process()
        slot = _Socket()
        ticket = watcher.add(slot, cancelled or _never)  # watched even uncancellable: close() shuts it
        try:
            resp, conn = self._ask(conns, target, slot, f"bytes={start}-{end - 1}", path, cancelled)
            return self._answer(resp, conn, conns, target.key, path, end - start, cancelled)
        finally:
            watcher.remove(ticket)
            slot.done()

    def _ask(self, conns: _Conns, target: _Target, slot: _Socket, ranged: str, path: str,
             cancelled: Callable[[], bool] | None) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        """Send the GET and read the answer's head: (answer, its connection). A kept connection
        that the server closed before answering (its idle timeout) is replaced by a new one at
        once, as that failure says nothing of the store."""
        while True:
            try:
                conn, reused = conns.take(target.key)
            except (OSError, http.client.HTTPException) as exc:
                _raise_cancelled(cancelled, path)
                raise _transport(exc, path) from None
            slot.note(conn.sock)
            try:
                conn.request("GET", target.path, headers={"Range": ranged})
                return conn.getresponse(), conn
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                _raise_cancelled(cancelled, path)
                if reused and isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                    continue
                raise _transport(exc, path) from None

    def _answer(self, resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, conns: _Conns,
                key: tuple[str, str, int], path: str, want: int, cancelled: Callable[[], bool] | None) -> bytes | None:
        whole = False  # the answer read to its end: the connection can serve the next GET
        try:
            if resp.status != 206:
                self._refused(resp, path)
                return None
            data = self._body(resp, path, want, cancelled)
            whole = data is not None
            if whole:
                self._served = True
            return data
        finally:
            if whole and resp.isclosed():
                conns.give(key, conn)
            else:
                resp.close()
                conn.close()

    def _refused(self, resp: Any, path: str) -> None:
        """Raise the answers the retry policy needs to see; else forget the URL (the caller gets
        None: s3fs asks)."""
        status = resp.status
        if status == 416 or status == 429 or status >= 500:
            try:
                found = _CODE.search(resp.read(4096) or b"")
            except (OSError, http.client.HTTPException):
                found = None
            code = found.group(1).decode() if found else ("InvalidRange" if status == 416 else "")
            raise RangeAnswerError(status, code, path)
        if status == 403 and self._served:  # credentials renewed since: sign every URL again
            with self._lock:
                self._urls.clear()
        else:
            self.forget(path)
        self._refused_once(f"HTTP {status} to a presigned GET of {path}")

    def _refused_once(self, why: str) -> None:
        """Count an answer left to s3fs; give up after ``GIVE_UP`` of them where none was served."""
        with self._lock:
            self._refusals += 1
            done = self._refusals >= GIVE_UP and not self._served
        if done:
            self._give_up(f"{why}, and {GIVE_UP} such answers without one served")

    def _body(self, resp: http.client.HTTPResponse, path: str, want: int,
              cancelled: Callable[[], bool] | None) -> bytes | None:
        length = resp.getheader("Content-Length")
        size = int(length) if length is not None and length.isdigit() and not resp.getheader("Content-Encoding") \
            else -1
        if not 0 <= size <= want:  # not the range asked for: s3fs asks
            self.forget(path)
            self._refused_once(f"HTTP {resp.status} with {size} bytes to a ranged GET of {want} of {path}")
            return None
        body, view = fresh(size)  # read once, into the bytes returned: no zeroing, no copy after
        got = 0
        try:
            while got < size:
                n = resp.readinto(view[got:got + _PIECE])
                if not n:
                    break
                got += n
        except (OSError, http.client.HTTPException) as exc:
            _raise_cancelled(cancelled, path)
            raise _transport(exc, path) from None
        if got < size:
            _raise_cancelled(cancelled, path)
            raise ConnectionResetError(f"the connection ended after {got} of {size} bytes of a ranged GET of {path}")
        return body


def _never() -> bool:
    return False


def _raise_cancelled(cancelled: Callable[[], bool] | None, path: str) -> None:
    """A GET that failed because it was cancelled (its socket shut by the watcher) says so."""
    if cancelled is not None and cancelled():
        raise ReadCancelledError("read: cancelled by its caller", url=path) from None


_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def usable(options: dict[str, Any]) -> bool:
    """Whether presigned GETs reach the store as s3fs's do with these storage options: not
    through a proxy (an environment proxy or botocore's ``proxies``, which this path does not
    use), nor with client certificates, nor with headers s3fs adds to every request
    (``s3_additional_kwargs``: a customer's encryption key, a requester-pays flag) or
    ``requester_pays``, which a presigned GET would not carry."""
    config = options.get("config_kwargs") or {}
    return not (any(os.environ.get(v) for v in _PROXY_VARS) or config.get("proxies") or config.get("client_cert")
                or options.get("s3_additional_kwargs") or options.get("requester_pays"))


def _tls(verify: bool | str | None) -> ssl.SSLContext:
    """The TLS settings for botocore's ``verify``: False (no check), a CA bundle's path, or None
    (``AWS_CA_BUNDLE``, else botocore's bundle, as botocore does; else the system's store)."""
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    bundle = verify if isinstance(verify, str) else os.environ.get("AWS_CA_BUNDLE")
    if not bundle:
        try:
            from botocore.httpsession import get_cert_path

            bundle = get_cert_path(True)
        except Exception:  # noqa: BLE001 - the system's store then
            bundle = None
    return ssl.create_default_context(cafile=bundle) if bundle else ssl.create_default_context()


def _transport(exc: BaseException, path: str) -> Exception:
    """A transport failure as the builtin the retry policy classifies (refused, unresolved,
    timed out: transient), its text without the signed URL."""
    text = f"{type(exc).__name__} on a ranged GET of {path}"
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 16 and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__ or getattr(cur, "reason", None)
    for e in chain:
        if isinstance(e, socket.gaierror):
            return socket.gaierror(e.errno, text)
        if isinstance(e, ConnectionRefusedError):
            return ConnectionRefusedError(text)
    if any(isinstance(e, TimeoutError) for e in chain):
        return TimeoutError(text)
    return ConnectionError(text)
