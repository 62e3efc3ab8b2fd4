"""Who the peers are: ``Membership``, resolved from a ``PeerConfig`` and the launcher.

- Addresses: ``PeerConfig.peers`` (``DATACACHE_PEERS``), node k serving on entry k; or, with
  ``"auto"``, exchanged through the job's c10d store (``exchange``): the first process of each node
  picks a port on the interface that reaches ``MASTER_ADDR`` and publishes ``host:port`` under the
  run's id; the first node to get there publishes a fresh random token; every process waits for all
  of them. No extra service: the store is the one torchrun (or ``init_process_group``) runs anyway.
- Node rank: ``PeerConfig.node_rank``, else the launcher's (``datacache.dist.detect().node_rank``).
- Read-only peers: another job's nodes, with their token.

Immutable once resolved; pickled into DataLoader workers as it is (the token travels only inside
the process tree, never in a repr).
"""
from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

from ..config import PeerConfig
from ..dist import DistInfo

__all__ = ["Membership", "resolve", "exchange"]


@dataclass(frozen=True)
class Membership:
    """This node's view of the job: ``peers`` (host:port by node rank), ``me`` (index into it, or
    -1 for a reader that serves nothing), ``bind`` (host, port) to listen on, the tokens, and the
    ``readonly`` peers of another job."""

    peers: tuple[str, ...]
    me: int
    bind: tuple[str, int] | None
    token: str = field(repr=False)
    readonly: tuple[str, ...] = ()
    readonly_token: str = field(default="", repr=False)
    config: PeerConfig = field(default_factory=lambda: PeerConfig(peers=()), repr=False)

    @property
    def others(self) -> list[int]:
        """Indices of the other nodes of the job."""
        return [k for k in range(len(self.peers)) if k != self.me]


def _bind(cfg: PeerConfig, own: str | None) -> tuple[str, int] | None:
    """Where the server listens: ``cfg.bind`` (host, or host:port), else this node's entry."""
    if own is None:
        return None
    host, _, port = own.rpartition(":")
    if cfg.bind:
        b_host, sep, b_port = str(cfg.bind).rpartition(":")
        if sep and b_port.isdigit():
            return b_host.strip("[]") or host, int(b_port)
        return str(cfg.bind).strip("[]"), int(port)
    return host, int(port)


def resolve(cfg: PeerConfig, dist: DistInfo, store: Any = None) -> Membership | None:
    """The membership of ``cfg`` for the process at ``dist`` (None: the tier is off). ``"auto"``
    peers come from ``store`` (a c10d ``Store``), else the job's (``job_store``)."""
    if not cfg.enabled:
        return None
    peers, token = cfg.peers, cfg.token
    if peers == "auto":
        store = store if store is not None else job_store()
        if store is None:
            raise ValueError("PeerConfig(peers='auto') needs the job's c10d store (torchrun, or MASTER_ADDR and "
                             "MASTER_PORT with torch.distributed): none is reachable; set DATACACHE_PEERS instead")
        peers, token = exchange(store, dist, token)
    peers = tuple(peers or ())
    me = cfg.node_rank if cfg.node_rank is not None else dist.node_rank
    if peers and me >= len(peers):
        raise ValueError(f"PeerConfig: this is node {me} but DATACACHE_PEERS lists {len(peers)} nodes: list every "
                         "node's host:port in node-rank order")
    if not peers:
        me = -1
    own = peers[me] if me >= 0 else None
    return Membership(peers=peers, me=me, bind=_bind(cfg, own), token=token or "",
                      readonly=tuple(cfg.readonly_peers), readonly_token=cfg.readonly_token or token or "",
                      config=cfg)


def job_store() -> Any:
    """The job's c10d store: the default process group's, else a client of torchrun's agent store
    at ``MASTER_ADDR:MASTER_PORT``; None where neither is reachable."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    from datetime import timedelta

    return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=300))


def _local_host() -> str:
    """This host's address on the interface that routes to ``MASTER_ADDR`` (``DATACACHE_PEER_HOST``
    wins): a UDP socket's connect sends nothing, it only picks the route."""
    if os.environ.get("DATACACHE_PEER_HOST"):
        return os.environ["DATACACHE_PEER_HOST"]
    target = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def exchange(store: Any, dist: DistInfo, token: str | None) -> tuple[tuple[str, ...], str]:
    """Every node's ``host:port`` and the job's token, through the c10d ``store`` (see the module
    docstring). Keys are namespaced by the run id and restart count, so a restarted job never reads
    a dead node's address."""
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    prefix = f"datacache/peers/{run}"
    node, nodes = dist.node_rank, dist.num_nodes
    if token is None:
        made = secrets.token_hex(32)
        token = _text(store.compare_set(f"{prefix}/token", "", made))
        if not token:  # a store whose compare_set returns the expected value on a missing key
            token = _text(store.get(f"{prefix}/token"))
    if dist.local_rank == 0:
        host = _local_host()
        store.set(f"{prefix}/node{node}", f"{host}:{_free_port(host)}")
    keys = [f"{prefix}/node{k}" for k in range(nodes)]
    store.wait(keys)
    return tuple(_text(store.get(k)) for k in keys), token


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
