"""``DATACACHE_*`` environment variables: one resolution (arguments/flags > environment > defaults)
for the library and the command line, so ``datacache warm`` fills the cache a default
``StreamingDataset`` in the same environment reads. Real subprocesses, the SeaweedFS S3 server.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datacache import CacheConfig, write_dataset

ROOT = Path(__file__).resolve().parents[1]
N_SHARDS, PER_SHARD, SAMPLE_BYTES = 6, 4, 2000

# In a fresh process with the environment under test: a default CacheConfig and the cache of a
# default StreamingDataset (no cache= argument), then one epoch; prints what they resolved to.
_EPOCH = """
import json, sys
from datacache import CacheConfig, StreamingDataset
url, opts = sys.argv[1], json.loads(sys.argv[2])
cfg = CacheConfig()
ds = StreamingDataset(url, storage_options=opts)
before = ds.cache.stats()
n = sum(1 for _ in ds)
after = ds.cache.stats()
c = ds.cache.config
print(json.dumps({"default": [cfg.ram_dir, cfg.ssd_dir, cfg.ram_bytes, cfg.ssd_bytes],
                  "dataset": [c.ram_dir, c.ssd_dir, c.ram_bytes, c.ssd_bytes], "samples": n,
                  "remote_bytes": after["remote_bytes"] - before["remote_bytes"],
                  "fetches": after["fetches"] - before["fetches"]}))
ds.close()
ds.cache.close()
"""


def _env(s3: Any, base: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(AWS_ENDPOINT_URL=s3.endpoint_url, AWS_ACCESS_KEY_ID=s3.access_key,
               AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_DEFAULT_REGION="us-east-1",
               DATACACHE_RAM_DIR=str(base / "ram"), DATACACHE_SSD_DIR=str(base / "ssd"),
               DATACACHE_RAM_BYTES="3MB", DATACACHE_SSD_BYTES="7MB")
    return env


def _run(args: list[str], env: dict[str, str]) -> Any:
    p = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    return json.loads(p.stdout)


@pytest.fixture
def dataset(s3_server: Any) -> str:
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
    rng = np.random.default_rng(uuid.uuid4().int)  # new bytes, so a new dataset id: never cached already
    samples = [{"x": i, "data": rng.bytes(SAMPLE_BYTES)} for i in range(N_SHARDS * PER_SHARD)]
    m = write_dataset(samples, url, shard_bytes=PER_SHARD * SAMPLE_BYTES,
                      storage_options=s3_server.storage_options(), progress=False)
    assert len(m.shards) == N_SHARDS
    return url


def test_default_cache_config_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DATACACHE_RAM_DIR", str(tmp_path / "r"))
    monkeypatch.setenv("DATACACHE_RAM_BYTES", "2MB")
    monkeypatch.setenv("DATACACHE_POLICY", "lru")
    cfg = CacheConfig()
    assert (cfg.ram_dir, cfg.ram_bytes, cfg.policy) == (str(tmp_path / "r"), 2_000_000, "lru")
    # explicit arguments win over the environment, field by field
    cfg = CacheConfig(ram_bytes="1MB", ram_dir=str(tmp_path / "x"))
    assert (cfg.ram_dir, cfg.ram_bytes, cfg.policy) == (str(tmp_path / "x"), 1_000_000, "lru")
    monkeypatch.setenv("DATACACHE_SSD_BYTES", "plenty")
    with pytest.raises(ValueError, match="DATACACHE_SSD_BYTES"):
        CacheConfig()
    assert CacheConfig(ssd_bytes=0).ssd_bytes == 0  # a bad variable of a field given explicitly is unused


def test_cli_and_default_dataset_resolve_the_same_cache(s3_server: Any, dataset: str, tmp_path: Path) -> None:
    env = _env(s3_server, tmp_path)
    opts = json.dumps(s3_server.storage_options())
    got = _run(["-c", _EPOCH, dataset, opts], env)
    expected = [str(tmp_path / "ram"), str(tmp_path / "ssd"), 3_000_000, 7_000_000]
    assert got["default"] == expected and got["dataset"] == expected
    st = _run(["-m", "datacache.cli", "stat", "--json"], env)
    assert [st["tiers"]["ram"]["dir"], st["tiers"]["ssd"]["dir"]] == expected[:2]
    # the epoch above filled the cache the CLI sees
    assert st["remote_bytes"] == got["remote_bytes"] > 0 and len(st["datasets"]) == 1


def test_warm_then_default_dataset_epoch_reads_nothing_remote(s3_server: Any, dataset: str,
                                                              tmp_path: Path) -> None:
    env = _env(s3_server, tmp_path)
    warm = _run(["-m", "datacache.cli", "warm", dataset, "--json", "--quiet"], env)
    assert warm["fetched"] == N_SHARDS and warm["budget_ram"] == 3_000_000
    got = _run(["-c", _EPOCH, dataset, json.dumps(s3_server.storage_options())], env)
    assert got["samples"] == N_SHARDS * PER_SHARD
    assert got["remote_bytes"] == 0 and got["fetches"] == 0
