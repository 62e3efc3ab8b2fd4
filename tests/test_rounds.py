"""``datacache.pytorch.rounds``: a DataLoader's per-worker position from the number of batches it handed
out. The model (turns from worker 0, skipping a worker with no batch left) is checked against a
brute-force round-robin and against what a real torch ``DataLoader`` does with uneven workers."""
from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch.utils.data as tud

from datacache.plan.resume import start_state
from datacache.pytorch.rounds import Rounds, WorkerBatches, delivered


def turns(counts: list[int], first: int) -> list[int]:
    """Which worker hands out each batch: round-robin from ``first``, exhausted workers skipped."""
    left, out, w = list(counts), [], first
    while any(left):
        if left[w]:
            out.append(w)
            left[w] -= 1
        w = (w + 1) % len(counts)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_delivered_matches_a_brute_force_round_robin(seed: int) -> None:
    rng = random.Random(seed)
    counts = [rng.choice([0, 1, 2, 5, 9]) for _ in range(rng.randint(1, 5))]
    first = rng.randrange(len(counts))
    seq = turns(counts, first)
    for k in range(len(seq) + 1):
        done, nxt = delivered(counts, first, k)
        assert done == [seq[:k].count(w) for w in range(len(counts))], (counts, first, k)
        if 0 < k:
            assert nxt == (seq[k - 1] + 1) % len(counts), (counts, first, k)
        else:
            assert nxt == first
    with pytest.raises(ValueError, match="batches delivered"):
        delivered(counts, first, len(seq) + 1)


def test_state_gives_plan_positions_and_the_next_worker() -> None:
    base = start_state(epoch=3, seed=1, dataset_id="d", dp_size=1, dp_rank=0, num_workers=3, batch_size=4)
    ws = [WorkerBatches(start=8, length=18, size=4), WorkerBatches(start=0, length=4, size=4),
          WorkerBatches(start=0, length=10, size=4, cuts=(3, 4, 8, 10))]
    rounds = Rounds(base=base, make_workers=lambda: ws)
    assert [w.count for w in ws] == [3, 1, 4]
    st = rounds.state(0)
    assert st.consumed == (8, 0, 0) and st.next_worker == 0
    st = rounds.state(5)  # w0 w1 w2 | w0 w2
    assert st.consumed == (16, 4, 4) and st.next_worker == 0 and st.epoch == 3
    st = rounds.state(8)  # then w0 w2 w2: all delivered
    assert st.consumed == (18, 4, 10)


class Tagged(tud.IterableDataset):
    """Worker ``w`` yields ``counts[w]`` items tagged with its id."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info()
        yield from [info.id] * self.counts[info.id]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("counts, persistent, prefetch", [([5, 1, 3], False, 2), ([0, 4, 2], True, 1),
                                                          ([7, 7, 2], True, 3)])
def test_torch_takes_the_workers_batches_in_turn(counts: list[int], persistent: bool, prefetch: int) -> None:
    loader = tud.DataLoader(Tagged(counts), batch_size=None, num_workers=len(counts),
                            persistent_workers=persistent, prefetch_factor=prefetch)
    for _ in range(2 if persistent else 1):  # a persistent loader's next epoch starts at worker 0 again
        assert [int(w) for w in loader] == turns(counts, 0)
