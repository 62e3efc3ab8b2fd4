"""Large ``bytes`` values read by the training process straight from their DataLoader worker's
memory (``datacache.pytorch.crossread``): real processes, real batches, the slot's kept memory."""
from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import pickle
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import datacache
from datacache import NodeCache, StreamingDataset, write_dataset
from datacache.errors import CacheError
from datacache.pytorch import crossread
from datacache.pytorch.batches import RingCollator
from datacache.pytorch.collate import Field
from datacache.pytorch.gather import _file_backed

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]

_HOLDER = """
import ctypes, json, sys
values = [bytes([k % 251]) * n for k, n in enumerate(json.loads(sys.argv[1]))]
print(json.dumps([ctypes.cast(v, ctypes.c_void_p).value for v in values]), flush=True)
sys.stdin.read()
"""


def test_values_are_read_from_another_process_and_a_gone_one_is_named() -> None:
    """Empty, one-byte, large and more than 1,024 values (several system calls), each a new
    ``bytes`` equal to the other process's; once that process is gone, an error naming it."""
    sizes = [0, 1, 2, 70_000, 0, 5] + [17] * 1500
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, json.dumps(sizes)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        addrs = np.array(json.loads(child.stdout.readline()), np.int64)  # type: ignore[union-attr]
        before = crossread.values_read()
        got = crossread.read_values(child.pid, _nowhere(addrs), np.array(sizes, np.int64))
        assert got == [bytes([k % 251]) * n for k, n in enumerate(sizes)]
        assert all(type(v) is bytes for v in got) and crossread.values_read() == before + len(sizes)
        assert len({id(v) for v in got if len(v) > 1}) == sum(n > 1 for n in sizes), "each value its own object"
    finally:
        child.communicate("")
    with pytest.raises(CacheError) as info:
        crossread.read_values(child.pid, _nowhere(addrs[3:4]), np.array([70_000], np.int64))
    assert f"pid {child.pid}" in str(info.value) and "DATACACHE_CROSS_READ=0" in str(info.value)


def _nowhere(addrs: np.ndarray) -> np.ndarray:
    """``read_values``' rows for values at ``addrs`` in no known file."""
    where = np.full((len(addrs), crossread.WHERE), -1, np.int64)
    where[:, 0] = addrs
    return where


_MAPPER = """
import json, os, sys
from datacache.readers._cowmap import CowMap, origin
fd = os.open(sys.argv[1], os.O_RDONLY)
cow = CowMap(fd, os.fstat(fd).st_size)
o = origin(cow.map)
other = os.open(sys.argv[2], os.O_RDONLY)
print(json.dumps([o.address, o.fd, o.dev, o.ino, other]), flush=True)
for line in sys.stdin:  # "swap": the descriptor now names another file; "fifo": a FIFO nobody writes
    if line.strip() == "fifo":
        fifo = sys.argv[1] + ".fifo"
        os.mkfifo(fifo)
        os.dup2(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK), fd)
    else:
        os.dup2(other, fd)
    print("swapped", flush=True)
"""


