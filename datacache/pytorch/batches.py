"""Collated batches in reusable shared memory: one copy from the decoded shard into the batch.

A DataLoader worker hands a tensor to the main process by moving its storage into a fresh shared
segment and passing a file descriptor over a socket, one connection per tensor: here about
0.8 ms per tensor, more than the copy itself, and the fresh pages are faulted in on both sides.
:class:`BatchRing` avoids all of it. A batch's fixed-shape columns (tensors, arrays, numbers:
see ``datacache.pytorch.collate``) are written into a *slot* of a ring mapped in both processes. What crosses the
queue is the batch's structure (dicts, lists, namedtuples as default_collate makes them) with a
small :class:`ShmTensor` where each such tensor goes; all of a batch's refer to one
:class:`ShmBatch`, which pickle sends once and unpickles, in the receiving process, into tensors
that are views of that slot (``_attach``). No copy, no descriptor, no fresh pages once the ring is
warm. Such a batch must not be collated again: :class:`ShmTensor` refuses ``default_collate``
with a line saying so (a DataLoader with a ``batch_size`` of its own over batched mode).

Slot life cycle (one state byte per slot in the ring's header page)::

    FREE --acquire (producer)--> IN_USE --last tensor of the batch freed (consumer)--> FREE

All of a batch's tensors wrap numpy arrays made from one buffer object over the slot
(``_span``), which marks the slot free when it is garbage: numpy keeps that object alive while
any array or view made from it lives. Whatever keeps a tensor alive (a view,
``.numpy()``, the DataLoader's reorder buffer, a user's list) keeps its slot, so a slot is never
overwritten while any part of its batch can be read. When every slot is in use the producer does
not wait: the batch is collated into ordinary memory (``ring.fallbacks`` counts these), which a
DataLoader worker then moves into shared memory itself (``to_shared_memory``): torch's queue would
do it in its feeder thread, where a full ``/dev/shm`` drops the batch with a printed traceback and
the training process waits for it for ever; here the error reaches the training process instead.

Files: a worker's ring is a file in ``/dev/shm`` (only a tmpfs, only with twice its size free),
named ``datacache-batch-<main pid>-<worker pid>-<n>``. The consumer unlinks it when it attaches;
a ring whose batches were never received is unlinked when its worker exits, and one left by a
killed process is removed by the next ring created on the node. A worker keeps its ring for all
its epochs (persistent workers): an epoch starts with warm, mapped slots. In the main process (no
DataLoader workers) the ring is anonymous memory.

A batch whose large ``bytes`` columns stay in the worker (``datacache.pytorch.crossread``) has
the worker keep what their addresses point into (``BatchRing.hold``) until its slot is free: the
consumer reads the values before it frees the slot, so the memory it reads is the values'.

Thread safety: a ring is filled by one producer thread; slots are freed from any thread.

Batched mode's loop (``batched``): a consumer's samples collated into whole batches on the read
layer's batching stage (``datacache.read.batcher``: a thread some batches ahead, closed with the
consumer, the plan position after each batch reported through ``mark``).
"""
from __future__ import annotations

import ctypes
import itertools
import mmap
import operator
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate_fn_map

from .._localfs import pid_alive as _alive
from .._localfs import remove_if_exists as _unlink
from ..errors import CacheError
from ..read.batcher import batches as run_batches
from ..read.consumer import Consumer
from .collate import Layout, PackedBytes, assemble, collate, layout_end, plan, tensors, values
from .crossread import available as crossread_available
from .crossread import populate_write
from .rounds import WorkerBatches

__all__ = ["RING_SLOTS", "BatchRing", "RingCollator", "ShmBatch", "ShmTensor", "PackedBytes", "batched", "collate",
           "sharing", "shm_available", "to_shared_memory"]

_PAGE = mmap.PAGESIZE
_FREE, _IN_USE = 0, 1  # slot states: one byte per slot in the ring's header page
_SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^datacache-batch-(\d+)-(\d+)-\d+$")
_counter = itertools.count()
RING_SLOTS = 16  # a ring's slots unless its maker asks for more (datacache.pytorch.bundles.ring_slots)
_GROWTHS = 8  # new, larger rings a RingCollator makes at most for batches its slots cannot hold


