"""The plan layer: which samples each consumer reads in each epoch, and in which order.

Guarantees:
- pure and deterministic: the same dataset, seed, epoch and world give every process the same plan,
  so each rank's future reads are known in advance (what the cache and the prefetcher use);
- every sample of an epoch is read exactly once across all ranks and workers (padding aside), also
  across a resume onto another world size (``resume``);
- node-sticky assignment: a node keeps reading the shards it cached, for the whole run
  (``node_assign``); the shuffles inside a node's share are ``node_shuffle`` (warm) and
  ``part_shuffle`` (cold).

No I/O, except ``node_share``'s once-per-node results, written atomically through ``_localfs``.
May import: the base modules only. Never ``store`` or ``cache``.
"""
from .epoch import ConsumerPlan, PlanSpec, build_plan

__all__ = ["ConsumerPlan", "PlanSpec", "build_plan"]
