"""``datacache._localfs.RangeLock``: the partial copies' unit locks, one file for every unit of a
key. Checked against a fresh open file description's non-blocking attempt (another thread's or
process's view): threads of one process exclude each other, disjoint ranges do not, and a range
is free again once its holder leaves the block, dies, or has forked a child that keeps the file."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from datacache._localfs import _FLOCK, RangeLock


def free(path: str, start: int, length: int) -> bool:
    """Whether ``[start, start + length)`` can be locked now by a new open file (released again):
    in this thread too, a new open file is another holder, as another thread's is."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_ranges_exclude_overlapping_ones_across_threads_not_disjoint_ones(tmp_path: Path) -> None:
    path = str(tmp_path / "k.units.lock")
    lock = RangeLock(path)
    entered = threading.Event()

    def other() -> None:  # another thread of this process, its own range overlapping ours
        with lock.held(3, 4):
            entered.set()
    with lock.held(0, 5):
        assert not free(path, 4, 1) and not free(path, 0, 1) and free(path, 5, 10)
        with lock.held(5, 2):  # a disjoint range, at once
            assert not free(path, 6, 1)
        t = threading.Thread(target=other)  # waits in the kernel until this block ends
        t.start()
    t.join(timeout=30)
    assert entered.is_set() and free(path, 0, 100)


_HOLD = """
import sys
from datacache._localfs import RangeLock
with RangeLock(sys.argv[1]).held(2, 3):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_holder_that_dies_releases_its_range(tmp_path: Path) -> None:
    path = str(tmp_path / "k.units.lock")
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "held"  # type: ignore[union-attr]
    assert not free(path, 3, 1) and free(path, 0, 2) and free(path, 5, 1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert free(path, 0, 10)


def test_a_range_is_released_even_where_a_forked_child_keeps_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "k.units.lock")
    r, w = os.pipe()
    with RangeLock(path).held(0, 4):
        pid = os.fork()
        if pid == 0:  # the child keeps its copy of the descriptor open until the parent says
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        os.close(r)
    try:
        assert free(path, 0, 4), "the child's copy of the descriptor kept the range"
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
