"""The node mix: an epoch read as one uniform permutation of the node's share. Pure functions.

The sliding-window shuffle (``datacache.plan.epoch``, step 4) mixes a consumer's samples across a few
consecutive shard runs, so that a cold epoch can start after one shard and keep only a few open. On
data written in class or source order, every batch then comes from a few shards. Once the node's
cache holds the node's whole share (the epochs after the first, when the share fits in the cache),
every sample is local and that limit buys nothing: the node mix instead permutes the node's whole
part of the epoch order (every rank and worker of the node together) uniformly, before the rank
and worker split, so each consumer's contiguous share, and each of its batches, is a uniform
random draw of the node's share: the quality of a global permutation within the node.

Reading: a mixed consumer reads its positions in *chunks* of up to ``chunk_bytes`` (about; the
first ones smaller, so that the first batch comes soon); a chunk's
samples are grouped by shard into runs (one pin and one read of the listed rows per shard and
chunk), and the chunk's samples are then yielded in the permuted order. The decoded samples in
memory are at most two chunks per consumer, whatever the shard size; the pins are the prefetch
lookahead's, as in a windowed epoch.

When: ``spec.shuffle`` and ``spec.mix_bytes > 0``, from epoch ``spec.mix_from`` on, and only
when the bytes of the shards in the node's part are at most ``spec.mix_bytes`` (so the part is
all local after one epoch). Not for a composed order (a mixed dataset's), and not with
``placement="global"`` on several nodes (each node would need every shard). Thread-safe: no state.
"""
from __future__ import annotations

import numpy as np

from .ragged import Ragged

__all__ = ["node_mixes", "mix_positions", "chunk_samples", "chunk_runs", "DEFAULT_CHUNK_BYTES", "MIX_SHARE"]

DEFAULT_CHUNK_BYTES = 64 << 20
MIX_SHARE = 0.9  # "auto" mixes when the node's share is at most this fraction of the cache budget


def node_mixes(*, shuffle: bool, mix_bytes: int, mix_from: int, epoch: int, composed: bool, spread_nodes: bool,
               share_bytes: int) -> bool:
    """Whether an epoch is read as a node mix (see the module docstring). ``spread_nodes``: the
    ranks span several nodes while the shards do not stay on theirs (``placement="global"``);
    ``share_bytes``: the bytes of the distinct shards in the node's part."""
    return (shuffle and mix_bytes > 0 and epoch >= mix_from and not composed and not spread_nodes
            and share_bytes <= mix_bytes)


