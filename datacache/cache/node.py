"""``NodeCache``: a RAM tier then an SSD tier, shared by every process on a node.

``get(key, fetch)`` returns a pinned ``CacheHandle`` on a local file: a RAM hit, else an SSD hit
(promoted to RAM when the policy says it is needed soon), else a miss, where ``fetch(path)`` is
called to write the bytes into a temporary file in the target tier (the cache imports no network
code). The temporary file is fsynced, its size and hash verified, and only then renamed into place
and recorded in the index, so a crash leaves nothing or a complete, verified entry.

Concurrency (see ``datacache._localfs`` for the locks):

- One fetch per key per node: the fetcher holds the key's ``flock``; other threads and processes
  asking for the key block on it in the kernel and find the entry when it is released. A fetcher
  that dies releases the lock with its last descriptor, and the next asker takes over.
- Budgets: an entry is added to a tier's ``used`` bytes only after victims have been removed in the
  same index transaction, so committed bytes never exceed a budget; on disk a budget is exceeded
  at most by the entries being written at that moment.
- Pins: a ``CacheHandle`` holds a shared ``flock`` on its file; eviction skips pinned files.

``NodeCache`` is thread-safe and fork-safe (the index is re-opened in a forked child).

Reporting and housekeeping: node-wide counters, entries, pins, free room, and ``clear``; every
such method is thread-safe and fork-safe, as the rest of ``NodeCache``'s are.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._localfs import (
    NO_SPACE_ERRNOS,
    KeyLock,
    ensure_private_dir,
    key_id,
    pinned_files,
    remove_if_exists,
    try_pin,
    unlock_close,
)
from ..config import CacheConfig
from ..errors import CacheError, IntegrityError
from ..hashing import hash_fd, hash_private_file
from .eviction import EvictionPolicy, LRUPolicy
from .handles import CacheHandle, PassDir
from .index import Entry, Index
from .placement import Victim, make_room
from .reconcile import NodeLock, clear, reconcile
from .tiers import Tier

__all__ = ["CacheHandle", "NodeCache"]

log = logging.getLogger("datacache.cache.node")
Fetch = Callable[[str], Any]


class NodeCache:
    """The node-local two-tier cache (see the module docstring)."""

    def __init__(self, config: CacheConfig | None = None, *, policy: EvictionPolicy | None = None) -> None:
        self.config = config or CacheConfig()
        self.policy: EvictionPolicy = policy or LRUPolicy()
        self.ram = Tier("ram", self.config.ram_dir, self.config.ram_bytes)
        self.ssd = Tier("ssd", self.config.ssd_dir, self.config.ssd_bytes)
        self.tiers = {"ram": self.ram, "ssd": self.ssd}
        self.control_dir = self._pick_control_dir()
        self.lock_dir = ensure_private_dir(os.path.join(self.control_dir, "locks"))
        self._pass = PassDir([self.ram, self.ssd], self.control_dir)
        self._access = threading.local()
        self.open_datasets: dict[int, frozenset[str]] = {}  # this process's readers of it (``reading``)
        self.index = Index(self.control_dir)
        self._node = NodeLock(self.control_dir)
        self.reconciled = self._node.join(lambda: reconcile(self.index, self.tiers, self.pass_dir,
                                                                      self.lock_dir))
        self.token = self._token()
        self._closed = False

    def _token(self) -> str:
        """This cache generation's verification token (a reconciliation issues a new one)."""
        with self.index.read() as txn:
            token = txn.meta("token")
        if token is None:
            with self.index.write() as txn:
                token = txn.meta("token") or uuid.uuid4().hex
                txn.set_meta("token", token)
        return token

    def _pick_control_dir(self) -> str:
        for base in (self.config.ssd_dir, self.config.ram_dir):
            try:
                return ensure_private_dir(os.path.join(base, "control"))
            except CacheError:
                raise
            except OSError:
                continue
        raise CacheError("no writable directory for the cache index", url=self.config.ssd_dir,
                         hint="Make ssd_dir or ram_dir writable (DATACACHE_SSD_DIR / DATACACHE_RAM_DIR)")

    @property
    def pass_dir(self) -> str:
        """Where pass-through copies (entries not admitted) are written now."""
        return self._pass.path

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Swap the eviction policy (e.g. when a dataset learns its future access order); the old
        one is closed."""
        old, self.policy = self.policy, policy
        if old is not policy:
            old.close()

    # ------------------------------------------------------------------ lookups
    def get(self, key: str, fetch: Fetch, *, size: int | None = None, hash: str | None = None,
            use_at: float | None = None, into: str | None = None) -> CacheHandle:
        """Return a pinned handle on ``key``'s bytes, fetching them with ``fetch(path)`` on a miss.

        ``size`` and ``hash`` (from the manifest) are verified before an entry becomes visible.
        ``use_at``: when a prefetcher asks ahead of time, the schedule time of the read this get
        serves; a clairvoyant policy then admits the entry only if its next use *after* that read
        comes before some cached entry's (MIN with bypass); otherwise it is served privately.
        ``into``: "ram" or "ssd" to fill a miss into that tier only, and not promote an SSD hit
        (``datacache warm`` fills the SSD part of a node's share so). Thread- and process-safe; at
        most one ``fetch`` per key runs on the node at a time.
        """
        self._check_open()
        if into not in (None, "ram", "ssd"):
            raise ValueError(f"into must be 'ram', 'ssd' or None, not {into!r}")
        self.policy.on_access(key)
        handle = self._lookup(key, promote=into is None)
        if handle is not None:
            return handle
        lock = KeyLock(self.lock_dir, key_id(key))
        with lock.held():
            handle = self._lookup(key, locked=True, promote=into is None)
            if handle is not None:
                self.index.count(waited=1)
                return handle
            self._access.key, self._access.use_at = key, use_at
            try:
                return self._fill(key, fetch, size, hash, into)
            finally:
                self._access.key = None

    def use_at(self, key: str) -> float | None:
        """The ``use_at`` of the get this thread is serving for ``key`` (None if none)."""
        return self._access.use_at if getattr(self._access, "key", None) == key else None

    def contains(self, key: str) -> str | None:
        """The fastest tier holding ``key`` ("ram"/"ssd"), or None. No pin is taken."""
        return _fastest(self.index.get(key))

    def contains_all(self, keys: Iterable[str]) -> bool:
        """Whether every one of ``keys`` is held now (one index read; no pin is taken)."""
        return all(_fastest(e) is not None for e in self.index.get_many(keys))

    def ram_files(self, keys: Sequence[str]) -> list[str | None]:
        """Per key, the path of its RAM tier file where the RAM tier holds it now, else None (one
        index read; no pin is taken, so the file may be evicted at any time: open it, then check it)."""
        ram = self.tiers["ram"]
        return [None if e is None or "ram" not in e.tiers else ram.file_path(e.tiers["ram"]["file"])
                for e in self.index.get_many(keys)]

    def peek(self, key: str, digest: str | None = None) -> CacheHandle | None:
        """A pinned handle on ``key``'s cached bytes (RAM first, verified as ``get`` verifies them), or
        None when the node does not hold them (or holds other content than ``digest``): no fetch, no
        promotion, no hit counted, no policy call. What a peer server serves. Thread- and process-safe."""
        self._check_open()
        return self._lookup(key, promote=False, touch=False, digest=digest)

    def _lookup(self, key: str, locked: bool = False, promote: bool = True, touch: bool = True,
                digest: str | None = None) -> CacheHandle | None:
        entry = self.index.get(key)
        if entry is None or (digest is not None and entry.hash != digest):
            return None
        for name in ("ram", "ssd"):
            rec = entry.tiers.get(name)
            if rec is None:
                continue
            tier = self.tiers[name]
            fd = try_pin(tier.file_path(rec["file"]))
            if fd is None:
                continue
            if (self.config.verify == "always" or rec.get("token") != self.token) and \
                    not self._verify(key, entry, name, rec, fd):
                continue
            handle = CacheHandle(key, tier.file_path(rec["file"]), entry.size, name, fd)
            if promote and name == "ssd" and self.ram.enabled and entry.size <= self.ram.budget and \
                    self.policy.should_promote(key):
                promoted = self._promote(key, entry, handle, locked)
                if promoted is not None:
                    return promoted
            if touch:
                self._touch(key, name, entry.size)
            return handle
        return None

    def _touch(self, key: str, tier: str, size: int) -> None:
        self.index.count(**{f"hits_{tier}": 1, f"bytes_{tier}": size})
        self.index.touch(key)

    def _verify(self, key: str, entry: Entry, tier: str, rec: dict[str, str], fd: int) -> bool:
        """Re-hash an entry file before serving it, through the pinned ``fd`` (another thread may
        have dropped the path meanwhile); drop it if it does not match."""
        path = self.tiers[tier].file_path(rec["file"])
        ok = os.fstat(fd).st_size == entry.size and hash_fd(fd) == entry.hash
        if ok:
            with self.index.write() as txn:
                e = txn.get(key)
                if e is not None and e.tiers.get(tier, {}).get("file") == rec["file"]:
                    e.tiers[tier]["token"] = self.token
                    txn.put(key, e)
            return True
        unlock_close(fd)
        if self._drop(key, tier, rec["file"]):  # once per file, when several threads verify it at once
            log.warning("datacache: cached file %s for %s failed verification (corrupt on disk); refetching",
                        path, key)
            self.index.count(corrupt=1)
        return False

    def _drop(self, key: str, tier: str, fname: str) -> bool:
        """Remove ``key``'s entry file ``fname`` from ``tier``; whether this call took it out of the
        index (False: another thread or process already had)."""
        with self.index.write() as txn:
            e = txn.get(key)
            dropped = e is not None and e.tiers.get(tier, {}).get("file") == fname
            if dropped:
                del e.tiers[tier]
                txn.put(key, e)
                txn.add_used(tier, -e.size)
        remove_if_exists(self.tiers[tier].file_path(fname))
        return dropped

    # ------------------------------------------------------------------ inserts
    def _fill(self, key: str, fetch: Fetch, size: int | None, digest: str | None,
              into: str | None = None) -> CacheHandle:
        kid = key_id(key)
        for tier in (self.ram, self.ssd, None):
            if tier is not None and (not tier.enabled or (size is not None and size > tier.budget)
                                     or into not in (None, tier.name) or not tier.has_room(size or 0)):
                continue
            tmp = tier.temp_path(kid) if tier else os.path.join(self._pass.dir_for(size or 0),
                                                                 f".pass-{kid}-{os.getpid()}-{time.time_ns()}")
            try:
                nbytes, h = self._download(key, fetch, tmp, size, digest)
            except OSError as exc:
                remove_if_exists(tmp)
                if tier is not None and exc.errno in NO_SPACE_ERRNOS:
                    tier.disable(f"no space left ({exc})", full=True)
                    continue
                if exc.errno in NO_SPACE_ERRNOS and self._pass.move_after(os.path.dirname(tmp), exc):
                    return self._fill(key, fetch, size, digest, into)
                if exc.errno in NO_SPACE_ERRNOS:  # not even a private pass-through copy fits
                    raise CacheError(f"no space left for a pass-through copy of {key} ({exc})", url=self.pass_dir,
                                     hint="Free space there, or give the cache a RAM tier (ram_bytes) on another "
                                     "file system") from exc
                raise
            except BaseException:
                remove_if_exists(tmp)
                raise
            if tier is None:
                return self._pass_through(key, tmp, nbytes)
            return self._commit(key, tier, tmp, nbytes, h)
        raise AssertionError("unreachable")

    def _download(self, key: str, fetch: Fetch, tmp: str, size: int | None, digest: str | None) -> tuple[int, str]:
        # O_TRUNC: a temp file of this key can only be left over by a fetcher that died.
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.close(fd)
        t0 = time.perf_counter()
        fetch(tmp)
        elapsed = time.perf_counter() - t0
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        nbytes = os.path.getsize(tmp)
        self.index.count(misses=1, fetches=1, remote_bytes=nbytes, fetch_seconds=elapsed)
        if size is not None and nbytes != size:
            raise IntegrityError(f"fetched {nbytes} bytes for {key}, the manifest declares {size}",
                                 hint="The object changed or is truncated: rebuild the manifest or re-upload it")
        h = hash_private_file(tmp)  # ours alone, under the key's lock: hashed in place
        if digest is not None and h != digest:
            raise IntegrityError(f"content hash of {key} is {h}, the manifest declares {digest}",
                                 hint="The object is corrupt or changed since the manifest was written")
        return nbytes, h

    def _pass_through(self, key: str, tmp: str, nbytes: int) -> CacheHandle:
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        self.index.count(bypassed=1)
        return CacheHandle(key, tmp, nbytes, "pass", fd)

    def _commit(self, key: str, tier: Tier, tmp: str, nbytes: int, digest: str) -> CacheHandle:
        """Rename a verified temp file into ``tier`` and index it, evicting (and demoting) victims."""
        fname = tier.new_name(key_id(key))
        final = tier.file_path(fname)
        os.replace(tmp, final)
        fd = try_pin(final)
        assert fd is not None, final
        try:
            admitted, victims = make_room(self.index, tier, key, nbytes, fname, digest, policy=self.policy,
                                          use_at=self.use_at(key), lock_dir=self.lock_dir, token=self.token,
                                          ssd=self.ssd)
        except BaseException:  # e.g. an LMDB error: the file was never indexed
            remove_if_exists(final)
            unlock_close(fd)
            raise
        if not admitted and tier is self.ram:  # not wanted in RAM: the SSD tier may still want it
            handle = self._try_ssd(key, final, nbytes, digest)
            if handle is not None:
                remove_if_exists(final)
                unlock_close(fd)
                return handle
        if not admitted:  # the policy bypasses it: serve it privately, deleted on release
            private = tier.file_path(f".pass-{fname}")
            os.replace(final, private)
            self.index.count(bypassed=1)
            return CacheHandle(key, private, nbytes, "pass", fd)
        self._finish(victims)
        return CacheHandle(key, final, nbytes, tier.name, fd)

    def _finish(self, victims: list[Victim]) -> None:
        """Demote the victims ``make_room`` marked (best effort), then drop every one of them, even
        if one raises: a victim's key lock must not outlive the call."""
        error: BaseException | None = None
        for v in victims:
            try:
                if v.demote and self.ssd.enabled:
                    self._demote(v)
            except BaseException as exc:
                error = error or exc
            finally:
                v.drop()
        if error is not None:
            raise error

    def _demote(self, v: Victim) -> None:
        try:
            handle = self._copy_in(v.key, v.path, self.ssd, v.entry.size, v.entry.hash)
        except Exception as exc:  # e.g. an LMDB error: demotion is best effort
            log.warning("datacache: could not demote %s to SSD: %s", v.key, exc)
            return
        if handle is not None:
            if handle.tier == "ssd":
                self.index.count(demotions=1)
            handle.release()

    def _try_ssd(self, key: str, path: str, nbytes: int, digest: str) -> CacheHandle | None:
        """Copy a file RAM turned down into the SSD tier; the SSD handle, or None if refused."""
        if not self.ssd.enabled or nbytes > self.ssd.budget:
            return None
        with self.index.read() as txn:
            e = txn.get(key)
        if e is not None and "ssd" in e.tiers:
            return None
        handle = self._copy_in(key, path, self.ssd, nbytes, digest)
        if handle is not None and handle.tier == "pass":
            handle.release()
            self.index.count(bypassed=-1)  # counted once, by the caller's pass-through
            return None
        return handle

    def _copy_in(self, key: str, src: str, tier: Tier, nbytes: int, digest: str) -> CacheHandle | None:
        """Copy the local file ``src`` into ``tier`` (temp, fsync, commit) for ``key``; the handle
        (tier "pass" if the policy refused it), or None when the tier's file system is full (the
        tier is then disabled with a warning, until it has room again) or has no room for the copy
        now (``Tier.has_room``). Used to promote, demote and fall through to SSD."""
        if not tier.has_room(nbytes):
            return None
        tmp = tier.temp_path(key_id(key))
        try:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            return self._commit(key, tier, tmp, nbytes, digest)
        except OSError as exc:
            remove_if_exists(tmp)
            if exc.errno in NO_SPACE_ERRNOS:
                tier.disable(f"no space left ({exc})", full=True)
                return None
            raise

    def _promote(self, key: str, entry: Entry, ssd_handle: CacheHandle, locked: bool) -> CacheHandle | None:
        lock = None
        if not locked:
            lock = KeyLock(self.lock_dir, key_id(key))
            if not lock.acquire(blocking=False):
                return None  # someone else is working on this key: serve from SSD
        try:
            if lock is not None:  # the entry may have changed between our lookup and taking its lock
                with self.index.read() as txn:
                    now = txn.get(key)
                if now is None or "ram" in now.tiers or \
                        now.tiers.get("ssd", {}).get("file") != os.path.basename(ssd_handle.path):
                    return None
            handle = self._copy_in(key, ssd_handle.path, self.ram, entry.size, entry.hash)
            if handle is None:
                return None
            if handle.tier == "pass":
                handle.release()
                return None
            self.index.count(promotions=1, hits_ssd=1, bytes_ssd=entry.size)
            ssd_handle.release()
            return handle
        finally:
            if lock is not None:
                lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError("NodeCache is closed", url=self.control_dir)

    def close(self) -> None:
        """Release this process's hold on the node cache. Idempotent; entries stay on disk."""
        if self._closed:
            return
        self._closed = True
        self.policy.close()
        self.index.close()
        self._node.close()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its config: a process started with spawn or forkserver (e.g. a DataLoader
        worker) opens the same node cache, as a new process on the node does (the eviction policy
        is the dataset's to install there)."""
        return (NodeCache, (self.config,))

    def __enter__(self) -> "NodeCache":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NodeCache({self.ram!r}, {self.ssd!r}, policy={self.policy.name})"

    index: Index
    tiers: dict[str, Tier]
    lock_dir: str

    def stats(self) -> dict[str, Any]:
        """Node-wide counters (summed over every process sharing the index) and tier usage."""
        self.index.flush()
        with self.index.read() as txn:
            out: dict[str, Any] = {k: (v if k == "fetch_seconds" else int(v)) for k, v in txn.counters().items()}
            for name, tier in self.tiers.items():
                out[f"used_{name}"] = txn.used(name)
                out[f"budget_{name}"] = tier.budget if tier.enabled else 0
            out["entries_ram"] = out["entries_ssd"] = 0
            for _, e in txn.items():
                for name in e.tiers:
                    out[f"entries_{name}"] += 1
        return out

    def entries(self) -> list[tuple[str, Entry]]:
        """Every indexed entry as (key, entry). A snapshot; no pins are taken."""
        with self.index.read() as txn:
            return list(txn.items())

    def entry_files(self, prefix: str = "") -> list[tuple[str, Entry, str, str]]:
        """(key, entry, tier, file path) of every entry file whose key starts with ``prefix``. A
        snapshot: a file may be evicted at any time, so pin it (``datacache._localfs.try_pin``) before reading."""
        return [(key, e, tier, self.tiers[tier].file_path(rec["file"]))
                for key, e in self.entries() if key.startswith(prefix) for tier, rec in e.tiers.items()]

    def pinned(self) -> dict[str, dict[str, int]] | None:
        """Entries pinned now per tier (``{"ram": {"entries", "bytes"}, "ssd": ...}``: held open by
        a reader, so not evictable), or None where pins cannot be seen (``datacache._localfs.pinned_files``)."""
        files = self.entry_files()
        held = pinned_files([path for *_, path in files])
        if held is None:
            return None
        pinned = set(held)
        out = {name: {"entries": 0, "bytes": 0} for name in self.tiers}
        for _, e, tier, path in files:
            if path in pinned:
                out[tier]["entries"] += 1
                out[tier]["bytes"] += e.size
        return out

    def room(self) -> dict[str, int]:
        """Free bytes each tier has now (its budget less what it holds; 0 for a disabled tier).
        Thread-safe; one index read."""
        with self.index.read() as txn:
            return {name: max(0, b - txn.used(name)) for name, b in self.budgets().items()}

    def budgets(self) -> dict[str, int]:
        """Bytes each tier may hold now ("ram", "ssd"; 0 for a disabled tier). Thread-safe."""
        return {name: (t.budget if t.enabled else 0) for name, t in self.tiers.items()}

    def reading(self, owner: object, datasets: frozenset[str]) -> None:
        """Note that ``owner`` (a dataset object) reads ``datasets`` through this cache in this
        process, until it is garbage (``others_reading``: the node mix's and part mix's decisions
        count it as a competing dataset before it has told the cache its plan). Thread-safe."""
        token = id(owner)
        self.open_datasets[token] = datasets  # type: ignore[attr-defined]
        weakref.finalize(owner, self.open_datasets.pop, token, None)  # type: ignore[attr-defined]

    def others_reading(self, datasets: frozenset[str]) -> bool:
        """Whether this process reads a dataset other than ``datasets`` through this cache."""
        return any(d - datasets for d in list(self.open_datasets.values()))  # type: ignore[attr-defined]

    def scratch_path(self, key: str, size: int) -> str | None:
        """Where a node-wide scratch copy of ``key`` may be filled (``datacache.cache.partial``): in the
        first enabled tier whose budget holds ``size`` bytes beside its entries and the scratch
        copies in it now, and whose file system has twice that free; else None (the caller fetches
        the whole shard). The name is new each call (``.tmp-<key id>.<generation>.part``), so a
        stale state can never name a newer copy's file; it starts with ``.tmp-``: reconciliation
        removes a leftover one."""
        with self.index.read() as txn:
            used = {name: txn.used(name) for name in self.tiers}
        for name, tier in self.tiers.items():
            if not tier.enabled:
                continue
            try:
                scratch = sum(_size(e) for e in tier.scan() if e.name.endswith(".part") and e.name.startswith(".tmp-"))
                free = shutil.disk_usage(tier.data_dir).free
            except OSError:
                continue
            if used[name] + scratch + size <= tier.budget and free >= 2 * size:
                return f"{tier.temp_path(key_id(key))}.{uuid.uuid4().hex[:12]}.part"
        return None

    def scratch_files(self, key: str) -> list[str]:
        """The paths of every scratch copy of ``key`` in the tiers now (``scratch_path``'s names)."""
        prefix = os.path.basename(next(iter(self.tiers.values())).temp_path(key_id(key))) + "."
        return [e.path for tier in self.tiers.values() for e in tier.scan()
                if e.name.startswith(prefix) and e.name.endswith(".part")]

    def count(self, **deltas: float) -> None:
        """Add to the node-wide counters of ``stats()`` (e.g. ``wait_seconds``, ``skipped_shards``);
        written at the next index transaction or ``flush_stats``. Thread-safe, no I/O."""
        self.index.count(**deltas)

    def flush_stats(self) -> None:
        """Write this process's pending counter deltas now."""
        self.index.flush()

    def clear(self, *, tiers: tuple[str, ...] = ("ram", "ssd"), dataset: str | None = None) -> int:
        """Remove unpinned entries (optionally only one dataset's); returns how many files went."""
        return clear(self.index, self.tiers, self.lock_dir, tiers, dataset)

    def reset_stats(self) -> None:
        with self.index.write() as txn:
            txn.reset_counters()


def _size(entry: Any) -> int:
    try:  # other processes' scratch copies come and go while we look
        return int(entry.stat(follow_symlinks=False).st_size)
    except FileNotFoundError:
        return 0


def _fastest(entry: Entry | None) -> str | None:
    """The fastest tier ``entry`` is held in ("ram"/"ssd"), or None."""
    return None if entry is None else next((t for t in ("ram", "ssd") if t in entry.tiers), None)
