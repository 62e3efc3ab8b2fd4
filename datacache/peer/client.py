"""Asking peers: signed HTTP requests on one event loop per process (aiohttp).

``Runtime`` is this process's loop thread (``datacache-peer-client``) and client session, made on
first use and made again in a forked child (a DataLoader worker) or an unpickled copy. Its
coroutines:

- ``get_shard``: a shard's bytes from one peer into a local file, checked as they come: the
  answer's length must be the manifest's (a longer body is cut off and refused: sizes are capped),
  the headers must come within ``connect_timeout + stall_timeout``, every chunk within
  ``stall_timeout`` (the first within ``fetch_timeout`` when the owner says it is downloading the
  shard for us), and the file must hash to the manifest's xxh3-128 before it counts (``PeerCorrupt``
  otherwise). Any failure raises ``PeerFailed`` (or its subclass), never a partial success.
- ``held``: a peer's held summary (``server``), capped at ``server.MAX_HELD`` entries.

Thread-safe: ``Runtime.call`` may be used from any thread; the coroutines run on the loop thread.
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any
from urllib.parse import quote

import aiohttp
import numpy as np
from yarl import URL

from ..config import PeerConfig
from ..hashing import hash_file
from .auth import HEADER, Signer
from .wire import BUDGET, CHUNK, FETCHING, MAX_HELD

__all__ = ["PeerFailed", "PeerCorrupt", "Runtime", "runtime", "get_shard", "held"]


class PeerFailed(Exception):
    """A peer did not deliver (unreachable, 4xx/5xx, stalled, cut off, wrong size). Carries no
    token; ``status`` is the HTTP status where one came."""

    def __init__(self, msg: str, status: int | None = None, timed_out: bool = False) -> None:
        super().__init__(msg)
        self.status, self.timed_out = status, timed_out


class PeerCorrupt(PeerFailed):
    """A peer's bytes did not hash to the manifest's hash."""


class Runtime:
    """One event loop thread and aiohttp session (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self._thread = threading.Thread(target=main, name="datacache-peer-client", daemon=True)
        self._thread.start()
        ready.wait()

    def session(self) -> aiohttp.ClientSession:
        """The session (on the loop thread only)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, limit_per_host=8, enable_cleanup_closed=True),
                timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        return self._session

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    """This process's ``Runtime`` (a new one in a forked child)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = Runtime()
        return _runtime


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) gets a lock of its own: another thread of the parent
    (the peer server's, asking for a shard it owns) may have held the lock at the fork, and the
    child's first ``runtime()`` would then wait for it forever."""
    global _runtime_lock
    _runtime_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _url(addr: str, path: str) -> URL:
    return URL(f"http://{addr}{path}", encoded=True)


async def get_shard(rt: Runtime, cfg: PeerConfig, signer: Signer, addr: str, dataset: str, name: str, digest: str,
                    size: int, path: str, *, fetch: bool) -> None:
    """Shard ``name`` (``size`` bytes, hash ``digest``) of ``dataset`` from the peer at ``addr`` into
    the file ``path``; ``fetch``: the peer is the shard's owner and downloads it on a miss."""
    target = f"/v1/shard/{quote(dataset, safe='')}/{quote(digest, safe='')}/{quote(name, safe='/')}"
    if fetch:
        target += "?fetch=1"
    headers = {HEADER: signer.sign("GET", target)}
    try:
        resp = await asyncio.wait_for(rt.session().get(_url(addr, target), headers=headers, allow_redirects=False),
                                      cfg.connect_timeout + cfg.stall_timeout)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        raise PeerFailed(f"no answer from {addr}: {type(exc).__name__}",
                         timed_out=isinstance(exc, asyncio.TimeoutError)) from None
    try:
        if resp.status != 200:
            raise PeerFailed(f"{addr} answered {resp.status}", resp.status)
        if resp.content_length != size:
            raise PeerFailed(f"{addr} announced {resp.content_length} bytes, the manifest {size}")
        first = resp.headers.get(FETCHING) == "1"
        got = 0
        with open(path, "wb") as f:
            while True:
                wait = cfg.fetch_timeout if first else cfg.stall_timeout
                try:
                    chunk = await asyncio.wait_for(resp.content.read(CHUNK), wait)
                except asyncio.TimeoutError:
                    raise PeerFailed(f"{addr} stalled for {wait:.1f} s at {got} of {size} bytes",
                                     timed_out=True) from None
                first = False
                if not chunk:
                    break
                got += len(chunk)
                if got > size:
                    raise PeerFailed(f"{addr} sent more than the manifest's {size} bytes")
                f.write(chunk)
        if got != size:
            raise PeerFailed(f"{addr} sent {got} of {size} bytes")
    except (aiohttp.ClientError, OSError) as exc:
        raise PeerFailed(f"transfer from {addr} failed: {type(exc).__name__}") from None
    finally:
        resp.release()
    actual = await asyncio.get_running_loop().run_in_executor(None, hash_file, path)
    if actual != digest:
        raise PeerCorrupt(f"{addr} sent bytes that hash to {actual}, the manifest declares {digest}")


async def held(rt: Runtime, cfg: PeerConfig, signer: Signer, addr: str, dataset: str) -> tuple[np.ndarray, int | None]:
    """The sorted name ids of ``dataset``'s shards the peer at ``addr`` holds, and its node cache's
    configured bytes (None if it did not say) (``PeerFailed``)."""
    target = f"/v1/held/{quote(dataset, safe='')}"
    budget: list[int | None] = [None]

    async def ask() -> bytes:
        async with rt.session().get(_url(addr, target), headers={HEADER: signer.sign("GET", target)},
                                    allow_redirects=False) as resp:
            if resp.status != 200:
                raise PeerFailed(f"{addr} answered {resp.status}", resp.status)
            if (resp.content_length or 0) > 8 * MAX_HELD:
                raise PeerFailed(f"{addr}'s summary is over {8 * MAX_HELD} bytes")
            text = resp.headers.get(BUDGET, "")
            budget[0] = int(text) if text.isdigit() and len(text) < 20 else None
            parts, got = [], 0
            while got <= 8 * MAX_HELD:
                part = await resp.content.read(CHUNK)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            return b"".join(parts)

    try:
        body = await asyncio.wait_for(ask(), cfg.connect_timeout + cfg.stall_timeout)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        raise PeerFailed(f"no summary from {addr}: {type(exc).__name__}") from None
    if len(body) % 8 or len(body) > 8 * MAX_HELD:
        raise PeerFailed(f"{addr}'s summary is malformed ({len(body)} bytes)")
    return np.sort(np.frombuffer(body, dtype="<u8").astype(np.uint64)), budget[0]
