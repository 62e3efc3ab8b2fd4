"""Progress of long operations (warm, verify, index, write) on stderr, thread-safe.

On a terminal: a tqdm byte bar (MB, MB/s, ETA) with an item counter. Elsewhere (a log file, a pipe)
no bar, whose ``\r`` redraws would fill the log, but plain periodic lines.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

from tqdm import tqdm

__all__ = ["Progress"]

_PLAIN_STEP, _PLAIN_SECONDS = 0.1, 30.0  # off a terminal: one line per 10 % done, or per 30 s
_PLAIN_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
_PLAIN_FORMAT_NO_TOTAL = "{desc}: {n_fmt}B [{elapsed}, {rate_fmt}{postfix}]"


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


class Progress:
    """A thread-safe tqdm byte bar (MB, MB/s, ETA) with an item counter as postfix, on stderr.

    When stderr is not a terminal (a log file, a pipe) there is no bar (its ``\r`` redraws would
    fill the log): a plain line is written each time another 10 % is done or 30 s have passed, and
    one at the end."""

    def __init__(self, quiet: bool, total: int | None, desc: str, items: int = 0, noun: str = "shards") -> None:
        """``quiet``: show nothing; ``total``: bytes expected (None: unknown, a line every 30 s off a
        terminal); ``desc``: what is being done; ``items``/``noun``: the item count shown beside it."""
        self._plain = not quiet and not _isatty(sys.stderr)
        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                         disable=quiet or self._plain, file=sys.stderr, dynamic_ncols=True, leave=False)
        self._lock = threading.Lock()
        self.items, self.done, self.noun, self.desc = items, 0, noun, desc
        self._total, self._n, self._t0 = total, 0, time.monotonic()
        self._line_n, self._line_t = (0, 0), self._t0  # (bytes, items) of the last plain line
        self._closed = False
        self._postfix()

    def _count(self) -> str:
        return f"{self.done}/{self.items} {self.noun}" if self.items else f"{self.done} {self.noun}"

    def _postfix(self) -> None:
        self._bar.set_postfix_str(self._count(), refresh=False)

    def _plain_line(self, final: bool = False) -> str | None:
        """The plain line due now, if any (called with the lock held; printed outside it)."""
        now = time.monotonic()
        if not self._plain or (self._n, self.done) == self._line_n:
            return None
        step_done = self._total is not None and self._n - self._line_n[0] >= _PLAIN_STEP * self._total
        if not final and not step_done and now - self._line_t < _PLAIN_SECONDS:
            return None
        self._line_n, self._line_t = (self._n, self.done), now
        return tqdm.format_meter(self._n, self._total, now - self._t0, prefix=self.desc, unit="B", unit_scale=True,
                                 unit_divisor=1000, postfix=self._count(),
                                 bar_format=_PLAIN_FORMAT if self._total else _PLAIN_FORMAT_NO_TOTAL)

    @staticmethod
    def _print(line: str | None) -> None:
        if line is not None:
            print(line, file=sys.stderr, flush=True)

    def add(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)
            self._n += n
            line = self._plain_line()
        self._print(line)

    def item_done(self) -> None:
        with self._lock:
            self.done += 1
            self._postfix()
            self._bar.refresh()

    def grow(self, nbytes: int, items: int = 1) -> None:
        with self._lock:
            self._bar.total = (self._bar.total or 0) + nbytes
            self._total = (self._total or 0) + nbytes
            self.items += items
            self._postfix()

    def close(self) -> None:
        """Remove the bar (or write the last plain line). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            line = self._plain_line(final=True)
        self._bar.close()
        self._print(line)
