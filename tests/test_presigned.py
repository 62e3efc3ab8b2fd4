"""Ranged GETs by presigned URL (``TransferConfig(presigned=True)``, ``datacache.store.presigned``)
against the real S3 server, through the slow-link emulator where a fault is injected: the same
bytes and the same errors as through s3fs, retries where s3fs's path retries, cancellation of a
GET in flight, and no signed URL in any message. (A connection reset mid-body: ``test_storage``.)"""
from __future__ import annotations

import os
import select
import threading
import uuid
from typing import Any

import pytest

from datacache.config import RetryConfig, TransferConfig
from datacache.errors import NotFoundError, PermissionDeniedError, ReadCancelledError
from datacache.store.storage import open_store
from tests.helpers import faults as H

PART = 16 * 1024
TRANSFER = TransferConfig(part_bytes=PART, concurrency=4, timeout=10, presigned=True)
FAST_RETRY = RetryConfig(attempts=8, base_delay=0.01, max_delay=0.05, deadline=20)


@pytest.fixture
def url(s3_server: Any) -> str:
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"


def _put(s3_server: Any, url: str, name: str, data: bytes) -> None:
    with open_store(url, s3_server.storage_options()) as store:
        store.write_bytes(name, data)


def test_ranges_and_whole_objects_come_by_presigned_url(s3_server: Any, url: str, tmp_path: Any) -> None:
    data = os.urandom(3 * PART + 123)
    _put(s3_server, url, "o.bin", data)
    with open_store(url, s3_server.storage_options(), transfer=TRANSFER, retry=FAST_RETRY) as store:
        assert store.read_range("o.bin", 0, 10) == data[:10]
        assert store.read_range("o.bin", PART - 5, 2 * PART + 7) == data[PART - 5:2 * PART + 7]
        assert store.read_bytes("o.bin", size=len(data)) == data
        target = tmp_path / "o.tmp"
        target.write_bytes(b"")
        assert store.read_into("o.bin", str(target), size=len(data)) == len(data)
        assert target.read_bytes() == data
        fast = store._presigned
        assert fast is not None and list(fast._urls) == [store._root + "o.bin"], "signed once, by path"


def test_a_grown_or_shrunk_object_is_an_integrity_error_as_through_s3fs(s3_server: Any, url: str) -> None:
    from datacache.errors import IntegrityError

    data = os.urandom(2 * PART)
    _put(s3_server, url, "o.bin", data)
    with open_store(url, s3_server.storage_options(), transfer=TRANSFER, retry=FAST_RETRY) as store:
        with pytest.raises(IntegrityError, match="larger than the expected"):
            store.read_bytes("o.bin", size=len(data) - 1)
        with pytest.raises(IntegrityError, match="expected at least"):
            store.read_bytes("o.bin", size=len(data) + PART)  # a range past the end: 416, as s3fs sees it


def test_missing_objects_and_wrong_keys_raise_s3fs_s_errors_without_the_signature(s3_server: Any, url: str) -> None:
    with open_store(url, s3_server.storage_options(), transfer=TRANSFER, retry=FAST_RETRY) as store:
        with pytest.raises(NotFoundError) as info:
            store.read_range("nope.bin", 0, 4)
        assert store.url_of("nope.bin") in str(info.value)
    _put(s3_server, url, "x.bin", b"hello")
    opts = {"key": "AKIAWRONGKEY12345", "secret": "SuperSecret-Do-Not-Leak-4f1c9e",
            "client_kwargs": {"endpoint_url": s3_server.endpoint_url, "region_name": "us-east-1"}}
    with open_store(url, opts, transfer=TRANSFER, retry=FAST_RETRY) as store:
        with pytest.raises(PermissionDeniedError) as denied:
            store.read_range("x.bin", 0, 5)
        text = str(denied.value)
        assert "X-Amz-Signature" not in text and "AKIAWRONGKEY12345" not in text
        assert store.stats()["retries"] == 0


def test_throttling_answers_are_retried_and_counted_as_throttling(s3_server: Any, url: str, slowlink: Any) -> None:
    data = os.urandom(5 * PART + 11)
    _put(s3_server, url, "o.bin", data)
    link = slowlink(fail_every=3)
    with open_store(url, s3_server.storage_options(link.endpoint_url), transfer=TRANSFER, retry=FAST_RETRY) as store:
        assert store.read_bytes("o.bin", size=len(data)) == data
        stats = store.stats()
    assert link.injected >= 1 and stats["retries"] >= 1
    assert stats["errors"].get("ThrottledError", 0) == stats["retries"]  # 503 SlowDown, not a fallback
    assert link.gets == stats["requests"], "every attempt one GET: a throttled answer is not asked again via s3fs"


