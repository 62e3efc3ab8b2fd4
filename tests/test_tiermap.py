"""The training process maps the node's RAM tier files as a cold epoch lands them
(``datacache.pytorch.tiermap``), so the warm epoch's large ``bytes`` values are copied from
mappings made before it: real DataLoader workers, a real node cache, real files."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import datacache
from datacache import CacheConfig, NodeCache, StreamingDataset, write_dataset
from datacache.pytorch import crossread

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
              pytest.mark.skipif(not crossread.available(os.getpid()),
                                 reason="this system forbids reading a child process's memory")]

N = 240


def _blob(i: int, raw: bool) -> bytes:
    """Sample ``i``'s value: 6 to 14 KB, incompressible (raw blocks, read in place) or half zeros
    (compressed blocks, decompressed in the worker, still over 4 KB a sample stored)."""
    n = 6_000 + (i * 7919) % 8_000
    return np.random.default_rng(i).bytes(n if raw else n // 2) + (b"" if raw else bytes(n - n // 2))


def _dataset(root: Path, raw: bool) -> str:
    url = f"file://{root}/ds"
    write_dataset(({"blob": _blob(i, raw), "name": f"s{i}", "id": i} for i in range(N)), url,
                  shard_bytes=200_000, writer_options={"block_bytes": 32_000}, progress=False)
    return url


def _cache(root: Path) -> NodeCache:
    return NodeCache(CacheConfig(ram_bytes="16MB", ssd_bytes="16MB", ram_dir=str(root / "ram"),
                                 ssd_dir=str(root / "ssd")))


def _epoch(loader: datacache.DataLoader, raw: bool) -> list[int]:
    ids: list[int] = []
    for b in loader:
        got = b["id"].tolist()
        assert b["blob"] == [_blob(i, raw) for i in got] and b["name"] == [f"s{i}" for i in got]
        ids += got
    return sorted(ids)


@pytest.mark.timeout(240)
def test_a_cold_epoch_maps_each_landed_tier_file_and_the_warm_epoch_copies_from_those_mappings(
        tmp_path: Path) -> None:
    """Cold epoch: every shard's RAM tier file ends up mapped in the training process, pages and
    all, by the time the epoch's thread is done. Warm epoch: every value exact and once, copied
    from a mapping of the training process; no file is opened for it (no miss)."""
    url, cache = _dataset(tmp_path, raw=True), _cache(tmp_path)
    ds = StreamingDataset(url, cache=cache, seed=7)
    loader = datacache.DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True)
    try:
        assert _epoch(loader, raw=True) == list(range(N))
        mapper = ds._mapper
        assert mapper is not None, "a cold epoch of large raw bytes values gets a tier mapper"
        assert mapper.wait(timeout=60)
        shards = len(ds.manifest.shards)
        assert mapper.mapped == shards
        keys = [ds.manifest.cache_key(s) for s in range(shards)]
        paths = cache.ram_files(keys)
        assert None not in paths, "the whole dataset fits the RAM tier"
        idents = {(st.st_dev, st.st_ino) for st in map(os.stat, paths)}  # type: ignore[arg-type]
        assert idents <= set(crossread.FILES._maps), "every landed tier file is mapped here"

        misses, mapped = crossread.FILES.misses, crossread.values_mapped()
        ds.set_epoch(1)
        assert _epoch(loader, raw=True) == list(range(N))
        assert ds._mapper is None, "a warm epoch gets none"
        assert crossread.values_mapped() > mapped, "the warm epoch copied values from mapped tier files"
        assert crossread.FILES.misses == misses, "each of them was mapped during the cold epoch"
    finally:
        del loader
        ds.close()
        cache.close()


@pytest.mark.timeout(240)
def test_a_cold_epoch_of_compressed_shards_maps_none_of_them(tmp_path: Path) -> None:
    """Values decompressed in the workers are never copied from their files: the mapper stops at
    the first shard that lands, having mapped nothing."""
    url, cache = _dataset(tmp_path, raw=False), _cache(tmp_path)
    ds = StreamingDataset(url, cache=cache, seed=7)
    loader = datacache.DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True)
    held = len(crossread.FILES._maps)
    try:
        assert _epoch(loader, raw=False) == list(range(N))
        mapper = ds._mapper
        assert mapper is not None and mapper.wait(timeout=60)
        assert mapper.mapped == 0 and len(crossread.FILES._maps) == held
    finally:
        del loader
        ds.close()
        cache.close()


def _rss_kb(address: int) -> int:
    """Resident KB of this process's mapping that starts at ``address`` (``/proc/self/smaps``)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]  # a mapping's first line: "start-end perms offset ..."
        if "-" in head and int(head.split("-", 1)[0], 16) == address:
            return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    raise AssertionError("no such mapping")


def test_a_file_adopted_by_path_is_mapped_with_its_pages_and_kept_within_the_room(tmp_path: Path) -> None:
    """``adopt`` maps a file by its path with every page (its mapping resident at once); a file
    already mapped is not mapped twice; a missing path or a directory is "not now" (False); once
    every place is taken, "never" (None), and no file is dropped for it."""
    files = crossread._Files()
    files.capacity = 2
    paths = []
    for k in range(3):
        p = tmp_path / f"f{k}"
        p.write_bytes(np.random.default_rng(k).bytes(1 << 20))
        paths.append(p)
    try:
        assert files.adopt(str(paths[0])) is True and files.adopted == 1
        st = os.stat(paths[0])
        fd, (m, size) = files._maps[(st.st_dev, st.st_ino)]
        assert size == 1 << 20 and m[:] == paths[0].read_bytes()
        address = np.frombuffer(m, np.uint8).ctypes.data
        assert _rss_kb(address) >= 1024 * 3 // 4, "its pages are mapped by adopt, not by the reads after it"
        assert files.adopt(str(paths[0])) is True and files.adopted == 1 and len(files._maps) == 1
        assert files.adopt(str(tmp_path / "missing")) is False
        assert files.adopt(str(tmp_path)) is False
        assert files.adopt(str(paths[1])) is True
        assert files.adopt(str(paths[2])) is None, "no room: never, in this process"
        assert len(files._maps) == 2 and files.evicted == 0
        files.on = False
        assert files.adopt(str(paths[0])) is None, "the path off"
    finally:
        files.close()
