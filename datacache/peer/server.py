"""The node's peer server: its cached shards, whole or by byte range, to the job's other nodes.

Endpoints (every request signed, ``datacache.peer.auth``; 401/403 and no byte otherwise):

- ``GET /v1/shard/<dataset id>/<hash>/<shard name>``: the shard's bytes from the node cache's RAM or
  SSD tier (a ``Range: bytes=a-b`` gets 206 and those bytes). Content keys only: the name and
  dataset id select an index entry, whose hash must equal ``<hash>``; no part of a request is ever
  used as a path, so there is nothing to traverse. 404 when the node does not hold it.
  ``?fetch=1`` (asked of a shard's owner only): on a miss the server downloads the shard from the
  store into its node cache (one download per node: the cache's per-key lock; a dataset opened by
  a process of the node registers how, ``register``) and serves it; the headers go out at once with
  ``X-Datacache-Fetching: 1``, so the asker tells a busy owner from a dead one.
- ``GET /v1/held/<dataset id>``: the shards of the dataset the node holds now, as sorted
  little-endian uint64 name ids (``placement.name_hashes``; 8 bytes a shard, capped), and the
  node cache's configured size (``X-Datacache-Budget``: owners are fitted to it, ``placement.fit``).

Every ``REPAIR_S`` seconds the server fetches back, from the peers holding them, the shards its
node owns but lacks (``Servable.repair``: stand-ins left on other nodes while it was not up).

Lifecycle (``serve``): once per node. The first datacache process of the node to take the node's
server lock (a ``flock`` in the cache's control directory, released by the kernel when its holder
dies) runs the server on a daemon thread; every other such process keeps a standby thread blocked
on that lock, which takes over if the holder dies. So the server lives as long as any datacache
process of the node, dies with the last (no orphan process can exist: it is a thread), and
DataLoader workers coming and going never touch it (they never serve; a forked child drops its
copy of the lock). No pickle on the wire; access logs off (nothing of a request is logged).
Thread-safe.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
from aiohttp import web

from ..cache.node import CacheHandle, NodeCache
from ..errors import ManifestError
from ..manifest import validate_shard_name
from .auth import HEADER, Signer, check
from .membership import Membership
from .placement import name_hashes
from .wire import BUDGET, CHUNK, FETCHING, MAX_HELD

__all__ = ["PeerServer", "Servable", "register", "serve"]

log = logging.getLogger("datacache.peer")
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_HASH_RE = re.compile(r"^[a-z0-9_]+:[0-9a-f]{16,128}$")
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


class Servable(Protocol):
    """What a dataset opened on the node registers: how to download one of its shards for a peer."""

    def size_of(self, name: str, digest: str) -> int | None:
        """The shard's bytes, or None if the dataset has no shard ``name`` of hash ``digest``."""

    def fetch_for_peer(self, name: str, digest: str) -> CacheHandle:
        """The shard, pinned, downloaded on a miss (from a holder or the store, never another owner)."""

    def repair(self, limit: int = 16) -> int:
        """Fetch owned shards the node lacks from the peers that hold them; how many came."""


_registry: dict[str, "weakref.ref[Any]"] = {}
_registry_lock = threading.Lock()


def register(dataset_id: str, source: Servable) -> None:
    """Let this process's server download ``dataset_id``'s shards for an asking peer (kept while
    ``source`` lives). Thread-safe."""
    with _registry_lock:
        _registry[dataset_id] = weakref.ref(source)


def _registered(dataset_id: str) -> Servable | None:
    with _registry_lock:
        ref = _registry.get(dataset_id)
    return ref() if ref is not None else None


def _all_registered() -> list[Servable]:
    with _registry_lock:
        refs = list(_registry.values())
    return [s for s in (r() for r in refs) if s is not None]


REPAIR_S = 5.0  # seconds between the server's repair rounds


