"""One resume checker for every resume test (in the style of torchdata's stateful tests).

``check_resume(make_ds, midpoints, ...)`` runs an uninterrupted reference, then for each midpoint
``k``: reads ``k`` items, takes ``state_dict()``, builds a NEW dataset (and loader),
``load_state_dict(state)``, reads the rest, and asserts ``prefix + rest == reference`` exactly. A
midpoint may be a tuple ``(k1, k2, ...)``: read k1, resume, read k2 more, resume again, ...
With ``world=(N, M, ...)`` it checks elastic resumes instead (see ``_check_elastic``).
"""
from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch


def norm(item: Any) -> Any:
    """A comparable form of a sample ({"i", "x"}) or a batch of them; checks x matches i."""
    i = item["i"]
    x = item["x"]
    if isinstance(i, torch.Tensor):
        ids = tuple(i.tolist())
        assert np.array_equal(np.asarray(x)[:, 0], np.asarray(ids)), "batch fields are misaligned"
        return ids
    assert int(np.asarray(x)[0]) == int(i), "sample fields are misaligned"
    return int(i)


def _take(it: Iterable[Any], k: int) -> list[Any]:
    out = []
    for _ in range(k):
        out.append(norm(next(it)))
    return out


def check_resume(make_ds: Callable[..., Any], midpoints: Sequence[int | Sequence[int]], *, epoch: int = 0,
                 then_epoch: int | None = None, make_loader: Callable[[Any], Any] | None = None,
                 world: Sequence[int] | None = None) -> list[Any]:
    """Check resuming at each midpoint (items: samples, or batches with a loader); see module doc.

    ``make_ds(dp_rank=0, dp_size=1)`` builds a fresh dataset; ``make_loader(ds)`` wraps it in a
    stateful loader (default: the dataset itself is iterated and checkpointed). ``then_epoch``:
    after loading, ``set_epoch(then_epoch)`` is called and the rest must be that epoch's reference.
    Returns the reference items.
    """
    if world is not None:
        return _check_elastic(make_ds, midpoints, world, epoch, make_loader)
    wrap = make_loader or (lambda ds: ds)

    def reference(e: int) -> list[Any]:
        ds = make_ds()
        ds.set_epoch(e)
        out = [norm(x) for x in wrap(ds)]
        ds.close()
        return out

    ref = reference(epoch)
    ref_after = ref if then_epoch is None else reference(then_epoch)
    for mp in midpoints:
        steps = (mp,) if isinstance(mp, int) else tuple(mp)
        assert 0 <= sum(steps) <= len(ref), f"midpoint {mp} outside [0, {len(ref)}]"
        prefix: list[Any] = []
        state = None
        for k in steps:  # read k, save, resume in a new dataset and loader; repeat
            ds = make_ds()
            loader = wrap(ds)
            if state is None:
                ds.set_epoch(epoch)
            else:
                loader.load_state_dict(state)
            it = iter(loader)
            prefix += _take(it, k)
            state = loader.state_dict()
            del it, loader
            ds.close()
            gc.collect()

        ds2 = make_ds()
        loader2 = wrap(ds2)
        loader2.load_state_dict(state)
        if then_epoch is not None:
            ds2.set_epoch(then_epoch)
        rest = [norm(x) for x in loader2]
        ds2.close()
        assert prefix == ref[:len(prefix)], f"midpoint {mp}: the prefix differs from the reference"
        if then_epoch is None:
            assert prefix + rest == ref, (f"midpoint {mp}: resumed run differs from the reference "
                                          f"({len(prefix)} + {len(rest)} items vs {len(ref)})")
        else:
            assert rest == ref_after, f"midpoint {mp}: epoch {then_epoch} after resume differs"
    return ref


def _check_elastic(make_ds: Callable[..., Any], reads: Sequence[int], world: Sequence[int], epoch: int,
                   make_loader: Callable[[Any], Any] | None) -> list[Any]:
    """Stage j runs ``world[j]`` ranks in this process, each reading ``reads[j]`` samples (the last
    stage reads to the end, through ``make_loader(ds)`` if given); the next stage loads rank 0's
    state. Every sample must be read exactly
    once over all stages, except padding repeats (fewer than the stage's rank count per stage), and
    no stage may re-read a sample an earlier stage read."""
    assert len(reads) >= len(world) - 1
    seen: list[int] = []
    state = None
    total = None
    for j, size in enumerate(world):
        last = j == len(world) - 1
        stage: list[int] = []
        datasets = [make_ds(dp_rank=r, dp_size=size) for r in range(size)]
        iters = []
        for ds in datasets:
            if state is None:
                ds.set_epoch(epoch)
            else:
                ds.load_state_dict(state)
            total = int(ds.manifest.num_samples)
            iters.append(iter(make_loader(ds) if last and make_loader else ds))
        for it in iters:
            stage += [norm(x) for x in it] if last else _take(it, reads[j])
        if not last:
            state = datasets[0].state_dict()
            assert state["dp_size"] == size
        for ds in datasets:
            ds.close()
        del iters
        repeats = len(stage) - len(set(stage))
        assert repeats < size, f"stage {j} repeats {repeats} samples (padding is < {size})"
        assert not set(stage) & set(seen), f"stage {j} re-reads samples read before the resume"
        seen += stage
    assert total is not None
    assert set(seen) == set(range(total)), f"{total - len(set(seen))} samples never read"
    counts = Counter(seen)
    assert sum(c - 1 for c in counts.values()) <= sum(w - 1 for w in world)
    return seen