@pytest.mark.timeout(60)
def test_a_get_in_flight_is_abandoned_once_cancelled_and_close_ends_the_watcher(s3_server: Any, url: str,
                                                                                 slowlink: Any) -> None:
    data = os.urandom(4 << 20)
    _put(s3_server, url, "big.bin", data)
    link = slowlink(bandwidth=256 << 10)  # 16 s for the object: cancelled long before

    def cancelled() -> bool:  # once its first 64 KiB have crossed the link: the GET is in flight
        return link.bytes_down >= 64 << 10

    with open_store(url, s3_server.storage_options(link.endpoint_url), transfer=TRANSFER, retry=FAST_RETRY) as store:
        with pytest.raises(ReadCancelledError):
            store.read_range("big.bin", 0, len(data), cancelled=cancelled)
        watcher = store._presigned._pool[2].thread
    assert link.bytes_down < len(data)
    watcher.join(30)
    assert not watcher.is_alive() and watcher.name == "datacache-presigned-cancel"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seen", ["before", "after"])
def test_a_kept_connection_the_link_cut_while_idle_is_replaced_without_a_retry(s3_server: Any, url: str,
                                                                                slowlink: Any, seen: str,
                                                                                monkeypatch: Any) -> None:
    """GETs reuse one kept-alive connection; once the link has cut it (idle), the next GET opens
    a new one at once: the same bytes, no retry and no error counted, nothing through s3fs.
    ``seen``: the cut found before the request (the idle socket is readable), or only once the
    request failed on it (the check made blind)."""
    if seen == "after":
        from datacache.store import presigned
        monkeypatch.setattr(presigned, "_dropped", lambda conn: conn.sock is None)
    data = os.urandom(3 * PART)
    _put(s3_server, url, "o.bin", data)
    link = slowlink()
    with open_store(url, s3_server.storage_options(link.endpoint_url), transfer=TRANSFER, retry=FAST_RETRY) as store:
        for k in range(3):
            assert store.read_range("o.bin", k, k + 100) == data[k:k + 100]
        assert link.snapshot()["connections"] == 1, "one connection kept for the GETs one after another"
        conns = store._presigned._pool[1]
        idle = [c for cs in conns._idle.values() for c in cs]
        assert len(idle) == 1
        link.throttle(0)  # cut every open connection, no 503 window
        poller = select.poll()
        poller.register(idle[0].sock, select.POLLIN)
        assert poller.poll(20_000), "the cut reached the kept socket (readable: its end)"
        assert store.read_range("o.bin", 7, PART + 7) == data[7:PART + 7]
        stats = store.stats()
    assert stats["retries"] == 0 and not stats["errors"], stats
    assert link.snapshot()["connections"] == 2 and link.gets == stats["requests"] == 4


def test_a_forked_child_reads_through_its_own_pool(s3_server: Any, url: str) -> None:
    from tests.helpers.cache_worker import in_child

    data = os.urandom(2 * PART + 5)
    _put(s3_server, url, "o.bin", data)
    with open_store(url, s3_server.storage_options(), transfer=TRANSFER, retry=FAST_RETRY) as store:
        assert store.read_range("o.bin", 0, 10) == data[:10]  # the parent's pool and URL made
        assert in_child(lambda: store.read_bytes("o.bin", size=len(data)) == data)
        assert store.read_range("o.bin", 5, 20) == data[5:20]


def test_a_proxy_or_client_certificate_leaves_ranged_gets_to_s3fs(s3_server: Any, url: str, monkeypatch: Any) -> None:
    from datacache.store.presigned import usable

    assert usable({}) and usable({"config_kwargs": {"retries": {}}})
    assert not usable({"config_kwargs": {"proxies": {"https": "http://proxy:3128"}}})
    assert not usable({"config_kwargs": {"client_cert": "/etc/cert.pem"}})
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with open_store(url, s3_server.storage_options(), transfer=TRANSFER, retry=FAST_RETRY) as store:
        store._ensure()
        assert store._presigned is None


