"""``PeerTier``: the fetch the read layer hands the node cache, peers first, then the store.

For a shard the node cache lacks (the cache holds the key's lock, so this runs once per node):

1. the peers that hold it (their held summaries, refreshed every ``HELD_TTL`` seconds and kept by
   the loop thread), in the shard's rendezvous order; this job's nodes first, then read-only ones;
2. the shard's owner with ``fetch=1`` (it downloads the shard from the store for the whole job,
   once: its own node cache's lock), unless this node is the owner;
3. the store, through ``store_fetch`` (the read layer's ranged GETs).

Each source gets the next only when it fails (answer, status, stall, size or hash: ``client``), or
when a holder's transfer is not done ``hedge_delay + size / hedge_bandwidth`` seconds after it began:
then the next source starts beside it (a hedge) and the first complete, verified copy wins; the
others are cancelled and their files removed. An owner that says it is downloading is not hedged:
that download is the job's one. A peer that timed out is left out for ``DOWN_FOR`` seconds. When the
store had to serve a shard another node owns (its owner did not answer: a node not up yet, or gone),
this node keeps it as a stand-in (``NodePolicy.stand_in``), and the owner, when it needs the shard,
takes it from there: a cold start whose nodes start apart still reads the store once. So a shard
arrives, or the store's own error is raised, within the deadlines of ``PeerConfig``.
Peer bytes are verified against the manifest's hash before they are
handed to the cache (which verifies again); a mismatch counts as ``corrupt`` and goes to the next
source. Counters (node-wide, in the node cache's statistics): ``peer_bytes_from_peers``,
``peer_bytes_from_store``, ``peer_fallbacks``, ``peer_hedged``, ``peer_corrupt``.

Thread-safe: ``fetch_into`` may be called from any thread; the state it shares lives on the
client's loop thread. Picklable (a spawned DataLoader worker makes its own loop).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._localfs import remove_if_exists
from ..errors import ReadCancelledError
from .auth import Signer
from .client import PeerCorrupt, PeerFailed, get_shard, held, runtime
from .membership import Membership
from .placement import fit, name_hashes, owners, rendezvous

if TYPE_CHECKING:
    from ..cache.node import NodeCache

__all__ = ["PeerTier", "StoreFetch", "HELD_TTL"]

log = logging.getLogger("datacache.peer")
HELD_TTL = 2.0  # seconds a peer's held summary is trusted
DOWN_FOR = 5.0  # seconds a peer that did not answer is left out
StoreFetch = Callable[[str, Callable[[], bool]], None]  # (path, cancelled) -> None
_STORE = ("", False, None)


class _Lost(Exception):
    """A hedged store download finished after another source won."""


class PeerTier:
    """Peers, then the store, for one dataset's shards (see the module docstring).

    ``names``, ``sizes``, ``hashes``: the manifest's shards; ``owner``: each shard's owner node
    (index into ``membership.peers``; default: rendezvous over them)."""

    def __init__(self, membership: Membership, cache: "NodeCache", dataset: str, names: Sequence[str],
                 sizes: Sequence[int], hashes: Sequence[str], owner: np.ndarray | None = None) -> None:
        self.membership, self.cache, self.dataset = membership, cache, dataset
        self.names, self.sizes, self.hashes = list(names), [int(s) for s in sizes], list(hashes)
        self.ids = name_hashes(self.names)
        self.owner = np.asarray(owner if owner is not None else owners(self.ids, membership.peers, self.sizes),
                                dtype=np.int32)
        self.cfg = membership.config
        self._signer, self._ro_signer = Signer(membership.token), Signer(membership.readonly_token)
        self._held: dict[str, np.ndarray] = {}
        self._held_at = -1e9
        self._refresh: asyncio.Future[None] | None = None
        self._down: dict[str, float] = {}
        self._answered: set[str] = set()  # peers that answered a summary request once
        self.budgets: dict[str, int] = {}  # address -> the node cache's configured bytes, as its server said
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"PeerTier({self.dataset}, peers={list(self.membership.peers)}, me={self.membership.me})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_refresh=None, _held={}, _held_at=-1e9, _down={}, _answered=set(), budgets={}, _pid=-1)
        return state

    def _loop_state(self) -> None:
        """In a forked child, forget the parent's loop-bound state (a refresh in flight at the fork
        belongs to the parent's loop); the summaries are asked again."""
        if self._pid != os.getpid():
            self._pid, self._refresh, self._held_at, self._down = os.getpid(), None, -1e9, {}

    def owned(self) -> np.ndarray:
        """Indices of the shards this node owns."""
        return np.flatnonzero(self.owner == self.membership.me)

    # ------------------------------------------------------------------ the fetch
    def fetch_into(self, shard: int, path: str, store_fetch: StoreFetch | None,
                   cancelled: Callable[[], bool] | None = None) -> str:
        """Shard number ``shard`` into the file ``path``: from a peer, else the store (see the
        module docstring); returns where it came from (``"peer"`` or ``"store"``). Raises the
        store's error when every source failed, ``ReadCancelledError`` once ``cancelled()``.
        ``store_fetch=None``: from a peer that holds it or nothing (``PeerFailed``)."""
        if store_fetch is not None and not self.membership.others and not self.membership.readonly:
            return self._store_only(shard, path, store_fetch, cancelled)
        self._loop_state()
        return runtime().call(self._fetch(shard, path, store_fetch, cancelled or (lambda: False)))

    def join(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds until every peer has answered once (any answer: it is up),
        and take their summaries; the peers that did not answer."""
        async def wait() -> list[str]:
            deadline = time.monotonic() + timeout
            while True:
                self._held_at = -1e9
                await self._refreshed()
                silent = [a for a in (*(self.membership.peers[k] for k in self.membership.others),
                                      *self.membership.readonly) if a not in self._answered]
                if not silent or time.monotonic() >= deadline:
                    return silent
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        self._loop_state()
        return runtime().call(wait())

    def fit_owners(self, own_budget: int) -> bool:
        """Refit the owners to the nodes' cache sizes (``placement.fit``) once every node of the job
        has told its own (``join``); whether it did. Every node computes the same from the same
        sizes; a node that did not answer leaves the owners as they were."""
        m = self.membership
        budgets = [own_budget if k == m.me else self.budgets.get(a) for k, a in enumerate(m.peers)]
        if m.me < 0 or any(b is None for b in budgets):
            return False
        self.owner = fit(self.owner, self.sizes, [int(b) for b in budgets if b is not None], self.ids, m.peers)
        return True

    def held_elsewhere(self, shards: Sequence[int]) -> list[int]:
        """Those of ``shards`` some peer holds now (its summary at most ``HELD_TTL`` seconds old)."""
        async def ask() -> list[int]:
            await self._refreshed()
            peers = [a for a in (*self.membership.peers, *self.membership.readonly)
                     if a not in self.membership.peers[self.membership.me:self.membership.me + 1]]
            return [i for i in shards if any(self._holds(a, self.ids[i]) for a in peers)]
        self._loop_state()
        return runtime().call(ask()) if shards else []

    def _store_only(self, shard: int, path: str, store_fetch: StoreFetch, cancelled: Callable[[], bool] | None) -> str:
        store_fetch(path, cancelled or (lambda: False))
        self.cache.count(peer_bytes_from_store=self.sizes[shard])
        return "store"

    async def _candidates(self, shard: int, store: bool = True) -> list[tuple[str, bool, Signer | None]]:
        """(address, fetch, signer) to ask in turn, the store (``_STORE``) last; ``store=False``:
        the holders only."""
        await self._refreshed()
        m, now, sid = self.membership, time.monotonic(), self.ids[shard]
        up = [a for a in m.peers if self._down.get(a, 0.0) <= now]
        order = [int(k) for k in rendezvous(self.ids[shard:shard + 1], m.peers)[0]] if m.peers else []
        owner = int(self.owner[shard])
        out: list[tuple[str, bool, Signer | None]] = []
        for k in order:
            addr = m.peers[k]
            if k != m.me and addr in up and self._holds(addr, sid):
                out.append((addr, k == owner, self._signer))
        out += [(a, False, self._ro_signer) for a in m.readonly if self._down.get(a, 0.0) <= now and
                self._holds(a, sid)]
        if not store:
            return [(a, False, s) for a, _, s in out]
        if 0 <= owner < len(m.peers) and owner != m.me and m.peers[owner] in up and \
                not any(addr == m.peers[owner] for addr, *_ in out):
            out.append((m.peers[owner], True, self._signer))
        return out + [_STORE]

    def _holds(self, addr: str, sid: np.uint64) -> bool:
        ids = self._held.get(addr)
        if ids is None or not len(ids):
            return False
        i = int(np.searchsorted(ids, sid))
        return i < len(ids) and ids[i] == sid

    async def _refreshed(self) -> None:
        """Every peer's held summary, at most ``HELD_TTL`` seconds old (one refresh at a time)."""
        if time.monotonic() - self._held_at < HELD_TTL:
            return
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._ask_held())
        await asyncio.shield(self._refresh)

    async def _ask_held(self) -> None:
        m, rt = self.membership, runtime()
        asks = [(m.peers[k], self._signer) for k in m.others] + [(a, self._ro_signer) for a in m.readonly]
        got = await asyncio.gather(*(held(rt, self.cfg, s, a, self.dataset) for a, s in asks), return_exceptions=True)
        now = time.monotonic()
        for (addr, _), ans in zip(asks, got):  # a peer not up yet holds nothing (and is asked again later)
            self._held[addr] = np.zeros(0, dtype=np.uint64) if isinstance(ans, BaseException) else ans[0]
            if not isinstance(ans, BaseException) and ans[1] is not None:
                self.budgets[addr] = ans[1]
            if not isinstance(ans, BaseException) or (isinstance(ans, PeerFailed) and ans.status is not None):
                self._answered.add(addr)
        self._held_at = now

    async def _fetch(self, shard: int, path: str, store_fetch: StoreFetch | None,
                     cancelled: Callable[[], bool]) -> str:
        cands = await self._candidates(shard, store=store_fetch is not None)
        if not cands:
            raise PeerFailed(f"no peer holds {self.names[shard]}")
        size = self.sizes[shard]
        lost = threading.Event()
        tasks: dict[asyncio.Future[Any], tuple[tuple[str, bool, Signer | None], str, float]] = {}
        nxt = 0
        error: BaseException | None = None

        def start() -> None:
            nonlocal nxt
            cand, tmp = cands[nxt], f"{path}.src{nxt}"
            nxt += 1
            if cand is _STORE:
                assert store_fetch is not None
                fut = asyncio.get_running_loop().run_in_executor(None, _store_job, store_fetch, tmp, cancelled, lost)
            else:
                addr, fetch, signer = cand
                assert signer is not None
                fut = asyncio.ensure_future(get_shard(runtime(), self.cfg, signer, addr, self.dataset,
                                                      self.names[shard], self.hashes[shard], size, tmp, fetch=fetch))
            tasks[fut] = (cand, tmp, time.monotonic())

        start()
        try:
            while tasks:
                wait = self._hedge_wait(tasks, nxt < len(cands), size)
                done, _ = await asyncio.wait(list(tasks), timeout=min(wait, 0.1), return_when=asyncio.FIRST_COMPLETED)
                if cancelled():
                    raise ReadCancelledError(f"fetch of {self.names[shard]} cancelled")
                if not done:
                    if wait <= 0.1 and nxt < len(cands):
                        self.cache.count(peer_hedged=1)
                        start()
                    continue
                for fut in done:
                    cand, tmp, _ = tasks.pop(fut)
                    exc = fut.exception()
                    if exc is None:
                        return self._won(shard, cand, tmp, path, size)
                    error = exc
                    remove_if_exists(tmp)
                    self._failed(cand, exc)
                if not tasks and nxt < len(cands):
                    start()
            assert error is not None
            raise error
        finally:
            lost.set()
            for fut, (_, tmp, _) in tasks.items():
                fut.cancel()
                if isinstance(fut, asyncio.Task):
                    remove_if_exists(tmp)

    def _hedge_wait(self, tasks: dict[Any, Any], more: bool, size: int) -> float:
        """Seconds until the newest running source should be hedged (inf: never)."""
        (addr, fetch, _), _, began = list(tasks.values())[-1]
        if not more or not addr or fetch:
            return float("inf")
        return began + self.cfg.hedge_delay + size / self.cfg.hedge_bandwidth - time.monotonic()

    def _won(self, shard: int, cand: tuple[str, bool, Signer | None], tmp: str, path: str, size: int) -> str:
        os.replace(tmp, path)
        if cand is _STORE:
            self.cache.count(peer_bytes_from_store=size)
            owner = int(self.owner[shard])
            stand_in = getattr(self.cache.policy, "stand_in", None)
            if owner != self.membership.me and self.membership.me >= 0 and stand_in is not None:
                stand_in(f"{self.dataset}/{self.names[shard]}")  # its owner could not: keep it for the job
            return "store"
        self.cache.count(peer_bytes_from_peers=size)
        return "peer"

    def _failed(self, cand: tuple[str, bool, Signer | None], exc: BaseException) -> None:
        addr = cand[0]
        if not addr:
            return
        self.cache.count(peer_fallbacks=1, **({"peer_corrupt": 1} if isinstance(exc, PeerCorrupt) else {}))
        if isinstance(exc, PeerCorrupt):
            log.warning("datacache: %s; fetching it elsewhere", exc)
        elif isinstance(exc, PeerFailed) and exc.timed_out:  # refused or cut: cheap to ask again
            self._down[addr] = time.monotonic() + DOWN_FOR
        if not isinstance(exc, PeerFailed):
            log.warning("datacache: peer %s failed: %r", addr, exc)
        elif not isinstance(exc, PeerCorrupt):  # handled (the next holder, or the store): why, for whoever asks
            log.info("datacache: a peer did not deliver (%s); fetching it elsewhere", exc)


def _store_job(store_fetch: StoreFetch, tmp: str, cancelled: Callable[[], bool], lost: threading.Event) -> None:
    """The store's download into ``tmp`` (in a thread); its file removed unless it is the winner."""
    try:
        os.close(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))  # read_into fills a file
        store_fetch(tmp, lambda: lost.is_set() or cancelled())
    except BaseException:
        remove_if_exists(tmp)
        raise
    if lost.is_set():
        remove_if_exists(tmp)
        raise _Lost()
