"""Small helpers of ``StreamingDataset``: shared-memory ints and the calling DataLoader's batch size."""
from __future__ import annotations

from types import FrameType

import torch

__all__ = ["shared_int", "loader_batch"]


def shared_int(size: int | None = None) -> torch.Tensor:
    """A 0-d int64 tensor (``size``: a vector of that many) in shared memory: DataLoader workers
    (fork or spawn) share it with the main process, so a value set there later is seen by
    persistent workers."""
    t = torch.zeros(() if size is None else (size,), dtype=torch.int64)
    try:
        return t.share_memory_()
    except (RuntimeError, OSError):  # no shared memory: persistent workers will not see set_epoch
        return t


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
