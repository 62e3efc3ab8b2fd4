"""The next epoch's plan, built while a DataLoader worker waits between epochs.

A persistent worker plans each epoch when the training process starts it: a node mix's plan of
100,000 samples (its permutation and its runs, ``datacache.plan.epoch.build_plan``) costs the
worker about as much as a tenth of the epoch's reads, and the first batch waits for it. The plan is
a pure function of the counts and the ``PlanSpec``, so a worker that has handed out its last batch
builds the plan of the spec it expects next (``expected_spec``) on a thread, and the next iteration
takes it when its own spec, computed as always, gives the same plan (``same_plan``); otherwise it
plans as before. The guess
decides nothing: it never asks the node for a decision (``datacache.read.node_schedule.mix_fields``
does that, for the real spec), so a wrong guess costs the thread's CPU and nothing else.

Thread-safety: ``NextPlan`` is made, taken and dropped by the worker's own thread; its thread only
computes and publishes the result once (an ``Event``).
"""
from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from ..plan.epoch import ConsumerPlan, PlanSpec, build_plan, mixed_share

__all__ = ["NextPlan", "expected_spec", "same_plan"]


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


class NextPlan:
    """``build_plan(counts, spec)`` computed on a thread (``datacache-next-plan``) from construction;
    ``take(spec)`` returns it where ``spec`` gives the same plan as the one it was built for
    (``same_plan``; waiting for the thread), else None. A plan whose build raised is None too (the
    caller's own build raises it again)."""

    def __init__(self, counts: np.ndarray, spec: PlanSpec) -> None:
        self.spec, self._counts = spec, counts
        self._plan: ConsumerPlan | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, args=(counts,), name="datacache-next-plan",
                                        daemon=True)
        self._thread.start()

    def _build(self, counts: np.ndarray) -> None:
        try:
            self._plan = build_plan(counts, self.spec)
        except Exception:  # noqa: BLE001 - the iteration that needs this plan builds it again and raises
            self._plan = None
        finally:
            self._done.set()

    def take(self, spec: PlanSpec) -> ConsumerPlan | None:
        """The plan, if built for ``spec`` (then after the thread is done), else None at once."""
        if not same_plan(self._counts, spec, self.spec):
            return None
        self._done.wait()
        return self._plan
