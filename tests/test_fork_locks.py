"""A DataLoader worker is forked from a process whose other threads are busy: the node's peer
server downloads the shards it owns for the other nodes (through the dataset's store, and asking
its peers through this process's peer client), while the main thread forks the workers. Whatever
those threads hold at the fork (a lock, a store's request slot, a place in its line) is copied into
the child, where no thread will ever give it back: the child must start with its own, or its first
read waits forever (a multi-node job's first epoch that never ended, every log empty).

Each test holds the state as a busy thread of the parent does (the threads wait on events), forks
a child that uses it, and checks the child got through; the parent's holders then let go."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from datacache import open_store
from datacache.config import RetryConfig
from datacache.peer import client
from datacache.store import Store, retry
from tests.helpers.cache_worker import in_child
from tests.helpers.faults import wait_for


def _holding(enter: Callable[[], AbstractContextManager[object]], n: int = 1) -> Iterator[None]:
    """``n`` threads of this process inside ``enter()`` until the generator resumes."""
    inside, leave = threading.Barrier(n + 1), threading.Event()

    def hold() -> None:
        with enter():
            inside.wait()
            leave.wait()

    threads = [threading.Thread(target=hold, name=f"test-holder-{k}", daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    inside.wait(timeout=60)
    try:
        yield
    finally:
        leave.set()
        for t in threads:
            t.join(timeout=60)


def _read_all(store: Store, name: str, path: str) -> bytes:
    open(path, "wb").close()
    store.read_into(name, path)  # a request slot for each part
    return Path(path).read_bytes()


def test_a_child_forked_while_the_parents_downloads_hold_every_request_slot_reads(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    (tmp_path / "store").mkdir()
    with open_store(str(tmp_path / "store")) as store:
        store.write_bytes("shard", data)
        slots = store._requests
        held = _holding(lambda: slots.hold(0.0), n=slots.n)  # the parent's downloads in flight
        next(held)

        def queue() -> None:
            with slots.hold(-1.0):
                pass
        queued = threading.Thread(target=queue, name="test-queued", daemon=True)
        queued.start()  # and one waiting first in line
        wait_for(lambda: slots._waiting, 60, "the parent's read to queue for a slot")
        assert in_child(_read_all, store, "shard", str(tmp_path / "child"), timeout=60) == data
        next(held, None)
        queued.join(timeout=60)
        assert _read_all(store, "shard", str(tmp_path / "parent")) == data


def _runtime_pid() -> tuple[int, int]:
    return client.runtime().pid, os.getpid()


def test_a_child_forked_while_another_thread_takes_the_peer_runtime_gets_its_own() -> None:
    held = _holding(lambda: client._runtime_lock)  # another thread's runtime() at the fork
    next(held)
    mine, pid = in_child(_runtime_pid, timeout=60)
    next(held, None)
    assert mine == pid != os.getpid()


def test_a_child_forked_while_another_thread_draws_a_backoff_draws_its_own() -> None:
    held = _holding(lambda: retry._rng_lock)
    next(held)
    delay = in_child(retry.backoff_delay, 1, RetryConfig(base_delay=0.5, max_delay=1.0), timeout=60)
    next(held, None)
    assert 0.0 <= delay <= 0.5
