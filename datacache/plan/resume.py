"""Resume state of a ``StreamingDataset``: what a checkpoint holds, how states merge, and how a
consumer continues from one. Pure functions and immutable objects (thread-safe).

The rules (the README's "Resuming" section says the same):

- A state belongs to one data-parallel rank: the epoch, the rank's layout (``dp_size``,
  ``num_workers``, ``num_nodes``, and in batched mode ``batch_size``: workers get whole batches),
  how many samples of its plan each DataLoader worker has *delivered* (handed to the training
  loop, not read ahead), and the chain of earlier elastic resumes of the epoch.
- Same layout (same ``dp_size``, ``num_workers``, ``num_nodes``, ``batch_size``): every consumer
  rebuilds its plan and skips what it delivered, so the order is exactly the uninterrupted one.
  Each rank loads its own state.
- Another layout (elastic, another node count, ``num_workers`` or ``batch_size``): the samples
  not delivered (``plan.remainder_order``) are planned afresh for the new layout; every sample is
  read exactly once (plus the new layout's padding). This needs every worker's count, and it takes one rank's
  counts for all ranks: ranks advance in lockstep, so when every rank saves at the same training
  step they all hold the same counts. Every new rank loads the same state: any old rank's, or the
  list of all old ranks' states, which ``common_state`` checks agree (refusing otherwise).
- ``StatefulDataLoader`` calls ``state_dict`` in each worker, and a worker knows only its own count
  (the others are ``None``); the loader's state holds every worker's state as of the last batch
  the loop received, and ``rank_state`` merges them into one complete rank state.
  ``StreamingDataset.load_state_dict`` accepts all of these forms.
- ``datacache.DataLoader`` needs no snapshot: it counts the batches it handed out and computes
  every worker's count (``datacache.pytorch.rounds``). torch starts each iteration at its worker 0, so a
  state also names the plan worker whose batch comes next (``next_worker``): resumed in the same
  layout, DataLoader worker ``p`` plays plan worker ``(p + next_worker) % num_workers``, and the
  order stays the uninterrupted one.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .epoch import EpochOrders, PlanSpec, remainder_order

__all__ = ["STATE_VERSION", "NO_MIX", "Link", "ResumeState", "start_state", "rank_state", "common_state",
           "resume_plan", "resume_spec", "plan_mix"]

STATE_VERSION = 2
# ``mix``: the PlanSpec fields a state records because its epoch's plan was read with them (the
# node-mix and part-mix decision, and whether the batches were dealt to the workers in turn)
_MIX_FIELDS = ("mix_bytes", "mix_from", "part_bytes", "part_narrow", "part_strata", "in_turns")
NO_MIX = (0, 1, 0, 0, 0, 0)  # a plan with neither mix, its batches in contiguous shares


def _check_mix(mix: Any) -> tuple[int, ...]:
    """``mix`` as (mix_bytes, mix_from, part_bytes, part_narrow, part_strata, in_turns); a state
    saved before the part mix has only the first two, one saved before its narrowing end the first
    three, one saved before its strata the first four, one saved before batches were dealt in turn
    the first five (their epochs were read without them: 0), so that it resumes the order it was
    saved in."""
    if not (isinstance(mix, tuple) and 2 <= len(mix) <= len(_MIX_FIELDS)
            and all(isinstance(v, (int, np.integer)) and v >= 0 for v in mix)):
        raise ValueError(f"resume state: mix={mix!r}, expected ({', '.join(_MIX_FIELDS)}) integers >= 0; {_HOW}")
    return tuple(int(v) for v in mix) + (0,) * (len(_MIX_FIELDS) - len(mix))


_HOW = ("pass what StreamingDataset.state_dict() or StatefulDataLoader.state_dict() returned "
        "(see datacache.plan.resume)")


def _count(name: str, value: Any, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"resume state: {name}={value!r}, expected an integer >= {low}; {_HOW}")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class Link:
    """An earlier elastic resume of the epoch: its layout and every worker's count. Immutable."""

    dp_size: int
    num_workers: int
    consumed: tuple[int, ...]
    batch_size: int = 1
    num_nodes: int = 1
    mix: tuple[int, ...] = NO_MIX

    def __post_init__(self) -> None:
        object.__setattr__(self, "mix", _check_mix(self.mix))
        _count("dp_size", self.dp_size, 1)
        _count("num_workers", self.num_workers, 1)
        _count("batch_size", self.batch_size, 1)
        if len(self.consumed) != self.num_workers:
            raise ValueError(f"resume state: chain link has {len(self.consumed)} counts for "
                             f"num_workers={self.num_workers}; {_HOW}")
        for c in self.consumed:
            _count("chain consumed", c)

    def to_dict(self) -> dict[str, Any]:
        return {"dp_size": self.dp_size, "num_workers": self.num_workers, "consumed": list(self.consumed),
                "batch_size": self.batch_size, "num_nodes": self.num_nodes, "mix": list(self.mix)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Link:
        return cls(dp_size=d["dp_size"], num_workers=d["num_workers"], consumed=tuple(d["consumed"]),
                   batch_size=d.get("batch_size", 1), num_nodes=d.get("num_nodes", 1),
                   mix=tuple(d.get("mix", NO_MIX)))


@dataclass(frozen=True, kw_only=True)
class ResumeState:
    """One rank's position in an epoch (see the module docstring). Immutable.

    ``consumed[w]``: samples of worker ``w``'s plan delivered so far; ``None`` where this state
    does not know it (a state saved inside one DataLoader worker). ``chain``: the epoch's earlier
    elastic resumes, oldest first. ``dp_rank``: the rank that saved it (``None`` once merged).
    """

    epoch: int
    seed: int
    dataset_id: str
    dp_size: int
    num_workers: int
    consumed: tuple[int | None, ...]
    chain: tuple[Link, ...] = ()
    dp_rank: int | None = None
    version: int = STATE_VERSION
    batch_size: int = 1  # the plan's (batched mode's); states without one were saved with 1
    num_nodes: int = 1  # the plan's node count (node placement); likewise
    next_worker: int = 0  # the plan worker whose batch comes next (datacache.pytorch.rounds); 0 in older states
    mix: tuple[int, ...] = NO_MIX  # the epoch's mix decision on the saving rank's node (PlanSpec fields)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mix", _check_mix(self.mix))
        _count("epoch", self.epoch)
        _count("dp_size", self.dp_size, 1)
        _count("num_workers", self.num_workers, 1)
        _count("batch_size", self.batch_size, 1)
        if len(self.consumed) != self.num_workers:
            raise ValueError(f"resume state: {len(self.consumed)} counts for num_workers={self.num_workers}; {_HOW}")
        for c in self.consumed:
            if c is not None:
                _count("consumed", c)
        if self.dp_rank is not None and not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"resume state: dp_rank={self.dp_rank} not in [0, {self.dp_size}); {_HOW}")
        if not 0 <= _count("next_worker", self.next_worker) < self.num_workers:
            raise ValueError(f"resume state: next_worker={self.next_worker} not in [0, {self.num_workers}); {_HOW}")

    @property
    def complete(self) -> bool:
        """Whether every worker's count is known (needed to resume with another layout)."""
        return all(c is not None for c in self.consumed)

    def same_layout(self, dp_size: int, num_workers: int, batch_size: int = 1, num_nodes: int = 1) -> bool:
        return ((self.dp_size, self.num_workers, self.batch_size, self.num_nodes)
                == (dp_size, num_workers, batch_size, num_nodes))

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values only (JSON- and ``torch.save``-friendly)."""
        return {"version": self.version, "epoch": self.epoch, "seed": self.seed, "dataset_id": self.dataset_id,
                "dp_size": self.dp_size, "dp_rank": self.dp_rank, "num_workers": self.num_workers,
                "consumed": list(self.consumed), "chain": [link.to_dict() for link in self.chain],
                "batch_size": self.batch_size, "num_nodes": self.num_nodes, "next_worker": self.next_worker,
                "mix": list(self.mix)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResumeState:
        """Parse and validate ``to_dict``'s output (or a version-1 state); ``ValueError`` if invalid."""
        if not isinstance(d, Mapping):
            raise ValueError(f"resume state: got {type(d).__name__}, expected a mapping; {_HOW}")
        version = d.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(f"state_dict is from another dataset or datacache version (version={version!r}, "
                             f"this datacache reads 1 and {STATE_VERSION}); cannot resume")
        try:
            consumed = list(d["consumed"])
            if version == 1 and d["num_workers"] > 1:  # version 1 wrote 0 for the other workers' counts
                consumed = [c if w == d["worker_id"] else None for w, c in enumerate(consumed)]
            return cls(epoch=d["epoch"], seed=d["seed"], dataset_id=str(d["dataset_id"]), dp_size=d["dp_size"],
                       num_workers=d["num_workers"], consumed=tuple(consumed), dp_rank=d.get("dp_rank"),
                       chain=tuple(Link.from_dict(link) for link in d.get("chain", ())),
                       batch_size=d.get("batch_size", 1), num_nodes=d.get("num_nodes", 1),
                       next_worker=d.get("next_worker", 0), mix=tuple(d.get("mix", NO_MIX)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"resume state: missing or malformed field {exc}; {_HOW}") from None

    def check_dataset(self, dataset_id: str, seed: int) -> None:
        """Raise ``ValueError`` unless this state is from that dataset and seed."""
        if self.dataset_id != dataset_id:
            raise ValueError(f"state_dict is from another dataset ({self.dataset_id}, this is {dataset_id}); "
                             "cannot resume")
        if self.seed != seed:
            raise ValueError(f"state_dict was saved with seed={self.seed}, this dataset has seed={seed}")

    def check_layout(self, dp_size: int, num_workers: int, batch_size: int = 1, num_nodes: int = 1) -> None:
        """Raise ``ValueError`` if resuming with this layout needs counts this state lacks."""
        if not (self.complete or self.same_layout(dp_size, num_workers, batch_size, num_nodes)):
            raise self._incomplete(f"resuming with dp_size={dp_size}, num_workers={num_workers}, "
                                   f"batch_size={batch_size}")

    def _incomplete(self, what: str) -> ValueError:
        known = [w for w, c in enumerate(self.consumed) if c is not None]
        return ValueError(
            f"this resume state knows only DataLoader worker {known}'s count (saved with dp_size={self.dp_size}, "
            f"num_workers={self.num_workers}, batch_size={self.batch_size}); {what} needs every worker's: pass "
            "the StatefulDataLoader's whole state_dict() to StreamingDataset.load_state_dict before creating the "
            "new loader, and do not load it into the new loader")

    def as_link(self) -> Link:
        """This (complete) state as a chain link."""
        if not self.complete:
            raise self._incomplete("an elastic resume")
        return Link(dp_size=self.dp_size, num_workers=self.num_workers, consumed=tuple(int(c) for c in self.consumed),
                    batch_size=self.batch_size, num_nodes=self.num_nodes, mix=self.mix)

    def advanced(self, *, dp_size: int, dp_rank: int, num_workers: int, worker_id: int,
                 consumed: int | None, batch_size: int = 1, num_nodes: int = 1,
                 mix: tuple[int, ...] | None = None) -> ResumeState:
        """The state of consumer ``worker_id`` that started from this state and has delivered
        ``consumed`` samples of its plan (the other workers' counts unknown to it). ``mix``: the
        node-mix decision its plan was built with (default: this state's in its own layout)."""
        same = self.same_layout(dp_size, num_workers, batch_size, num_nodes)
        chain = self.chain if same else self.chain + (self.as_link(),)
        counts: list[int | None] = [None] * num_workers
        counts[worker_id] = consumed
        return replace(self, dp_size=dp_size, dp_rank=dp_rank, num_workers=num_workers, consumed=tuple(counts),
                       chain=chain, version=STATE_VERSION, batch_size=batch_size, num_nodes=num_nodes,
                       next_worker=self.next_worker if same else 0,
                       mix=tuple(mix) if mix is not None else (self.mix if same else NO_MIX))

    def plan_worker(self, worker: int, num_workers: int) -> int:
        """The plan worker DataLoader worker ``worker`` plays when it resumes from this state in
        the same layout: the loader starts at its worker 0, the plan at ``next_worker``."""
        return (worker + self.next_worker) % num_workers

    def pending(self, *, dp_size: int, dp_rank: int, num_workers: int, worker_id: int,
                batch_size: int = 1, num_nodes: int = 1, mix: tuple[int, ...] | None = None) -> ResumeState:
        """What a DataLoader worker that loaded this state but has not delivered anything reports,
        in its own layout (so it merges with the states of its fellow workers that did); ``None``
        if this state lacks the worker's count (then ``rank_state`` refuses the loader's state).
        ``mix``: the decision a new layout's plan will use."""
        same = self.same_layout(dp_size, num_workers, batch_size, num_nodes)
        own = self.consumed[worker_id] if same else 0
        return self.advanced(dp_size=dp_size, dp_rank=dp_rank, num_workers=num_workers, worker_id=worker_id,
                             consumed=own, batch_size=batch_size, num_nodes=num_nodes, mix=None if same else mix)


def start_state(*, epoch: int, seed: int, dataset_id: str, dp_size: int, dp_rank: int, num_workers: int,
                batch_size: int = 1, num_nodes: int = 1, mix: tuple[int, ...] = NO_MIX) -> ResumeState:
    """The state at the start of an epoch (nothing delivered, no chain); ``mix``: the epoch's
    node-mix and part-mix decision (the ``PlanSpec`` fields of ``_MIX_FIELDS``)."""
    return ResumeState(epoch=epoch, seed=seed, dataset_id=dataset_id, dp_size=dp_size, dp_rank=dp_rank,
                       num_workers=num_workers, consumed=(0,) * num_workers, batch_size=batch_size,
                       num_nodes=num_nodes, mix=tuple(mix))


def plan_mix(spec: PlanSpec) -> tuple[int, ...]:
    """A spec's node-mix and part-mix decision, as a state records it."""
    return _check_mix(tuple(int(getattr(spec, f)) for f in _MIX_FIELDS))


def _with_mix(spec: PlanSpec, mix: tuple[int, ...], **other: Any) -> PlanSpec:
    """``spec`` with the decision ``mix`` (``plan_mix``'s inverse) and the ``other`` fields."""
    return replace(spec, **dict(zip(_MIX_FIELDS, mix)), **other)


def resume_spec(spec: PlanSpec, state: ResumeState | None) -> PlanSpec:
    """``spec`` with the node-mix decision a consumer continuing from ``state`` in the same layout
    must plan with: the one the state's epoch was read with (recorded, so that a resume on another
    node, whose cache may decide otherwise, reads the same order); ``spec`` as is otherwise."""
    if state is None or not state.same_layout(spec.dp_size, spec.num_workers, spec.batch_size, spec.num_nodes):
        return spec
    return _with_mix(spec, state.mix)


def _worker_state(snapshot: Mapping[str, Any], key: str) -> ResumeState:
    ds_state = (snapshot.get(key) or {}).get("dataset_state")
    if ds_state is None:
        raise ValueError(f"StatefulDataLoader state: {key} holds no StreamingDataset state; {_HOW}")
    return ResumeState.from_dict(ds_state)


def _key(s: ResumeState) -> tuple[Any, ...]:
    return (s.epoch, s.seed, s.dataset_id, s.dp_size, s.num_workers, s.batch_size, s.num_nodes, s.chain,
            s.next_worker, s.mix)


def rank_state(state: Any) -> ResumeState:
    """One rank's state from a ``StatefulDataLoader.state_dict()`` (any ``num_workers``: the
    workers' states are merged into one with every worker's count), a ``StreamingDataset``
    state dict, or a ``ResumeState``. ``ValueError`` if it cannot be made consistent."""
    if isinstance(state, ResumeState):
        return state
    if not isinstance(state, Mapping):
        raise ValueError(f"resume state: got {type(state).__name__}, expected a mapping; {_HOW}")
    if "_snapshot" in state:
        if state.get("_steps_since_snapshot", 0):
            raise ValueError("StatefulDataLoader state taken between snapshots: create the loader with "
                             "snapshot_every_n_steps=1 (the default) to resume a StreamingDataset from it")
        snapshot = state["_snapshot"].get("_worker_snapshots") or {}
        workers = [_worker_state(snapshot, f"worker_{w}") for w in range(len(snapshot))]
        # loader worker p knows the count of the plan worker it plays (p, or p + next_worker)
        plays = [s.plan_worker(p, len(workers)) for p, s in enumerate(workers)]
        if not workers or any(_key(s) != _key(workers[0]) or s.num_workers != len(workers) or s.consumed[w] is None
                              for w, s in zip(plays, workers)):
            raise ValueError(f"StatefulDataLoader state: its {len(workers)} workers' states disagree "
                             f"({[s.to_dict() for s in workers]}); {_HOW}")
        counts = [0] * len(workers)
        for w, s in zip(plays, workers):
            counts[w] = s.consumed[w]
        last = state["_snapshot"].get("_last_yielded_worker_id", len(workers) - 1)  # torchdata's next: last + 1
        return replace(workers[0], consumed=tuple(counts), next_worker=workers[0].plan_worker(last + 1, len(workers)))
    if "dataset_state" in state and "version" not in state:  # StatefulDataLoader with num_workers=0
        return rank_state(state["dataset_state"])
    return ResumeState.from_dict(state)


def common_state(states: Sequence[Any]) -> ResumeState:
    """The state every new rank loads for an elastic resume, from the states of several (ideally
    all) old ranks: merged per rank (``rank_state``) and checked to agree, which they do when every
    rank saved at the same training step. ``ValueError`` naming the ranks that differ otherwise."""
    ranks = [rank_state(s) for s in states]
    if not ranks:
        raise ValueError(f"resume state: an empty list of rank states; {_HOW}")
    first = ranks[0]
    for s in ranks[1:]:
        if _key(s) != _key(first) or s.consumed != first.consumed:
            raise ValueError(
                f"the ranks' resume states disagree: rank {first.dp_rank} saved epoch {first.epoch} counts "
                f"{list(first.consumed)}, rank {s.dp_rank} saved epoch {s.epoch} counts {list(s.consumed)}; save "
                "every rank at the same training step, or resume with the same dp_size and num_workers, where "
                "each rank loads its own state")
    return replace(first, dp_rank=None)


def _link_spec(spec: PlanSpec, link: Link | ResumeState) -> PlanSpec:
    """The spec of the layout that read ``link``, with the node-mix decision it recorded (every old
    node taken to have decided as the saving rank's did)."""
    return _with_mix(spec, link.mix, dp_size=link.dp_size, num_workers=link.num_workers, batch_size=link.batch_size,
                     num_nodes=link.num_nodes, dp_rank=0, worker_id=0)


def resume_plan(counts: np.ndarray, spec: PlanSpec, state: ResumeState | None,
                orders: EpochOrders | None = None) -> tuple[np.ndarray | None, int]:
    """(order override, samples to skip) for consumer ``spec`` continuing from ``state``.

    Each chain link turns the epoch's order into the remainder it left. With the state's layout
    the plan is rebuilt on that order and the consumer skips what it delivered (exact order);
    otherwise the state becomes one more remainder, planned afresh for the new layout.
    ``orders``: the epoch's own order (a mixed dataset's, ``datacache.mixing.plan``), planned with the
    layout that began the epoch, and how a remainder is laid out again for the next layout.
    """
    if state is None:
        return (None if orders is None else orders.epoch_order(spec)), 0
    links: list[Link | ResumeState] = [*state.chain, state]
    order = None if orders is None else orders.epoch_order(_link_spec(spec, links[0]))
    for link, after in zip(state.chain, links[1:]):
        order = remainder_order(counts, _link_spec(spec, link), list(link.consumed), order=order)
        if orders is not None:
            order = orders.resume_order(order, _link_spec(spec, after))
    if state.same_layout(spec.dp_size, spec.num_workers, spec.batch_size, spec.num_nodes):
        skip = state.consumed[spec.worker_id]
        if skip is None:
            raise ValueError(f"this resume state is another DataLoader worker's: it lacks worker {spec.worker_id}'s "
                             "count; pass the StatefulDataLoader's whole state_dict() to the loader's or the "
                             "dataset's load_state_dict")
        return order, skip
    state.check_layout(spec.dp_size, spec.num_workers, spec.batch_size, spec.num_nodes)
    link = state.as_link()
    order = remainder_order(counts, _link_spec(spec, link), list(link.consumed), order=order)
    return (order if orders is None else orders.resume_order(order, spec)), 0
