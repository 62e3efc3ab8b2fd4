"""The cold part mix: a node's cold epoch read from many shards at once, a part of each at a time.
Pure functions.

The sliding window (``datacache.plan.epoch``, step 4) lets a cold epoch start after one shard, but every
batch then comes from the few shards a consumer has open, and on data written in class order
from a few classes. The node mix (``datacache.plan.node_shuffle``) draws every batch from the whole share,
but needs the share local. The part mix is the cold epoch's answer: the node's part of the epoch
order is cut into *parts* of ``part_rows`` consecutive samples of a shard (about ``part_bytes``),
the parts are permuted, and the node reads that stream of parts in order, each part by a ranged
read into the shard's partial copy (``datacache.cache.partial``: each block fetched once per node,
the copy cached whole once its last block is in). The node's samples are then ordered in *node
time* by a sliding-window shuffle over the stream: the samples of part ``m`` get the keys
``m + U[0, 1) * min(window, 2 + 8 m, M - m + 1)`` (``M`` parts), so each batch draws from about
``window / 2`` parts, of as many shards, downloaded and not yet used; the first parts spread over
few steps, so the first batch waits for a few parts (the window is whole from the 16th part on),
and the last ones over ever fewer, so little is left to read once the last byte is in; but 0.3
of the samples of the last 96 parts are read after all the others, in a uniform order, so the
epoch's last batches draw from 96 parts too (about 430 samples left after the last byte; 0.4 of
64 left the bench's last 5 % of batches at 0.78 of random, 0.3 of 96 at 0.84, seeds 0-2 at least
0.83). Where a part holds ``NARROW_ROWS`` samples or more, the window also narrows linearly
over the last ``narrow`` parts (``PlanSpec.part_narrow``; by half without strata): the taper
packs the last parts' samples into the epoch's last steps, and a part of 240 samples (4 KB
samples in 1 MB) holds 7.5 batches, so a consumer barely faster than the link was left about
1.2 s of batches after the last byte. Half the window over the last 256 parts cut that to 1.0 s
(8 interleaved pairs on the 200,000 x 4 KB cold epoch with a 2 ms step,
see CHANGELOG.md), its last 5 % at 0.87 of random against 0.89. A part of 15
samples (the bench's 64 KB) holds half a batch: there the plan model gained nothing and put the
last 5 % at 0.81, so its window stays whole.

Strata: data is often written in class or source order, and a uniform permutation of the parts
puts some neighbours (the same class) into one window: 128 parts of the 200,000 x 4 KB dataset
(8 parts a class) cover about 72 of its 100 classes. With ``strata`` > 0 the parts are permuted
in rounds instead: the dataset is cut by write position into ``strata`` spans of consecutive
parts, and each round visits every span once, in a random order, with a random part of it (each
span's parts shuffled). A window of ``strata`` parts then spans the whole dataset, about once
each, and any window's parts lie far apart; on data in no order its batches are as mixed as a
uniform permutation's. Its last parts lie far apart too, so the end holds back less
(``_STRATA_END_SHARE`` of the last 96 parts, against 0.3) and narrows deeper (by
``_STRATA_DEPTH`` of the window over ``PART_NARROW`` = 384 parts). On the class-sorted 200,000
x 4 KB cold epoch with a 2 ms step (8 interleaved pairs, see CHANGELOG.md):
quality 0.926 of random's against 0.901, the last 5 % at 0.86 against 0.87, 0.66 s after the
last byte against 0.83 s, and the epoch 0.18 s shorter (median of the pairs' differences;
shorter in all 8). ``PlanSpec.part_strata`` records it; a state saved before it resumes without.

Node time: the node's consumers read in lockstep, its ranks side by side, and a rank's
DataLoader takes its workers' batches in turn. So batch ``k`` of worker ``w`` of a rank comes at
rank step ``k * num_workers + w``, and position ``j`` of that batch at node slot
``((k * num_workers + w) * batch_size + j) * node_ranks + rank``. The node's sample order is
dealt to the slots in slot order: each consumer's positions (its contiguous share of whole
batches, as every plan has) get the samples of their slots, so every consumer's batch draws from
the node's pool of the moment and every sample is read once.

When: an epoch that is not a node mix but whose node share would be one (it fits ``mix_bytes``,
so it is cached whole after this epoch), with ``part_bytes > 0`` (the dataset sets it where its
format can be read part by part: ``readers.base.ShardLayout``), on one node (``plan._mix_block``).
Node-sticky plans over several nodes keep the window for now: a node's part holds pieces of
shards another node owns (``datacache.plan.epoch.node_assign``'s transfers), whose partial copies would never complete
there, and a run of the ``nodes`` test read 1.34 x its predicted bytes in epoch 0. Thread-safe: no state; results
memoized per process (``datacache.plan.epoch.node_assign.memo``).
"""
from __future__ import annotations

import numpy as np

from .node_share import memo, readonly
from .node_shuffle import FIRST_CHUNK
from .pieces import Pieces

__all__ = ["PART_BYTES", "PART_WINDOW", "PART_NARROW", "PART_STRATA", "part_mixes", "part_rows", "part_chunk",
           "part_piece"]