class PeerServer:
    """The aiohttp server of one node (see the module docstring); ``start`` runs it on a thread."""

    def __init__(self, cache: NodeCache, membership: Membership) -> None:
        assert membership.bind is not None
        self.cache, self.membership = cache, membership
        self.host, self.port = membership.bind
        self._signers = (Signer(membership.token),)
        self._validity = membership.config.validity
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="datacache-peer-io")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="datacache-peer-server", daemon=True)

    def __repr__(self) -> str:
        return f"PeerServer({self.host}:{self.port})"

    def start(self, timeout: float = 30.0) -> "PeerServer":
        """Listen (returns once listening, or raises the bind error)."""
        self._thread.start()
        self._ready.wait(timeout)
        if self.error is not None:
            raise self.error
        return self

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._listen())
        except BaseException as exc:  # the bind failed: start() raises it
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()

    async def _listen(self) -> None:
        app = web.Application(middlewares=[self._auth], client_max_size=4096)
        app.router.add_get("/v1/shard/{dataset}/{digest}/{name:.+}", self._shard)
        app.router.add_get("/v1/held/{dataset}", self._held)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()
        self._repairs = asyncio.ensure_future(self._repair())

    async def _repair(self) -> None:
        """Every ``REPAIR_S`` seconds, each registered dataset's ``repair`` (owned shards held by
        peers only, fetched back); errors are logged, never raised."""
        while True:
            await asyncio.sleep(REPAIR_S)
            for source in _all_registered():
                try:
                    await self._run(source.repair)
                except web.HTTPServiceUnavailable:
                    return
                except Exception as exc:  # noqa: BLE001 - best effort, next round
                    log.warning("datacache: peer repair failed: %s", exc)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        code = check(self._signers, request.method, request.raw_path, request.headers.get(HEADER), self._validity)
        if code != 200:
            self.cache.count(peer_refused=1)
            await self._run(self.cache.flush_stats)
            raise (web.HTTPUnauthorized if code == 401 else web.HTTPForbidden)(text="datacache peer: not authorized")
        return await handler(request)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except RuntimeError as exc:  # the interpreter is exiting: its thread pools take nothing new
            if "shutdown" not in str(exc):
                raise
            raise web.HTTPServiceUnavailable(text="datacache peer: shutting down") from None

    async def _shard(self, request: web.Request) -> web.StreamResponse:
        ds, digest, name = (request.match_info[k] for k in ("dataset", "digest", "name"))
        try:
            validate_shard_name(name)
        except ManifestError:
            raise web.HTTPBadRequest(text="datacache peer: bad shard name") from None
        if not _ID_RE.match(ds) or not _HASH_RE.match(digest):
            raise web.HTTPBadRequest(text="datacache peer: bad dataset id or hash")
        handle = await self._run(self.cache.peek, f"{ds}/{name}", digest)
        if handle is not None:
            return await self._send(request, handle, request.headers.get("Range"))
        source = _registered(ds) if request.query.get("fetch") == "1" else None
        size = None if source is None else source.size_of(name, digest)
        if source is None or size is None:
            raise web.HTTPNotFound(text="datacache peer: not held")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Content-Length": str(size),
                                           FETCHING: "1"})
        await resp.prepare(request)
        try:
            handle = await self._run(source.fetch_for_peer, name, digest)
        except Exception as exc:  # the asker sees a cut transfer and goes on to the store
            log.warning("datacache: peer server could not fetch %s/%s for a peer: %s", ds, name, exc)
            if request.transport is not None:
                request.transport.close()
            return resp
        return await self._send(request, handle, None, resp)

    async def _send(self, request: web.Request, handle: CacheHandle, rng: str | None,
                    resp: web.StreamResponse | None = None) -> web.StreamResponse:
        """Stream ``handle``'s bytes (a range of them), releasing the pin whatever happens."""
        try:
            start, end = 0, handle.size
            if rng is not None:
                m = _RANGE_RE.match(rng.strip())
                start = int(m.group(1)) if m else handle.size
                end = min(handle.size, int(m.group(2)) + 1) if m and m.group(2) else handle.size
                if start >= end:
                    raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{handle.size}"})
            if resp is None:
                headers = {"Content-Type": "application/octet-stream", "Content-Length": str(end - start)}
                if rng is not None:
                    headers["Content-Range"] = f"bytes {start}-{end - 1}/{handle.size}"
                resp = web.StreamResponse(status=206 if rng is not None else 200, headers=headers)
                await resp.prepare(request)
            fd = os.open(handle.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                pos = start
                while pos < end:
                    chunk = await self._run(os.pread, fd, min(CHUNK, end - pos), pos)
                    if not chunk:
                        raise OSError(f"{handle.path} ended at {pos} of {end} bytes")
                    await resp.write(chunk)
                    pos += len(chunk)
            finally:
                os.close(fd)
            await resp.write_eof()
            self.cache.count(peer_bytes_served=end - start, peer_served=1)
            await self._run(self.cache.flush_stats)
            return resp
        finally:
            handle.release()

    async def _held(self, request: web.Request) -> web.Response:
        ds = request.match_info["dataset"]
        if not _ID_RE.match(ds):
            raise web.HTTPBadRequest(text="datacache peer: bad dataset id")
        names = await self._run(self._held_names, ds)
        ids = np.sort(name_hashes(names[:MAX_HELD])).astype("<u8")
        budget = int(self.cache.config.ram_bytes) + int(self.cache.config.ssd_bytes)
        return web.Response(body=ids.tobytes(), content_type="application/octet-stream",
                            headers={BUDGET: str(budget)})

    def _held_names(self, ds: str) -> list[str]:
        prefix = f"{ds}/"
        return [k[len(prefix):] for k, e in self.cache.entries() if k.startswith(prefix) and e.tiers]

    def close(self) -> None:
        """Stop listening and end the thread. Idempotent."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def stop() -> None:
            if getattr(self, "_repairs", None) is not None:
                self._repairs.cancel()
            if self._runner is not None:
                await self._runner.cleanup()

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False)


# ---------------------------------------------------------------- one server per node
class _Lease:
    """This process's part in the node's server: the lock's descriptor, and the server once held."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.server: PeerServer | None = None


_leases: dict[str, _Lease] = {}
_leases_lock = threading.Lock()
_forked = False  # this process is a forked child (a DataLoader worker): it never serves


def serve(cache: NodeCache, membership: Membership) -> PeerServer | None:
    """Make sure the node's server runs (see the module docstring): this process's server if it
    took the node's lock now, else None (another process serves; a standby thread takes over when it
    dies). Once per process and address; a reader-only membership serves nothing."""
    if membership.bind is None or _forked:
        return None
    host, port = membership.bind
    path = os.path.join(cache.control_dir, f"peer-server-{port}.lock")
    with _leases_lock:
        lease = _leases.get(path)
        if lease is not None:
            return lease.server
        lease = _leases[path] = _Lease(path)
    try:
        fcntl.flock(lease.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        threading.Thread(target=_standby, args=(lease, cache, membership), name="datacache-peer-standby",
                         daemon=True).start()
        return None
    return _start(lease, cache, membership)


def _start(lease: _Lease, cache: NodeCache, membership: Membership) -> PeerServer | None:
    try:
        lease.server = PeerServer(cache, membership).start()
    except OSError as exc:
        log.warning("datacache: the peer server cannot listen on %s:%s (%s); this node reads from its peers but "
                    "serves none", *membership.bind or ("?", "?"), exc)
        return None
    return lease.server


def _standby(lease: _Lease, cache: NodeCache, membership: Membership) -> None:
    try:
        fcntl.flock(lease.fd, fcntl.LOCK_EX)  # blocks until the serving process is gone
    except OSError:
        return
    if lease.fd >= 0:
        _start(lease, cache, membership)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) serves nothing: drop its copies of the locks (closing a
    copy leaves the parent's lock held) and forget the parent's servers (their threads are not here)."""
    global _forked
    _forked = True
    for lease in _leases.values():
        try:
            os.close(lease.fd)
        except OSError:
            pass
        lease.fd = -1
    _leases.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
