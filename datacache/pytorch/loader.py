"""``datacache.DataLoader``: the line users write first, made the fast one.

``torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2)`` over samples pays PyTorch's
per-sample path: every sample crosses ``next()`` in the worker, ``default_collate`` allocates a
fresh shared-memory segment per batch field, and the training process maps each one. A
``StreamingDataset`` in batched mode collates in the worker straight from the reader into a
reusable shared-memory ring instead (``datacache.pytorch.batches``), but only for users who know to write
``StreamingDataset(batch_size=32)`` with ``DataLoader(batch_size=None)``.

``DataLoader`` takes torch's ``DataLoader`` signature and, over a ``StreamingDataset``, turns
``batch_size=B`` into the dataset's batched mode: it sets the dataset's ``batch_size`` (and
``collate_fn``, and ``drop_last`` when asked) and iterates the dataset through a plain torch
``DataLoader(batch_size=None)``. Its ``state_dict``/``load_state_dict`` resume mid-epoch, exactly,
as torchdata's ``StatefulDataLoader`` does, but with no per-batch snapshot of every worker's state:
torch takes the workers' batches in turn and the dataset deals each worker known whole batches, so
the number of batches handed out tells where every worker stands (``datacache.pytorch.rounds``). Over any
other dataset it is torchdata's ``StatefulDataLoader``. A plain torch ``DataLoader`` over a
samples-mode ``StreamingDataset`` keeps working as before (the slow path).
"""
from __future__ import annotations

import queue
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader

from ..read.headstart import HeadStart
from . import crossread
from .batches import RING_SLOTS, collate
from .bundles import BUNDLE, Unbundler, ring_slots
from .dataset import StreamingDataset
from .rounds import Rounds
from .torch_compat import batch_range, batch_step

__all__ = ["DataLoader"]

# torchdata 0.11's StatefulDataLoader.__init__ calls torch.set_vital, which torch >= 2.9 keeps only
# as a deprecated no-op that warns on every call: the warning is torchdata's, not the user's, so
# it is ignored while that constructor runs, and only it (warnings.catch_warnings swaps the
# process's filters for that time, as any caller that builds a loader in one thread does).
_NO_VITAL = "'set_vital' is deprecated"


