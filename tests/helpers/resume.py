"""One resume checker for every resume test (in the style of torchdata's stateful tests).

``check_resume(make_ds, midpoints, ...)`` runs an uninterrupted reference, then for each midpoint
``k``: reads ``k`` items, takes ``state_dict()``, builds a NEW dataset (and loader),
``load_state_dict(state)``, reads the rest, and asserts ``prefix + rest == reference`` exactly. A
midpoint may be a tuple ``(k1, k2, ...)``: read k1, resume, read k2 more, resume again, ...
With ``world=(N, M, ...)`` it checks elastic resumes instead (see ``_check_elastic``).

``check_exactly_once(make_ds, [Stage(...), ...])`` checks save/resume from several ranks and from
StatefulDataLoader workers, resumed with the same / fewer / more ranks and the same / other
``num_workers``, in samples or batched mode, counting every read (see ``Stage``).
"""
from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Stage:
    """One run of an elastic resume check: ``dp_size`` ranks (simulated in this process, one after
    the other, each a dataset with explicit ``dp_rank``/``dp_size``), each reading ``reads`` items
    (``None``: to the end) and then saving its state.

    ``num_workers``: ``None`` iterates the dataset itself; an int wraps it in torchdata's
    ``StatefulDataLoader(num_workers=...)`` (0: in the main process) and checkpoints the loader.
    ``load``: how each rank of this stage loads the previous stage's states: ``"all"`` the list of
    every old rank's state (into the dataset), ``"mod"`` old rank ``r % old size``'s state (into the
    dataset), ``"loader"`` its own old state into its new loader (torchdata's path; same layout).
    """

    dp_size: int
    num_workers: int | None = None
    reads: int | None = None
    load: str = "all"

    @property
    def layout(self) -> tuple[int, int]:
        return self.dp_size, self.num_workers or 1


def _ids(item: Any) -> list[int]:
    n = norm(item)
    return list(n) if isinstance(n, tuple) else [n]


def _run_rank(make_ds: Callable[..., Any], stage: Stage, r: int, prev: list[Any] | None, epoch: int,
              loader_batch: int | None, loader: Callable[..., Any] | None) -> tuple[list[int], Any, int]:
    """One rank of a stage: (sample ids read, its state, the dataset's sample count)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = make_ds(dp_rank=r, dp_size=stage.dp_size)
    src = ds if stage.num_workers is None else (loader or StatefulDataLoader)(ds, num_workers=stage.num_workers,
                                                                             batch_size=loader_batch)
    if prev is None:
        ds.set_epoch(epoch)
    elif stage.load == "loader":
        src.load_state_dict(prev[r])
    else:
        ds.load_state_dict(prev[r % len(prev)] if stage.load == "mod" else prev)
    it = iter(src)
    try:
        items = list(it) if stage.reads is None else [next(it) for _ in range(stage.reads)]
        state = src.state_dict()
    finally:
        del it
        ds.close()
        gc.collect()
    return [i for x in items for i in _ids(x)], state, int(ds.manifest.num_samples)


def check_exactly_once(make_ds: Callable[..., Any], stages: Sequence[Stage], *, epoch: int = 0,
                       loader_batch: int | None = None, loader: Callable[..., Any] | None = None,
                       expected: Counter[int] | None = None) -> list[int]:
    """Run ``stages`` (each resuming from the one before; the last reads to the end) and check
    exactly once by counting: every sample is read, and the reads exceed the sample count by
    exactly the padding of the last plan (``drop_last=False``): that of the last stage that changed
    the layout, ``(-unread) % dp_size``, with ``unread`` the samples not read before it. So an
    interrupted stage must stop before any rank reaches its padding (the end of the last rank).
    ``loader_batch``: the StatefulDataLoader's ``batch_size`` (``None`` in batched mode);
    ``loader``: the loader class (default torchdata's ``StatefulDataLoader``; e.g. ``datacache.DataLoader``).
    ``expected``: the sample ids an uninterrupted epoch reads, with their multiplicities (a mixed
    dataset's repeats and subsets), checked instead of "every id below the sample count once".
    Every stage's rank states must agree (``common_state``): ranks save at the same step.
    Returns every sample id read, in order."""
    from datacache.plan.resume import common_state

    seen: list[int] = []
    prev: list[Any] | None = None
    pad, layout, total = 0, None, 0
    for j, stage in enumerate(stages):
        last = j == len(stages) - 1
        assert last == (stage.reads is None), "only the last stage reads to the end"
        if stage.layout != layout:
            pad_base = (total - (len(seen) if expected is not None else len(set(seen)))) if seen else None
            layout = stage.layout
        states = []
        for r in range(stage.dp_size):
            ids, state, total = _run_rank(make_ds, stage, r, prev, epoch, loader_batch, loader)
            seen += ids
            states.append(state)
        if pad_base is None:  # the first stage: the whole epoch
            pad_base = total
        pad = (-pad_base) % layout[0]
        if not last:
            common_state(states)  # lockstep ranks saved the same counts
        prev = states
    counts = Counter(seen)
    if expected is not None:
        lost, extra = expected - counts, counts - expected
        assert not lost, f"{sum(lost.values())} expected reads never made (e.g. {sorted(lost)[:5]})"
        assert sum(extra.values()) == pad, f"{sum(extra.values())} reads beyond the epoch's, padding is {pad}: {extra}"
        return seen
    missing = set(range(total)) - set(seen)
    assert not missing, f"{len(missing)} samples never read (e.g. {sorted(missing)[:5]})"
    assert len(seen) - total == pad, (f"{len(seen)} reads of {total} samples: {len(seen) - total} duplicates, "
                                      f"padding accounts for {pad}; most repeated: {counts.most_common(3)}")
    return seen


def _check_elastic(make_ds: Callable[..., Any], reads: Sequence[int], world: Sequence[int], epoch: int,
                   make_loader: Callable[[Any], Any] | None) -> list[Any]:
    """Stage j runs ``world[j]`` ranks in this process, each reading ``reads[j]`` samples (the last
    stage reads to the end, through ``make_loader(ds)`` if given); the next stage loads rank 0's
    state. Every sample must be read exactly once over all stages, plus the last plan's padding,
    and no stage may re-read a sample an earlier stage read."""
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
        unread = total - len(set(seen))
        for it in iters:
            stage += [norm(x) for x in it] if last else _take(it, reads[j])
        if not last:
            state = datasets[0].state_dict()
            assert state["dp_size"] == size
        for ds in datasets:
            ds.close()
        del iters
        assert not set(stage) & set(seen), f"stage {j} re-reads samples read before the resume"
        seen += stage
    assert total is not None
    assert set(seen) == set(range(total)), f"{total - len(set(seen))} samples never read"
    assert len(seen) - total == (-unread) % world[-1], \
        f"{len(seen) - total} duplicates, padding is {(-unread) % world[-1]}"
    return seen
