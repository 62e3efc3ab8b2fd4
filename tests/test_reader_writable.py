"""Samples are writable at no cost, in every reader: an in-place op never segfaults, never reaches
the shard file, never shows in a later read, and PyTorch never warns that an array is not writable."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from datacache import readers
from datacache.readers import zstd as rzstd

REPO = Path(__file__).resolve().parent.parent
N = 12
# zstd-raw: incompressible pixels, so blocks are stored raw and read in place from the mapping
CASES = ["zstd-raw", "zstd", "parquet", "lmdb", "tar"]


def _pixels(i: int, compressible: bool) -> np.ndarray:
    if compressible:
        return np.full((32, 32), i, dtype=np.uint8)
    return np.random.default_rng(i).integers(0, 256, (32, 32), dtype=np.uint8)


def _write(case: str, tmp_path: Path) -> tuple[str, str]:
    """(format name, path) of a shard of ``N`` samples ``{"x": pixels, "y": i}``."""
    fmt = "zstd" if case.startswith("zstd") else case
    path = str(tmp_path / f"shard{readers.get_format(fmt).extension}")
    kw: dict[str, Any] = {"block_bytes": 4000} if fmt == "zstd" else {}
    with readers.get_format(fmt).ShardWriter(path, {"x": "ndarray", "y": "int"}, **kw) as w:
        for i in range(N):
            w.write({"x": _pixels(i, case != "zstd-raw"), "y": i})
    if fmt == "zstd":
        with rzstd.ZstdShardReader(path) as r:
            raw = (r._blocks[:, 0] & np.uint64(rzstd.RAW_BLOCK)) != 0
        assert raw.all() if case == "zstd-raw" else not raw.any()
    return fmt, path


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


_INPLACE = textwrap.dedent("""
    import sys, numpy as np, torch, readers
    fmt, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with readers.open_shard(fmt, path) as r:
        first = list(r.iter_range(0, n))
        for s in first:
            torch.as_tensor(s["x"]).zero_()   # SIGSEGV on a read-only mapping
            s["x"] += 1                        # numpy in place too
        assert all((s["x"] == 1).all() for s in first)
        single = r.get(n - 1)["x"]
        torch.as_tensor(single).mul_(0)
        print("ok")
