"""The node's plan board: the schedules of every dataset in use on the node, published in a directory
of the node cache, so that each process's clairvoyant policy (``node_policy``) knows the future
reads of the other processes too, not only its own.

Layout under ``<dir>/plans/``, one *plan* per distinct schedule (every consumer of one
dataset on a node computes the same node schedule, so it is stored once):

- ``<name>.live``: every process whose schedule it is holds a shared ``flock`` on it. A plan that no
  process holds is stale and the next ``scan`` removes it, so a job that ended (or died) never
  pins the cache;
- ``<name>.plan``: the schedule as JSON, written once, atomically (temp file, ``os.replace``: a
  reader sees the whole plan or none). Not fsynced: a plan lives as long as a process holds its
  ``.live`` lock, so after a crash of the machine, the only case an fsync covers, every plan on the
  board is stale and removed unread (and an unreadable one is ignored); an fsync at every epoch's
  start would only make the first batch wait for the disk;
- ``<name>.clock``: the schedule's clock ``now``, 8 bytes rewritten in place (``pwrite``) by its
  publishers as they read, so that other processes know how far that dataset has got.

``<name>`` is ``<dataset id>-<digest of the schedule>``. Thread-safe: the board keeps no mutable
state; each ``Published`` and ``Foreign`` owns its descriptors.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import struct
import threading
import time
from collections.abc import Hashable, Mapping, Sequence

from .._localfs import BUSY, ensure_private_dir, lock_nonblocking, remove_if_exists, unlock_close
from ..errors import CacheError
from .eviction import INF, Schedule

__all__ = ["PlanBoard", "Published", "Foreign"]

log = logging.getLogger("datacache.cache.node")
PLAN, CLOCK, LIVE = ".plan", ".clock", ".live"
_CLOCK = struct.Struct("<d")
_TMP_MAX_AGE = 3600.0  # a temp plan older than this was left by a writer that died


class Published:
    """This process's hold on a plan it published (see the module docstring). Thread-safe: its
    descriptors are used and closed under a lock (a closed number may be reused by another file)."""

    def __init__(self, name: str, live_fd: int, clock_fd: int) -> None:
        self.name, self._live, self._clock = name, live_fd, clock_fd
        self._lock = threading.Lock()

    def write_clock(self, now: float) -> None:
        """Publish the schedule's clock (one 8-byte ``pwrite``; never raises; a no-op once closed)."""
        with self._lock:
            if self._clock >= 0:
                try:
                    os.pwrite(self._clock, _CLOCK.pack(now), 0)
                except OSError as exc:
                    log.debug("datacache: cannot publish the clock of plan %s: %s", self.name, exc)

    def close(self) -> None:
        """Release the plan (it becomes stale when no other process holds it). Idempotent."""
        with self._lock:
            live, clock, self._live, self._clock = self._live, self._clock, -1, -1
            if clock >= 0:
                os.close(clock)
            if live >= 0:
                unlock_close(live)

    def forget(self) -> None:
        """In a forked child: close the inherited descriptors without unlocking (the lock is the
        parent's: unlocking a shared open file description would drop its hold)."""
        self._lock = threading.Lock()  # the parent's may have been held at fork
        for fd in (self._live, self._clock):
            if fd >= 0:
                os.close(fd)
        self._live = self._clock = -1


class Foreign:
    """Another process's plan, loaded: its dataset, its schedule, advanced from its clock file.
    Thread-safe (its descriptor is used and closed under a lock)."""

    def __init__(self, name: str, dataset: str, schedule: Schedule, clock_fd: int) -> None:
        self.name, self.dataset, self.schedule, self._clock = name, dataset, schedule, clock_fd
        self._lock = threading.Lock()

    def read_clock(self) -> None:
        """Advance the schedule to the published clock (one 8-byte ``pread``)."""
        with self._lock:
            try:
                data = os.pread(self._clock, _CLOCK.size, 0) if self._clock >= 0 else b""
            except OSError:
                return
        if len(data) == _CLOCK.size and math.isfinite(now := _CLOCK.unpack(data)[0]):
            self.schedule.advance(now)

    def idle_for(self) -> float:
        """Seconds since a publisher last moved the clock (infinity once closed)."""
        with self._lock:
            try:
                return time.time() - os.fstat(self._clock).st_mtime if self._clock >= 0 else INF
            except OSError:
                return INF

    def close(self) -> None:
        """Idempotent."""
        with self._lock:
            fd, self._clock = self._clock, -1
            if fd >= 0:
                os.close(fd)

    def forget(self) -> None:
        """In a forked child: close the inherited descriptor (the parent's lock may be held)."""
        self._lock = threading.Lock()
        self.close()