class DataLoader(StatefulDataLoader):
    """torch's ``DataLoader`` that batches a datacache ``StreamingDataset`` in its workers, through
    the dataset's batched mode, and resumes mid-epoch (torchdata's ``StatefulDataLoader`` over any
    other dataset).

    Arguments are torch's; what differs over a ``StreamingDataset``:

    - ``batch_size``: becomes the dataset's ``batch_size`` (the loader below gets ``None``); the
      default 1 yields batches of one, as torch's does, and ``None`` single samples. A dataset
      already in batched mode keeps its own size: ``batch_size`` left at its default, ``None`` or
      equal to the dataset's is accepted, another size is refused. ``len(loader)`` is the rank's
      batch count.
    - ``collate_fn``: becomes the dataset's ``collate_fn`` (``None`` or torch's
      ``default_collate``: the dataset's ring collation, which gives what ``default_collate``
      gives).
    - ``drop_last=True``: sets the dataset's ``drop_last`` (every batch of every rank full; the
      remainder across ranks is dropped rather than padded). ``False`` leaves the dataset's own.
    - ``shuffle``, ``sampler``, ``batch_sampler``: refused (the dataset's seeded plan shuffles;
      pass ``shuffle``/``seed`` to ``StreamingDataset``), as torch refuses them for any
      ``IterableDataset``; so is ``in_order=False`` (the state counts on torch's in-order turns).
    - ``snapshot_every_n_steps``: accepted and unused (there is no per-step snapshot).
    - ``state_dict()``: the rank's complete ``StreamingDataset`` state (``datacache.plan.resume``), as of
      the last batch handed to the training loop; ``load_state_dict`` takes it (or any state
      ``StreamingDataset.load_state_dict`` takes) into the dataset, and the next iteration starts
      fresh workers from it (persistent ones too).
    - ``worker_init_fn``: runs in each worker as torch's does, after the loader has unblocked
      SIGINT there: the workers are forked with it blocked, so that a Ctrl-C that finds one still
      starting ends it quietly in torch's worker loop and the training process gets its
      ``KeyboardInterrupt`` (``_CtrlCInLoop``).
    - each iteration with workers gives them a head start: once they have forked, this process
      fetches their first shards into the node cache while they start (``datacache.read.headstart``),
      so a cold epoch's link does not idle through the workers' start-up.
    - in a cold epoch whose warm epochs will copy large ``bytes`` values from the node's tier files,
      a thread of this process (``datacache-tiermap``) maps each file as it lands, while the loop
      waits for the link, so the first warm epoch's copies take no page faults
      (``datacache.pytorch.tiermap``).
    - once the training loop spends a millisecond or more between two batches (a training step), a
      thread of this process (``datacache-loader-ahead``) takes the next batch from the workers while
      the loop works on the current one, one batch ahead at most (``_ReadAhead``); not under a
      profiler, where torch's per-batch range stays in the training thread.
    - with ``persistent_workers=True``, each worker builds its next epoch's plan once it has handed
      out its last batch (``datacache.pytorch.next_plan``).

    The dataset is configured in place (``loader.dataset is ds``), before any iteration, so its
    ``state_dict``, ``len()`` and ``set_epoch`` agree with the loader's. Not thread-safe, like
    torch's loaders: one thread iterates and checkpoints it.
    """

    def __init__(self, dataset: tud.Dataset, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, **kwargs: Any) -> None:
        self._plain: dict[str, Any] | None = None  # over a StreamingDataset: the torch loader's arguments
        if isinstance(dataset, StreamingDataset):
            for name, value in (("shuffle", shuffle), ("sampler", sampler), ("batch_sampler", batch_sampler)):
                if value:
                    raise ValueError(f"datacache.DataLoader: {name}= is not supported over a StreamingDataset, whose "
                                     "seeded plan orders the samples: pass shuffle=/seed= to StreamingDataset instead")
            if kwargs.get("in_order") is False:
                raise ValueError("datacache.DataLoader: in_order=False is not supported over a StreamingDataset: its "
                                 "resume state counts on torch taking the workers' batches in turn")
            _configure(dataset, batch_size, collate_fn, drop_last)
            dataset._pin = bool(pin_memory)  # the training process pins the batch rings (datacache.pytorch.batches)
            dataset._plan_ahead = bool(kwargs.get("persistent_workers"))  # a worker that lives on plans its next epoch
            batch_size, collate_fn, drop_last = None, None, False
            kwargs.pop("snapshot_every_n_steps", None)
            self._plain = dict(batch_size=None, num_workers=num_workers, pin_memory=pin_memory, **kwargs)
            self._plain["worker_init_fn"] = _CtrlCInLoop(kwargs.get("worker_init_fn"))
        with warnings.catch_warnings():  # see _NO_VITAL
            warnings.filterwarnings("ignore", message=_NO_VITAL, category=UserWarning)
            super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                             batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                             pin_memory=pin_memory, drop_last=drop_last, **kwargs)
        self._head: HeadStart | None = None  # this iteration's (datacache.read.headstart)
        self._reopen()

    def _reopen(self) -> None:
        """A fresh torch loader (new workers at the next iteration) and no iteration counted."""
        self._torch = None if self._plain is None else tud.DataLoader(self.dataset, **self._plain)
        self._live: _Counted | None = None

    def __iter__(self) -> Any:
        if self._torch is None:
            return super().__iter__()
        if self.num_workers == 0:  # the dataset, in this process, knows its own position
            return iter(self._torch)
        self._stop_live()  # its read-ahead out of torch's iterator, which iter() below resets
        self._stop_head()
        crossread.FILES.prune()  # tier files mapped here and evicted since are let go
        self.dataset.start_iteration()  # its epoch, decided here for the workers
        rounds = self.dataset.worker_rounds(self.num_workers)
        # Planned before the fork, so that the workers inherit the plans (a part mix of 200,000
        # samples: about 0.1 s a process) and the head start's reads lead theirs; its threads
        # start after the fork (see datacache.read.headstart).
        head = self.dataset.head_start(self.num_workers, start=False)
        maps = self.dataset.tier_mapper(self.num_workers)  # a cold epoch's: started after the fork too
        # Workers forked now send their batches in bundles (datacache.pytorch.bundles); only they
        # (persistent ones keep their copy): another loader over the dataset gets batches.
        bundle = BUNDLE if self.dataset.batch_size is not None else 0
        ds = self.dataset
        ds._bundle, ds._ring_slots = bundle, ring_slots(self._plain.get("prefetch_factor"), RING_SLOTS) if bundle \
            else RING_SLOTS
        try:
            with _ctrl_c_held(self._plain["worker_init_fn"]):
                it = iter(self._torch)  # the workers start (and copy the dataset with any loaded state)
        except BaseException:
            for planned in (head, maps):  # planned, never started: nothing in flight, nothing left open
                if planned is not None:
                    planned.close()
            raise
        finally:
            ds._bundle, ds._ring_slots = 0, RING_SLOTS
        if head is not None:
            head.start()
        if maps is not None:
            maps.start()
        self._head = head
        self.dataset.resume_started()
        self._live = _Counted(it, rounds, bundled=self.num_workers if bundle else 0,
                              on_batch=None if maps is None else maps.notify)
        return self._live

    def __len__(self) -> int:
        if self._torch is None:
            return super().__len__()
        return self.dataset.num_batches()  # len(dataset) stays its sample count

    def _stop_live(self) -> None:
        if self._live is not None:
            self._live.close()

    def _stop_head(self) -> None:
        head, self._head = self._head, None
        if head is not None:
            head.close()

    def state_dict(self) -> dict[str, Any]:
        if self._torch is None:
            return super().state_dict()
        ds = self.dataset
        if self.num_workers == 0:
            return ds.state_dict()
        live = self._live
        if live is None or live.rounds.base.epoch != ds.epoch:  # not iterated, or set_epoch moved on
            return ds.worker_rounds(self.num_workers).state(0).to_dict()
        return live.rounds.state(live.handed).to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._torch is None:
            super().load_state_dict(state_dict)
            return
        if state_dict == {}:  # as torchdata: nothing to load
            return
        self.dataset.load_state_dict(state_dict)
        self._stop_live()
        self._stop_head()
        self._reopen()  # persistent workers hold the old dataset copy: start new ones


