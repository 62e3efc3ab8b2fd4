"""``datacache.DataLoader``: the line users write first, made the fast one.

``torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2)`` over samples pays PyTorch's
per-sample path: every sample crosses ``next()`` in the worker, ``default_collate`` allocates a
fresh shared-memory segment per batch field, and the training process maps each one. A
``StreamingDataset`` in batched mode collates in the worker straight from the reader into a
reusable shared-memory ring instead (``datacache._batches``), but only for users who know to write
``StreamingDataset(batch_size=32)`` with ``DataLoader(batch_size=None)``.

``DataLoader`` takes torch's ``DataLoader`` signature (it is torchdata's ``StatefulDataLoader``,
so ``state_dict``/``load_state_dict`` resume mid-epoch) and, over a ``StreamingDataset``, turns
``batch_size=B`` into the dataset's batched mode: it sets the dataset's ``batch_size`` (and
``collate_fn``, and ``drop_last`` when asked) and passes ``batch_size=None`` to the loader below.
Over any other dataset it is a plain ``StatefulDataLoader``. A plain torch ``DataLoader`` over a
samples-mode ``StreamingDataset`` keeps working as before (the slow path).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader

from ._batches import collate
from .dataset import StreamingDataset

__all__ = ["DataLoader"]


class DataLoader(StatefulDataLoader):
    """torch's ``DataLoader`` (torchdata's ``StatefulDataLoader``) that batches a datacache
    ``StreamingDataset`` in its workers, through the dataset's batched mode.

    Arguments are torch's; what differs over a ``StreamingDataset``:

    - ``batch_size``: becomes the dataset's ``batch_size`` (the loader below gets ``None``); the
      default 1 yields batches of one, as torch's does, and ``None`` single samples. A dataset
      already in batched mode keeps its own size: ``batch_size`` left at its default, ``None`` or
      equal to the dataset's is accepted, another size is refused. ``len(loader)`` is the rank's
      batch count.
    - ``collate_fn``: becomes the dataset's ``collate_fn`` (``None`` or torch's
      ``default_collate``: the dataset's ring collation, which gives what ``default_collate``
      gives).
    - ``drop_last=True``: sets the dataset's ``drop_last`` (every batch of every rank full; the
      remainder across ranks is dropped rather than padded). ``False`` leaves the dataset's own.
    - ``shuffle``, ``sampler``, ``batch_sampler``: refused (the dataset's seeded plan shuffles;
      pass ``shuffle``/``seed`` to ``StreamingDataset``), as torch refuses them for any
      ``IterableDataset``.

    The dataset is configured in place (``loader.dataset is ds``), before any iteration, so its
    ``state_dict``, ``len()`` and ``set_epoch`` agree with the loader's. Not thread-safe, like
    torch's loaders.
    """

    def __init__(self, dataset: tud.Dataset, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, **kwargs: Any) -> None:
        if isinstance(dataset, StreamingDataset):
            for name, value in (("shuffle", shuffle), ("sampler", sampler), ("batch_sampler", batch_sampler)):
                if value:
                    raise ValueError(f"datacache.DataLoader: {name}= is not supported over a StreamingDataset, whose "
                                     "seeded plan orders the samples: pass shuffle=/seed= to StreamingDataset instead")
            _configure(dataset, batch_size, collate_fn, drop_last)
            batch_size, collate_fn, drop_last = None, None, False
        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                         batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                         pin_memory=pin_memory, drop_last=drop_last, **kwargs)


def _configure(ds: StreamingDataset, batch_size: int | None, collate_fn: Callable[[list[Any]], Any] | None,
               drop_last: bool) -> None:
    """Put ``ds`` in the batched mode the loader arguments ask for (see ``DataLoader``)."""
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"datacache.DataLoader: batch_size must be a positive int or None, got {batch_size!r}")
    if ds.batch_size is not None and batch_size not in (None, 1, ds.batch_size):
        raise ValueError(f"datacache.DataLoader: batch_size={batch_size}, but the dataset already yields batches of "
                         f"{ds.batch_size} (StreamingDataset(batch_size={ds.batch_size})): pass one of the two")
    if ds.batch_size is None and batch_size is not None:  # 1 too: torch's default yields batches of one
        ds.batch_size = batch_size
    if collate_fn is not None and collate_fn is not tud.default_collate:
        if ds.batch_size is None:
            raise ValueError("datacache.DataLoader: collate_fn= needs a batch_size (batch_size=None yields samples one "
                             "by one)")
        ds.collate_fn = collate_fn
    elif ds.batch_size is not None and ds.collate_fn is tud.default_collate:
        ds.collate_fn = collate
    if drop_last:
        ds.drop_last = True
