"""Node-wide congestion control for one store prefix: every process of a node backs off together.

A store that throttles (503 SlowDown, 429...) asks the *node* to slow down, not one of its 16
DataLoader workers. Every process reading a prefix through one node cache therefore shares one
state, a small file in the cache's control directory (``<control>/congestion/<id>.state``) mapped
into memory and guarded by an ``flock`` held only for a few memory operations (never during I/O).
With no control directory (a plain ``open_store``) the state is private to the process.

The state, in the manner of botocore's adaptive retry mode but for a whole node:

- **window**: requests in flight node-wide (AIMD): starts at ``MAX_WINDOW``, halves on each
  throttling answer (never below 1), grows by one on each success;
- **gate**: after a throttling answer no request of the node starts before the gate, which moves
  ``d/2 + uniform(0, d/2)`` ahead with ``d = min(max_delay, base_delay * 2**(n-1))`` for the n-th
  throttling answer in a row; one success resets ``n``, so a store that recovers gets the link back
  at the next request;
- **budget** (optional, ``TransferConfig.max_requests_per_s``): a token bucket one second deep;
- counters: requests, throttled answers, seconds spent throttled (from the first throttling
  answer to the next success), shown by ``stats()``, ``StreamingDataset.stats()`` and
  ``datacache stat``.

In-flight requests are counted per pid, so a process that dies mid-request stops counting once a
waiter finds it gone. ``Congestion`` is thread-safe and fork-safe (a forked child reopens the file
and keeps its own count). Waiting for a free place in the window polls the shared state (1 to 20
ms, only while the node is over its window); waiting for the gate or a token sleeps until then.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import random
import struct
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .._localfs import pid_alive as _alive  # file helpers only: the store still imports no cache
from .retry import NodeBackoff, classify, describe

_log = logging.getLogger("datacache.store.storage")

__all__ = ["Congestion", "MAX_WINDOW", "node_states"]

MAX_WINDOW = 128  # 8 ranks x 8 workers x 2 request slots: no node is slowed by the window alone
_MAGIC = b"dcCONG01"
# magic, boot id, window, gate, consecutive, throttled, requests, throttle_s, throttled_since, tokens, token_t
_HEAD = struct.Struct("<8s16sddqqqdddd")
_URL_LEN = 512
_PID = struct.Struct("<ii")
_NPIDS = 256
_PIDS_AT = _HEAD.size + _URL_LEN
_SIZE = _PIDS_AT + _NPIDS * _PID.size
_FIELDS = ("window", "gate", "consecutive", "throttled", "requests", "throttle_seconds", "throttled_since",
           "tokens", "token_time")


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return hashlib.sha1(f.read().strip()).digest()[:16]
    except OSError:
        return b"\0" * 16


_open_lock = threading.Lock()  # first use by several threads at once opens one mapping


def _reset_open_lock() -> None:
    global _open_lock
    _open_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_open_lock)


class _Mapped:
    """The state of one prefix in a shared (or private) mapping; used under ``Congestion._locked``."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm

    def load(self) -> dict[str, Any]:
        vals = _HEAD.unpack_from(self.mm, 0)
        return dict(zip(("magic", "boot") + _FIELDS, vals))

    def save(self, st: dict[str, Any]) -> None:
        _HEAD.pack_into(self.mm, 0, _MAGIC, st["boot"], *(st[k] for k in _FIELDS))

    def init(self, url: str, boot: bytes) -> None:
        self.mm[:] = b"\0" * _SIZE
        raw = url.encode()[:_URL_LEN]
        self.mm[_HEAD.size:_HEAD.size + len(raw)] = raw
        self.save({"boot": boot, "window": float(MAX_WINDOW), "gate": 0.0, "consecutive": 0, "throttled": 0,
                   "requests": 0, "throttle_seconds": 0.0, "throttled_since": 0.0, "tokens": -1.0,
                   "token_time": 0.0})

    def url_bytes(self) -> bytes:
        return bytes(self.mm[_HEAD.size:_PIDS_AT]).rstrip(b"\0")

    def url(self) -> str:
        return self.url_bytes().decode(errors="replace")

    def pids(self) -> list[tuple[int, int]]:
        return list(_PID.iter_unpack(self.mm[_PIDS_AT:_SIZE]))

    def add_inflight(self, pid: int, n: int) -> None:
        free = None
        for i, (p, c) in enumerate(self.pids()):
            if p == pid:
                _PID.pack_into(self.mm, _PIDS_AT + i * _PID.size, pid, max(0, c + n))
                return
            if free is None and (p == 0 or c == 0):
                free = i
        if n > 0 and free is not None:  # a full table (256 busy pids) stops counting, never blocks
            _PID.pack_into(self.mm, _PIDS_AT + free * _PID.size, pid, n)

    def purge_dead(self) -> None:
        for i, (p, c) in enumerate(self.pids()):
            if p and c and not _alive(p):
                _PID.pack_into(self.mm, _PIDS_AT + i * _PID.size, 0, 0)


