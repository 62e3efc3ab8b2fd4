"""Ranged GETs of presigned URLs (``datacache._presigned``) against a real S3 server, metered at the proxy."""
from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from datacache.config import RetryConfig, TransferConfig
from datacache.errors import NotFoundError, TransientStorageError
from datacache.storage import open_store

PART = 16 * 1024
FAST_RETRY = RetryConfig(attempts=4, base_delay=0.01, max_delay=0.05, deadline=20)
RANGES = [(0, 1), (5, 105), (PART - 3, PART + 3), (3 * PART, 5 * PART + 7)]


def _write(s3_server: Any, url: str, n: int) -> bytes:
    data = os.urandom(n)
    with open_store(url, s3_server.storage_options()) as store:
        store.write_bytes("o.bin", data)
    return data


@pytest.mark.parametrize("presigned", [True, False])
def test_ranged_reads_are_the_same_bytes_either_way(presigned: bool, s3_server: Any, s3_store_url: str,
                                                    slowlink: Any) -> None:
    data = _write(s3_server, s3_store_url, 5 * PART + 7)
    link = slowlink()
    transfer = TransferConfig(part_bytes=PART, concurrency=4, presigned=presigned)
    with open_store(s3_store_url, s3_server.storage_options(link.endpoint_url), transfer=transfer) as store:
        for start, end in RANGES:
            assert store.read_range("o.bin", start, end) == data[start:end]
        assert store.read_bytes("o.bin", size=len(data)) == data
        gets = len(RANGES) + 6  # the ranges, then 6 parts
        assert link.gets == gets and store.stats()["requests"] == gets
    # every GET was of a presigned URL, or none was; never two requests for one
    assert link.snapshot()["signed_urls"] == (gets if presigned else 0)


def test_errors_of_presigned_gets_are_the_stores_errors(s3_server: Any, s3_store_url: str, slowlink: Any) -> None:
    data = _write(s3_server, s3_store_url, 2 * PART)
    link = slowlink(fail_every=2)  # every 2nd request: 503 SlowDown, as throttling
    with open_store(s3_store_url, s3_server.storage_options(link.endpoint_url), retry=FAST_RETRY) as store:
        assert store.read_range("o.bin", 10, PART) == data[10:PART]
        assert store.read_range("o.bin", PART, 2 * PART) == data[PART:]
        stats = store.stats()
        assert stats["errors"] == {"ThrottledError": 1} and stats["congestion"]["throttled"] == 1
        link.fail_every = 0
        with pytest.raises(NotFoundError) as info:
            store.read_range("nope.bin", 0, 4)
        assert store.url_of("nope.bin") in str(info.value) and "NoSuchKey" in str(info.value)
        with pytest.raises(Exception) as past_end:  # the object is smaller than the range asked for
            store.read_range("o.bin", 4 * PART, 4 * PART + 10)
        assert "expected at least" in str(past_end.value)
    assert link.snapshot()["signed_urls"] >= 4


@pytest.mark.timeout(60)
def test_a_store_that_refuses_presigned_urls_is_read_through_s3fs(s3_server: Any, s3_store_url: str,
                                                                 slowlink: Any, caplog: Any) -> None:
    data = _write(s3_server, s3_store_url, 3 * PART)
    link = slowlink(refuse_signed_urls=True)
    with caplog.at_level(logging.WARNING, logger="datacache.storage"), \
            open_store(s3_store_url, s3_server.storage_options(link.endpoint_url), retry=FAST_RETRY) as store:
        for start, end in RANGES[:3]:
            assert store.read_range("o.bin", start, end) == data[start:end]
        assert store.stats()["errors"] == {}  # a refusal is not a failed attempt: s3fs's answer counts
    # one refused presigned GET, then s3fs's for it and for every later read
    assert link.snapshot()["signed_urls"] == 1 and link.gets == 4
    assert any("refused a presigned ranged GET" in r.getMessage() and s3_store_url in r.getMessage()
               for r in caplog.records)


@pytest.mark.timeout(60)
def test_a_presigned_get_that_times_out_is_retried_not_waited_on(s3_server: Any, s3_store_url: str,
                                                                 slowlink: Any) -> None:
    """aiohttp's read timeout is a ``TimeoutError``, as is the poll of a cancellable wait
    (``_cancel.cat_range``): the GET's own timeout must end the wait, not be taken for a poll."""
    data = _write(s3_server, s3_store_url, PART)
    link = slowlink(latency_spike=(1, 2.0))  # every request: 2 s before the server sees it
    transfer = TransferConfig(part_bytes=PART, timeout=0.3)
    retry = RetryConfig(attempts=3, base_delay=0.01, max_delay=0.05, deadline=20)
    with open_store(s3_store_url, s3_server.storage_options(link.endpoint_url), transfer=transfer,
                    retry=retry) as store:
        for cancelled in (None, lambda: False):
            with pytest.raises(TransientStorageError) as info:
                store.read_range("o.bin", 0, 100, cancelled=cancelled)
            assert "3 attempts" in str(info.value) and "Timeout" in str(info.value)
        link.latency_spike = None
        assert store.read_range("o.bin", 0, 100, cancelled=lambda: False) == data[:100]
