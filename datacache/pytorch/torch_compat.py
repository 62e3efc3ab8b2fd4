"""The places where datacache relies on torch internals, kept together so that a torch that changes
them fails one test (``tests/test_torch_compat.py``) rather than a user's job.

- ``loader_batch``: whether the DataLoader iterating a dataset batches its items itself. Nothing
  public tells a dataset, so it reads the frame that resumed ``__iter__``: torch's iterable-dataset
  fetcher (``torch.utils.data._utils.fetch._BaseDatasetFetcher.fetch``).
- ``batch_step``: ``next()`` on torch's DataLoader iterator less the profiler range its
  ``__next__`` opens around every batch (``_next_data``, ``_sampler_iter``, ``_num_yielded``).
- ``batch_range``: that range's name (``_profile_name``), for the batches of a bundle
  (``datacache.pytorch.bundles``) that the training process hands out without that call.

Each falls back to the public behaviour when the internals are not there (None; ``it.__next__``).
Thread safety: stateless.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

import torch

__all__ = ["batch_range", "batch_step", "loader_batch"]


def loader_batch(caller: FrameType | None) -> int | None:
    """The batch size of the DataLoader that batches this dataset's items itself (None: it does not,
    or the caller is no DataLoader), which batched mode refuses. Nothing public tells a dataset, so
    this looks at the frame that resumed ``__iter__``: torch's iterable-dataset fetcher
    (StatefulDataLoader's too), whose ``auto_collation`` is set when the DataLoader has a
    batch_size, and which holds the batch's indices. Any other caller (a loop over the dataset, a
    future torch) gives None; its locals are not read (before Python 3.13 that would keep them
    alive, this iterator among them)."""
    try:
        from torch.utils.data._utils.fetch import _BaseDatasetFetcher
    except ImportError:
        return None
    if caller is None or caller.f_code.co_name != "fetch":
        return None
    local = caller.f_locals
    fetcher = local.get("self")
    if not isinstance(fetcher, _BaseDatasetFetcher) or not getattr(fetcher, "auto_collation", False):
        return None
    index = local.get("possibly_batched_index")
    return len(index) if hasattr(index, "__len__") else 1


def batch_range(it: Any) -> Callable[[], AbstractContextManager[Any]]:
    """A new profiler range named as the one torch's worker iterator ``it`` opens around each batch
    its ``__next__`` hands out (``_profile_name``), for a batch handed out without that call."""
    name = getattr(it, "_profile_name", None) or f"enumerate(DataLoader)#{type(it).__name__}.__next__"
    return lambda: torch.autograd.profiler.record_function(name)


def batch_step(it: Any) -> Callable[[], Any]:
    """``next(it)`` for torch's worker iterator ``it``, less the profiler range that torch's
    ``__next__`` opens around every batch while no profiler is running.

    That range (``record_function``: two dispatcher calls) takes 6 us in a tight loop but 0.1-0.25
    ms after a training step has left the caches cold, a fifth to two fifths of what torch's
    hand-over of a batch costs the training loop on the 2-core VM (``tools/loader_floor.py``).
    Under a profiler, and on the call that starts an epoch, torch's own ``__next__`` runs. The
    rest of that method is kept (its count of batches handed out); its warning that an iterable
    dataset yielded more than ``len()`` cannot apply, the dataset's length being exact. An
    iterator without the attributes of torch 2.x's gets its own ``__next__``."""
    step = getattr(it, "_next_data", None)
    if step is None or not hasattr(it, "_sampler_iter") or not hasattr(it, "_num_yielded"):
        return it.__next__

    def next_batch() -> Any:
        if it._sampler_iter is None or torch.autograd._profiler_enabled():
            return it.__next__()
        data = step()
        it._num_yielded += 1
        return data

    return next_batch