PART_BYTES = 1 << 20  # a part's bytes: a dcz block's, by default
PART_WINDOW = 128  # parts of the node's sliding window: a batch draws from about half as many
PART_NARROW = 384  # the last parts over which the window narrows, where a part holds NARROW_ROWS or more
PART_STRATA = PART_WINDOW  # spans each round of the part stream visits once (0: a uniform permutation)
NARROW_ROWS = 64  # samples a part holds at least for the window to narrow at the end
_END_PARTS, _END_SHARE = 96, 0.3  # the epoch's end: 0.3 of the last 96 parts' samples, read last together
_DEPTH = 0.5  # without strata the window narrows by half over the last ``narrow`` parts
_STRATA_END_SHARE, _STRATA_DEPTH = 0.2, 0.625  # a stratified stream's end: 0.2 held back; the window narrows by 5/8
_RAMP0, _RAMP = 2, 8  # the epoch's first parts: part m spreads over 2 + 8 m (the first batch waits for few)


def part_mixes(*, shuffle: bool, part_bytes: int, mix_bytes: int, mix_from: int, epoch: int, composed: bool,
               spread_nodes: bool, share_bytes: int) -> bool:
    """Whether an epoch is read as a part mix (see the module docstring; the arguments as for
    ``datacache.plan.epoch.node_shuffle.node_mixes``, ``part_bytes`` from ``PlanSpec``). A part mix spreads each unit's
    samples over as many batches, about one sample a run; a consumer loads and reads each unit
    once for all of its runs (``datacache.read.stash``), so small samples cost little more than the
    window's sequential reads. Cold epochs of ``tools/bench.py --scenario shuffle`` (one run
    each, the part mix against the window in the same run; ``--compute 0.002`` for the small
    samples): 64 KB samples, 15 a block: 11.35 s against 11.10 s (medians of 3 runs), quality 0.92 against 0.43;
    4 KB, 240 a block (``--size 800MB``): 20.77 s against 18.50 s, 0.91 against 0.33; 1 KB,
    about 1,000 a block (``--size 200MB``): 20.62 s against 16.95 s, 0.90 against 0.57."""
    return (shuffle and part_bytes > 0 and mix_bytes > 0 and epoch < mix_from and not composed
            and not spread_nodes and share_bytes <= mix_bytes)