_AHEAD_AFTER = 1e-3  # a training step at least this long (between two batches) starts the read-ahead


class _Counted:
    """The iterator ``DataLoader`` hands out over a ``StreamingDataset``'s workers: torch's, with
    a count of the batches handed to the training loop. Once the loop has spent ``_AHEAD_AFTER``
    between two batches (a training step, not a loop that only reads), the next batch is taken
    from torch's iterator by a thread while the loop works on the current one (``_ReadAhead``), so
    the hand-over (unpickling, mapping the ring, a bytes column's copies) overlaps the step instead
    of following it. Used by one thread, as torch's; ``close`` stops the read-ahead (idempotent)."""

    def __init__(self, it: Any, rounds: Rounds, bundled: int = 0,
                 on_batch: Callable[[bool], None] | None = None) -> None:
        self._it, self.rounds, self.handed = it, rounds, 0
        self._on_batch = on_batch  # told of each batch, and of the end (True): a cold epoch's TierMapper
        step = batch_step(it)
        self._next = Unbundler(step, bundled, batch_range(it)) if bundled else step  # bundled: the workers'
        self._ahead: _ReadAhead | None = None
        self._returned = -1.0  # when the last batch was handed out (perf_counter)

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        ahead = self._ahead
        profiled = torch.autograd._profiler_enabled()  # torch's range of each batch, in this thread
        if ahead is None and not profiled and self._returned >= 0 and \
                time.perf_counter() - self._returned >= _AHEAD_AFTER:
            ahead = self._ahead = _ReadAhead(self._next)
        try:
            if ahead is None:
                item = self._next()
            elif profiled:  # a profiler began: the batch asked for, then this thread again
                item = ahead.take(more=False)
                ahead.stop()
                self._ahead = None
            else:
                item = ahead.take()
        except StopIteration:
            if self._on_batch is not None:
                self._on_batch(True)
            raise
        if self._on_batch is not None:
            self._on_batch(False)
        self.handed += 1
        self._returned = time.perf_counter()
        return item

    def __len__(self) -> int:
        return len(self._it)

    def close(self) -> None:
        """Stop the read-ahead: back once its thread is out of torch's iterator (after the batch it
        may be taking), so that the iterator may be reset or dropped. Idempotent."""
        if self._ahead is not None:
            self._ahead.stop()

    def __del__(self) -> None:
        if self._ahead is not None:
            self._ahead.stop(wait=False)


