"""``NodeCache``: a RAM tier then an SSD tier, shared by every process on a node.

``get(key, fetch)`` returns a pinned ``CacheHandle`` on a local file: a RAM hit, else an SSD hit
(promoted to RAM when the policy says it is needed soon), else a miss, where ``fetch(path)`` is
called to write the bytes into a temporary file in the target tier (the cache imports no network
code). The temporary file is fsynced, its size and hash verified, and only then renamed into place
and recorded in the index, so a crash leaves nothing or a complete, verified entry.

Concurrency (see ``tiers`` for the locks):

- One fetch per key per node: the fetcher holds the key's ``flock``; other threads and processes
  asking for the key block on it in the kernel and find the entry when it is released. A fetcher
  that dies releases the lock with its last descriptor, and the next asker takes over.
- Budgets: an entry is added to a tier's ``used`` bytes only after victims have been removed in the
  same index transaction, so committed bytes never exceed a budget; on disk a budget is exceeded
  at most by the entries being written at that moment.
- Pins: a ``CacheHandle`` holds a shared ``flock`` on its file; eviction skips pinned files.

``NodeCache`` is thread-safe and fork-safe (the index is re-opened in a forked child).
"""
from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from .config import CacheConfig
from .errors import CacheError, IntegrityError
from .eviction import EvictionPolicy, LRUPolicy
from .hashing import hash_file
from .index import Entry, Index
from .tiers import NO_SPACE_ERRNOS, KeyLock, Tier, ensure_private_dir, key_id, try_pin, unlock_close
from . import _reconcile
from ._placement import finish_all, make_room

__all__ = ["NodeCache", "CacheHandle"]

log = logging.getLogger("datacache.cache")
Fetch = Callable[[str], Any]


