"""``StreamingDataset``'s checkpoint and loader side: ``state_dict``/``load_state_dict``, and what
``datacache.DataLoader`` asks before its workers start (``worker_rounds``, ``head_start``,
``resume_started``). A part of ``StreamingDataset`` (``datacache.dataset``), kept in its own
module to keep each file readable: ``ResumeMixin`` holds no state of its own and works on the
attributes ``StreamingDataset.__init__`` sets (the plan inputs, ``_resume``, ``_resume_base``,
``_consumer``, ``_worker``, ``_in_workers``). The rules of a resume are in ``datacache.resume``.

Thread safety: as ``StreamingDataset``'s (one iterating thread per process).
"""
from __future__ import annotations

import os
from typing import Any

import torch.utils.data as tud

from ._headstart import RUNS_PER_WORKER, HeadStart, first_chunks
from ._partmix import part_chunk
from ._rounds import Rounds, WorkerBatches
from .plan import ConsumerPlan, build_plan, mixed_share
from .resume import ResumeState, common_state, plan_mix, rank_state, resume_plan, resume_spec, start_state

__all__ = ["ResumeMixin"]


class ResumeMixin:
    """Resume and loader hooks of ``StreamingDataset`` (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """Where this consumer is: epoch and samples delivered per worker (``ResumeState.to_dict``).

        Called in the main process (``num_workers=0``) or, by ``StatefulDataLoader``, in each worker
        (a worker's state holds only its own count; the loader's state holds them all). In the main
        process while DataLoader workers iterate, the position is in the workers: ``RuntimeError``.
        """
        info = tud.get_worker_info()  # in a DataLoader worker, valid even before __iter__ ran
        if info is None and int(self._in_workers):
            raise RuntimeError("StreamingDataset.state_dict() in the main process while DataLoader workers read it: "
                               "the position is in the workers; checkpoint torchdata's StatefulDataLoader.state_dict() "
                               "instead (StreamingDataset.load_state_dict accepts it)")
        worker_id, num_workers = self._worker
        if info is not None:  # the plan worker it plays, or (before __iter__) will play
            worker_id, num_workers = (self._worker if self._consumer is not None else
                                      (self._plan_worker(info), info.num_workers))
        if self._resume is not None and info is None:  # loaded but not iterated yet: at the loaded position
            return self._resume.to_dict()
        spec = self._spec(num_workers, worker_id)
        if self._resume is not None:
            return self._resume.pending(dp_size=self.dp_size, dp_rank=self.dp_rank, num_workers=num_workers,
                                        worker_id=worker_id, batch_size=self.batch_size or 1,
                                        num_nodes=self.num_nodes, mix=plan_mix(spec)).to_dict()
        base = self._resume_base
        if base is None or base.epoch != self.epoch:
            base = start_state(epoch=self.epoch, seed=self.seed, dataset_id=self.manifest.dataset_id,
                               dp_size=self.dp_size, dp_rank=self.dp_rank, num_workers=num_workers,
                               batch_size=self.batch_size or 1, num_nodes=self.num_nodes, mix=plan_mix(spec))
        mix = plan_mix(resume_spec(spec, base))  # what this epoch's plan used
        consumed = 0
        if self._consumer is not None and self._consumer.epoch == self.epoch:
            delivered = getattr(self, "_delivered", None)
            consumed = self._consumer.consumed if delivered is None else delivered
        return base.advanced(dp_size=self.dp_size, dp_rank=self.dp_rank, num_workers=num_workers,
                             worker_id=worker_id, consumed=consumed, batch_size=self.batch_size or 1,
                             num_nodes=self.num_nodes, mix=mix).to_dict()

    def _plan_worker(self, info: Any) -> int:
        """The plan worker DataLoader worker ``info.id`` plays (``ResumeState.plan_worker``)."""
        st = self._resume
        if st is None or not st.same_layout(self.dp_size, info.num_workers, self.batch_size or 1, self.num_nodes):
            return int(info.id)
        return st.plan_worker(info.id, info.num_workers)

    def worker_rounds(self, num_workers: int) -> Rounds:
        """Where a ``DataLoader`` with ``num_workers`` workers starting an iteration now begins
        (the loaded state, if any, else the epoch's start), and each worker's batches (built on
        first use): ``datacache._rounds``, for ``datacache.DataLoader``'s state. Call it before
        the loader starts its workers, then ``resume_started()`` once they have."""
        resume = self._pending()
        layout = dict(dp_size=self.dp_size, dp_rank=self.dp_rank, num_workers=num_workers,
                      batch_size=self.batch_size or 1, num_nodes=self.num_nodes)
        spec0 = self._spec(num_workers, 0)
        start = resume or start_state(epoch=self.epoch, seed=self.seed, dataset_id=self.manifest.dataset_id,
                                      mix=plan_mix(spec0), **layout)

        def workers() -> list[WorkerBatches]:
            return [self._batches(*self._worker_plan(num_workers, w, resume, start.epoch)) for w in range(num_workers)]

        base = start.advanced(worker_id=0, consumed=0, mix=plan_mix(resume_spec(spec0, resume)), **layout)
        return Rounds(base=base, make_workers=workers)

    def head_start(self, num_workers: int, *, start: bool = True) -> HeadStart | None:
        """Fetch, from this (the training) process, the first shards of ``num_workers`` DataLoader
        workers that have just begun the epoch (``datacache._headstart``), or a part-mixed epoch's
        first chunks' rows; ``None`` when a resume is pending (the workers start mid-plan), the
        epoch is a node mix, or there is nothing to read. ``start=False``: planned (the workers'
        plans computed and memoized in this process), its threads started by ``HeadStart.start``."""
        if self._pending() is not None:
            return None
        spec0 = self._spec(num_workers, 0)
        if self._mix is None and mixed_share(self.counts, spec0) is not None:
            return self._part_head_start(num_workers, start) if spec0.part_bytes > 0 else None
        runs = []
        for w in range(num_workers):
            plan, _ = self._worker_plan(num_workers, w, None, self.epoch, shards_only=True)
            times = plan.run_times(self.epoch)
            runs += [(k, w, plan.runs[k][0], times[k]) for k in range(min(RUNS_PER_WORKER, len(plan.runs)))]
        if not runs:
            return None
        return HeadStart(self.source, [(shard, t) for _, _, shard, t in sorted(runs)],
                         name=f"datacache-headstart-r{self.dp_rank}", start=start)

    def _part_head_start(self, num_workers: int, start: bool) -> HeadStart | None:
        """The head start of a part-mixed epoch: the runs of each worker's first ``RUNS_PER_WORKER``
        chunks (a chunk: one run per shard it touches), chunk by chunk across the workers, on as
        many threads as the store has ranged reads in flight. Each worker's plan is planned for
        those chunks only (``build_plan(head=...)``: 0.05 s for two workers of a 200,000-sample
        part mix, not 0.2 s); their next use is the epoch's start."""
        runs = []
        head = RUNS_PER_WORKER * part_chunk(self.batch_size or 1, 1 << 62)  # the first chunks' positions, at least
        for w in range(num_workers):
            plan, _ = self._worker_plan(num_workers, w, None, self.epoch, shards_only=True, head=head)
            if not plan.parts:
                return None
            runs += [(c, w, k, shard, float(self.epoch), rows)
                     for k, (c, shard, _, rows) in enumerate(first_chunks(plan, self.epoch, RUNS_PER_WORKER))]
        if not runs:
            return None
        runs.sort(key=lambda r: r[:3])
        return HeadStart(self.source, [(r[3], r[4]) for r in runs], rows=[r[5] for r in runs],
                         threads=self.source.store.transfer.range_requests,
                         name=f"datacache-headstart-r{self.dp_rank}", start=start)

    def _pending(self) -> ResumeState | None:
        """The loaded state not yet iterated, if it is of the current epoch."""
        st = self._resume
        return st if st is not None and st.epoch == self.epoch else None

    def _worker_plan(self, num_workers: int, w: int, resume: ResumeState | None, epoch: int,
                     shards_only: bool = False, head: int | None = None) -> tuple[ConsumerPlan, int]:
        """(plan, plan positions already delivered) of DataLoader worker ``w`` of ``num_workers``
        in ``epoch``, continuing from ``resume``: what that worker's ``__iter__`` computes
        (``head``: of a mixed plan, its first ``head`` positions only, ``build_plan``)."""
        spec = resume_spec(self._spec(num_workers, w, epoch=epoch), resume)
        order, skip = resume_plan(self.counts, spec, resume, orders=self._mix)
        return build_plan(self.counts, spec, order=order, shards_only=shards_only, head=head), skip

    def resume_started(self) -> None:
        """A loader's workers took the loaded state (``worker_rounds``) and the epoch of
        ``start_iteration``: the state is no longer pending, workers forked later decide their own."""
        self._resume_base, self._resume = self._resume, None
        self._follow = False

    def load_state_dict(self, state: Any) -> None:
        """Resume from ``state`` at the next ``__iter__`` (possibly with another world size or
        ``num_workers``). ``state``: what ``state_dict()`` returned, a ``StatefulDataLoader``'s
        ``state_dict()``, a ``ResumeState``, or a list of several old ranks' states (checked to
        agree; see ``datacache.resume`` for which state each new rank loads). ``ValueError`` if the
        state is from another dataset or seed, or lacks counts this resume needs."""
        st = common_state(state) if isinstance(state, (list, tuple)) else rank_state(state)
        st.check_dataset(self.manifest.dataset_id, self.seed)
        info = tud.get_worker_info()
        if info is not None and self._epoch_explicit and st.epoch != self.epoch:
            # StatefulDataLoader loads worker states only at worker start, after the training loop's
            # set_epoch: an epoch selected there that differs from the state's wins, as set_epoch
            # after load_state_dict does in the main process (e.g. saved at the end of epoch e,
            # resumed with set_epoch(e + 1)).
            self._resume = None
            return
        if info is not None:  # torchdata gave this worker its own state: refuse one it cannot use
            st.check_layout(self.dp_size, info.num_workers, self.batch_size or 1, self.num_nodes)
        self.epoch = st.epoch
        self._resume, self._resume_pid = st, os.getpid()
        if info is None:
            self._epochs.clear()  # without set_epoch, the iteration after this one reads st.epoch + 1

