"""Small keyword-only configuration objects (in the style of httpx's ``Timeout``/``Limits``).

Each is a frozen dataclass with a readable repr; sizes accept ints or strings such as ``"8GB"``
(powers of 1000) and ``"8GiB"`` (powers of 1024). All are immutable and therefore thread-safe.
"""
from __future__ import annotations

import getpass
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["parse_size", "format_size", "RetryConfig", "TransferConfig", "CacheConfig", "PrefetchConfig",
           "PeerConfig", "ENV_VARS", "PEER_ENV_VARS", "POLICIES", "cache_settings"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str | None) -> int | None:
    """Parse ``8GB``, ``512MiB``, ``1e9`` or an int into bytes; ``None`` stays ``None``."""
    if value is None or isinstance(value, bool):
        return None if value is None else int(value)
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value!r}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot parse size {value!r}: expected a number with an optional unit like 8GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int | float) -> str:
    """Human-readable bytes, powers of 1000 (``"1.5 GB"``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass(frozen=True, kw_only=True)
class RetryConfig:
    """Retry policy for storage requests that failed for a reason that may pass.

    A throttled store (503 SlowDown, 429, RequestLimitExceeded...) or an unavailable one (other 5xx,
    connection refused or reset, timeouts) is retried until ``deadline`` seconds after the
    operation began (default 10 minutes: S3 can take minutes to repartition a hot prefix), then one
    ``ThrottledError`` or ``TransientStorageError`` names the URL. ``attempts`` additionally bounds
    the count when set (``None``: only the deadline counts). Permanent errors (403, 404, other 4xx)
    are never retried. Unavailable: exponential backoff with full jitter between ``base_delay`` and
    ``max_delay`` per operation; throttled: the node backs off as a whole (``datacache.store.congestion``:
    its request window halves and its gate waits ``base_delay`` doubling up to ``max_delay``).

    ``connect_deadline``: a store that has never answered this ``Store`` (nor the one it was
    pickled or forked from) and refuses the connection or whose host name does not resolve (a
    typo in the endpoint, a store that is not running) is retried only this long, then one
    ``UnreachableError`` names the endpoint and the cause. Once the store has answered, an outage
    gets the whole ``deadline``.
    """

    attempts: int | None = None
    base_delay: float = 0.2
    max_delay: float = 4.0
    deadline: float = 600.0
    connect_deadline: float = 10.0


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """How whole objects are read: parallel byte-range GETs of ``part_bytes`` each.

    ``concurrency`` is the number of parts in flight per object; 8-16 MB parts are what S3 recommends.
    ``max_requests`` caps the ranged GETs in flight per process and store; waiting parts are admitted
    in the order the read plan needs them (the prefetcher passes each shard's position as its
    priority), so the shard needed next gets the link instead of sharing it with shards needed later.
    Two hide a 20 ms request latency at 50 MB/s; raise it for links with a large bandwidth x latency
    product (DataLoader workers each have their own store, so a node has workers x max_requests).
    Every process of the node also shares one congestion window per store prefix (at most
    ``datacache.store.congestion.MAX_WINDOW`` requests in flight, halved on each throttling answer).

    ``range_requests``: the same cap for the small ranged reads of partial copies (a block of a
    shard at a time: ``ShardSource.load_rows``), in flight beside them: a 1 MB read needs more in
    flight than an 8 MB part to keep the link busy past its latency. Four hide a 20 ms latency at
    50 MB/s without starving the first batch's blocks of the link (eight took it 1.2 s, not 0.5 s);
    raise it, as ``max_requests``, for a large bandwidth x latency product. A read of at most 64 KiB
    (a shard's index or header, ``datacache.store.storage.SMALL_READ``) takes no slot.

    ``max_requests_per_s``: optional budget of requests per second to this store prefix for the
    whole node, kept by every process of the node together (a token bucket in the cache's control
    directory); set it below the store's limit divided by the number of nodes reading the prefix.

    ``presigned`` (S3 only; on): ranged GETs by presigned URL on kept-alive connections, each object's
    URL signed once, rather than through s3fs and botocore per request, at less CPU per GET and
    per byte (``datacache.store.presigned``); the answers it does not handle itself go through
    s3fs, and so does every GET behind a proxy, with client certificates or extra request headers,
    or of a store that refuses presigned GETs. False: every GET through s3fs.
    """

    part_bytes: int = 8 << 20
    concurrency: int = 8
    max_requests: int = 2
    range_requests: int = 4
    timeout: float = 60.0
    max_requests_per_s: float | None = None
    presigned: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "part_bytes", parse_size(self.part_bytes))
        if self.part_bytes <= 0 or self.concurrency <= 0 or self.max_requests <= 0 or self.range_requests <= 0:
            raise ValueError("TransferConfig: part_bytes, concurrency, max_requests and range_requests must be > 0")
        if self.max_requests_per_s is not None and not self.max_requests_per_s > 0:
            raise ValueError(f"TransferConfig.max_requests_per_s must be > 0 or None, got {self.max_requests_per_s!r}")


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid())


def default_ram_dir() -> str:
    return os.path.join("/dev/shm", f"datacache-{_user()}")


def default_ssd_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "datacache")


# CacheConfig field -> environment variable: explicit arguments (or CLI flags) override these, these
# override the defaults. The library and the CLI resolve them here, so both use the same cache.
ENV_VARS: dict[str, str] = {
    "ram_bytes": "DATACACHE_RAM_BYTES",
    "ssd_bytes": "DATACACHE_SSD_BYTES",
    "ram_dir": "DATACACHE_RAM_DIR",
    "ssd_dir": "DATACACHE_SSD_DIR",
    "policy": "DATACACHE_POLICY",
}
_DEFAULTS: dict[str, Callable[[], Any]] = {
    "ram_bytes": lambda: "4GB", "ssd_bytes": lambda: "64GB", "ram_dir": default_ram_dir,
    "ssd_dir": default_ssd_dir, "policy": lambda: "auto",
}
POLICIES = ("auto", "lru", "clairvoyant")


def _checked(name: str, value: Any, source: str) -> Any:
    """``value`` of CacheConfig field ``name`` parsed and validated; errors name ``source``."""
    try:
        if name in ("ram_bytes", "ssd_bytes"):
            return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if name == "policy" and value not in POLICIES:
        raise ValueError(f"{source}: policy must be one of {', '.join(POLICIES)}, not {value!r}")
    return value


def _setting(name: str, override: Any, env: Mapping[str, str], label: Callable[[str], str]) -> Any:
    var = ENV_VARS[name]
    if override is not None:
        return _checked(name, override, label(name))
    if env.get(var) not in (None, ""):
        return _checked(name, env[var], f"environment variable {var}")
    return _DEFAULTS[name]()


def cache_settings(overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                   label: Callable[[str], str] = lambda name: name) -> dict[str, Any]:
    """The tier settings of a ``CacheConfig``: ``overrides`` (non-None values: arguments, or CLI flags
    named by ``label``), then the ``DATACACHE_*`` variables of ``env`` (default ``os.environ``), then
    the defaults. Raises ``ValueError`` naming the argument or variable that is invalid."""
    env = os.environ if env is None else env
    return {name: _setting(name, (overrides or {}).get(name), env, label) for name in ENV_VARS}


def _from_env(name: str) -> Callable[[], Any]:
    """A default factory: the field's environment variable (validated) when set, else its default."""
    return lambda: _setting(name, None, os.environ, str)


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The node-local cache: a RAM tier then an SSD tier, both directory-backed and shared by every
    process on the node.

    - ``ram_bytes`` / ``ssd_bytes``: byte budgets (0 disables a tier). Each is shrunk at open time
      to what the directory's filesystem has free (with one warning).
    - ``ram_dir`` / ``ssd_dir``: tier directories (default ``/dev/shm/datacache-$USER`` and
      ``~/.cache/datacache``); created with mode 0700 and refused if owned by another user.
    - A tier setting or ``policy`` not passed comes from its ``DATACACHE_*`` environment variable
      (``ENV_VARS``), read when the config is made, else from the default: the same resolution as
      the ``datacache`` command line, so ``datacache warm`` and a default ``CacheConfig()`` in the
      same environment use the same cache.
    - ``policy``: ``"auto"`` (clairvoyant when the future access order is known, else LRU),
      ``"lru"`` or ``"clairvoyant"`` (Belady's MIN).
    - ``verify``: ``"first"`` hashes an entry when it is written and the first time it is served
      after a restart; ``"always"`` hashes it on every serve.
    """

    ram_bytes: int | str = field(default_factory=_from_env("ram_bytes"))
    ssd_bytes: int | str = field(default_factory=_from_env("ssd_bytes"))
    ram_dir: str = field(default_factory=_from_env("ram_dir"))
    ssd_dir: str = field(default_factory=_from_env("ssd_dir"))
    policy: Literal["auto", "lru", "clairvoyant"] = field(default_factory=_from_env("policy"))
    verify: Literal["first", "always"] = "first"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ram_bytes", parse_size(self.ram_bytes))
        object.__setattr__(self, "ssd_bytes", parse_size(self.ssd_bytes))
        object.__setattr__(self, "ram_dir", os.path.abspath(os.path.expanduser(self.ram_dir)))
        object.__setattr__(self, "ssd_dir", os.path.abspath(os.path.expanduser(self.ssd_dir)))
        if self.policy not in POLICIES:
            raise ValueError(f"CacheConfig.policy must be 'auto', 'lru' or 'clairvoyant', not {self.policy!r}")
        if self.verify not in ("first", "always"):
            raise ValueError(f"CacheConfig.verify must be 'first' or 'always', not {self.verify!r}")


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    """The prefetch thread pool of one consumer process.

    Starts at ``threads`` workers and ``lookahead_bytes`` of plan ahead of the consumer; when the
    consumer waits it adds one thread and grows the lookahead (additive increase), when it has not
    waited for a while it halves them (multiplicative decrease), never beyond the ``max_*`` caps.
    ``nice``: added to the niceness of these threads (Linux sets it per thread), so that when the
    CPU is short they yield it to the training loop instead of delaying its next step; 0 leaves
    them at the process's priority. ``slow_start``: until a consumer's first shard has loaded,
    its lookahead waits; and at an epoch's start a DataLoader worker first gets the earlier
    workers' first shards into the cache, then its own, then the later workers' before its
    lookahead, so the rank's first shards cross the link one after another, each with the link to
    itself, in the order the loader takes batches (``tools/bench.py --scenario shuffle``, cold
    epoch, 2 workers: first batch 0.92 -> 0.46 s, wall +0.5 %, medians of 3 and 5 runs); ``False``
    starts every worker's first shard and lookahead at once.
    """

    threads: int = 4
    max_threads: int = 16
    lookahead_bytes: int | str = "256MB"
    max_lookahead_bytes: int | str = "2GB"
    adaptive: bool = True
    nice: int = 5
    slow_start: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "lookahead_bytes", parse_size(self.lookahead_bytes))
        object.__setattr__(self, "max_lookahead_bytes", parse_size(self.max_lookahead_bytes))
        if not (1 <= self.threads <= self.max_threads):
            raise ValueError("PrefetchConfig: need 1 <= threads <= max_threads")


# PeerConfig field -> environment variable (an argument overrides it; it overrides the default).
PEER_ENV_VARS: dict[str, str] = {
    "peers": "DATACACHE_PEERS",
    "token": "DATACACHE_PEER_TOKEN",
    "bind": "DATACACHE_PEER_BIND",
    "readonly_peers": "DATACACHE_READONLY_PEERS",
    "readonly_token": "DATACACHE_READONLY_PEER_TOKEN",
}
_OFF = ("", "0", "off", "none", "false", "no")


def _peer_env(name: str) -> Callable[[], Any]:
    return lambda: os.environ.get(PEER_ENV_VARS[name]) or None


def _addresses(value: Any, what: str) -> tuple[str, ...]:
    """``host:port`` entries from a list or a comma-separated string, each checked."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    out = []
    for item in items:
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"PeerConfig.{what}: {item!r} is not host:port (e.g. 10.0.0.7:7761)")
        out.append(f"{host.strip('[]')}:{int(port)}")
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """The peer tier: nodes of one job serve their cached shards to each other (``datacache.peer``).

    - ``peers``: every node's ``host:port`` in node-rank order (node k serves on entry k), a list
      or a comma-separated string; default ``DATACACHE_PEERS``. ``"auto"``: exchanged through the
      job's c10d store under torchrun (``datacache.peer.membership``). None, empty or ``"off"``:
      the tier is off and nothing changes.
    - ``token``: the job's shared secret (``DATACACHE_PEER_TOKEN``; with ``"auto"``, made and
      exchanged through the job's store when not set). Never shown in a repr, log or error.
    - ``node_rank``: this node's entry (default: the launcher's node rank, ``datacache.dist``).
    - ``bind``: the ``host`` or ``host:port`` the server listens on (``DATACACHE_PEER_BIND``;
      default: this node's entry; never all interfaces unless given ``0.0.0.0``).
    - ``readonly_peers`` / ``readonly_token``: nodes of another job (say, the run a sweep follows)
      whose cached shards this job may read, never asks to download (``DATACACHE_READONLY_PEERS``,
      ``DATACACHE_READONLY_PEER_TOKEN``; the token defaults to ``token``).
    - Deadlines, in seconds: a peer answers (headers) within ``connect_timeout``; its bytes never
      stop for more than ``stall_timeout``; a shard an owner downloads for us arrives within
      ``fetch_timeout``; then the next holder or the store is asked. A holder's transfer not done
      after ``hedge_delay`` + its bytes / ``hedge_bandwidth`` is hedged: the next source starts too,
      the first verified copy wins. A hedge may go to the store (when no other node holds the shard)
      and then costs store bytes: set ``hedge_bandwidth`` below what a healthy peer delivers under
      load (its link's speed over the transfers it carries at once).
    - ``validity``: how long a request's signature is accepted (clocks may differ by that much).
    - ``join_timeout``: when a dataset is opened, how long to wait for the other nodes' servers to
      answer once (the nodes of a job start seconds apart; a shard asked for before its holder is
      up would come from the store); a node not up by then is asked again later, and meanwhile
      its shards come from elsewhere.
    """

    peers: tuple[str, ...] | str | None = field(default_factory=_peer_env("peers"))
    token: str | None = field(default_factory=_peer_env("token"), repr=False)
    node_rank: int | None = None
    bind: str | None = field(default_factory=_peer_env("bind"))
    readonly_peers: tuple[str, ...] | str | None = field(default_factory=_peer_env("readonly_peers"))
    readonly_token: str | None = field(default_factory=_peer_env("readonly_token"), repr=False)
    connect_timeout: float = 1.0
    stall_timeout: float = 2.0
    fetch_timeout: float = 60.0
    hedge_delay: float = 0.5
    hedge_bandwidth: int | str = "20MB"
    validity: float = 30.0
    join_timeout: float = 30.0

    def __post_init__(self) -> None:
        peers = self.peers
        if isinstance(peers, str) and peers.strip().lower() in _OFF:
            peers = ()
        elif isinstance(peers, str) and peers.strip().lower() == "auto":
            peers = "auto"
        else:
            peers = _addresses(peers or (), "peers")
        object.__setattr__(self, "peers", peers)
        object.__setattr__(self, "readonly_peers", _addresses(self.readonly_peers or (), "readonly_peers"))
        object.__setattr__(self, "hedge_bandwidth", parse_size(self.hedge_bandwidth))
        if self.bind is not None and not str(self.bind).strip():
            object.__setattr__(self, "bind", None)
        if self.join_timeout < 0:
            raise ValueError(f"PeerConfig.join_timeout must be >= 0, got {self.join_timeout!r}")
        for name in ("connect_timeout", "stall_timeout", "fetch_timeout", "validity"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PeerConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.hedge_delay < 0 or not self.hedge_bandwidth:
            raise ValueError("PeerConfig: hedge_delay must be >= 0 and hedge_bandwidth > 0")
        if self.node_rank is not None and self.node_rank < 0:
            raise ValueError(f"PeerConfig.node_rank must be >= 0, got {self.node_rank!r}")
        if (self.peers or self.readonly_peers) and not (self.token or self.peers == "auto"):
            raise ValueError("PeerConfig: peers are set but no token: set DATACACHE_PEER_TOKEN (the job's shared "
                             "secret, e.g. `openssl rand -hex 32`) or pass PeerConfig(token=...)")

    @property
    def enabled(self) -> bool:
        """Whether the tier is on (peers of this job, or read-only peers, are configured)."""
        return bool(self.peers) or bool(self.readonly_peers)