class CacheHandle:
    """A pinned local file holding one entry. ``path`` stays valid until ``release()``.

    ``tier`` is "ram", "ssd" or "pass" (not admitted: a private file deleted on release). Release
    is idempotent; a handle is also a context manager. Not thread-safe (one owner at a time).
    """

    def __init__(self, key: str, path: str, size: int, tier: str, fd: int) -> None:
        self.key, self.path, self.size, self.tier = key, path, size, tier
        self._fd = fd
        self._pid = os.getpid()
        self._lock = threading.Lock()

    @property
    def fd(self) -> int:
        return self._fd

    def mmap(self) -> mmap.mmap:
        """A read-only memory map of the entry (valid while the handle is held)."""
        return mmap.mmap(self._fd, 0, prot=mmap.PROT_READ) if self.size else mmap.mmap(-1, 1)

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def release(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd < 0:
            return
        if self._pid != os.getpid():  # a forked child's copy: the pin (and a pass file) are the parent's
            os.close(fd)
            return
        if self.tier == "pass":
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        unlock_close(fd)

    def __enter__(self) -> "CacheHandle":
        return self

    def __exit__(self, *_: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"CacheHandle({self.key!r}, tier={self.tier!r}, size={self.size})"


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
        self.pass_dir = self._pick_pass_dir()
        self._pass_lock = threading.Lock()
        self._access = threading.local()
        self.index = Index(self.control_dir)
        self._node_fd, self.token, self.reconciled = _reconcile.open_node(self)
        self._closed = False

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

    def _pick_pass_dir(self) -> str:
        for tier in (self.ram, self.ssd):
            if tier.enabled:
                return tier.data_dir
        return ensure_private_dir(os.path.join(self.control_dir, "pass"))

    def _spare_pass_dir(self, failed_dir: str, exc: OSError) -> bool:
        """Move pass-through copies to a private dir on another file system (``/dev/shm`` or the temp
        dir) after ENOSPC in ``failed_dir``; False when there is none left to try. Thread-safe."""
        with self._pass_lock:
            if self.pass_dir != failed_dir:
                return True  # another thread already moved them
            return self._move_pass_dir(exc)

    def _move_pass_dir(self, exc: OSError) -> bool:
        for base in ("/dev/shm", tempfile.gettempdir()):
            path = os.path.join(base, f"datacache-pass-{os.getuid()}")
            if not os.path.isdir(base) or os.path.realpath(path) == os.path.realpath(self.pass_dir):
                continue
            if os.path.exists(self.pass_dir) and os.stat(base).st_dev == os.stat(self.pass_dir).st_dev:
                continue
            try:
                self.pass_dir = ensure_private_dir(path)
            except OSError:
                continue
            log.warning("datacache: no space for pass-through copies (%s); using %s and continuing", exc, path)
            return True
        return False

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Swap the eviction policy (e.g. when a dataset learns its future access order)."""
        self.policy = policy

    # ------------------------------------------------------------------ lookups
    def get(self, key: str, fetch: Fetch, *, size: int | None = None, hash: str | None = None,
            use_at: float | None = None) -> CacheHandle:
        """Return a pinned handle on ``key``'s bytes, fetching them with ``fetch(path)`` on a miss.

        ``size`` and ``hash`` (from the manifest) are verified before an entry becomes visible.
        ``use_at``: when a prefetcher asks ahead of time, the schedule time of the read this get
        serves; a clairvoyant policy then admits the entry only if its next use *after* that read
        comes before some cached entry's (MIN with bypass); otherwise it is served privately.
        Thread- and process-safe; at most one ``fetch`` per key runs on the node at a time.
        """
        self._check_open()
        self.policy.on_access(key)
        handle = self._lookup(key)
        if handle is not None:
            return handle
        lock = KeyLock(self.lock_dir, key_id(key))
        with lock.held():
            handle = self._lookup(key, locked=True)
            if handle is not None:
                self.index.count(waited=1)
                return handle
            self._access.key, self._access.use_at = key, use_at
            try:
                return self._fill(key, fetch, size, hash)
            finally:
                self._access.key = None

    def use_at(self, key: str) -> float | None:
        """The ``use_at`` of the get this thread is serving for ``key`` (None if none)."""
        return self._access.use_at if getattr(self._access, "key", None) == key else None

    def contains(self, key: str) -> str | None:
        """The fastest tier holding ``key`` ("ram"/"ssd"), or None. No pin is taken."""
        with self.index.read() as txn:
            e = txn.get(key)
        return None if e is None else next((t for t in ("ram", "ssd") if t in e.tiers), None)

    def _lookup(self, key: str, locked: bool = False) -> CacheHandle | None:
        with self.index.read() as txn:
            entry = txn.get(key)
        if entry is None:
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
            if name == "ssd" and self.ram.enabled and entry.size <= self.ram.budget and \
                    self.policy.should_promote(key):
                promoted = self._promote(key, entry, handle, locked)
                if promoted is not None:
                    return promoted
            self._touch(key, name, entry.size)
            return handle
        return None

    def _touch(self, key: str, tier: str, size: int) -> None:
        self.index.count(**{f"hits_{tier}": 1, f"bytes_{tier}": size})
        with self.index.write() as txn:
            e = txn.get(key)
            if e is not None:
                e.atime = time.time()
                txn.put(key, e)

    def _verify(self, key: str, entry: Entry, tier: str, rec: dict[str, str], fd: int) -> bool:
        """Re-hash an entry file before serving it; drop it if it does not match."""
        path = self.tiers[tier].file_path(rec["file"])
        ok = os.fstat(fd).st_size == entry.size and hash_file(path) == entry.hash
        if ok:
            with self.index.write() as txn:
                e = txn.get(key)
                if e is not None and e.tiers.get(tier, {}).get("file") == rec["file"]:
                    e.tiers[tier]["token"] = self.token
                    txn.put(key, e)
            return True
        unlock_close(fd)
        log.warning("datacache: cached file %s for %s failed verification (corrupt on disk); refetching", path, key)
        self.index.count(corrupt=1)
        self._drop(key, tier, rec["file"])
        return False

    def _drop(self, key: str, tier: str, fname: str) -> None:
        with self.index.write() as txn:
            e = txn.get(key)
            if e is not None and e.tiers.get(tier, {}).get("file") == fname:
                del e.tiers[tier]
                txn.put(key, e)
                txn.add_used(tier, -e.size)
        try:
            os.unlink(self.tiers[tier].file_path(fname))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ inserts
    def _fill(self, key: str, fetch: Fetch, size: int | None, digest: str | None) -> CacheHandle:
        kid = key_id(key)
        for tier in (self.ram, self.ssd, None):
            if tier is not None and (not tier.enabled or (size is not None and size > tier.budget)):
                continue
            tmp = tier.temp_path(kid) if tier else os.path.join(self.pass_dir, f".pass-{kid}-{os.getpid()}-{time.time_ns()}")
            try:
                nbytes, h = self._download(key, fetch, tmp, size, digest)
            except OSError as exc:
                _unlink(tmp)
                if tier is not None and exc.errno in NO_SPACE_ERRNOS:
                    tier.disable(f"no space left ({exc})")
                    continue
                if exc.errno in NO_SPACE_ERRNOS and self._spare_pass_dir(os.path.dirname(tmp), exc):
                    return self._fill(key, fetch, size, digest)
                if exc.errno in NO_SPACE_ERRNOS:  # not even a private pass-through copy fits
                    raise CacheError(f"no space left for a pass-through copy of {key} ({exc})", url=self.pass_dir,
                                     hint="Free space there, or give the cache a RAM tier (ram_bytes) on another "
                                     "file system") from exc
                raise
            except BaseException:
                _unlink(tmp)
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
        h = hash_file(tmp)
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
            admitted, victims = make_room(self, tier, key, nbytes, fname, digest)
        except BaseException:  # e.g. an LMDB error: the file was never indexed
            _unlink(final)
            unlock_close(fd)
            raise
        if not admitted and tier is self.ram:  # not wanted in RAM: the SSD tier may still want it
            handle = self._try_ssd(key, final, nbytes, digest)
            if handle is not None:
                _unlink(final)
                unlock_close(fd)
                return handle
        if not admitted:  # the policy bypasses it: serve it privately, deleted on release
            private = tier.file_path(f".pass-{fname}")
            os.replace(final, private)
            self.index.count(bypassed=1)
            return CacheHandle(key, private, nbytes, "pass", fd)
        finish_all(self, victims)
        return CacheHandle(key, final, nbytes, tier.name, fd)

    def _try_ssd(self, key: str, path: str, nbytes: int, digest: str) -> CacheHandle | None:
        """Copy a file RAM turned down into the SSD tier; the SSD handle, or None if refused."""
        if not self.ssd.enabled or nbytes > self.ssd.budget:
            return None
        with self.index.read() as txn:
            e = txn.get(key)
        if e is not None and "ssd" in e.tiers:
            return None
        handle = self.copy_in(key, path, self.ssd, nbytes, digest)
        if handle is not None and handle.tier == "pass":
            handle.release()
            self.index.count(bypassed=-1)  # counted once, by the caller's pass-through
            return None
        return handle

    def copy_in(self, key: str, src: str, tier: Tier, nbytes: int, digest: str) -> CacheHandle | None:
        """Copy the local file ``src`` into ``tier`` (temp, fsync, commit) for ``key``; the handle
        (tier "pass" if the policy refused it), or None when the tier's file system is full (the
        tier is then disabled with a warning). Used to promote, demote and fall through to SSD."""
        tmp = tier.temp_path(key_id(key))
        try:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            return self._commit(key, tier, tmp, nbytes, digest)
        except OSError as exc:
            _unlink(tmp)
            if exc.errno in NO_SPACE_ERRNOS:
                tier.disable(f"no space left ({exc})")
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
            handle = self.copy_in(key, ssd_handle.path, self.ram, entry.size, entry.hash)
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

    # ------------------------------------------------------------------ admin
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
        with self.index.read() as txn:
            return list(txn.items())

    def clear(self, *, tiers: tuple[str, ...] = ("ram", "ssd"), dataset: str | None = None) -> int:
        """Remove unpinned entries (optionally only one dataset's); returns how many files went."""
        return _reconcile.clear(self, tiers, dataset)

    def reset_stats(self) -> None:
        with self.index.write() as txn:
            txn.reset_counters()

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError("NodeCache is closed", url=self.control_dir)

    def close(self) -> None:
        """Release this process's hold on the node cache. Idempotent; entries stay on disk."""
        if self._closed:
            return
        self._closed = True
        self.index.close()
        if self._node_fd >= 0:
            fd, self._node_fd = self._node_fd, -1
            unlock_close(fd)

    def __enter__(self) -> "NodeCache":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NodeCache({self.ram!r}, {self.ssd!r}, policy={self.policy.name})"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