def state_path(control_dir: str, url: str) -> str:
    """The state file of store prefix ``url`` in a node cache's ``control_dir``."""
    return os.path.join(control_dir, "congestion", hashlib.sha1(url.encode()).hexdigest()[:20] + ".state")


class Congestion:
    """The node's congestion state for store prefix ``url`` (see the module docstring).

    ``control_dir``: the node cache's control directory (``NodeCache.control_dir``); ``None`` keeps
    the state in this process. ``base_delay``/``max_delay``: the gate's backoff (``RetryConfig``);
    ``max_requests_per_s``: the node's request budget (``TransferConfig``), or None.
    """

    def __init__(self, url: str, control_dir: str | None = None, *, base_delay: float = 0.2,
                 max_delay: float = 4.0, max_requests_per_s: float | None = None) -> None:
        self.url, self.control_dir = url, control_dir
        self.base_delay, self.max_delay, self.rate = base_delay, max_delay, max_requests_per_s
        self._pid = -1
        self._fd = -1
        self._state: _Mapped | None = None
        self._lock = threading.Lock()
        self._rng = random.Random()
        # this process's last throttling answer (``describe``d): what a request the gate turns away names
        self._answer: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in ("url", "control_dir", "base_delay", "max_delay", "rate")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("url"), state.pop("control_dir"), base_delay=state["base_delay"],  # type: ignore[misc]
                      max_delay=state["max_delay"], max_requests_per_s=state["rate"])

    def __repr__(self) -> str:
        return f"Congestion({self.url!r}, shared={self.control_dir is not None})"

    # ------------------------------------------------------------------ plumbing
    def _open(self) -> _Mapped:
        """This process's mapping (created on first use, again after a fork); process-private, with
        one warning, where the control directory has no room for the node's file."""
        if self.control_dir is None:
            return self._private()
        path = state_path(self.control_dir, self.url)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)  # inside the private control dir
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size != _SIZE:
                os.ftruncate(fd, _SIZE)
            try:  # every page backed now: a page of a sparse file on a full disk is a SIGBUS when touched
                os.posix_fallocate(fd, 0, _SIZE)
            except OSError as exc:
                os.close(fd)
                _log.warning("datacache: %s: no room for the node's congestion state (%s); this process "
                             "backs off on its own. Free space in %s", path, exc, self.control_dir)
                return self._private()
            state = _Mapped(mmap.mmap(fd, _SIZE))
            head = state.load()
            if (head["magic"] != _MAGIC or head["boot"] != _boot_id()
                    or state.url_bytes() != self.url.encode()[:_URL_LEN]):
                state.init(self.url, _boot_id())  # new file, or left from before a reboot
            state.add_inflight(os.getpid(), -(1 << 30))  # a reused pid starts from zero
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return state

    def _private(self) -> _Mapped:
        state = _Mapped(mmap.mmap(-1, _SIZE, flags=mmap.MAP_PRIVATE))
        state.init(self.url, _boot_id())
        return state

    @contextmanager
    def _locked(self) -> Iterator[_Mapped]:
        if self._pid != os.getpid():  # first use, or a forked child: its own lock, descriptor, count
            with _open_lock:
                if self._pid != os.getpid():
                    self._lock, self._fd = threading.Lock(), -1
                    self._state = self._open()
                    self._pid = os.getpid()
        assert self._state is not None
        with self._lock:
            if self._fd >= 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self._state
            finally:
                if self._fd >= 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close this process's descriptor (the shared state stays). Idempotent; a later request
        opens it again."""
        with _open_lock:
            if self._pid != os.getpid():
                return
            with self._lock:
                if self._fd >= 0:
                    os.close(self._fd)
                self._pid, self._fd = -1, -1

    # ------------------------------------------------------------------ requests
    def _admit(self, shm: _Mapped, now: float, purge: bool) -> float:
        """0 and the request is counted in flight, or how long to wait before asking again."""
        st = shm.load()
        if st["gate"] > now + 3600:  # a clock that cannot be ours: start afresh
            st["gate"] = 0.0
        if st["gate"] > now:
            return st["gate"] - now
        if self.rate:
            depth = max(1.0, self.rate)
            tokens = depth if st["tokens"] < 0 else st["tokens"]
            tokens = min(depth, tokens + max(0.0, now - st["token_time"]) * self.rate)
            st["tokens"], st["token_time"] = tokens, now
            if tokens < 1.0:
                shm.save(st)
                return (1.0 - tokens) / self.rate
        if purge:
            shm.purge_dead()
        if sum(c for _, c in shm.pids()) >= max(1, int(st["window"])):
            shm.save(st)
            return -1.0  # the window is full: poll
        if self.rate:
            st["tokens"] -= 1.0
        shm.save(st)
        shm.add_inflight(os.getpid(), 1)
        return 0.0

    def acquire(self, give_up_at: float, cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait for the node's gate, budget and window, then count one request in flight (pair
        with ``release``). False when that would pass ``give_up_at`` (a ``time.monotonic()``
        value) or ``cancelled()`` turned true: nothing is counted then."""
        poll, polled_since = 0.001, None
        while True:
            now = time.monotonic()
            with self._locked() as shm:
                wait = self._admit(shm, now, purge=polled_since is not None and now - polled_since > 1.0)
            if wait == 0.0:
                return True
            if wait < 0:
                polled_since = now if polled_since is None else polled_since
                wait, poll = poll, min(0.02, poll * 2)
            if now + wait > give_up_at or (cancelled is not None and cancelled()):
                return False
            time.sleep(wait)

    @contextmanager
    def request(self, give_up_at: float, cancelled: Callable[[], bool] | None = None) -> Iterator[None]:
        """One request to the store in the block: ``acquire`` (``NodeBackoff``, a throttling
        error, when that fails: it names this process's last throttling answer, which another
        thread's request may have had), then ``release`` with the outcome of the block's exception."""
        if not self.acquire(give_up_at, cancelled):
            answer = self._answer
            raise NodeBackoff("the node is backing off from a throttling store past this operation's deadline"
                              + (f" (the store's last throttling answer here: {answer})" if answer else ""))
        outcome = "error"
        try:
            yield
            outcome = "ok"
        except Exception as exc:
            outcome = classify(exc)
            if outcome == "throttled":
                self._answer = describe(exc)  # one str assignment: no lock needed
            raise
        finally:
            self.release(outcome)

    def release(self, outcome: str) -> None:
        """End a request counted by ``acquire``: ``outcome`` is "ok", "throttled" or anything else
        (an error that says nothing about congestion)."""
        now = time.monotonic()
        with self._locked() as shm:
            shm.add_inflight(os.getpid(), -1)
            st = shm.load()
            st["requests"] += 1
            if outcome == "throttled":
                st["throttled"] += 1
                st["consecutive"] += 1
                st["window"] = max(1.0, st["window"] / 2)
                d = min(self.max_delay, self.base_delay * 2 ** min(st["consecutive"] - 1, 30))
                st["gate"] = max(st["gate"], now + d / 2 + self._rng.uniform(0.0, d / 2))
                st["throttled_since"] = st["throttled_since"] or now
            elif outcome == "ok":
                st["consecutive"] = 0
                st["window"] = min(float(MAX_WINDOW), st["window"] + 1)
                if st["throttled_since"]:
                    st["throttle_seconds"] += max(0.0, now - st["throttled_since"])
                    st["throttled_since"] = 0.0
            shm.save(st)

    def stats(self) -> dict[str, Any]:
        """Node-wide: ``requests`` finished, ``throttled`` answers, ``throttle_seconds`` spent
        throttled (an ongoing spell included), ``concurrency`` (the window now), ``in_flight``."""
        with self._locked() as shm:
            return _summary(shm, time.monotonic())


def _summary(shm: _Mapped, now: float) -> dict[str, Any]:
    st = shm.load()
    since = st["throttled_since"]
    return {"url": shm.url(), "requests": st["requests"], "throttled": st["throttled"],
            "throttle_seconds": round(st["throttle_seconds"] + (now - since if since else 0.0), 3),
            "concurrency": int(st["window"]), "in_flight": sum(c for _, c in shm.pids()),
            "backing_off": st["gate"] > now}


def node_states(control_dir: str) -> list[dict[str, Any]]:
    """The congestion summary of every store prefix this node has read (for ``datacache stat``);
    a snapshot read without locking."""
    folder = os.path.join(control_dir, "congestion")
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                raw = f.read(_SIZE)
        except OSError:
            continue
        if len(raw) == _SIZE and raw.startswith(_MAGIC):
            mm = mmap.mmap(-1, _SIZE)
            mm[:] = raw
            out.append(_summary(_Mapped(mm), time.monotonic()))
    return out
