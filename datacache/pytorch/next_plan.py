"""The next epoch, planned and opened while a DataLoader worker waits between epochs.

A persistent worker starts each epoch when the training process asks for it: it plans it (a node
mix's plan of 100,000 samples, its permutation and runs, ``datacache.plan.epoch.build_plan``, costs
the worker about a tenth of the epoch's reads), tells the cache its schedule, starts its consumer's
threads and reads the first chunk before the first batch can go. The plan is a pure function of
the counts and the ``PlanSpec``, so a worker that has handed out its last batch does that work on a
thread for the spec it expects next (``expected_spec``): it plans, and where every shard the plan
reads is in the node cache already, opens the consumer, which reads its first chunks (no fetch:
nothing is evicted ahead of the epoch, and a limited cache's next epoch is only planned). The next
iteration computes its spec as always and takes what was built if that spec plans the same
(``same_plan``); otherwise it closes it and starts as before. The guess decides nothing: it never
asks the node for a decision (``datacache.read.node_schedule.mix_fields`` does that, for the real
spec), so a wrong guess costs CPU and nothing else.

Thread-safety: ``NextEpoch`` is made, taken and closed by the worker's own thread; its thread builds
once and publishes the result under a lock, and ``close`` never waits for it (what the thread opens
after a ``close`` it closes itself).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ..plan.epoch import ConsumerPlan, PlanSpec, build_plan, mixed_share

__all__ = ["NextEpoch", "expected_spec", "same_plan"]


def expected_spec(spec: PlanSpec) -> PlanSpec:
    """The spec the epoch after ``spec``'s is expected to have: the same with the next epoch, and,
    after a cold part mix, the node mix the warm epochs read (the part fields cleared), its
    chunk size to be set by the caller."""
    nxt = replace(spec, epoch=spec.epoch + 1)
    if spec.part_bytes:
        nxt = replace(nxt, part_bytes=0, part_narrow=0, part_strata=0)
    return nxt


def same_plan(counts: np.ndarray, a: PlanSpec, b: PlanSpec) -> bool:
    """Whether ``build_plan`` gives ``a`` and ``b`` the same plan: equal specs, or specs that differ
    in ``mix_bytes`` alone and agree on whether the node's part is mixed (``mix_bytes`` is only the
    budget the share is held against, and a cache's budget moves with the free space its processes
    see)."""
    if a == b:
        return True
    if replace(a, mix_bytes=b.mix_bytes) != b:
        return False
    return (mixed_share(counts, a) is None) == (mixed_share(counts, b) is None)


class NextEpoch:
    """``build_plan(counts, spec)``, then ``open(plan)`` (a consumer, or None where it opens none),
    on a thread (``datacache-next-epoch``) from construction. ``take`` hands them over, ``close``
    closes the consumer not taken."""

    def __init__(self, counts: np.ndarray, spec: PlanSpec, open: Callable[[ConsumerPlan], Any]) -> None:
        self.spec, self._counts = spec, counts
        self._plan: ConsumerPlan | None = None
        self._consumer: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self._built = threading.Event()  # the plan made, and the consumer opened (or not)
        self._thread = threading.Thread(target=self._build, args=(open,), name="datacache-next-epoch", daemon=True)
        self._thread.start()

    def _build(self, open: Callable[[ConsumerPlan], Any]) -> None:
        consumer = None
        try:
            self._plan = build_plan(self._counts, self.spec)
            consumer = None if self._closed else open(self._plan)
            with self._lock:
                if not self._closed:
                    self._consumer, consumer = consumer, None
        except Exception:  # noqa: BLE001 - the iteration that needs them builds them again, and raises
            pass
        finally:
            self._built.set()
        if consumer is not None:  # closed meanwhile
            consumer.close()

    def take(self, spec: PlanSpec, *, opened: bool = True) -> tuple[ConsumerPlan | None, Any]:
        """(plan, consumer) if built for a spec that plans as ``spec`` does (waiting until they are:
        planning and opening take no I/O wait, as the cache holds every shard), else (None, None);
        ``opened=False``: the plan alone. What is taken is no longer closed by ``close``."""
        if not same_plan(self._counts, spec, self.spec):
            return None, None
        self._built.wait()
        with self._lock:
            consumer, self._consumer = (self._consumer, None) if opened else (None, self._consumer)
        return self._plan, consumer

    def close(self) -> None:
        """Close the consumer opened and not taken (now, or when its thread has opened it).
        Idempotent; never waits."""
        with self._lock:
            self._closed = True
            consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()
