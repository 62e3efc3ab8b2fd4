"""Shared test helpers: ``faults`` (datasets whose every byte is checkable, cache configs, fork and
wait helpers, and a child-process epoch), ``cache_worker`` (cache stress workers), ``resume``
(the one save/resume helper), ``plans`` (the epoch plan's exactly-once checks), ``torchrun_worker``,
``node_worker`` and ``shared_cache_job`` (process entry points).

The repository root is on ``sys.path`` under pytest (``tests`` is a package), so these import as
``tests.helpers.*``; the process entry points are run from the root (``python -m ...``) or with
it on ``PYTHONPATH``.
"""