def mix_positions(positions: np.ndarray, length: int, *, seed: int, epoch: int, node: int) -> np.ndarray:
    """Where each of ``positions`` (of the node's part, ``length`` long) takes its sample from:
    a uniform-looking seeded permutation of ``range(length)`` (a 4-round Feistel network over the
    next even power of two, walked back into range), evaluated for these positions only, so a
    consumer computes its own share in O(its samples) and never the node's whole order. Every
    process of the node computes the same permutation from (``seed``, ``epoch``, ``node``)."""
    x = np.asarray(positions, dtype=np.uint64)
    if length <= 1 or len(x) == 0:
        return x.astype(np.int64)
    half = max(1, (int(length - 1).bit_length() + 1) // 2)
    keys = np.random.default_rng([seed, epoch, 2, node]).integers(0, 1 << 62, size=_ROUNDS, dtype=np.uint64)
    out = _feistel(x, half, keys)
    bad = out >= length
    while bad.any():  # cycle-walk: a permutation of [0, 4^half) restricted to [0, length)
        out[bad] = _feistel(out[bad], half, keys)
        bad = out >= length
    return out.astype(np.int64)


_ROUNDS = 4
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
        h = (right ^ k) * _M1
        h ^= h >> np.uint64(29)
        h *= _M2
        h ^= h >> np.uint64(32)
        left, right = right, left ^ (h & mask)
    return (left << np.uint64(half)) | right


def chunk_runs(piece: np.ndarray, offsets: np.ndarray, chunk: int, growth: int = 2, first: int = 0, *,
               in_place_shards: int = 0) -> dict:
    """A mixed consumer's reads: ``piece`` (its global ids, in read order) cut into chunks of at
    most ``chunk`` positions (``chunk_bounds`` with ``growth``, ``first`` and ``in_place_shards``),
    each chunk's samples grouped into one run per shard.

    Returns ``runs`` ((shard, lo, hi) per run, ordered by chunk then shard), ``rows`` (the sorted
    shard-local rows each run reads, a ``Ragged``), ``run_of`` (each position's run), ``steps`` (positions each
    run's step yields: a chunk's positions all at its last run's step, once every run of the chunk
    is open), ``starts`` (each run's chunk start), ``window`` (the most runs of one chunk: a run
    stays open until its chunk is done) and ``row_in_run`` (each position's place among its run's
    rows)."""
    n = len(piece)
    chunk = max(1, int(chunk))
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return {"runs": [], "rows": Ragged(z, np.zeros(1, dtype=np.int64)), "run_of": z,
                "steps": np.zeros(1, dtype=np.int64), "starts": z, "window": 1, "row_in_run": z}
    shard = np.searchsorted(offsets, piece, side="right") - 1
    local = piece - offsets[shard]
    shards = len(offsets) - 1
    chunks = chunk_bounds(n, chunk, growth, first, in_place_shards=in_place_shards)
    of_position = np.repeat(np.arange(len(chunks), dtype=np.int64), np.diff(np.append(chunks, n)))
    key = of_position * shards + shard
    if len(chunks) * shards <= 4 * n:  # few (chunk, shard) keys: counted, not sorted (same result)
        present = np.bincount(key, minlength=len(chunks) * shards) > 0
        ukeys = np.flatnonzero(present)
        run_of = (np.cumsum(present) - 1)[key]
    else:
        ukeys, run_of = np.unique(key, return_inverse=True)
        run_of = run_of.astype(np.int64)
    order = np.argsort(run_of * (int(local.max()) + 1) + local)  # by run, then row (equal keys: equal rows)
    bounds = np.searchsorted(run_of[order], np.arange(len(ukeys) + 1))
    sorted_local = local[order]
    rows = Ragged(sorted_local, bounds)
    runs = list(zip((ukeys % shards).tolist(), sorted_local[bounds[:-1]].tolist(),
                    (sorted_local[bounds[1:] - 1] + 1).tolist()))
    row_in_run = np.empty(n, dtype=np.int64)  # each position's place among its run's rows
    row_in_run[order] = np.arange(n, dtype=np.int64) - bounds[:-1][run_of[order]]
    starts = chunks[ukeys // shards]
    steps = np.append(starts, n).astype(np.int64)
    per_chunk = np.bincount(ukeys // shards)
    return {"runs": runs, "rows": rows, "run_of": run_of, "steps": steps, "starts": starts.astype(np.int64),
            "window": int(per_chunk.max()), "row_in_run": row_in_run}


FIRST_CHUNK = 32  # positions of a consumer's first chunk: its first batch waits for one chunk's runs
# How fast a node mix's chunks grow to their size: each chunk is about one run per shard (a pin and
# a table each), so a warm epoch's runs are about shards x chunks; a part mix's (cold) grow by 2.
MIX_GROWTH = 16


def chunk_bounds(n: int, chunk: int, growth: int = 2, first: int = 0, *, in_place_shards: int = 0) -> np.ndarray:
    """Where each chunk of ``n`` positions starts: ``max(FIRST_CHUNK, first)`` positions, then
    ``growth`` times as many each time up to ``chunk`` (a chunk touches about every shard whatever
    its size, so the first batch waits for a small one, and the epoch's reads for few large ones;
    ``first``: a batch's positions, so that the first batch waits for one chunk's runs, not two).
    ``in_place_shards``: where > 0, the rows are read in place from that many shards, so a chunk
    costs one run per shard it touches and no memory: the chunks after the first are all of
    ``chunk``, and where the first touches about every shard already (it has at least as many
    positions) it is of ``chunk`` too."""
    size = min(max(FIRST_CHUNK, first), chunk)
    if in_place_shards and size >= in_place_shards:
        size = chunk
    out, at = [], 0
    while at < n:
        out.append(at)
        at += size
        size = chunk if in_place_shards else min(growth * size, chunk)
    return np.asarray(out, dtype=np.int64)


def chunk_samples(chunk_bytes: int, shard_bytes: np.ndarray | None, counts: np.ndarray) -> int:
    """Positions per chunk: ``chunk_bytes`` over the dataset's mean sample size (``chunk_bytes``
    samples without ``shard_bytes``, as ``mix_bytes`` then counts samples)."""
    total = int(np.sum(counts))
    if shard_bytes is None or total == 0:
        return max(1, int(chunk_bytes))
    mean = max(1.0, float(np.sum(shard_bytes)) / total)
    return max(1, int(chunk_bytes / mean))