""")


@pytest.mark.parametrize("case", CASES)
def test_in_place_op_on_a_sample_works_and_leaves_the_file_unchanged(case: str, tmp_path: Path) -> None:
    fmt, path = _write(case, tmp_path)
    before = _digest(path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", _INPLACE, fmt, path, str(N)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"exit {p.returncode} (-11 is SIGSEGV): {p.stderr[-2000:]}"
    assert p.stdout.strip() == "ok"
    assert _digest(path) == before, "an in-place op on a sample reached the shard file"


@pytest.mark.parametrize("case", CASES)
def test_samples_are_writable_and_torch_does_not_warn(case: str, tmp_path: Path) -> None:
    fmt, path = _write(case, tmp_path)
    with readers.open_shard(fmt, path) as r, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = list(r.iter_range(0, N)) + [r.get(3)]
        assert all(s["x"].flags.writeable for s in samples)
        torch.as_tensor(samples[0]["x"])
        torch.from_numpy(samples[-1]["x"])
        batch = default_collate(samples[:4])
    assert batch["x"].shape == (4, 32, 32)
    assert not [w for w in caught if "not writable" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("case", CASES)
def test_a_write_to_a_sample_never_shows_in_a_later_read(case: str, tmp_path: Path) -> None:
    """A reader is kept open across epochs: what a caller wrote into a sample must not come back."""
    fmt, path = _write(case, tmp_path)
    with readers.open_shard(fmt, path) as r:
        held = list(r.iter_range(0, N))
        for s in held:
            s["x"][:] = 0
        again = list(r.iter_range(0, N))  # the written samples are still alive
        for i, s in enumerate(again):
            assert np.array_equal(s["x"], _pixels(i, case != "zstd-raw")), f"sample {i}"
            s["x"] += 3
        assert all((s["x"] == 0).all() for s in held), "the earlier samples lost their own writes"
        del held, again, s
        # written samples gone: a new run (and a get from another block) sees the file's bytes
        assert all(np.array_equal(s["x"], _pixels(i, case != "zstd-raw"))
                   for i, s in enumerate(r.iter_range(0, N)))
        for i in (0, N // 2, N - 1):
            assert np.array_equal(r.get(i)["x"], _pixels(i, case != "zstd-raw"))


_LOADER = textwrap.dedent("""
    import sys, torch, readers
    from torch.utils.data import DataLoader, IterableDataset
    fmt, path = sys.argv[1], sys.argv[2]

    class Shard(IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            with readers.open_shard(fmt, path) as r:
                for i in range(info.id, len(r), info.num_workers):
                    yield r.get(i)

    n = sum(len(b["y"]) for b in DataLoader(Shard(), batch_size=4, num_workers=2))
    print(n)
""")


@pytest.mark.parametrize("case", ["zstd-raw", "parquet"])
def test_dataloader_workers_print_no_not_writable_warning(case: str, tmp_path: Path) -> None:
    fmt, path = _write(case, tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", _LOADER, fmt, path], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == [str(N)]
    assert "not writable" not in p.stderr, p.stderr[-2000:]


_STREAMING = textwrap.dedent("""
    import json, sys
    from torch.utils.data import DataLoader
    from datacache import CacheConfig, StreamingDataset
    url, opts, base = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    cache = CacheConfig(ram_bytes="4MB", ssd_bytes="8MB", ram_dir=base + "/ram", ssd_dir=base + "/ssd")
    ds = StreamingDataset(url, storage_options=opts, cache=cache, shuffle=False)
    print(sorted(int(y) for b in DataLoader(ds, batch_size=4, num_workers=2) for y in b["y"]) == list(range(40)))
    ds.close()
""")


@pytest.mark.parametrize("fmt", ["zstd", "parquet"])
def test_streaming_dataset_workers_print_no_not_writable_warning(fmt: str, s3_store_url: str,
                                                                s3_storage_options: dict[str, Any],
                                                                tmp_path: Path) -> None:
    """Out of pytest's process: its warning capture would hide what a worker prints."""
    import json

    from datacache import write_dataset

    samples = [{"x": _pixels(i, compressible=False), "y": i} for i in range(40)]
    write_dataset(samples, s3_store_url, format=fmt, shard_bytes=8000, storage_options=s3_storage_options,
                  progress=False)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", _STREAMING, s3_store_url, json.dumps(s3_storage_options),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.split() == ["True"], p.stderr[-2000:]
    assert "not writable" not in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("pagemap", [True, False])
def test_cow_map_gives_written_pages_back_once_no_view_uses_them(pagemap: bool, tmp_path: Path) -> None:
    from datacache.readers._cowmap import CowMap

    data = np.random.default_rng(0).bytes(64 * 4096 + 100)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    cow = CowMap(fd, len(data))
    try:
        if not pagemap:  # no readable /proc/self/pagemap: every page handed out counts as written
            cow.use_pagemap = False
        a = np.frombuffer(cow.region(10, 20 * 4096), np.uint8)
        a[:] = 7
        assert cow._written(0, 21) or not pagemap
        b = np.frombuffer(cow.region(10, 20 * 4096), np.uint8)  # a is alive: a fresh private map
        assert bytes(b[:64]) == data[10:74] and (a == 7).all()
        del a, b
        c = np.frombuffer(cow.region(40 * 4096, 4096), np.uint8)  # reclaims the dead regions
        assert not cow._maybe[:21].any()
        if pagemap:
            assert not cow._written(0, 21)  # the private copies are gone
        assert bytes(np.frombuffer(cow.region(10, 20 * 4096), np.uint8)) == data[10:10 + 20 * 4096]
        del c
    finally:
        cow.close()
        os.close(fd)
    assert path.read_bytes() == data
