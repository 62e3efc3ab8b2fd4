"""``on_error="skip"``: one warning and one count per unreadable shard, per epoch, on the node.

With DataLoader workers, a node mix or a part mix, several consumers of the node read parts of one
shard, and each of them that reaches an unreadable shard skips it; the first to do so in this run
and epoch reports it (``stats()["skipped_shards"]`` and the warning), the others log it at INFO.
A marker file per (shard, epoch) in the node cache's control directory (``skipped/``), checked
and written under an ``flock``, says that the shard was reported. A marker older than this run's
dataset object (``SkipMarks`` is made with it, and its DataLoader workers inherit it) is from an
earlier run and is renewed, so a restarted job warns again.

Thread-safe and process-safe (the lock); a marker that cannot be read or written reports the skip
(a repeated warning rather than none).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import time

from .tiers import ensure_private_dir

__all__ = ["SkipMarks"]

_CLOCK_SLACK = 0.1  # s: file times come from the kernel's coarse clock, up to a tick behind time.time()


class SkipMarks:
    """Which unreadable shards the consumers of this run reported on the node, per epoch."""

    def __init__(self, control_dir: str) -> None:
        self.dir = os.path.join(control_dir, "skipped")
        self.since = time.time() - _CLOCK_SLACK  # markers older than this are an earlier run's

    def first(self, key: str, epoch: int) -> bool:
        """Whether the caller is the first consumer of this run on the node to skip the shard of
        cache key ``key`` in ``epoch`` (and so reports it); marks it so."""
        name = hashlib.blake2b(f"{key}\0{epoch}".encode(), digest_size=16).hexdigest()
        path = os.path.join(self.dir, name)
        try:
            ensure_private_dir(self.dir)
            with open(os.path.join(self.dir, ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                try:
                    if os.stat(path).st_mtime >= self.since:
                        return False
                except FileNotFoundError:
                    pass
                with open(path, "w"):
                    pass
                os.utime(path)
        except OSError:
            pass
        return True
