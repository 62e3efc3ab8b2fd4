"""Shared by the mixed-dataset tests (tests/test_mix*.py): three streams on the S3 server and
the per-epoch count check. Sample ``i`` of stream ``s`` has id ``1000 s + i``."""
from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import numpy as np

from datacache import Stream, write_dataset

SIZES = (120, 60, 24)  # web: drawn below its size; code: 1.8 x; math: 3 x
PROPS = (0.25, 0.45, 0.3)
EPOCH = 240
DRAWS = (60, 108, 72)
B = 8


def write_stream(server: Any, name: str, n: int, base: int, field: str = "x") -> str:
    url = f"s3://{server.bucket}/{uuid.uuid4().hex}/{name}/"
    samples = ({"i": base + i, field: np.full(4, base + i, dtype=np.int32)} for i in range(n))
    m = write_dataset(samples, url, shard_bytes=500, storage_options=server.storage_options(), progress=False)
    assert len(m.shards) >= 3, "several shards per stream"
    return url


def streams(urls: list[str], opts: dict[str, Any], props: tuple[float, ...] = PROPS) -> list[Stream]:
    return [Stream(u, proportion=p, storage_options=opts) for u, p in zip(urls, props)]


def stream_of(i: int) -> int:
    return i // 1000


def write_streams(server: Any) -> list[str]:
    """The three streams (web, code, math) of ``SIZES`` samples on ``server``."""
    return [write_stream(server, name, n, 1000 * s) for s, (name, n) in enumerate(zip(("web", "code", "math"), SIZES))]


def check_epoch(ids: list[int]) -> Counter[int]:
    """Exact per-stream counts; each sample of a stream drawn k times its size read floor/ceil(k) times."""
    per = Counter(ids)
    assert Counter(stream_of(i) for i in ids) == dict(enumerate(DRAWS))
    for s, (n, d) in enumerate(zip(SIZES, DRAWS)):
        times = Counter(per[1000 * s + i] for i in range(n))
        lo, hi = d // n, -(-d // n)
        assert set(times) <= {lo, hi}, f"stream {s}: samples read {dict(times)} times, expected {lo} or {hi}"
    return per