def _encode(dataset: str, times: Mapping[Hashable, Sequence[float]]) -> bytes:
    doc = {"dataset": dataset, "times": {str(k): list(v) for k, v in times.items()}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class PlanBoard:
    """The plans directory of one node cache (see the module docstring)."""

    def __init__(self, base_dir: str) -> None:
        self.dir = ensure_private_dir(os.path.join(base_dir, "plans"))

    def _path(self, name: str, kind: str) -> str:
        return os.path.join(self.dir, name + kind)

    def publish(self, dataset: str, times: Mapping[Hashable, Sequence[float]], now: float) -> Published:
        """Publish ``dataset``'s schedule (``times`` of its keys, clock at ``now``) and hold it."""
        payload = _encode(dataset, times)
        name = f"{re.sub(r'[^A-Za-z0-9._-]', '_', dataset)[:64]}-{hashlib.blake2b(payload, digest_size=8).hexdigest()}"
        live = self._hold(name)
        try:
            clock = os.open(self._path(name, CLOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            pub = Published(name, live, clock)
            if len(os.pread(clock, _CLOCK.size, 0)) < _CLOCK.size:  # a new plan: other holders keep theirs
                pub.write_clock(now)
            if not os.path.exists(self._path(name, PLAN)):
                self._write(self._path(name, PLAN), payload)
        except BaseException:
            unlock_close(live)
            raise
        return pub

    def _hold(self, name: str) -> int:
        """A shared lock on the plan's live file, which exists under its name while we hold it (a
        scanner that removed it between our open and our lock makes us retry)."""
        path = self._path(name, LIVE)
        for _ in range(100):
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # a scanner holds LOCK_EX only while it unlinks
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                return fd
            unlock_close(fd)
        raise CacheError("cannot hold a plan file: it keeps being removed", url=path,
                         hint="Check that nothing else deletes files in this directory")

    @staticmethod
    def _write(path: str, payload: bytes) -> None:
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}-{time.time_ns()}")
        try:
            with open(tmp, "wb") as f:
                f.write(payload)  # no fsync: see the module docstring
            os.replace(tmp, path)
        except BaseException:
            remove_if_exists(tmp)
            raise

    def scan(self, skip: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
        """The names of the live plans (held by some process, plan written) not in ``skip``;
        stale plans (held by no one) and temp files of dead writers are removed."""
        names = []
        try:
            entries = list(os.scandir(self.dir))
        except OSError as exc:
            log.debug("datacache: cannot list plans in %s: %s", self.dir, exc)
            return []
        for entry in entries:
            if entry.name.startswith("."):
                self._drop_old_temp(entry)
                continue
            if not entry.name.endswith(LIVE) or entry.name[:-len(LIVE)] in skip:
                continue
            name = entry.name[:-len(LIVE)]
            fd = lock_nonblocking(entry.path, exclusive=True)
            if fd == BUSY:  # held: live (its plan may not be written yet: seen at the next scan)
                if os.path.exists(self._path(name, PLAN)):
                    names.append(name)
            elif fd >= 0:  # no process holds it: stale
                try:
                    for kind in (PLAN, CLOCK, LIVE):
                        remove_if_exists(self._path(name, kind))
                finally:
                    unlock_close(fd)
        return names

    @staticmethod
    def _drop_old_temp(entry: os.DirEntry) -> None:
        try:
            if ".tmp-" in entry.name and time.time() - entry.stat().st_mtime > _TMP_MAX_AGE:
                remove_if_exists(entry.path)
        except OSError:
            pass

    def load(self, name: str) -> Foreign | None:
        """The plan ``name`` (None if it is gone or unreadable)."""
        try:
            clock = os.open(self._path(name, CLOCK), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            with open(self._path(name, PLAN), "rb") as f:
                doc = json.loads(f.read())
            foreign = Foreign(name, str(doc["dataset"]), Schedule(doc["times"]), clock)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            os.close(clock)
            if not (isinstance(exc, OSError) and exc.errno == errno.ENOENT):
                log.warning("datacache: ignoring unreadable plan %s: %s", self._path(name, PLAN), exc)
            return None
        foreign.read_clock()
        return foreign