def part_rows(part_bytes: int, shard_bytes: np.ndarray | None, counts: np.ndarray, unit_rows: int = 0) -> int:
    """Samples per part: as many whole units of ``unit_rows`` samples (where > 0: a dcz block's,
    which the writer records) as come nearest ``part_bytes`` at the dataset's mean sample size, at
    least one; without ``unit_rows``, the most samples that fit in ``part_bytes`` (at least 1).
    Parts are cut at shard-local multiples of it, so that where blocks hold ``unit_rows`` samples
    each part is one block: one ranged read, not two half blocks."""
    total = int(np.sum(counts))
    if shard_bytes is None or total == 0:
        return max(1, int(part_bytes))
    mean = max(1.0, float(np.sum(shard_bytes)) / total)
    if unit_rows > 0:
        return int(unit_rows) * max(1, int(round(part_bytes / (unit_rows * mean))))
    return max(1, int(part_bytes // mean))


def part_chunk(batch_size: int, chunk_samples: int) -> int:
    """A part-mixed consumer's read granule in positions: one batch (``FIRST_CHUNK`` samples at
    least), within the node mix's chunk (``chunk_samples``). Each chunk reads its rows of every
    shard it touches at once, and its positions all wait for the last of them: one batch's worth,
    so a batch waits only for its own blocks. Four batches per chunk kept a batch waiting for the
    blocks of the three after it (0.15-0.5 s behind its own data on the bench's cold epoch, and
    that much more after the last byte; ``tools/bench.py --scenario shuffle``)."""
    return max(1, min(chunk_samples, max(FIRST_CHUNK, batch_size)))


def part_piece(block: Pieces, offsets: np.ndarray, lo: int, hi: int, *, rows: int, window: int, seed: int,
               epoch: int, node: int, node_ranks: int, per: int, bounds: np.ndarray, batch_size: int,
               pad: int = 0, narrow: int = 0, strata: int = 0) -> np.ndarray:
    """The samples (global ids) of node positions ``lo .. hi - 1`` (rank-major: rank ``r``'s
    positions are ``r * per ..``; ``bounds``: where each worker's share of a rank starts, plus the
    end) under the part mix of ``block``, the node's part of the epoch order, whose last ``pad``
    positions are padding repeats: they stay last in node time (the node's last slots), as in a
    windowed plan, so a state saved before them and resumed by another world reads none.
    ``narrow``: the last parts over which the window narrows (``PlanSpec.part_narrow``);
    ``strata``: the spans of the stratified part stream (``PlanSpec.part_strata``; 0: uniform)."""
    key = ("partmix", rows, window, seed, epoch, node, node_ranks, per, batch_size, pad, narrow, strata,
           tuple(bounds.tolist()), block.shard.tobytes(), block.lo.tobytes(), block.hi.tobytes())
    dealt = memo(key, lambda: readonly(_deal(block, offsets, rows=rows, window=window, seed=seed, epoch=epoch,
                                             node=node, node_ranks=node_ranks, per=per, bounds=bounds,
                                             batch_size=batch_size, pad=pad, narrow=narrow, strata=strata)))
    return dealt[lo:hi]


def _deal(block: Pieces, offsets: np.ndarray, *, rows: int, window: int, seed: int, epoch: int, node: int,
          node_ranks: int, per: int, bounds: np.ndarray, batch_size: int, pad: int, narrow: int,
          strata: int) -> np.ndarray:
    real = len(block) - pad
    narrow = narrow if rows >= NARROW_ROWS else 0  # see the module docstring
    order = _node_order(block.cut(0, real), offsets, rows=rows, window=window, seed=seed, epoch=epoch, node=node,
                        narrow=narrow, strata=strata)
    if pad:  # the padding last, in node time
        order = np.concatenate([order, block.cut(real, len(block)).samples(offsets)])
    slot = _slots(node_ranks, per, bounds, batch_size)
    rank_of_slot = np.empty(len(slot), dtype=np.int64)
    rank_of_slot[np.argsort(slot, kind="stable")] = np.arange(len(slot), dtype=np.int64)
    return order[rank_of_slot]


def _parts(block: Pieces, rows: int) -> Pieces:
    """``block``'s pieces cut at the shard-local multiples of ``rows``."""
    shard, lo, hi = [], [], []
    for s, a, b in zip(block.shard.tolist(), block.lo.tolist(), block.hi.tolist()):
        cuts = [a] + list(range((a // rows + 1) * rows, b, rows)) + [b]
        shard += [s] * (len(cuts) - 1)
        lo += cuts[:-1]
        hi += cuts[1:]
    return Pieces(np.asarray(shard, dtype=np.int64), np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64))


def _node_order(block: Pieces, offsets: np.ndarray, *, rows: int, window: int, seed: int, epoch: int,
                node: int, narrow: int = 0, strata: int = 0) -> np.ndarray:
    """The node's samples in node time: the parts permuted (in ``strata`` rounds where > 0), then
    the sliding-window keys; over the last ``narrow`` parts the window narrows linearly (see the
    module docstring)."""
    parts = _parts(block, rows)
    rng = np.random.default_rng([seed, epoch, 3, node])
    order = _stratified(parts, offsets, rng, strata) if strata > 0 else rng.permutation(len(parts.shard))
    parts = parts.take(order)
    samples = parts.samples(offsets)
    sizes = parts.hi - parts.lo
    m = len(sizes)
    part_of = np.repeat(np.arange(m, dtype=np.int64), sizes)
    width = np.full(len(part_of), float(window))
    if narrow > 0:
        into = np.clip(part_of - (m - narrow), 0, None) / narrow  # 0 before the last ``narrow`` parts, then to 1
        width -= (_STRATA_DEPTH if strata > 0 else _DEPTH) * window * into
    spread = np.minimum(np.minimum(width, _RAMP0 + _RAMP * part_of), m - part_of + 1)
    keys = part_of + rng.random(len(samples)) * spread
    # The end: a share of the last parts' samples is read last, together, so the epoch's last
    # batches draw from as many parts as the others (the window alone tapers to a few).
    share = _STRATA_END_SHARE if strata > 0 else _END_SHARE
    last = (part_of >= m - _END_PARTS) & (rng.random(len(samples)) < share)
    keys[last] = m + rng.random(int(last.sum()))
    return samples[np.argsort(keys, kind="stable")]


def _stratified(parts: Pieces, offsets: np.ndarray, rng: np.random.Generator, strata: int) -> np.ndarray:
    """A permutation of ``parts`` in rounds: cut by write position (``offsets[shard] + lo``) into
    ``strata`` spans of consecutive parts, each span's parts shuffled, the ``k``-th of every span
    in round ``k`` (a span of ``s`` parts spreads them over the rounds at ``(k + U[0, 1)) / s``)."""
    m = len(parts.shard)
    rank = np.empty(m, dtype=np.int64)
    rank[np.argsort(offsets[parts.shard] + parts.lo, kind="stable")] = np.arange(m, dtype=np.int64)
    span = rank * min(strata, m) // m
    size = np.bincount(span)
    within = np.empty(m, dtype=np.int64)
    within[np.lexsort((rng.random(m), span))] = np.arange(m) - np.repeat(np.cumsum(size) - size, size)
    return np.argsort((within + rng.random(m)) / size[span], kind="stable")


def _slots(node_ranks: int, per: int, bounds: np.ndarray, batch_size: int) -> np.ndarray:
    """Each node position's slot in node time (see the module docstring); distinct values."""
    q = np.arange(node_ranks * per, dtype=np.int64)
    rank, p = q // per, q % per
    workers = len(bounds) - 1
    w = np.searchsorted(bounds, p, side="right") - 1
    off = p - bounds[w]
    k, j = off // batch_size, off % batch_size
    return (((k * workers + w) * batch_size + j) * node_ranks + rank).astype(np.int64)