@pytest.mark.timeout(60)
def test_values_in_a_mapped_file_are_copied_from_this_process_s_own_mapping(tmp_path: Path) -> None:
    """Values whose rows name their file (as a worker's mapped tier file gives them) are copied
    from this process's mapping of the same file, opened through the producer's descriptor; a
    descriptor that names another file by then (closed and reused), or a file deleted since,
    is not used: those values come from the producer's memory, still exact; nor is a FIFO opened
    (without a writer, its open would block)."""
    data = np.random.default_rng(1).bytes(200_000)
    path, other = tmp_path / "shard.bin", tmp_path / "other.bin"
    path.write_bytes(data)
    other.write_bytes(bytes(200_000))
    child = subprocess.Popen([sys.executable, "-c", _MAPPER, str(path), str(other)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    files = crossread._Files()
    try:
        base, fd, dev, ino, _ = json.loads(child.stdout.readline())  # type: ignore[union-attr]
        offsets = np.array([0, 5, 70_000, 199_999, 100], np.int64)
        sizes = np.array([10, 0, 65_536, 1, 100_000], np.int64)
        where = np.stack([base + offsets, np.full(5, fd), np.full(5, dev), np.full(5, ino), offsets], 1)
        want = [data[o:o + n] for o, n in zip(offsets.tolist(), sizes.tolist())]
        mapped = crossread.values_mapped()
        out: list = [None] * 5
        files.copy(child.pid, where[:, 1:], sizes.tolist(), out)
        assert out == want and all(type(v) is bytes for v in out)
        assert crossread.values_mapped() == mapped + 5 and files.misses == 1
        assert crossread.read_values(child.pid, where, sizes) == want  # the module's own files, the same way

        child.stdin.write("swap\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        assert child.stdout.readline().strip() == "swapped"  # type: ignore[union-attr]
        fresh = crossread._Files()
        out = [None] * 5
        fresh.copy(child.pid, where[:, 1:], sizes.tolist(), out)
        assert out == [None] * 5 and not fresh._maps, "another file behind the descriptor: not used"
        assert crossread.read_values(child.pid, where, sizes) == want  # this inode, mapped before the swap

        child.stdin.write("fifo\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        assert child.stdout.readline().strip() == "swapped"  # type: ignore[union-attr]
        out = [None] * 5
        crossread._Files().copy(child.pid, where[:, 1:], sizes.tolist(), out)  # opening it would block
        assert out == [None] * 5, "a FIFO behind the descriptor: not opened"

        assert (dev, ino) in files._maps
        path.unlink()
        files.prune()
        assert (dev, ino) not in files._maps, "a deleted file is let go"
    finally:
        child.communicate("")
        files.close()


def test_a_slot_keeps_its_batch_s_memory_until_it_is_free_even_after_the_ring_grows() -> None:
    collator = RingCollator(shared=True, slots=2)
    ring = collator.ring_for(4096)
    assert ring is not None
    slot = ring.acquire(64)
    assert slot is not None

    class Keep:
        pass
    keep = Keep()
    gone = weakref.ref(keep)
    ring.hold(slot, keep)
    handles = ring.publish(slot, (Field("|u1", (64,), 0, 64),))
    del keep
    tensors = pickle.loads(pickle.dumps(handles))  # the consumer's side: a view of the slot
    bigger = collator.ring_for(1 << 20)  # a larger batch: a new ring; the old one's batch is alive
    assert bigger is not ring and ring.holding() and gone() is not None
    del tensors
    gc.collect()
    collator.ring_for(64)
    assert gone() is None and not collator._retired, "the slot is free: what it kept is dropped"
    collator.close()


def _blob(i: int, raw: bool = True) -> bytes:
    """Sample ``i``'s value: 0 to 40 KB, incompressible (raw blocks, read in place) or zeros
    (compressed blocks, decompressed in the worker)."""
    n = (i * 7919) % 40_000 if i % 9 else i % 2
    return np.random.default_rng(i).bytes(n) if raw else bytes(n)


@pytest.fixture(scope="module", params=["raw", "compressed"])
def blobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bool]:
    raw = request.param == "raw"
    url = f"file://{tmp_path_factory.mktemp('blobs')}/ds"
    write_dataset(({"blob": _blob(i, raw), "name": f"s{i}", "id": i} for i in range(300)), url,
                  shard_bytes=1_000_000, writer_options={"block_bytes": 64_000}, progress=False)
    return url, raw


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cross", ["1", "0"])
def test_large_bytes_values_come_exactly_once_read_from_their_worker(blobs: tuple[str, bool], cache: NodeCache,
                                                                     cross: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers, a cold and a warm epoch: every batch's bytes are the written ones, every
    sample once. Values in raw blocks are read from the workers' memory (``cross`` 1, where this
    system allows it); through the slot with ``DATACACHE_CROSS_READ=0``, and where they were
    decompressed (kept for the consumer, a block's buffer a batch would be memory held). The
    workers' values in tier files are copied from this process's own mapping of those files."""
    url, raw = blobs
    monkeypatch.setenv("DATACACHE_CROSS_READ", cross)
    ds = StreamingDataset(url, cache=cache, seed=5)
    loader = datacache.DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True)
    before, mapped = crossread.values_read(), crossread.values_mapped()
    try:
        for epoch in range(2):
            ds.set_epoch(epoch)
            ids: list[int] = []
            for b in loader:
                got = b["id"].tolist()
                assert b["blob"] == [_blob(i, raw) for i in got] and b["name"] == [f"s{i}" for i in got]
                ids += got
            assert sorted(ids) == list(range(300)), f"epoch {epoch}: not exactly once"
    finally:
        del loader
        ds.close()
    read, mapped = crossread.values_read() - before, crossread.values_mapped() - mapped
    if cross == "0" or not raw or not crossread.available(os.getpid()):
        assert read == 0
    else:
        assert read > 0, "no value was read from a worker"
        assert mapped > 0, "no value was copied from the tier file the worker had mapped"


@pytest.mark.timeout(240)
def test_a_warm_epoch_of_large_bytes_resumed_mid_way_gives_each_value_once(tmp_path: Path,
                                                                           cache: NodeCache) -> None:
    """A warm epoch over raw blocks (the values copied from the tier files the workers mapped),
    stopped after 4 batches and resumed by a new dataset and loader from the loader's state: each
    sample once over both, every value the written one."""
    url = f"file://{tmp_path}/ds"
    write_dataset(({"blob": _blob(i), "id": i} for i in range(300)), url, shard_bytes=1_000_000,
                  writer_options={"block_bytes": 64_000}, progress=False)

    def loader_of(ds: StreamingDataset) -> Any:
        return datacache.DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True)

    ds = StreamingDataset(url, cache=cache, seed=3)
    loader = loader_of(ds)
    ids: list[int] = []
    for _ in loader:  # epoch 0 fills the cache
        pass
    ds.set_epoch(1)
    mapped = crossread.values_mapped()
    it = iter(loader)
    for _ in range(4):
        b = next(it)
        assert b["blob"] == [_blob(i) for i in b["id"].tolist()]
        ids += b["id"].tolist()
    state = loader.state_dict()
    del it, loader
    ds.close()
    again = StreamingDataset(url, cache=cache, seed=3)
    again.set_epoch(1)
    loader = loader_of(again)
    loader.load_state_dict(state)
    try:
        for b in loader:
            assert b["blob"] == [_blob(i) for i in b["id"].tolist()]
            ids += b["id"].tolist()
    finally:
        del loader
        again.close()
    assert sorted(ids) == list(range(300)), "each sample once over the two loaders"
    if crossread.available(os.getpid()):
        assert crossread.values_mapped() > mapped


def test_only_file_mappings_count_as_memory_kept_for_free(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(8192))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = np.frombuffer(m, np.uint8)
    assert _file_backed(whole) and _file_backed(memoryview(whole)[10:20]) and _file_backed(memoryview(m)[5:])
    assert not _file_backed(memoryview(bytearray(10))) and not _file_backed(np.zeros(4)) and not _file_backed(b"x")
    del whole
    m.close()


_HEAP = """
import ctypes, sys
from datacache.pytorch import heap
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "reserve":
    heap.reserve(32 * 65536)
given = []
for batch in range(3):
    values = [bytes(65536) for _ in range(32)]  # a batch of values, dropped a step later
    peak = libc.mallinfo2().arena
    del values
    given.append(peak - libc.mallinfo2().arena)  # heap memory given back to the system
print(max(given))
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc >= 2.33 only (mallinfo2)")
def test_the_heap_keeps_a_batch_of_values_warm_once_reserved() -> None:
    """A fresh process drops a batch of 32 x 64 KiB values three times: glibc gives the memory
    back to the system each time (the next batch faults in fresh pages), unless ``heap.reserve``
    sized it for the batch first."""
    def given(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _HEAP, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        return int(out.stdout)
    assert given("plain") >= 32 * 65536 // 2 and given("reserve") == 0


def test_a_forked_child_starts_with_no_mapped_file_and_closes_the_parent_s_descriptors(tmp_path: Path) -> None:
    """The training process's mapped files (``crossread.FILES``) are not a forked child's: it
    starts empty, and its copies of the parent's descriptors are closed (else each fork leaks them)."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    files = crossread.FILES  # its fork handler is registered at import
    try:
        st = os.fstat(fd)
        assert files.view(os.getpid(), fd, st.st_dev, st.st_ino) is not None
        kept = files._maps[(st.st_dev, st.st_ino)][0]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once, running nothing of the parent's
            try:
                try:
                    os.fstat(kept)
                    still_open = 1
                except OSError:
                    still_open = 0
                os.write(w, json.dumps([len(files._maps), still_open]).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            got = json.loads(f.read())
        os.waitpid(pid, 0)
        assert got == [0, 0]
        os.fstat(kept)  # the parent's own is still open
    finally:
        files.close()
        os.close(fd)
