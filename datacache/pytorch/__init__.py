"""The PyTorch layer: ``StreamingDataset``, ``DataLoader``, ``CachedDataset`` and batches in shared memory.

Guarantees:
- a drop-in ``IterableDataset`` and torch's ``DataLoader`` signature: the same samples and batches
  ``default_collate`` makes, collated once into reusable shared memory by the workers (``batches``),
  carried a few per item and handed out in the order of one per item (``bundles``);
- mid-epoch ``state_dict``/``load_state_dict`` resume exactly, with any number of workers
  (``rounds``);
- the one place that touches torch internals is ``torch_compat``.

May import every layer below (``mixing``, ``read``, ``plan``, ``cache``, ``store``) and the base
modules. Never ``cli``. Imports nothing at package import, so ``import datacache`` stays free of torch.
"""

__all__: list[str] = []