def test_extra_request_headers_leave_ranged_gets_to_s3fs() -> None:
    from datacache.store.presigned import usable

    assert not usable({"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "k" * 32}})
    assert not usable({"s3_additional_kwargs": {"RequestPayer": "requester"}})
    assert not usable({"requester_pays": True})
    assert usable({"s3_additional_kwargs": {}, "requester_pays": False})
    assert TransferConfig().presigned, "on by default: S3 stores read by presigned URL where usable"


def _signer(s3_server: Any, url: str, link: Any, *, spoilt: Any) -> tuple[str, Any]:
    """(the path of ``url``'s object o.bin, a signer of real URLs through ``link`` whose signature is
    spoilt while ``spoilt()``)."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_server.storage_options(link.endpoint_url))

    def sign(p: str, seconds: int) -> str:
        good = fs.sign(p, expiration=seconds)
        return good.replace("Signature=", "Signature=00") if spoilt() else good
    return f"{s3_server.bucket}/{url.split('/')[3]}/o.bin", sign


def _ranges(sign: Any) -> Any:
    from datacache.store.presigned import PresignedRanges

    return PresignedRanges(sign, connect_timeout=5, read_timeout=10, pool_size=2)


def test_a_store_that_refuses_presigned_gets_is_left_to_s3fs_after_a_few(s3_server: Any, url: str,
                                                                         slowlink: Any) -> None:
    """A store that answers 403 to every presigned GET (here: URLs whose signature is wrong) costs
    ``GIVE_UP`` round trips, then none: every later GET goes to s3fs at once (None)."""

    from datacache.store.presigned import GIVE_UP

    _put(s3_server, url, "o.bin", b"0123456789")
    link = slowlink()
    path, signer = _signer(s3_server, url, link, spoilt=lambda: True)
    ranges = _ranges(signer)
    try:
        link.reset_counters()
        for _ in range(GIVE_UP + 5):
            assert ranges.get(path, 0, 4) is None
        assert ranges.off and link.gets == GIVE_UP
    finally:
        ranges.close()


def test_a_signing_failure_leaves_ranged_gets_to_s3fs(s3_server: Any) -> None:
    def sign(p: str, seconds: int) -> str:
        raise RuntimeError("no credentials to sign with")

    ranges = _ranges(sign)
    try:
        assert ranges.get("bucket/o.bin", 0, 4) is None and ranges.off
    finally:
        ranges.close()


def test_after_a_served_get_a_403_signs_every_url_again_and_never_gives_up(s3_server: Any, url: str,
                                                                           slowlink: Any) -> None:
    """Temporary credentials renewed after the URLs were signed: the 403s that follow drop every
    URL kept (each is signed again), and a store that served presigned GETs is not given up on."""

    from datacache.store.presigned import GIVE_UP

    _put(s3_server, url, "o.bin", b"0123456789")
    link = slowlink()
    spoilt = [False]
    signed = []

    def spoil() -> bool:
        signed.append(True)
        return spoilt[0]

    path, signer = _signer(s3_server, url, link, spoilt=spoil)
    ranges = _ranges(signer)
    try:
        assert ranges.get(path, 2, 6) == b"2345"
        spoilt[0] = True
        ranges.forget(path)  # its URL as if signed with credentials that have expired since
        for _ in range(GIVE_UP + 2):
            assert ranges.get(path, 0, 4) is None  # each a fresh URL (signed again), refused
        assert not ranges.off and len(signed) == GIVE_UP + 3
        spoilt[0] = False
        assert ranges.get(path, 0, 4) == b"0123"
    finally:
        ranges.close()


def _read_in_thread(store: Any, cancelled: Any) -> tuple[threading.Thread, list[BaseException | bytes]]:
    got: list[BaseException | bytes] = []

    def read() -> None:
        try:
            got.append(store.read_range("o.bin", 0, 10, cancelled=cancelled))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            got.append(exc)

    thread = threading.Thread(target=read, name="test-presigned-read")
    thread.start()
    return thread, got


@pytest.mark.timeout(60)
def test_a_get_waiting_for_its_answer_is_abandoned_once_cancelled(s3_server: Any, url: str, slowlink: Any) -> None:
    """The watcher shuts a GET's socket from the moment its connection is up, not only while its body
    is read: here the link holds the request 30 s before the server sees it."""
    _put(s3_server, url, "o.bin", b"0123456789")
    link = slowlink(latency_spike=(1, 30.0))
    flag = threading.Event()
    with open_store(url, s3_server.storage_options(link.endpoint_url), transfer=TRANSFER, retry=FAST_RETRY) as store:
        thread, got = _read_in_thread(store, flag.is_set)
        H.wait_for(lambda: link.gets >= 1, 20, "the GET to be waiting for its answer")
        flag.set()
        thread.join(20)
        assert not thread.is_alive() and isinstance(got[0], ReadCancelledError), got


@pytest.mark.timeout(60)
def test_close_ends_a_get_in_flight_that_nothing_cancels(s3_server: Any, url: str, slowlink: Any) -> None:
    """A store's close() shuts every presigned GET in flight, even one read with no cancel flag,
    so that nothing of the closed store is left transferring (a Ctrl-C left a partial copy's temp
    file behind while a GET waited for its answer)."""
    _put(s3_server, url, "o.bin", b"0123456789")
    link = slowlink(latency_spike=(1, 30.0))
    store = open_store(url, s3_server.storage_options(link.endpoint_url), transfer=TRANSFER, retry=FAST_RETRY)
    thread, got = _read_in_thread(store, None)
    H.wait_for(lambda: link.gets >= 1, 20, "the GET to be waiting for its answer")
    store.close()
    thread.join(20)
    assert not thread.is_alive() and isinstance(got[0], Exception), got
