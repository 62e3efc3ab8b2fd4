"""``datacache warm --streams FILE`` (JSON or YAML): a node warmed for a mixed dataset holds
exactly the shards the mix reads this epoch (a subset stream's other shards not fetched, a
repeated stream's shards once), and the epoch then reads nothing remote. In-process CLI, real S3."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from datacache import CacheConfig, NodeCache, StreamingDataset
from datacache.cli.main import main
from datacache.plan.epoch import build_plan
from tests.helpers.mix import EPOCH, PROPS, B, check_epoch, streams, write_streams


@pytest.fixture(scope="module")
def stream_urls(s3_server: Any) -> list[str]:
    return write_streams(s3_server)


def warm(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["warm", *args, "--json", "--quiet"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_warm_streams_fills_what_the_mix_reads(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                               tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    mix = {"streams": [{"url": u, "proportion": p, "storage_options": s3_storage_options}
                       for u, p in zip(stream_urls, PROPS)],
           "epoch_size": EPOCH, "batching": "stratified"}
    path = tmp_path / f"mix.{fmt}"
    if fmt == "yaml":
        import yaml

        path.write_text(yaml.safe_dump(mix))
    else:
        path.write_text(json.dumps(mix))
    config = CacheConfig(ram_bytes="1MB", ssd_bytes="8MB", ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"))
    dirs = ["--ram-bytes", "1MB", "--ssd-bytes", "8MB", "--ram-dir", config.ram_dir, "--ssd-dir", config.ssd_dir]
    plan = ["--streams", str(path), "--seed", "5", "--epoch", "2", "--world-size", "2", "--ranks", "0-1",
            "--workers", "2", "--batch-size", str(B)]
    out = warm([*plan, *dirs], capsys)

    with NodeCache(config) as cache:
        before = cache.stats()
        ids, keys = [], set()
        for r in range(2):
            ds = StreamingDataset(streams=streams(stream_urls, s3_storage_options), epoch_size=EPOCH, batch_size=B,
                                  batching="stratified", cache=cache, seed=5, dp_rank=r, dp_size=2)
            ds.set_epoch(2)
            for w in range(2):  # the shards this consumer's plan reads
                spec = ds._spec(2, w)
                plan_w = build_plan(ds.counts, spec, order=ds._mix.epoch_order(spec), shards_only=True)
                keys |= {ds.manifest.cache_key(s) for s in plan_w.shard_sequence}
            every = sum(len(src.manifest.shards) for src in ds.source.sources)
            ids += [i for b in ds for i in b["i"].tolist()]
            ds.close()
        after = cache.stats()
    check_epoch(ids)
    assert len(keys) < every, "stream 0 is drawn below its size: some of its shards are not read"
    assert out["fetched"] == out["selected_shards"] == out["node_shards"] == len(keys)
    assert after["remote_bytes"] - before["remote_bytes"] == 0, "the warmed node reads nothing remote"
    assert after["fetches"] - before["fetches"] == 0


def test_warm_streams_bad_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"streams": [{"url": "s3://b/a", "proportion": 0.5}, {"url": "s3://b/b", "repeat": 2}]}))
    assert main(["warm", "--streams", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--streams {path}" in err and "stream s3://b/b: repeat (absolute) mixed" in err
    path.write_text(json.dumps({"streams": [{"url": "s3://b/a", "weight": 1}]}))
    assert main(["warm", "--streams", str(path)]) == 2
    assert "stream 1 is" in capsys.readouterr().err


@pytest.mark.timeout(200)
@pytest.mark.parametrize("batching", ["stratified", "per_stream"])
def test_warm_one_node_of_a_composed_mix(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                         tmp_path: Path, capsys: pytest.CaptureFixture[str], batching: str) -> None:
    """``warm --nodes 2 --node-rank 1`` for a composed mix on 4 ranks: node 1's cache gets its
    share (fewer shards than the mix reads on both nodes), and node 1's two ranks then read the
    epoch from it with nothing remote."""
    from datacache.dist import DistInfo

    mix = {"streams": [{"url": u, "proportion": p, "storage_options": s3_storage_options}
                       for u, p in zip(stream_urls, PROPS)], "epoch_size": EPOCH, "batching": batching}
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(mix))
    config = CacheConfig(ram_bytes="1MB", ssd_bytes="8MB", ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"))
    out = warm(["--streams", str(path), "--seed", "5", "--epoch", "1", "--world-size", "4", "--nodes", "2",
                "--node-rank", "1", "--batch-size", str(B), "--ram-bytes", "1MB", "--ssd-bytes", "8MB",
                "--ram-dir", config.ram_dir, "--ssd-dir", config.ssd_dir], capsys)
    assert out["nodes"] == 2 and out["node_rank"] == 1 and out["dp_ranks"] == [2, 3]
    with NodeCache(config) as cache:
        before = cache.stats()
        keys = set()
        for r in (2, 3):
            ds = StreamingDataset(streams=streams(stream_urls, s3_storage_options), epoch_size=EPOCH, batch_size=B,
                                  batching=batching, cache=cache, seed=5,
                                  dist=DistInfo(rank=r, world_size=4, local_rank=r - 2, local_world_size=2))
            ds.set_epoch(1)
            assert ds.num_nodes == 2
            spec = ds._spec(1, 0)
            plan = build_plan(ds.counts, spec, order=ds._mix.epoch_order(spec), shards_only=True)
            keys |= {ds.manifest.cache_key(s) for s in plan.shard_sequence}
            assert sum(len(b["i"]) for b in ds) > 0
            every = sum(len(src.manifest.shards) for src in ds.source.sources)
            ds.close()
        after = cache.stats()
    assert out["fetched"] == len(keys) < every
    assert after["remote_bytes"] == before["remote_bytes"] and after["fetches"] == before["fetches"]