class BatchRing:
    """``slots`` batch slots of ``slot_bytes`` each, in a file under ``/dev/shm`` (``shared=True``:
    batches cross to another process as :class:`ShmBatch`) or in anonymous memory (batches are
    tensors at once). See the module docstring for the slot life cycle."""

    def __init__(self, slot_bytes: int, slots: int = RING_SLOTS, *, shared: bool, pin: bool = False) -> None:
        if not 1 <= slots <= _PAGE:
            raise ValueError(f"slots must be in [1, {_PAGE}], got {slots}")
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        self.slots = slots
        self.size = _PAGE + slots * self.slot_bytes
        self.path: str | None = None
        self.pin = pin  # the receiving process registers the mapping as pinned memory (``_SlotState.pin``)
        self.fallbacks = self.published = 0
        self._held: dict[int, Any] = {}  # slot -> what its batch's values left in this process need (``hold``)
        if shared:
            self.path = _create_file(self.size)
            with open(self.path, "r+b") as f:
                self._mm = mmap.mmap(f.fileno(), self.size)
            if populate_write is not None:  # every slot writable now: not a fault per page at its first batch
                populate_write(self._mm, self.size)
            from multiprocessing import util

            # At the producer's exit no batch of this ring will be received any more (a DataLoader
            # reads every batch before it stops its workers, and drops the rest when abandoned).
            util.Finalize(None, _unlink, args=(self.path,), exitpriority=10)
        else:
            self._mm = mmap.mmap(-1, self.size)
            self._state = _SlotState(self._mm)
            if pin:
                self._state.pin()

    def acquire(self, nbytes: int) -> int | None:
        """A free slot (now in use) for a batch of ``nbytes``, or None: too big, or every slot busy."""
        if nbytes > self.slot_bytes:
            self.fallbacks += 1
            return None
        self.holding()
        # The lowest free slot: recently freed memory is still in the CPU caches (a round robin
        # over all slots would write to memory that has long left them).
        slot = self._mm.find(b"\x00", 0, self.slots)
        if slot < 0:
            self.fallbacks += 1
            return None
        self._mm[slot] = _IN_USE
        return slot

    def buffer(self, slot: int) -> np.ndarray:
        """``slot``'s bytes, a writable uint8 array."""
        return np.frombuffer(self._mm, np.uint8, self.slot_bytes, self._offset(slot))

    def _offset(self, slot: int) -> int:
        return _PAGE + slot * self.slot_bytes

    def publish(self, slot: int, fields: Layout) -> list[Any]:
        """The filled slot's fields as this process's tensors (anonymous ring) or as
        :class:`ShmTensor` handles of one :class:`ShmBatch`."""
        self.published += 1
        if self.path is None:
            return _values(self._state, self._mm, self._offset(slot), slot, fields)
        # torch's DataLoader converts a worker's numpy arrays to tensors (default_convert) before it
        # sends the batch, so a shared ring's ragged arrays come as the tensors that would make
        fields = tuple(f._replace(kind="tensors") if f.kind == "arrays" else f for f in fields)
        batch = ShmBatch(self.path, self.size, self._offset(slot), slot, fields, self.pin)
        return [ShmTensor(batch, i) for i in range(len(fields))]

    def abandon(self, slot: int) -> None:
        """Give back a slot that was acquired but will not be published (its batch failed)."""
        self._held.pop(slot, None)
        self._mm[slot] = _FREE

    def hold(self, slot: int, keep: Any) -> None:
        """Keep ``keep`` alive until ``slot`` is free again: the memory that a published batch's
        ``remote`` columns point into, read by the consumer before it frees the slot."""
        self._held[slot] = keep

    def holding(self) -> bool:
        """Drop what ``hold`` kept for slots that are free now; whether anything is still kept."""
        if self._held:
            for slot in [k for k in self._held if self._mm[k] == _FREE]:
                del self._held[slot]
        return bool(self._held)

    def in_use(self) -> int:
        """Slots currently held (by batches being filled or not yet freed by their consumer)."""
        return self.slots - self._mm[:self.slots].count(bytes([_FREE]))

    def close(self) -> None:
        """Stop producing. The mapping stays open until the ring is garbage: batches may still be
        in flight to the consumer, which finds the file until it attaches. Idempotent."""
        if self.path is not None and self.published == 0:
            _unlink(self.path)


