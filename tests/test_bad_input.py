"""Bad input at the dataset level: each case is one clear error naming the URL, with the backend's
error chained as ``__cause__`` where there is one, and nothing wrong enters the cache. Store-level
cases (missing bucket/key, wrong credentials, size mismatches) are in test_storage.py, reader-level
ones in test_readers.py; a deleted shard raising NotFoundError is in test_dataset.py.
"""
from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest

from datacache import (
    IntegrityError,
    Manifest,
    ManifestError,
    NotFoundError,
    PermissionDeniedError,
    ReaderError,
    StreamingDataset,
    open_store,
)
from tests.helpers import faults as H

SIZE = 1000
N = 40  # 5 shards of 8 samples


def rewrite_manifest(url: str, opts: dict[str, Any] | None, m: Manifest, **changes: Any) -> Manifest:
    """Write a manifest like ``m`` with ``changes`` (a consistent, content-derived dataset id)."""
    new = Manifest(**{"format": m.format, "schema": m.schema, "shards": m.shards, **changes})
    with open_store(url, opts) as store:
        store.write_bytes("manifest.json", new.to_json().encode())
    return new


def samples_of_other_shards(m: Manifest, shard: int) -> list[int]:
    lo, hi = m.offsets[shard], m.offsets[shard + 1]
    return [i for i in range(N) if not lo <= i < hi]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["same-size", "other-size", "deleted"])
def test_shard_not_matching_the_manifest(change: str, small_dataset: Any, tmp_path: Path) -> None:
    url, opts, m = small_dataset
    victim = m.shards[2]
    with open_store(url, opts) as store:
        data = store.read_bytes(victim.name)
        if change == "same-size":
            store.write_bytes(victim.name, data[:100] + bytes([data[100] ^ 1]) + data[101:])
        elif change == "other-size":
            store.write_bytes(victim.name, data[:-10])
        else:
            store.delete(victim.name)
        victim_url = store.url_of(victim.name)
    expected = NotFoundError if change == "deleted" else IntegrityError
    ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path), window=1)
    with pytest.raises(expected) as info:
        list(ds)
    err = info.value
    assert err.url == victim_url and victim_url in str(err)
    if change == "deleted":
        assert err.__cause__ is not None  # the backend's 404
    key = ds.manifest.cache_key(2)
    assert ds.cache.contains(key) is None and key not in dict(ds.cache.entries())
    assert H.leftovers(ds.cache.ram.data_dir) == []
    ds.close()

    # on_error="skip": that shard is skipped with one warning, every other sample is delivered
    ds = StreamingDataset(url, storage_options=opts, cache=ds.cache, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(ds)
    ids = sorted(H.check(got, SIZE)[0])
    assert H.check(got, SIZE)[1] == 0 and ids == samples_of_other_shards(m, 2)
    mine = [w for w in caught if "skipping shard" in str(w.message)]
    assert len(mine) == 1 and victim_url in str(mine[0].message)
    assert ds.stats()["skipped_shards"] == 1 and ds.cache.contains(key) is None
    ds.close()
    ds.cache.close()


@pytest.mark.parametrize("case", ["truncated", "not-json", "wrong-dataset-id", "missing"])
def test_bad_manifest(case: str, small_dataset: Any, tmp_path: Path) -> None:
    url, opts, m = small_dataset
    text = m.to_json()
    with open_store(url, opts) as store:
        if case == "truncated":
            store.write_bytes("manifest.json", text[: len(text) // 2].encode())
        elif case == "not-json":
            store.write_bytes("manifest.json", b"<html>502 Bad Gateway</html>")
        elif case == "wrong-dataset-id":
            doc = json.loads(text)
            doc["dataset_id"] = "ds-" + "0" * 24
            store.write_bytes("manifest.json", json.dumps(doc).encode())
        else:
            store.delete("manifest.json")
        manifest_url = store.url_of("manifest.json")
    with pytest.raises(NotFoundError if case == "missing" else ManifestError) as info:
        StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path))
    assert info.value.url == manifest_url and manifest_url in str(info.value)
    if case != "wrong-dataset-id":  # the JSON parser's or the backend's error
        assert info.value.__cause__ is not None


def test_wrong_bucket(s3_server: Any, tmp_path: Path) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/ds/"
    with pytest.raises(NotFoundError) as info:  # a HEAD's 404 has no body: bucket and key look alike
        StreamingDataset(url, storage_options=s3_server.storage_options(), cache=H.cache_config(tmp_path))
    assert info.value.url == url + "manifest.json" and info.value.__cause__ is not None


def test_wrong_credentials(small_dataset: Any, s3_server: Any, tmp_path: Path) -> None:
    url = small_dataset[0]
    opts = {"key": s3_server.access_key, "secret": "not-the-right-secret-0001",
            "client_kwargs": {"endpoint_url": s3_server.endpoint_url, "region_name": "us-east-1"}}
    with pytest.raises(PermissionDeniedError) as info:
        StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path))
    assert info.value.url == url + "manifest.json" and info.value.__cause__ is not None
    assert "not-the-right-secret-0001" not in str(info.value)


@pytest.mark.timeout(60)
def test_reader_given_a_shard_of_another_format(small_dataset: Any, tmp_path: Path) -> None:
    url, opts, m = small_dataset
    rewrite_manifest(url, opts, m, format="parquet")  # the shards are zstd .dcz files
    ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path))
    with pytest.raises(ReaderError, match="parquet") as info:
        list(ds)
    assert info.value.url.startswith(url) and info.value.url in str(info.value)
    assert info.value.url.removeprefix(url) in {s.name for s in m.shards} and info.value.__cause__ is not None
    # what is cached is exactly the bytes the manifest declares: the format is what is wrong
    for key, entry in ds.cache.entries():
        assert entry.hash == m.shards[[s.name for s in m.shards].index(key.split("/", 1)[1])].hash
    ds.close()
    ds = StreamingDataset(url, storage_options=opts, cache=ds.cache, on_error="skip")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert list(ds) == []
    assert ds.stats()["skipped_shards"] == len(m.shards)
    ds.close()
    ds.cache.close()

