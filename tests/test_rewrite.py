"""Rewriting a dataset in place: a failed rewrite leaves the old dataset readable, a successful one
replaces it atomically and then deletes the old shards; an existing dataset is replaced only with
overwrite=True (CLI --force); sizes may be strings; an empty dataset is an error."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

from datacache import (
    DatacacheError,
    DatasetWriter,
    Manifest,
    NodeCache,
    NotFoundError,
    StreamingDataset,
    load_manifest,
    open_store,
    write_dataset,
)
from datacache.cli.main import main
from datacache.errors import DatasetExistsError
from tests.helpers import faults as H

SIZE = 1000
N = 72  # 9 shards of 8 samples


def _samples(n: int, version: int, fail_at: int | None = None, check: Any = None) -> Iterator[dict[str, Any]]:
    """Sample i of ``version``: its payload differs per version. Raises at ``fail_at``; calls
    ``check()`` (mid-write, after some shards were uploaded) at ``n // 2``."""
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("the sample source failed")
        if check is not None and i == n // 2:
            check()
        yield {"i": i, "v": version, "data": H.payload(i + 1000 * version, SIZE)}


def _write(url: str, opts: Any, n: int, version: int, **kw: Any) -> Any:
    return write_dataset(_samples(n, version, kw.pop("fail_at", None), kw.pop("check", None)), url,
                         shard_bytes=8 * SIZE, storage_options=opts, progress=False, **kw)


def _assert_version(url: str, opts: Any, cache: Any, n: int, version: int) -> None:
    """Every sample of ``version`` exactly once, with that version's bytes."""
    ds = StreamingDataset(url, storage_options=opts, cache=cache)
    try:
        got = {int(s["i"]): (int(s["v"]), bytes(s["data"])) for s in ds}
    finally:
        ds.close()
    assert sorted(got) == list(range(n))
    assert all(v == (version, H.payload(i + 1000 * version, SIZE)) for i, v in got.items())


def _objects(url: str, opts: Any) -> list[str]:
    with open_store(url, opts) as store:
        return [name for name, _ in store.list()]


@pytest.fixture(params=["file", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Any]:
    if request.param == "s3":
        return request.getfixturevalue("s3_store_url"), request.getfixturevalue("s3_storage_options")
    return f"file://{tmp_path}/ds/", None


@pytest.mark.timeout(120)
def test_failed_rewrite_leaves_the_old_dataset_readable(location: tuple[str, Any], cache: NodeCache,
                                                        tmp_path: Path) -> None:
    url, opts = location
    v1 = _write(url, opts, N, 1)
    assert len(v1.shards) == 9
    _assert_version(url, opts, cache, N, 1)  # the cache now holds v1's shards
    with pytest.raises(RuntimeError, match="sample source failed"):
        _write(url, opts, 200, 2, fail_at=150, overwrite=True)  # 18 shards uploaded, then it fails
    assert sorted(_objects(url, opts)) == sorted(["manifest.json", *(s.name for s in v1.shards)])  # nothing left over
    with open_store(url, opts) as store:
        assert load_manifest(store) == v1
    _assert_version(url, opts, cache, N, 1)  # through the cache that holds the old shards
    _assert_version(url, opts, H.cache_config(tmp_path / "fresh"), N, 1)  # and all from the store


@pytest.mark.timeout(120)
def test_rewrite_keeps_the_live_dataset_until_commit_then_deletes_its_shards(location: tuple[str, Any],
                                                                             cache: NodeCache, tmp_path: Path) -> None:
    url, opts = location
    v1 = _write(url, opts, N, 1)
    _assert_version(url, opts, cache, N, 1)
    checked = []

    def v1_still_live() -> None:  # mid-write: v2 shards are on the store, the live dataset is untouched
        assert len(_objects(url, opts)) > len(v1.shards) + 1
        with open_store(url, opts) as store:
            assert load_manifest(store) == v1
        _assert_version(url, opts, H.cache_config(tmp_path / f"mid{len(checked)}"), N, 1)
        checked.append(True)

    n2 = N // 2 + 8  # fewer shards than v1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean rewrite warns about nothing
        v2 = _write(url, opts, n2, 2, check=v1_still_live, overwrite=True)
    assert checked == [True]
    assert not {s.name for s in v1.shards} & {s.name for s in v2.shards}
    assert sorted(_objects(url, opts)) == sorted(["manifest.json", *(s.name for s in v2.shards)])  # v1's are gone
    _assert_version(url, opts, cache, n2, 2)  # the cache holding v1's shards serves v2, not v1
    assert v2.dataset_id != v1.dataset_id and v2.extra["write_id"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("made_by", ["index", "old-writer"])
def test_overwrite_deletes_only_the_shards_a_writer_made(made_by: str, tmp_path: Path) -> None:
    """Files that `datacache index` listed are the user's: replacing that manifest keeps them.
    Shards of a writer from before write ids (``shard-000000.dcz``, no ``extra``) are deleted."""
    url, root = f"file://{tmp_path}/ds", tmp_path / "ds"
    v1 = _write(url, None, N, 1)
    names = [f"part-{i}.dcz" if made_by == "index" else f"shard-{i:06d}.dcz" for i in range(len(v1.shards))]
    for s, name in zip(v1.shards, names):
        os.rename(root / s.name, root / name)
    extra = {"indexed_by": "datacache index"} if made_by == "index" else {}
    old = Manifest(format=v1.format, schema=v1.schema, extra=extra,
                   shards=tuple(dataclasses.replace(s, name=n) for s, n in zip(v1.shards, names)))
    (root / "manifest.json").write_text(old.to_json())
    _assert_version(url, None, H.cache_config(tmp_path / "c"), N, 1)
    v2 = _write(url, None, N, 2, overwrite=True)
    kept = names if made_by == "index" else []
    assert sorted(os.listdir(root)) == sorted(["manifest.json", *kept, *(s.name for s in v2.shards)])


@pytest.mark.timeout(60)
def test_existing_dataset_is_refused_without_overwrite(s3_store_url: str, s3_storage_options: Any) -> None:
    url, opts = s3_store_url, s3_storage_options
    v1 = _write(url, opts, N, 1)
    before = _objects(url, opts)
    for attempt in (lambda: _write(url, opts, N, 2),
                    lambda: DatasetWriter(url, storage_options=opts, progress=False)):
        with pytest.raises(DatasetExistsError) as info:
            attempt()
        err = info.value
        assert isinstance(err, FileExistsError) and isinstance(err, DatacacheError)
        assert err.url == url + "manifest.json" and url in str(err)
        assert "overwrite=True" in str(err) and "--force" in str(err)
    assert _objects(url, opts) == before
    with open_store(url, opts) as store:
        assert load_manifest(store) == v1


@pytest.mark.timeout(60)
def test_reader_of_a_replaced_manifest_is_told_the_dataset_changed(s3_store_url: str, s3_storage_options: Any,
                                                                   tmp_path: Path) -> None:
    url, opts = s3_store_url, s3_storage_options
    _write(url, opts, N, 1)
    stale = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path), window=1)  # v1's manifest
    _write(url, opts, N, 2, overwrite=True)
    with pytest.raises(NotFoundError) as info:
        list(stale)
    stale.close()
    text = str(info.value)
    assert "the manifest names shard" in text and "open the dataset again" in text, text
    assert "holds a datacache dataset" not in text  # the store's generic hint does not fit here


