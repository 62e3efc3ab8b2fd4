"""A shard filled unit by unit on the node, readable before it is whole.

A cold epoch that draws each batch from many shards wants a little of each of them soon, not all
of one. ``PartialShard`` is one process's handle on a node-wide *scratch copy* of one cache key,
filled one unit at a time (a unit is a format's smallest independently readable piece: a dcz
block; ``readers.base.ShardLayout``) by whichever process of the node needs it first:

- ``ensure(rows)`` makes the samples at those shard-local rows readable in ``path``: it fetches
  the units holding them that no process has fetched yet (contiguous ones in one ranged read) and waits for
  those another process is fetching. The first call also gets the ranges every read needs
  (header, index, footer): the format's ``layout`` reads them.
- When the last unit is in, the process that filled it hands the scratch file to the cache
  (``NodeCache.get`` with a fetcher that moves it into place): size and hash are verified and the
  entry appears as any fetched entry does, atomically; the scratch state is removed.

Files, per key id ``kid``:

- ``<tier data dir>/.tmp-<kid>.<generation>.part``: the scratch file, full size, sparse until
  filled; a new name for each copy. It starts with ``.tmp-``, so reconciliation after an unclean
  stop removes a leftover one.
- ``<lock dir>/<kid>.part``: the state, written once the fixed ranges are in (temp file and
  ``os.replace``): a header naming the scratch file and its identity (device and inode), then one
  byte per unit (1: filled), mapped shared by every process using it.
- ``<lock dir>/<kid>.units.lock``: byte ``n`` of it locked (``datacache._localfs.RangeLock``: one
  file for every unit, where a file per unit cost a file creation on the control directory's disk
  per unit fetched) by the one thread on the node that is fetching unit ``n``, a run of units one
  range; ``<lock dir>/<kid>.u0.lock`` (``KeyLock``): creating the copy (the fixed ranges), or
  completing it. Waiters block in the kernel; a fetcher that dies releases its units with its
  file descriptors. These locks are the single flight of a fetch, held for its duration as
  ``KeyLock`` is held for a whole download; no other lock is held during I/O. The units' lock
  file goes with a completed copy; ``u0`` stays, as a key's lock file does.

A unit's byte is set after its bytes are written (``os.pwrite``), so a reader that sees it set
reads the unit's bytes. A process that dies mid-fill leaves the scratch copy and its state: the
next user continues from the units already in. State and scratch file are one unit: a state is
used only with the very file it was written for (its name, device, inode and size checked on
attach), else it is stale and removed (under ``u0``), so a state left by a dead copy can never
mark units of a newer, sparse one as filled; a scratch file without a state (its creator died
before writing it) is removed by the next creator of the key (under ``u0``); reconciliation
removes both (``datacache.cache.reconcile``). Nothing is visible in the cache until the whole
file has passed the manifest's hash; a copy that fails it is dropped (``IntegrityError`` for the
caller that completed it; later reads fall back to a whole fetch).

Thread-safe and process-safe; not fork-safe (open one per process).
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..readers.base import ShardLayout
from ..readers.errors import ReaderError

if TYPE_CHECKING:  # a partial copy is filled for a NodeCache, which it only calls
    from .node import NodeCache

from .._localfs import NO_SPACE_ERRNOS, KeyLock, RangeLock, key_id, remove_if_exists

__all__ = ["PartialShard", "PartialGone", "Fetch", "LayoutOf"]

Fetch = Callable[[int, int], bytes]  # (start, end) -> those bytes of the remote object
LayoutOf = Callable[[Callable[[int, int], bytes], int, str], ShardLayout]

_TAIL_BYTES = 16 << 10  # the first read of a shard: its tail, where a dcz index usually fits
_HEAD_BYTES = 4 << 10  # read beside the tail: the head, where a magic (and a small header) lies
_MAGIC = b"DCP2"
_HEAD = struct.Struct("<4sQQQI")  # magic, file size, scratch device, inode, path length; the path; a byte per unit


class PartialGone(Exception):
    """The scratch copy is gone (completed and moved into the cache by another process, dropped
    for a failed hash, or removed by reconciliation): read the shard from the cache instead."""


class PartialShard:
    """One process's handle on the node's scratch copy of one key (see the module docstring)."""

    def __init__(self, cache: NodeCache, key: str, *, size: int, digest: str | None, samples: int,
                 layout_of: LayoutOf, name: str) -> None:
        """``cache``: the node cache; ``key``: the cache key; ``size``/``digest``/``samples``: the
        manifest's byte count, hash and sample count of the whole file; ``layout_of``: the format's
        ``layout``; ``name``: the object's URL, for errors."""
        self.cache, self.key, self.size, self.digest, self.samples = cache, key, size, digest, samples
        self._layout_of, self.name = layout_of, name
        self._kid = key_id(key)
        self._state_path = os.path.join(cache.lock_dir, f"{self._kid}.part")
        self._units_lock = os.path.join(cache.lock_dir, f"{self._kid}.units.lock")
        self._lock = threading.Lock()  # guards the attachment below (no I/O under it but the attach)
        self.layout: ShardLayout | None = None
        self.path: str | None = None
        self._fd = -1
        self._state: mmap.mmap | None = None
        self._base = 0
        self.fetched_bytes = 0  # bytes this handle fetched
        self._committing = False  # a thread of this process is handing the whole copy to the cache

    # ------------------------------------------------------------------ attach
    def _attach(self, fetch: Fetch) -> None:
        """Map the state and open the scratch file, creating both the first time on the node."""
        with self._lock:
            if self._state is not None:
                return
            if not self._try_attach(locked=False):
                with KeyLock(self.cache.lock_dir, f"{self._kid}.u0").held():
                    if not self._try_attach(locked=True):
                        self._create(fetch)
                        if not self._try_attach(locked=True):
                            raise PartialGone(self.key)

    def _try_attach(self, locked: bool) -> bool:
        """Attach to the node's copy if its state names an existing scratch file, the very one it
        was written for; a stale state (its file gone or replaced) is removed when ``locked``
        (under ``u0``). Whether attached."""
        try:
            fd = os.open(self._state_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            state = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        if state[:len(_MAGIC)] != _MAGIC:  # another version's: stale
            sfd = -1
        else:
            _, size, dev, ino, plen = _HEAD.unpack_from(state, 0)
            if size != self.size:
                state.close()
                raise PartialGone(f"{self._state_path}: not the state of a {self.size}-byte copy")
            path = bytes(state[_HEAD.size:_HEAD.size + plen]).decode()
            sfd = self._open_scratch(path, dev, ino)
        if sfd < 0:  # reconciled away, moved into the cache, or replaced: the state is stale
            state.close()
            if locked:
                remove_if_exists(self._state_path)
            return False
        try:
            layout = self._layout_of(lambda a, b: os.pread(sfd, b - a, a), size, path)
        except ReaderError as exc:  # cannot be, with the fixed ranges in before the state: read it whole
            state.close()
            os.close(sfd)
            raise PartialGone(f"{path}: {exc.message}") from exc
        self.layout, self.path, self._fd, self._state = layout, path, sfd, state
        self._base = _HEAD.size + plen
        return True

    def _open_scratch(self, path: str, dev: int, ino: int) -> int:
        """A descriptor on the scratch file ``path`` if it is the file ``dev``/``ino`` of this
        copy's size, else -1."""
        try:
            sfd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return -1
        st = os.fstat(sfd)
        if (st.st_dev, st.st_ino, st.st_size) != (dev, ino, self.size):
            os.close(sfd)
            return -1
        return sfd

    def _create(self, fetch: Fetch) -> None:
        """Under the ``u0`` lock: a scratch file with the fixed ranges in, then its state."""
        if self.cache.contains(self.key) is not None:
            raise PartialGone(f"{self.key} is in the cache")
        for orphan in self.cache.scratch_files(self.key):  # no state names it (see the module docstring)
            remove_if_exists(orphan)
        path = self.cache.scratch_path(self.key, self.size)
        if path is None:
            raise PartialGone(f"no tier has room for a {self.size}-byte scratch copy of {self.key}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise PartialGone(f"cannot create {path}: {exc}") from exc
        try:
            os.ftruncate(fd, self.size)
            layout, units = self._fetch_fixed(fd, fetch)
        except BaseException as exc:
            os.close(fd)
            remove_if_exists(path)
            if isinstance(exc, ReaderError):  # not the file the manifest names: the whole fetch says why
                raise PartialGone(f"{self.name}: {exc.message}") from exc
            if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
                raise PartialGone(f"no space for a scratch copy at {path}") from exc
            raise
        st = os.fstat(fd)
        os.close(fd)
        encoded = path.encode()
        body = _HEAD.pack(_MAGIC, self.size, st.st_dev, st.st_ino, len(encoded)) + encoded + units
        tmp = f"{self._state_path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, self._state_path)

    def _fetch_fixed(self, fd: int, fetch: Fetch) -> tuple[ShardLayout, bytes]:
        """Fetch the file's tail (where the index fits in it) and, beside it on a second thread, its
        head (where a magic or a small header lies), both at once: one round trip, not two. Parse
        the layout, then fetch the fixed ranges not yet in; all written to ``fd``. Returns the
        layout and the units' initial state (those wholly in already: 1)."""
        tail_start = max(0, self.size - _TAIL_BYTES)
        head_end = min(_HEAD_BYTES, tail_start)
        with ThreadPoolExecutor(1, thread_name_prefix="datacache-head") as pool:
            head_job = pool.submit(fetch, 0, head_end) if head_end else None
            tail = fetch(tail_start, self.size)
            head = head_job.result() if head_job else b""
        self._write(fd, tail, tail_start)
        written = [(tail_start, self.size)]
        if head:
            self._write(fd, head, 0)
            written.append((0, head_end))

        def read(a: int, b: int) -> bytes:
            if a >= tail_start:
                return tail[a - tail_start:b - tail_start]
            if b <= head_end:
                return head[a:b]
            end = tail_start if b > tail_start else b  # an index longer than the tail: only its start
            data = fetch(a, end)
            self._write(fd, data, a)
            written.append((a, end))
            return data + tail[:b - end]
        layout = self._layout_of(read, self.size, self.name)
        if layout.samples != self.samples:  # the whole fetch's count check says so, with the URL
            raise ReaderError(f"{layout.samples} samples, the manifest declares {self.samples}", path=self.name)
        # The fixed ranges the layout did not read (e.g. the header); not with the first unit: the
        # sample a read wants is in another, most often. An index read in two pieces is in already.
        for a, b in _gaps(sorted(layout.fixed), _merged(written)):
            read(a, b)
        merged = _merged(written)
        state = bytes(int(any(x <= a and b <= y for x, y in merged)) for a, b in layout.spans)
        return layout, state

    def _write(self, fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
        self.fetched_bytes += len(data)
        self.cache.count(partial_bytes=len(data))

    # ------------------------------------------------------------------ fill
    def filled(self, unit: int) -> bool:
        assert self._state is not None
        return self._state[self._base + unit] == 1

    def ensure(self, rows: list[int], fetch: Fetch, use_at: float | None = None) -> bool:
        """Make the samples at the shard-local ``rows`` (sorted) readable in ``path``, fetching what
        is missing with ``fetch(start, end)`` (a ranged read of the object; see the module
        docstring); the last unit in completes the copy into the cache. Returns whether the copy
        is complete (it is in the cache then, unless the cache's policy declined it: read it with
        a cache get); False also while another thread of this process hands the complete copy to
        the cache (the rows are in: read them from ``path``, or, once it is gone, from the cache;
        at the end of a part-mixed epoch, when most shards complete, up to ten threads of a
        process queued up to 0.1 s each for that hand-over with their rows in). Raises
        ``PartialGone`` where the copy is gone (read the shard with a cache get),
        ``IntegrityError`` where it completed and failed the hash, and the fetch's errors."""
        self._attach(fetch)
        assert self.layout is not None
        units = [u for u in self.layout.units_of_rows(rows) if not self.filled(u)]
        while units:
            run = [units.pop(0)]
            while units and units[0] == run[-1] + 1:
                run.append(units.pop(0))
            self._fill_run(run, fetch)
        if not self.complete():
            return False
        with self._lock:  # one thread of the process hands the copy over; the others read it meanwhile
            if self._committing:
                return False
            self._committing = True
        try:
            self._commit(use_at)
        finally:
            with self._lock:
                self._committing = False
        return True

    def _fill_run(self, run: list[int], fetch: Fetch) -> None:
        """Fetch the units ``run`` (consecutive) that are still missing once their locks are held."""
        assert self.layout is not None
        # One range: a thread holds no other unit while it waits, so no cycle of waits.
        with RangeLock(self._units_lock).held(run[0], run[-1] + 1 - run[0]):
            todo = [u for u in run if not self.filled(u)]
            while todo:  # runs of still-missing units, each one ranged read
                part = [todo.pop(0)]
                while todo and todo[0] == part[-1] + 1:
                    part.append(todo.pop(0))
                start, end = self.layout.spans[part[0]][0], self.layout.spans[part[-1]][1]
                end = min(end, max(start, self.size - _TAIL_BYTES))  # the tail's bytes are in since the start
                if not os.path.exists(self.path or ""):
                    raise PartialGone(self.key)
                if end > start:
                    try:
                        self._write(self._fd, fetch(start, end), start)
                    except OSError as exc:
                        if exc.errno in NO_SPACE_ERRNOS:
                            raise PartialGone(f"no space to fill {self.path}") from exc
                        raise
                assert self._state is not None
                for u in part:
                    self._state[self._base + u] = 1

    def complete(self) -> bool:
        """Whether every unit is in (thread-safe; reads the shared state)."""
        if self._state is None or self.layout is None:
            return False
        return self._state.find(b"\x00", self._base) < 0

    def _commit(self, use_at: float | None) -> None:
        """Hand the whole copy to the cache (verified there); idempotent across processes. Under the
        ``u0`` lock: a process creating a copy (``_create``, under it too) sees either this copy's
        state or the finished entry, never the moment between."""
        assert self.path is not None and self.layout is not None
        path = self.path

        def move(tmp: str) -> None:
            try:
                os.replace(path, tmp)
            except FileNotFoundError as exc:
                raise PartialGone(self.key) from exc
            except OSError:  # another file system: copy
                with open(path, "rb") as src, open(tmp, "wb") as dst:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                remove_if_exists(path)
        with KeyLock(self.cache.lock_dir, f"{self._kid}.u0").held():
            try:
                self.cache.get(self.key, move, size=self.size, hash=self.digest, use_at=use_at).release()
            finally:
                remove_if_exists(self._state_path)
                remove_if_exists(path)
        remove_if_exists(self._units_lock)  # a waiter on a unit re-checks its byte: filled

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the state and close the scratch file (the copy stays for others). Idempotent; not
        while another thread of this process uses the handle (``ShardSource`` lets it go instead)."""
        with self._lock:
            if self._state is not None:
                self._state.close()
                self._state = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (start, end) as the sorted, disjoint ranges that cover the same bytes."""
    out: list[tuple[int, int]] = []
    for x, y in sorted(ranges):
        if out and x <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], y))
        else:
            out.append((x, y))
    return out


def _gaps(wanted: list[tuple[int, int]], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The bytes of ``wanted`` ranges that the sorted, disjoint ``have`` ranges lack, as ranges
    (adjacent ones joined: one ranged read each)."""
    out: list[tuple[int, int]] = []
    for a, b in wanted:
        for x, y in have:
            if y <= a or x >= b:
                continue
            if x > a:
                out.append((a, x))
            a = max(a, y)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return _merged(out)
