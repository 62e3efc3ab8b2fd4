"""DataLoader workers die with their parent: a SIGKILLed training process leaves no worker downloading.

``die_with_parent()`` runs in a DataLoader worker (``StreamingDataset.__iter__`` calls it there): on
Linux it asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to kill this process the moment its
parent dies, and it records the parent's pid so that ``parent_gone()``, which the prefetcher's
transfers poll, is true once the parent is gone. That check is the portable fallback: elsewhere (or
if prctl fails) a worker's transfers are abandoned as soon as its parent dies, and PyTorch's own
worker loop then exits. Both are cheap and thread-safe; the pid is per process (a forked child
re-records its own).

Linux sends the death signal when the *thread* that started the worker ends: start DataLoader
iteration (``iter(loader)``) in a thread that lives as long as the workers (the main thread, as
usual), not in a short-lived helper thread.

The heap a forked worker inherits is frozen for the garbage collector (``gc.freeze()`` just
before ``os.fork()``, ``gc.unfreeze()`` in the parent right after; a fork hook registered when
this module is imported, which every ``StreamingDataset`` does). Otherwise a worker's first full
collection walks, and so writes to (copy-on-write), every object of the training process: about
0.2 s of CPU per worker on the 2-core VM, run by every worker at once in the 0.3 s before its
first request, so a cold epoch's link stayed idle that much longer. The collector in the child
still collects what the child makes; what the parent made is never collected there (the parent
collects its own as before). Where the parent has frozen objects itself
(``gc.get_freeze_count() > 0``) the hook does nothing, so it never thaws them.
"""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

__all__ = ["die_with_parent", "parent_gone"]

_PR_SET_PDEATHSIG = 1
_forking = threading.local()  # whether this thread's fork froze the heap (the hooks run in it)


def _freeze_before_fork() -> None:
    _forking.froze = gc.get_freeze_count() == 0
    if _forking.froze:
        gc.freeze()


def _thaw_after_fork() -> None:
    if getattr(_forking, "froze", False):
        _forking.froze = False
        gc.unfreeze()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_freeze_before_fork, after_in_parent=_thaw_after_fork)

_parent: tuple[int, int, Any] | None = None  # (this pid, the parent's pid at start, the parent process)


def die_with_parent() -> None:
    """In a worker process: be killed when the parent dies (Linux), and let ``parent_gone`` see it.
    Outside a multiprocessing child (the training process itself) it does nothing."""
    global _parent
    if _parent is not None and _parent[0] == os.getpid():
        return
    proc = multiprocessing.parent_process()
    if proc is None:
        return
    _parent = (os.getpid(), os.getppid(), proc)
    if sys.platform.startswith("linux") and proc.pid == _parent[1]:  # forked or spawned by it (no forkserver)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: parent_gone() still stops the transfers
            pass
    if parent_gone():  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def parent_gone() -> bool:
    """True in a worker whose parent (recorded by ``die_with_parent``) has died: this process was
    re-parented, or multiprocessing's parent sentinel says so."""
    p = _parent
    if p is None or p[0] != os.getpid():
        return False
    return os.getppid() != p[1] or not p[2].is_alive()
