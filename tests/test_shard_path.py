"""The one shard path (``datacache.read.shard_source``): every entry point gets the same error translation and
checks. A reader failure is a ``datacache.ReaderError`` (also a ``DatacacheError`` and a
``readers.ReaderError``) naming the shard's URL, from ``StreamingDataset`` (in the main process and
through DataLoader workers) and from ``CachedDataset`` (planned and off-plan reads); a manifest
whose sample count does not match its shard is an ``IntegrityError`` naming the shard, whether the
count is too high or too low, instead of an ``IndexError`` or silently dropped samples.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data as tud

import datacache
from datacache import CachedDataset, IntegrityError, Manifest, StreamingDataset, open_store, readers
from datacache.hashing import hash_bytes
from tests.helpers import faults as H

SIZE = 1000
N = 40  # 5 shards of 8 samples


def _replace_shard(url: str, opts: dict[str, Any], m: Manifest, shard: int, *, data: bytes | None = None,
                   samples: int | None = None) -> tuple[Manifest, str]:
    """Store ``data`` as shard ``shard`` and/or declare ``samples`` for it, with a manifest that
    matches the bytes (so only the reader or the count check can notice). Returns (manifest, URL)."""
    info = m.shards[shard]
    with open_store(url, opts) as store:
        if data is not None:
            store.write_bytes(info.name, data)
            info = dataclasses.replace(info, bytes=len(data), hash=hash_bytes(data))
        if samples is not None:
            info = dataclasses.replace(info, samples=samples)
        shards = tuple(info if i == shard else s for i, s in enumerate(m.shards))
        new = Manifest(format=m.format, schema=m.schema, shards=shards)
        store.write_bytes("manifest.json", new.to_json().encode())
        return new, store.url_of(info.name)


def _entry_points(url: str, opts: dict[str, Any], tmp_path: Path, n: int) -> dict[str, Any]:
    """name -> a function that reads the whole dataset through that entry point."""
    def streaming() -> None:
        list(StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path / "s")))

    def streaming_workers() -> None:
        ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path / "w"))
        list(tud.DataLoader(ds, batch_size=None, num_workers=2))

    def mapped_planned() -> None:
        ds = CachedDataset(url, storage_options=opts, cache=H.cache_config(tmp_path / "m"))
        ds.plan(range(n))
        [ds[i] for i in range(n)]

    def mapped_off_plan() -> None:
        ds = CachedDataset(url, storage_options=opts, cache=H.cache_config(tmp_path / "o"))
        [ds[i] for i in reversed(range(n))]
    return {"streaming": streaming, "streaming-workers": streaming_workers, "mapped-planned": mapped_planned,
            "mapped-off-plan": mapped_off_plan}


ENTRY_POINTS = ["streaming", "streaming-workers", "mapped-planned", "mapped-off-plan"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_reader_failure_is_one_datacache_reader_error_from_every_entry_point(entry: str, small_dataset: Any,
                                                                              tmp_path: Path) -> None:
    url, opts, m = small_dataset
    _, shard_url = _replace_shard(url, opts, m, 2, data=b"\x00garbage, not a zstd shard" * 40)
    read = _entry_points(url, opts, tmp_path, N)[entry]
    with pytest.raises(datacache.ReaderError) as info:
        read()
    err = info.value
    assert isinstance(err, datacache.DatacacheError) and isinstance(err, readers.ReaderError)
    assert shard_url in str(err)
    if entry != "streaming-workers":  # a DataLoader re-raises the worker's error by its message
        assert err.url == shard_url and err.__cause__ is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("declared", ["too-high", "too-low"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_sample_count_that_does_not_match_the_shard_is_an_integrity_error(entry: str, declared: str,
                                                                           small_dataset: Any, tmp_path: Path) -> None:
    url, opts, m = small_dataset
    actual = m.shards[1].samples
    new, shard_url = _replace_shard(url, opts, m, 1, samples=actual + 5 if declared == "too-high" else actual - 3)
    read = _entry_points(url, opts, tmp_path, min(new.num_samples, N))[entry]
    with pytest.raises(IntegrityError) as info:
        read()
    assert shard_url in str(info.value)
    assert f"holds {actual} samples" in str(info.value)
