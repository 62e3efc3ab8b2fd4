"""One consumer's epoch: plan -> prefetched, pinned shards -> samples. Used by the datasets.

A ``Consumer`` belongs to one process (the main process, or one DataLoader worker) and one epoch.
It runs a two-stage pipeline over its runs, both through the one shard path (``shards``): stage 1
(``Prefetcher``, adaptive thread pool) gets each run's shard into the cache far ahead; stage 2
(one decode thread) takes the next runs' pinned shards, reads their ranges sequentially (each
block decompressed once) and unpins them. The consumer then walks the plan's steps, yielding samples in the
shuffled order while at most ``window`` runs are open. A node-mixed plan's run (``datacache.plan.node_shuffle``)
is one shard's rows of one chunk, read with ``read_rows``; its step yields the whole chunk once every
run of the chunk is open. A part mix's run (``datacache.plan.part_shuffle``) is the same, its rows loaded
into the shard's partial copy (``ShardSource.load_rows``) rather than the whole shard fetched, and
each unit (dcz block) loaded and read once, by the first run that reaches it, for every later run
of this consumer too (``datacache.read.stash``): a run with nothing left to read skips both stages,
its samples taken from the stash in the consumer's thread. Not thread-safe: one consumer per thread.

Columnar mode (``columnar=True``; batched mode's default collation, no transform, not a part mix):
the decode stage reads each run as one table per field (``readers.columns.Columns``; a format
without columnar reads, or rows too irregular for one table, as a list of samples), and
``steps()`` replaces iteration: per step, where each of its positions' rows lies in the open
runs' tables, as arrays, so that ``datacache.pytorch.gather`` copies whole batches at once. A
node-mixed plan's compressed blocks are decompressed once per epoch, however many chunks read
rows of them (a ``BlockCache`` of ``block_cache`` bytes).

``on_error="skip"``: one warning and one count per unreadable shard, per epoch, on the node.

With DataLoader workers, a node mix or a part mix, several consumers of the node read parts of one
shard, and each of them that reaches an unreadable shard skips it; the first to do so in this run
and epoch reports it (``stats()["skipped_shards"]`` and the warning), the others log it at INFO.
A marker file per (shard, epoch) in the node cache's control directory (``skipped/``), checked
and written under an ``flock``, says that the shard was reported. A marker older than this run's
dataset object (``SkipMarks`` is made with it, and its DataLoader workers inherit it) is from an
earlier run and is renewed, so a restarted job warns again.

Thread-safe and process-safe (the lock); a marker that cannot be read or written reports the skip
(a repeated warning rather than none).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from itertools import takewhile
from typing import Any, NamedTuple

import numpy as np

from .._localfs import ensure_private_dir
from ..cache.eviction import Schedule
from ..cache.node import CacheHandle
from ..config import PrefetchConfig
from ..errors import IntegrityError, NotFoundError, ReaderError
from ..plan.epoch import ConsumerPlan
from ..plan.ragged import Ragged
from ..readers.columns import is_sorted
from ..readers.zstd import BlockCache
from .headstart import Lead, LeadItem
from .lifecycle import parent_gone
from .prefetch import Prefetcher
from .shard_source import PartHandle, ShardSource
from .stash import Stash, read_plan

__all__ = ["Consumer", "SkipMarks", "Step"]

log = logging.getLogger("datacache.pytorch.dataset")


class Consumer:
    """Iterates one consumer's plan for one epoch (see module docstring)."""

    def __init__(self, *, source: ShardSource, plan: ConsumerPlan, epoch: int, skip: int, prefetch: PrefetchConfig,
                 schedule: Schedule | None, on_error: str, name: str,
                 lead: tuple[Sequence[LeadItem], Sequence[LeadItem]] = ((), ()),
                 marks: SkipMarks | None = None, columnar: bool = False, block_cache: int = 0) -> None:
        """``source``: the dataset through the node cache; ``plan``: this consumer's reads in
        ``epoch``; ``skip``: plan positions already read (a resume); ``prefetch``: the fetch stage's
        config; ``schedule``: the node's schedule in force (``shards.tell_plan``), advanced as runs
        are read; ``on_error``: "raise" or "skip" (unreadable shards); ``name``: thread name prefix;
        ``lead``: (before, after): the first shards of the rank's other DataLoader workers, those
        before this one and those after it (``plan.first_shards``), or in a part mix the runs
        ((shard, rows)) of their first chunks: this consumer gets ``before`` into the cache ahead
        of its own first step, and ``after`` ahead of its lookahead (``datacache.read.headstart.Lead``: whole
        shards one at a time, runs on every thread that waits), so the workers' first reads
        arrive one after another, each with the link to itself, in the order the loader needs them.
        ``marks``: the node's record of the shards skipped this run (``datacache.read.consumer``), so
        that only the first consumer to skip a shard in an epoch counts and warns; None: this one does.
        ``columnar``: read runs as tables and walk the plan with ``steps()`` (see the module
        docstring; ignored for a part mix); ``block_cache``: bytes of decompressed blocks then
        kept for later runs."""
        self.source, self.plan = source, plan
        self.columnar = columnar and not plan.parts
        self._blocks = BlockCache(block_cache) if self.columnar and block_cache > 0 else None
        self.manifest = source.manifest
        self.epoch, self.skip = epoch, skip
        self.on_error, self.marks = on_error, marks
        self.schedule = schedule
        self._stop = threading.Event()  # set by close(): transfers in flight are abandoned
        self._attached: list[Any] = []  # stages over this consumer, closed with it (attach)
        n_runs = len(plan.runs)
        # Runs that still have samples to read (all of them unless resuming mid-epoch).
        self.needed = sorted(set(plan.run_of[skip:].tolist())) if skip and plan.run_of is not None \
            else list(range(n_runs))
        self.run_times = plan.run_times(epoch)  # set before the stages start: their threads read it
        self.skipped_shards = 0  # set before the stages start: the decode thread counts into it
        self.reported_skips = 0  # of them, those this consumer reported (``marks``)
        self._name = name
        self._skipped: set[int] = set()
        self._first = _first_chunk(plan, self.needed)
        # A part mix: the rows each needed run loads and reads (``datacache.read.stash``), by position.
        self._reads = read_plan([plan.runs[r][0] for r in self.needed], plan.rows if len(self.needed) == n_runs
                                else [plan.rows[r] for r in self.needed], plan.unit_rows,
                                alone=self._first) if plan.parts and plan.rows is not None else None
        self._position = {r: i for i, r in enumerate(self.needed)} if self._reads is not None else {}
        # The runs (positions) that read: a part mix's followers (all rows read by earlier runs)
        # never reach the stages; the consumer takes their samples from the stash itself.
        leading = list(range(len(self.needed))) if self._reads is None else \
            np.flatnonzero(self._reads.sizes()).tolist()
        self._follows = set(np.flatnonzero(self._reads.sizes() == 0).tolist()) if self._reads is not None else set()
        self._stash = Stash()  # filled by the decode thread, emptied by the consumer's
        # A part mix's slow start (``PrefetchConfig.slow_start``; its prefetcher starts every run
        # of the first chunk at once): the lookahead waits until the first chunk is in.
        self._first_left = self._first if plan.parts and prefetch.slow_start else 0
        self._first_lock, self._first_in = threading.Lock(), threading.Event()
        if not self._first_left:
            self._first_in.set()
        if plan.parts:  # many small ranged reads, the first chunk's from many shards: more at once from the start
            prefetch = dataclasses.replace(prefetch, slow_start=False, threads=max(prefetch.threads, _PART_THREADS),
                                           max_threads=max(prefetch.max_threads, _PART_THREADS))
        # The first chunk's runs (a whole-shard plan's first run) go after lead[0], the rest after lead[1].
        when = self.run_times[self.needed[0]] if self.needed else float(epoch)
        self._leads = [Lead(source, items, helpers=len(items) if plan.parts else 1, priority=p, use_at=when,
                            cancelled=self._cancelled, who=name)
                       for items, p in ((lead[0], -1.0), (lead[1], self._first - 0.5))]
        # Stage 1: shards into the cache, far ahead (network-bound, adaptive, byte-bounded).
        self.prefetcher: Prefetcher[tuple[int, int], CacheHandle | PartHandle] = Prefetcher(
            [(i, plan.runs[self.needed[i]][0]) for i in leading], self._load, size_of=self._size_of,
            release=lambda handle: handle.release(), config=prefetch, name=name)
        # Stage 2: the next runs decoded while the current step is consumed: two runs ahead, or in
        # a node-mixed plan (whose step yields a chunk once all of its runs are open) the next chunk.
        decode_size, ahead = decode_ahead(plan)
        self.decoder: Prefetcher[int, _Run] = Prefetcher.bounded(
            [self.needed[i] for i in leading], self._decode, ahead=ahead, size_of=decode_size,
            release=_Run.release, name=f"{name}-decode")
        self.consumed = skip

    def _size_of(self, item: tuple[int, int]) -> int:
        """The bytes the load of (position, shard) brings: the shard's, or a part mix's rows' share."""
        info = self.manifest.shards[item[1]]
        if self._reads is None:
            return info.bytes
        return -(-info.bytes * len(self._reads[item[0]]) // max(info.samples, 1))

    def _load(self, item: tuple[int, int]) -> CacheHandle | PartHandle:
        """Get (position in the plan, shard) into the cache (a part mix's run: its rows, into the
        shard's partial copy), after the lead its position waits for; earlier positions get the
        link first."""
        position, shard = item
        use_at = self.run_times[self.needed[position]]
        if position >= self._first:
            self._first_in.wait()
            self._leads[1].enter()
            return self._get(position, shard, use_at)
        self._leads[0].enter()
        try:
            return self._get(position, shard, use_at)
        finally:
            with self._first_lock:
                self._first_left -= 1
                if self._first_left <= 0:  # failed or not, the rest may go (and raise their own)
                    self._first_in.set()

    def _get(self, position: int, shard: int, use_at: float) -> CacheHandle | PartHandle:
        if self._reads is not None:
            return self.source.load_rows(shard, self._reads[position].tolist(), priority=position,
                                         use_at=use_at, cancelled=self._cancelled)
        return self.source.fetch(shard, priority=position, use_at=use_at, cancelled=self._cancelled)

    def _decode(self, run: int) -> "_Run":
        """Runs on the decode thread: pin the run's shard (waiting on stage 1) and read its range."""
        shard, lo, hi = self.plan.runs[run]
        if self.schedule is not None:  # the shard file is read now: for the cache, this is its use
            self.schedule.advance(self.run_times[run])
        try:
            handle = self.prefetcher.take()
        except (IntegrityError, NotFoundError) as exc:  # this shard's object is missing or not the manifest's
            if self.on_error != "skip":
                raise
            self._skip(shard, exc)
            return _Run(lo, None)
        try:
            rows = None if self.plan.rows is None else self.plan.rows[run]
            if self.columnar:
                return _Run(lo, self._columns(shard, handle, lo, hi, rows))
            if self._reads is not None and rows is not None:
                return _Run(lo, self._part_samples(shard, handle, lo, rows, self._reads[self._position[run]]))
            return _Run(lo, self._read(shard, handle, lo, hi, rows))
        finally:
            # Decoded samples own their memory, so the shard is unpinned at once: pins stay within
            # the prefetch lookahead and the cache keeps its freedom to evict.
            handle.release()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        plan = self.plan
        assert plan.samples is not None and plan.run_of is not None
        shards = np.array([r[0] for r in plan.runs] or [0], dtype=np.int64)
        los = np.array([r[1] for r in plan.runs] or [0], dtype=np.int64)
        run_of = plan.run_of.tolist()
        index = (plan.samples - np.asarray(self.manifest.offsets)[shards[plan.run_of]] - los[plan.run_of]).tolist()
        needed = set(self.needed)
        open_runs: dict[int, _Run] = {}
        steps = plan.steps.tolist()
        try:
            for i in range(len(steps) - 1):
                if i in needed:
                    open_runs[i] = self._open(i)
                for p in range(max(steps[i], self.skip), steps[i + 1]):
                    samples = open_runs[run_of[p]].samples
                    self.consumed = p + 1
                    if samples is not None:
                        yield samples[index[p]]
                done = open_runs.pop(i - plan.window + 1, None)
                if done is not None:
                    done.release()
        finally:
            for r in open_runs.values():
                r.release()
            self._stop_stages()  # not the stages attached: they still hand out what they made of it

    def steps(self) -> Iterator[Step]:
        """Columnar mode's walk of the plan (instead of iterating): per step with positions to
        yield, a ``Step``. Runs close as they do when iterating; a step keeps its tables."""
        plan = self.plan
        assert self.columnar and plan.run_of is not None
        run_of = plan.run_of
        table_rows = self._table_rows()
        needed = set(self.needed)
        open_runs: dict[int, _Run] = {}
        steps = plan.steps.tolist()
        try:
            for i in range(len(steps) - 1):
                if i in needed:
                    open_runs[i] = self._open(i)
                p0, p1 = max(steps[i], self.skip), steps[i + 1]
                if p1 > p0:
                    ids = sorted(open_runs)
                    tables = [open_runs[r].samples for r in ids]
                    slot = np.searchsorted(ids, run_of[p0:p1])
                    pos, row = np.arange(p0, p1, dtype=np.int64), table_rows[p0:p1]
                    dead = [j for j, t in enumerate(tables) if t is None]  # skipped shards (on_error="skip")
                    if dead:
                        live = ~np.isin(slot, dead)
                        slot, pos, row = slot[live], pos[live], row[live]
                    if len(pos):
                        yield Step(tables, slot, row, pos)
                done = open_runs.pop(i - plan.window + 1, None)
                if done is not None:
                    done.release()
            self.consumed = max(self.consumed, len(plan))
        finally:
            for r in open_runs.values():
                r.release()
            self._stop_stages()  # not the stages attached: they still hand out what they made of it

    def _table_rows(self) -> np.ndarray:
        """Per plan position, its row in its run's table: the run's shard-local row less ``lo``,
        or in a node-mixed plan the row's place among the rows the run reads."""
        plan = self.plan
        assert plan.samples is not None and plan.run_of is not None
        if plan.rows is not None and plan.row_in_run is not None:  # as the plan grouped them (a search
            return plan.row_in_run  # of each position among its run's rows: 0.4 us a position, at random)
        shards = np.array([r[0] for r in plan.runs] or [0], dtype=np.int64)
        los = np.array([r[1] for r in plan.runs] or [0], dtype=np.int64)
        local = plan.samples - np.asarray(self.manifest.offsets)[shards[plan.run_of]]
        if plan.rows is None:
            return local - los[plan.run_of]
        rows = Ragged.of(plan.rows)
        if not len(rows.flat):
            return np.zeros(len(local), np.int64)
        span = int(max(int(local.max(initial=0)), int(rows.flat.max()))) + 1
        keys = np.repeat(np.arange(len(rows), dtype=np.int64), rows.sizes()) * span + rows.flat
        wanted = plan.run_of * span + local
        if (np.diff(keys) < 0).any():  # rows not sorted within a run: search them sorted
            order = np.argsort(keys, kind="stable")
            return order[np.searchsorted(keys[order], wanted)] - rows.cuts[plan.run_of]
        return np.searchsorted(keys, wanted) - rows.cuts[plan.run_of]

    def _columns(self, shard: int, handle: CacheHandle, lo: int, hi: int, rows: np.ndarray | None) -> Any:
        """Columnar mode's read of a run: its table, or where the format or the rows allow none,
        its samples in table order (a list); None if the shard is skipped."""
        try:
            table = None if rows is not None and not is_sorted(rows) else \
                self.source.read_columns(shard, handle, lo, hi, rows, self._blocks)
        except (ReaderError, IntegrityError) as err:
            if self.on_error != "skip":
                raise
            self._skip(shard, err)
            return None
        if table is not None:
            return table
        got = self._read(shard, handle, lo, hi, rows)
        if isinstance(got, dict):
            assert rows is not None
            return [got[r - lo] for r in rows.tolist()]
        return got

    def _open(self, run: int) -> "_Run":
        """Run ``run``'s samples (the consumer's thread): from the decode stage, or for a part
        mix's follower from the stash, which its leaders (earlier runs, so taken from the decode
        stage already) have filled."""
        if self._position.get(run, -1) not in self._follows:
            return self.decoder.take()
        shard, lo, _ = self.plan.runs[run]
        assert self.plan.rows is not None
        return _Run(lo, self._part_samples(shard, None, lo, self.plan.rows[run], self._reads[self._position[run]]))

    def _read(self, shard: int, handle: CacheHandle, lo: int, hi: int, rows: np.ndarray | None, *,
              copy: bool = False) -> list[Any] | dict[int, Any] | None:
        """Samples ``lo .. hi - 1`` (a list), or only ``rows`` (a node mix's run: a dict by row -
        lo; ``copy``: samples in memory of their own, ``ShardSource.read_rows``)."""
        try:
            if rows is None:
                return self.source.read_runs(shard, handle, lo, hi)
            return {r - lo: s for r, s in self.source.read_rows(shard, handle, rows.tolist(), copy=copy).items()}
        except (ReaderError, IntegrityError) as err:
            if self.on_error != "skip":
                raise
            self._skip(shard, err)
            return None

    def _part_samples(self, shard: int, handle: CacheHandle | PartHandle | None, lo: int, rows: np.ndarray,
                      reads: np.ndarray) -> dict[int, Any] | None:
        """A part mix's run: its ``reads`` read from ``handle`` (a leader, on the decode thread;
        ``datacache.read.stash``: its own rows and the later runs' rows of the units it leads, which go
        to the stash), its other rows taken from the stash (a follower, ``reads`` empty and no
        handle: on the consumer's thread). Rows the stash lacks (their leader's shard was skipped)
        are loaded and read here. By row - lo, as ``_read``; None if the shard is skipped."""
        own, ahead = rows.tolist(), reads.tolist()
        mine = set(own)
        stashing = any(r not in mine for r in ahead)  # only samples kept for later runs: read to be kept
        got = self._read(shard, handle, lo, lo, reads, copy=stashing) if handle is not None and ahead else {}
        if not isinstance(got, dict):
            return None
        later = {r: got.pop(r - lo) for r in ahead if r not in mine}
        if later:
            self._stash.put_many(shard, later)
        wanted = sorted({r for r in own if r - lo not in got})
        found = self._stash.take_many(shard, wanted) if wanted else {}
        for r, sample in found.items():
            got[r - lo] = sample
        rest = [r for r in wanted if r not in found]
        if rest:
            if shard in self._skipped:
                return None
            extra = self.source.load_rows(shard, rest, cancelled=self._cancelled)
            try:
                more = self._read(shard, extra, lo, lo, np.asarray(rest))
            finally:
                extra.release()
            if not isinstance(more, dict):
                return None
            got.update(more)
        return got

    def _skip(self, shard: int, err: BaseException) -> None:
        """on_error="skip": count the shard (``stats()["skipped_shards"]``) and warn, once per shard
        and epoch on the node (``marks``; the other consumers that skip it log it at INFO)."""
        if shard in self._skipped:
            return
        self._skipped.add(shard)
        self.skipped_shards += 1
        if self.marks is not None and not self.marks.first(self.manifest.cache_key(shard), self.epoch):
            log.info("datacache: skipping shard (reported by another consumer on this node): %s", err)
            return
        self.reported_skips += 1
        self.source.cache.count(skipped_shards=1)
        warnings.warn(f"datacache: skipping shard: {err}", stacklevel=3)

    @property
    def wait_seconds(self) -> float:
        """Seconds the consumer waited for data (network and decoding) in this epoch."""
        return self.decoder.wait_seconds

    @property
    def stash_bytes(self) -> int:
        """Bytes of samples a part mix's leaders read ahead for this consumer's later runs
        (``datacache.read.stash``), held in this process's memory now; thread-safe."""
        return self._stash.nbytes

    def _cancelled(self) -> bool:
        """Stop fetching: the consumer was closed (Ctrl-C, end of iteration) or, in a DataLoader
        worker, the training process died. Polled by transfers in flight; thread-safe."""
        return self._stop.is_set() or parent_gone()

    def attach(self, stage: Any) -> None:
        """Close ``stage`` (anything with an idempotent ``close()``, e.g. the batching stage's
        thread, ``datacache.read.batcher``) when this consumer is closed, after its own stages.
        Called by the thread that iterates the consumer, before it iterates."""
        self._attached.append(stage)

    def close(self) -> None:
        """Abandon transfers in flight (their temp files are removed), stop both stages (the
        prefetcher first, which wakes the decode thread waiting on it), then close the stages
        attached. Idempotent."""
        self._stop_stages()
        for stage in self._attached:
            stage.close()

    def _stop_stages(self) -> None:
        """``close`` but for the stages attached (where the plan is read to its end)."""
        self._stop.set()
        self._first_in.set()  # a load waiting for the first chunk or a lead: wake it (it then sees the stop)
        for lead in self._leads:
            lead.close()
        self.prefetcher.close()
        self.decoder.close()
        self._stash.clear()
        if self._blocks is not None:
            self._blocks.clear()
        if self.plan.parts:
            self.source.forget_parts()


_DECODE_AHEAD = 2  # runs decoded ahead of the one being consumed
_PART_THREADS = 12  # a part mix's loads at once per consumer, at least


def decode_ahead(plan: ConsumerPlan) -> tuple[Callable[[int], int], int]:
    """The decode stage's lookahead: (size of a run, budget). ``_DECODE_AHEAD`` runs; in a
    node-mixed plan (``plan.rows``, not ``plan.parts``) the positions of the largest step, counted
    in each run's rows: a step yields its chunk once every run of it is open, so with two runs
    decoded ahead the next chunk's runs were read one after the other while the consumer waited
    (a node-mixed epoch of 4 KB samples: 0.14-0.26 s each chunk of 16,000 samples). The samples
    held stay within the documented two chunks per consumer: the open one and the next. A part
    mix keeps two runs: its decode stage takes each run from the fetch stage, so decoding ahead
    let the fetch stage start more reads at once, and the first batch's blocks shared the link
    with them (the bench's cold epoch, interleaved runs: first batch 0.55-0.59 s against
    0.43-0.46 s, wall 10.99-11.03 s against 10.79-10.88 s)."""
    if plan.rows is None or plan.parts or len(plan.steps) < 2:
        return (lambda _: 1), _DECODE_AHEAD
    rows = plan.rows
    return (lambda run: max(1, len(rows[run]))), max(_DECODE_AHEAD, int(np.diff(plan.steps).max()))


def _first_chunk(plan: ConsumerPlan, needed: list[int]) -> int:
    """How many of the ``needed`` runs belong to the first step: a mixed plan's first chunk (its
    runs all start there), else the first run."""
    if not plan.parts or not needed:
        return 1
    starts = plan.run_starts  # runs are in chunk order: the first chunk's are a prefix of needed
    return sum(1 for _ in takewhile(lambda r: starts[r] == starts[needed[0]], needed))


class Step(NamedTuple):
    """One step of a columnar consumer (``Consumer.steps``): the open runs' ``tables`` (each a
    ``readers.columns.Columns``, or a list of samples), and per position it yields (``pos``, plan
    positions, ascending) the table it reads (``slot``, an index into ``tables``) and its row there."""

    tables: list[Any]
    slot: np.ndarray
    row: np.ndarray
    pos: np.ndarray


class _Run:
    """A decoded run: its first local index and samples, by local index - lo (a list, or a dict
    for a node mix's rows; None if the shard was skipped)."""

    def __init__(self, lo: int, samples: list[Any] | dict[int, Any] | None) -> None:
        self.lo, self.samples = lo, samples

    def release(self) -> None:
        self.samples = None


_CLOCK_SLACK = 0.1  # s: file times come from the kernel's coarse clock, up to a tick behind time.time()


class SkipMarks:
    """Which unreadable shards the consumers of this run reported on the node, per epoch."""

    def __init__(self, control_dir: str) -> None:
        self.dir = os.path.join(control_dir, "skipped")
        self.since = time.time() - _CLOCK_SLACK  # markers older than this are an earlier run's

    def first(self, key: str, epoch: int) -> bool:
        """Whether the caller is the first consumer of this run on the node to skip the shard of
        cache key ``key`` in ``epoch`` (and so reports it); marks it so."""
        name = hashlib.blake2b(f"{key}\0{epoch}".encode(), digest_size=16).hexdigest()
        path = os.path.join(self.dir, name)
        try:
            ensure_private_dir(self.dir)
            with open(os.path.join(self.dir, ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                try:
                    if os.stat(path).st_mtime >= self.since:
                        return False
                except FileNotFoundError:
                    pass
                with open(path, "w"):
                    pass
                os.utime(path)
        except OSError:
            pass
        return True