class _ReadAhead:
    """One batch taken ahead from torch's iterator (``step``) on a thread of the training process:
    each ``take`` returns the batch asked for at the previous one (or takes one now) and asks for
    the next. Back-pressure: at most one batch is ahead of the training loop, so the loop's state
    (``_Counted.handed``) stays exact and the rings hold at most one more batch. An exception of
    ``step`` (a worker's, ``StopIteration`` at the epoch's end) is raised by the ``take`` that
    waits for it, with its traceback, and ends the thread. The thread holds nothing of the
    ``_Counted``, so a dropped iterator stops it (``__del__``)."""

    def __init__(self, step: Callable[[], Any]) -> None:
        self._asked = threading.Semaphore(0)
        self._out: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._pending = False  # a batch asked for and not yet taken
        self._ended = False  # the thread has ended (the epoch, or an error, was raised)
        self._thread = threading.Thread(target=_read_ahead, args=(step, self._asked, self._out, self._stopped),
                                        name="datacache-loader-ahead", daemon=True)
        self._thread.start()

    def take(self, more: bool = True) -> Any:
        """The next batch; ``more``: and ask for the one after it."""
        if self._ended:  # as torch's iterator once it has ended: no thread is left to ask
            raise StopIteration
        if not self._pending:
            self._asked.release()
        ok, value = self._out.get()
        self._pending = False
        if not ok:
            self._ended = True
            raise value
        if more:
            self._asked.release()  # the next batch, while the training loop works on this one
            self._pending = True
        return value

    def stop(self, wait: bool = True) -> None:
        """End the thread (``wait``: and wait until it has left torch's iterator). Idempotent."""
        self._stopped.set()
        self._asked.release()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


def _read_ahead(step: Callable[[], Any], asked: threading.Semaphore, out: queue.SimpleQueue,
                stopped: threading.Event) -> None:
    while True:
        asked.acquire()
        if stopped.is_set():
            return
        try:
            out.put((True, step()))
        except BaseException as exc:  # StopIteration too: the taker raises it, with its traceback
            out.put((False, exc))
            return


class _CtrlCInLoop:
    """The torch loader's ``worker_init_fn`` over a ``StreamingDataset``: SIGINT unblocked in the
    worker (``_ctrl_c_held`` forks it blocked), then the user's ``worker_init_fn``.

    A Ctrl-C reaches the workers too (the terminal signals the whole process group). torch's worker
    loop catches it and the worker exits with code 0, but a worker still starting (multiprocessing's
    bootstrap, before that loop) died of it with code 1, and torch's SIGCHLD handler in the training
    process then raised "DataLoader worker exited unexpectedly" (a ``RuntimeError``) in place of the
    training process's own ``KeyboardInterrupt`` as that unwound. Forked with SIGINT blocked, a
    worker takes a Ctrl-C only here, inside the loop. Picklable (for spawned workers)."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn
        self.unblock = True  # False where the forking thread itself had SIGINT blocked: left so

    def __call__(self, worker_id: int) -> None:
        if self.unblock:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending Ctrl-C raises here
        if self.user_fn is not None:
            self.user_fn(worker_id)


@contextmanager
def _ctrl_c_held(init: _CtrlCInLoop) -> Iterator[None]:
    """SIGINT blocked in this thread while torch starts the workers, which inherit the mask
    (``_CtrlCInLoop``). A Ctrl-C meanwhile is not lost: another thread of this process takes it
    for the main thread, or it stays pending until the mask is restored on the way out."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    init.unblock = signal.SIGINT not in old
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _configure(ds: StreamingDataset, batch_size: int | None, collate_fn: Callable[[list[Any]], Any] | None,
               drop_last: bool) -> None:
    """Put ``ds`` in the batched mode the loader arguments ask for (see ``DataLoader``)."""
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"datacache.DataLoader: batch_size must be a positive int or None, got {batch_size!r}")
    if ds.batch_size is not None and batch_size not in (None, 1, ds.batch_size):
        raise ValueError(f"datacache.DataLoader: batch_size={batch_size}, but the dataset already yields batches of "
                         f"{ds.batch_size} (StreamingDataset(batch_size={ds.batch_size})): pass one of the two")
    if ds.batch_size is None and batch_size is not None:  # 1 too: torch's default yields batches of one
        ds.batch_size, ds._loader_batched = batch_size, True
    if collate_fn is not None and collate_fn is not tud.default_collate:
        if ds.batch_size is None:
            raise ValueError("datacache.DataLoader: collate_fn= needs a batch_size (batch_size=None yields samples one "
                             "by one)")
        ds.collate_fn = collate_fn
    elif ds.batch_size is not None and ds.collate_fn is tud.default_collate:
        ds.collate_fn = collate
    if drop_last:
        ds.drop_last = True