@pytest.mark.timeout(60)
def test_local_manifest_is_replaced_atomically(tmp_path: Path) -> None:
    """On file:// the new manifest is a new file renamed over the old one (never rewritten in place):
    a reader that opened the old manifest reads it whole, and no temporary file is left."""
    url = f"file://{tmp_path}/ds"
    v1 = _write(url, None, N, 1)
    with open(tmp_path / "ds" / "manifest.json", "rb") as old:
        v2 = _write(url, None, N, 2, overwrite=True)
        assert json.loads(old.read())["dataset_id"] == v1.dataset_id
    assert json.loads((tmp_path / "ds" / "manifest.json").read_bytes())["dataset_id"] == v2.dataset_id
    assert not [n for n in os.listdir(tmp_path / "ds") if n.startswith(".tmp-")]


@pytest.mark.timeout(120)
def test_cli_force_reshards_a_dataset_in_place(s3_store_url: str, s3_storage_options: Any, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`datacache write URL URL --force` reads the old shards while writing the new ones; the old
    are deleted only once the new manifest is live. Without --force: exit 2, nothing changed."""
    url, opts = s3_store_url, s3_storage_options
    v1 = _write(url, opts, N, 1)
    args = ["write", url, url, "--shard-bytes", "20KB", "--storage-options", json.dumps(opts), "--json", "--quiet"]
    assert main(args[:3] + args[5:]) == 2
    assert "--force" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_samples"] == N and out["num_shards"] < len(v1.shards)
    with open_store(url, opts) as store:
        v2 = load_manifest(store)
    assert sorted(_objects(url, opts)) == sorted(["manifest.json", *(s.name for s in v2.shards)])
    _assert_version(url, opts, H.cache_config(tmp_path), N, 1)  # same samples, new shards


def test_sizes_may_be_strings(tmp_path: Path) -> None:
    as_int = _write(f"file://{tmp_path}/a", None, N, 1)
    as_text = write_dataset(_samples(N, 1), f"file://{tmp_path}/b", shard_bytes="8KB", progress=False,
                            writer_options={"block_bytes": "4KB"})
    assert [s.samples for s in as_text.shards] == [s.samples for s in as_int.shards]
    with pytest.raises(ValueError, match="cannot parse size"):
        write_dataset(_samples(N, 1), f"file://{tmp_path}/c", shard_bytes="8 parsecs", progress=False)
    assert not (tmp_path / "c").exists()


@pytest.mark.timeout(60)
def test_empty_dataset_is_an_error(location: tuple[str, Any]) -> None:
    url, opts = location
    with pytest.raises(DatacacheError, match="no samples were written") as info:
        write_dataset([], url, storage_options=opts, progress=False)
    assert info.value.url is not None and info.value.url.rstrip("/") == url.rstrip("/")
    assert _objects(url, opts) == []
    v1 = _write(url, opts, N, 1)  # an empty rewrite leaves the old dataset as it was
    with pytest.raises(DatacacheError, match="no samples were written"):
        write_dataset(iter(()), url, storage_options=opts, progress=False, overwrite=True)
    with open_store(url, opts) as store:
        assert load_manifest(store) == v1
