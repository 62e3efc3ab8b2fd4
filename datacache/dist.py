"""Rank and world size, without collective calls (so any backend works: gloo, NCCL, MPI).

Sources, first match wins: an initialized ``torch.distributed``; torchrun's ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; Open MPI's ``OMPI_COMM_WORLD_*``; PMI (MPICH, Intel MPI)
``PMI_RANK``/``PMI_SIZE`` with ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``; Slurm's ``SLURM_PROCID``/
``SLURM_NTASKS``/``SLURM_LOCALID`` with ``SLURM_NTASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE`` or
``SLURM_NNODES``; else a single process. The node count (``DistInfo.num_nodes``) follows from the
ranks per node, which is how the epoch plan keeps shards on their nodes.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DistInfo", "detect", "plan_nodes"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank/world size and rank/size within its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)

    @property
    def num_nodes(self) -> int:
        """Nodes in the job (every node runs ``local_world_size`` ranks; the last may run fewer)."""
        return -(-self.world_size // max(self.local_world_size, 1))

    def node_ranks(self) -> range:
        """Global ranks on this node (assumes ranks are packed per node, as all launchers do)."""
        start = self.node_rank * self.local_world_size
        return range(start, min(start + self.local_world_size, self.world_size))


def plan_nodes(world_size: int, local_world_size: int, replication: int = 1, placement: str = "node") -> int:
    """The node count a node-sticky epoch plan spreads the ranks over: ``world_size /
    local_world_size`` when ``placement`` is "node", every node runs ``local_world_size`` ranks and
    those are whole groups of ``replication`` ranks; else 1 (a global plan)."""
    if placement not in ("node", "global"):
        raise ValueError(f"placement={placement!r}: expected 'node' (shards stay on their nodes) or 'global'")
    lw = max(int(local_world_size), 1)
    if placement != "node" or world_size % lw or lw % max(int(replication), 1):
        return 1
    return world_size // lw


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            return int(v)
    return None


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    v = _int(env, "SLURM_NTASKS_PER_NODE")
    if v is not None:
        return v
    m = re.match(r"^(\d+)", env.get("SLURM_TASKS_PER_NODE", ""))
    if m:
        return int(m.group(1))
    tasks, nodes = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    return -(-tasks // nodes) if tasks and nodes else None


def detect(env: Mapping[str, str] | None = None) -> DistInfo:
    """Detect rank, world size and local rank/size (see module docstring)."""
    env = os.environ if env is None else env
    rank = world = None
    try:
        import torch.distributed as dist

        if env is os.environ and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except ImportError:  # torch is a dependency, but stay importable without it
        pass
    launchers = (
        (("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
        (("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
         ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
        (("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
         ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
        (("SLURM_PROCID",), ("SLURM_NTASKS",), ("SLURM_LOCALID",), ()),
    )
    for r_names, w_names, lr_names, lw_names in launchers:
        r, w = _int(env, *r_names), _int(env, *w_names)
        if r is None or w is None:
            continue
        lr, lw = _int(env, *lr_names), _int(env, *lw_names) if lw_names else _slurm_tasks_per_node(env)
        if rank is None:
            rank, world = r, w
        if lw is None:
            lw = world
        if lr is None:
            lr = rank % lw
        return DistInfo(rank, world, lr, lw)
    if rank is None:
        return DistInfo()
    return DistInfo(rank, world, rank, world)