class RingCollator:
    """``collate`` into a :class:`BatchRing` made at the first batch and sized for it (``shared``:
    a file in ``/dev/shm`` for a DataLoader worker; else anonymous memory), kept for the process's
    later epochs (``pid`` tells a forked child not to use its parent's). A batch larger than its
    slots (variable-length fields, or a short first batch) gets a new ring sized for it, up to
    ``_GROWTHS`` times; the old ring's batches stay valid. Falls back to plain collation when the
    ring cannot be made (no tmpfs, not enough free space). ``pin``: the receiving process pins
    the ring (``_SlotState.pin``); ``bytes_views``: bytes and str columns come as ``PackedBytes``.
    One producer thread."""

    def __init__(self, *, shared: bool, slots: int = RING_SLOTS, pin: bool = False, bytes_views: bool = False) -> None:
        self.shared, self.slots, self.pid = shared, slots, os.getpid()
        self.pin, self.bytes_views = pin, bytes_views
        self.ring: BatchRing | None = None
        self._retired: list[BatchRing] = []  # rings grown out of that still hold memory for their batches
        self._tried = False
        self._growths = 0

    @property
    def cross_read(self) -> bool:
        """Whether large bytes columns may stay in this process for the consumer to read
        (``datacache.pytorch.crossread``): a shared ring's, where the system lets it."""
        return self.shared and crossread_available(os.getppid())

    def __call__(self, samples: Sequence[Any]) -> Any:
        batch = plan(samples, bytes_views=self.bytes_views)
        return assemble(samples, batch, self.ring_for(batch.nbytes, any(f.kind != "tensor" for f in batch.fields)))

    def ring_for(self, nbytes: int, variable: bool = False) -> BatchRing | None:
        """The ring a batch of ``nbytes`` goes into (made or grown for it where it can be), or
        None. ``variable``: its size varies from batch to batch (bytes, str, ragged columns)."""
        if not self._tried:
            self._tried = True
            self.ring = self._make(nbytes, variable)
        elif self.ring is not None and nbytes > self.ring.slot_bytes and self._growths < _GROWTHS:
            bigger = self._make(nbytes, True)
            if bigger is not None:
                self._growths += 1
                self.ring.close()
                self._retired.append(self.ring)
                self.ring = bigger
        if self._retired:
            self._retired = [r for r in self._retired if r.holding()]
        return self.ring

    def _make(self, nbytes: int, variable: bool) -> BatchRing | None:
        extra = nbytes // 2 if variable else nbytes // 8  # room for larger batches
        slot = -(-(nbytes + extra) // _PAGE) * _PAGE
        if nbytes == 0 or (self.shared and not shm_available(_PAGE + self.slots * slot)):
            return None
        try:
            return BatchRing(slot, self.slots, shared=self.shared, pin=self.pin)
        except OSError:
            return None

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


def to_shared_memory(batch: Any) -> Any:
    """``batch`` with every CPU tensor in it (through mappings, lists and tuples) moved into shared
    memory now, in place, as torch's queue would move it when it sends the batch to the training
    process. Called in a DataLoader worker on each batch before it is handed to torch, so that a
    full ``/dev/shm`` raises here, in the worker's iteration (torch then re-raises it in the
    training process), and not in the queue's feeder thread, which prints it, drops the batch, and
    leaves the training process waiting for ever. Ring batches (``ShmTensor``) and tensors already
    shared (``default_collate``'s in a worker) cost a type check each. Thread-safe for distinct
    batches."""
    for t in tensors(batch):
        if t.layout == torch.strided and t.device.type == "cpu" and not t.is_shared():
            _share(t)
    return batch


def sharing(collate_fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``collate_fn`` whose batches are in shared memory when it returns (``to_shared_memory``)."""
    def collate_shared(samples: list[Any]) -> Any:
        return to_shared_memory(collate_fn(samples))

    return collate_shared


def _share(t: torch.Tensor) -> None:
    try:
        t.share_memory_()
    except RuntimeError as exc:  # torch's: "unable to allocate shared memory(shm) for file </torch_...>: <cause>"
        cause = str(exc).rsplit(": ", 1)[-1]
        raise CacheError(f"{_SHM_DIR} has no room for a batch tensor of {t.nbytes} bytes ({cause}): DataLoader workers "
                         "hand their batches to the training process through shared memory there; free space in it "
                         "or make it larger (docker run --shm-size), or use fewer workers or smaller batches",
                         url=_SHM_DIR) from exc


class ShmBatch:
    """A batch's ring slot, as sent through the DataLoader's queue; unpickles into the list of its
    fields' values (``datacache.pytorch.collate.values``: tensors viewing the slot, lists built
    from it), in the receiving process, which then owns the slot until it frees the views."""

    def __init__(self, path: str, size: int, offset: int, slot: int, fields: Layout, pin: bool = False) -> None:
        self.args = (path, size, offset, slot, fields, pin)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _attach, self.args


class ShmTensor:
    """Field ``index`` of a :class:`ShmBatch`, in the batch's structure; unpickles into its tensor
    (pickle sends the batch once for all its fields)."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: ShmBatch, index: int) -> None:
        self.batch, self.index = batch, index

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return operator.getitem, (self.batch, self.index)


def _refuse_collate(batch: list[Any], *, collate_fn_map: Any = None) -> Any:
    raise ValueError("datacache: the DataLoader collates batches that StreamingDataset(batch_size=...) already "
                    "made: pass batch_size=None to the DataLoader, or drop batch_size from the dataset")


default_collate_fn_map[ShmTensor] = _refuse_collate  # torch's documented way to extend default_collate


class _SlotState:
    """Frees slots of one mapping when the last tensor of their batch is gone (consumer side).

    Pinned (``pin``: the mapping registered with CUDA as page-locked host memory, so that torch's
    ``pin_memory`` takes the batch's tensors as they are, without a copy): a freed slot becomes
    free only once the copies queued before its batch was freed are done (a CUDA event recorded
    on the freeing thread's current stream), so that an asynchronous host-to-device copy of a batch
    never reads a slot the worker is refilling. Copies on another stream must be synchronised by
    the caller before it drops the batch, as with any pinned buffer it reuses."""

    _free = _FREE  # module globals are None while the interpreter exits, when the last batches may go

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()
        self.pinned: int = 0  # the registered address, or 0
        self._pending: list[tuple[Any, int]] = []  # (CUDA event, slot) freed, waiting for their copies

    def hold(self, slot: int, fields: int) -> None:
        with self._lock:
            self._live[slot] = fields

    def drop(self, slot: int) -> None:
        event = None
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            left = self._live[slot] - 1
            self._live[slot] = left
            if left == 0:
                del self._live[slot]
                if event is not None:
                    self._pending.append((event, slot))
                elif not self.mm.closed:
                    self.mm[slot] = self._free
            if self._pending:
                self._reap()

    def _reap(self) -> None:
        """Free the pending slots whose copies are done (under the lock)."""
        waiting = []
        for event, slot in self._pending:
            if event.query():
                if not self.mm.closed:
                    self.mm[slot] = self._free
            else:
                waiting.append((event, slot))
        self._pending = waiting

    def poll(self) -> None:
        """Free the pending slots whose copies are done (a pinned ring's, at each batch received)."""
        if self._pending:
            with self._lock:
                self._reap()

    def pin(self) -> bool:
        """Register the mapping as pinned host memory where CUDA is available (once); whether it is."""
        if self.pinned:
            return True
        addr = _register(self.mm)
        if addr:
            self.pinned = addr
            self._finalizer = weakref.finalize(self, _unregister, addr)
        return bool(addr)


def _register(mm: mmap.mmap) -> int:
    """``cudaHostRegister`` the mapping ``mm``: its address, or 0 where CUDA is not available or
    refuses (torch then pins each batch by copying it, as for any tensor)."""
    try:
        if not torch.cuda.is_available():
            return 0
        addr = int(np.frombuffer(mm, np.uint8, 1).ctypes.data)
        rc = torch.cuda.cudart().cudaHostRegister(addr, len(mm), 0)
        return addr if int(getattr(rc, "value", rc)) == 0 else 0
    except (RuntimeError, AttributeError, OSError):
        return 0


def _unregister(addr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(addr)
    except (RuntimeError, AttributeError, OSError):
        pass


def _free_slot(buf: Any) -> None:
    buf.state.drop(buf.slot)


_SPAN_TYPES: dict[int, type] = {}  # byte length -> ctypes array type whose instances free their slot


def _span(mm: mmap.mmap, base: int, nbytes: int, state: _SlotState, slot: int) -> Any:
    """The slot's first ``nbytes`` as one buffer object that frees the slot when it is garbage.

    Every field's array is made from it, and numpy keeps the object an array was made from alive
    for as long as any view of that array (or tensor over one) lives: one finaliser per batch, on
    the very object its tensors keep alive (a finaliser per field costs the training loop 35 us
    each in a step's cold caches)."""
    kind = _SPAN_TYPES.get(nbytes)
    if kind is None:
        kind = _SPAN_TYPES.setdefault(nbytes, type("SlotSpan", (ctypes.c_char * nbytes,), {"__del__": _free_slot}))
    buf = kind.from_buffer(mm, base)
    buf.state, buf.slot = state, slot
    return buf


def _values(state: _SlotState, mm: mmap.mmap, base: int, slot: int, fields: Layout, producer: int = 0) -> list[Any]:
    """The values of the slot's fields (``datacache.pytorch.collate.values``; ``producer``: the
    process whose memory ``remote`` columns point into); the slot is freed when none of them views
    it any more (at once when none does: lists of bytes or str), after every value was read."""
    state.hold(slot, 1)
    if not fields:  # nothing views the slot (assemble takes none for such a batch)
        state.drop(slot)
        return []
    buf = _span(mm, base, layout_end(fields), state, slot)
    return values(buf, fields, producer)


# ---------------------------------------------------------------- consumer side (main process)
# Attached rings by producer pid. A producer (a DataLoader worker) keeps one ring for its life, or
# makes a new one after it, and its batches arrive in order: its new ring means no batch of the
# previous one is still to come. Entries of producers that have exited are dropped whenever a new
# ring is attached; the mapping itself lasts while any of its tensors does.
_ATTACHED_RINGS: dict[int, tuple[str, _SlotState]] = {}
_RINGS_LOCK = threading.Lock()


def _attach(path: str, size: int, offset: int, slot: int, fields: Layout, pin: bool = False) -> list[Any]:
    """Unpickle a :class:`ShmBatch`: map its ring once (and unlink the file; ``pin``: register it
    as pinned memory where CUDA is available), return its fields' values."""
    producer = int(_NAME.match(os.path.basename(path)).group(2))  # type: ignore[union-attr]
    with _RINGS_LOCK:
        entry = _ATTACHED_RINGS.get(producer)
    if entry is None or entry[0] != path:
        entry = _attach_ring(producer, path, size)
        if pin:
            entry[1].pin()
    state = entry[1]
    state.poll()
    return _values(state, state.mm, offset, slot, fields, producer)


def _attach_ring(producer: int, path: str, size: int) -> tuple[str, _SlotState]:
    """Map a producer's new ring and unlink its file (the file system calls outside the lock)."""
    mm = _map_existing(path, size)
    with _RINGS_LOCK:
        entry = _ATTACHED_RINGS.get(producer)
        if entry is not None and entry[0] == path:  # another thread attached it meanwhile
            return entry
        entry = _ATTACHED_RINGS[producer] = (path, _SlotState(mm))
        others = [p for p in _ATTACHED_RINGS if p != producer]
    _unlink(path)
    gone = [p for p in others if not _alive(p)]
    with _RINGS_LOCK:
        for pid in gone:
            _ATTACHED_RINGS.pop(pid, None)
    return entry


def _map_existing(path: str, size: int) -> mmap.mmap:
    try:
        with open(path, "r+b") as f:
            return mmap.mmap(f.fileno(), size)
    except FileNotFoundError:
        raise RuntimeError(f"datacache: batch ring {path} is gone (its DataLoader worker exited, or something "
                           "removed it from /dev/shm); the batch cannot be read") from None


# ---------------------------------------------------------------- files
def _sweep() -> None:
    """Remove rings left by processes that were killed (both ends dead)."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))) and not _alive(int(m.group(2))):
            _unlink(os.path.join(_SHM_DIR, name))


def shm_available(size: int) -> bool:
    """Whether a ring of ``size`` bytes fits in ``/dev/shm`` with as much again to spare."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return False
    return os.access(_SHM_DIR, os.W_OK) and st.f_bavail * st.f_frsize >= 2 * size


def _create_file(size: int) -> str:
    _sweep()
    path = os.path.join(_SHM_DIR, f"datacache-batch-{os.getppid()}-{os.getpid()}-{next(_counter)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # backed now: a page /dev/shm cannot give later is a SIGBUS
    except OSError:
        os.close(fd)
        _unlink(path)
        raise
    os.close(fd)
    return path


def batched(consumer: Consumer, batches: WorkerBatches, collate: Callable[[list[Any]], Any],
            transform: Callable[[Any], Any] | None, mark: Callable[[int], None]) -> Iterator[Any]:
    """Yield ``consumer``'s samples (``transform``ed) as ``batches`` says, each ``collate``d, on
    the batching stage (``datacache.read.batcher``: ``mark(position)`` before each batch is yielded,
    and once with the start position)."""
    samples = iter(consumer)
    cuts = batches.cuts

    def make_batch(j: int) -> tuple[Any, int] | None:
        n = batches.size if cuts is None else cuts[j] - consumer.consumed  # per_stream: cut at stream changes
        batch = [transform(s) if transform else s for s in itertools.islice(samples, n)]
        if not batch:
            return None
        return collate(batch), consumer.consumed

    return run_batches(consumer, batches.count, make_batch, mark, finish=samples.close)
