"""Shared fixtures: one SeaweedFS S3 server per test session, fresh prefixes, SlowLink proxies.

The S3 server is a real ``weed mini`` process (tools/s3server.py) on free loopback ports; it starts
in ~1-10 s, is shared by the whole session and is stopped even when tests fail.

Ctrl-C: a shell without job control starts its background commands with SIGINT ignored, and a
child inherits that, so the tests that interrupt a loader, the warm command or the slow link with
SIGINT would see nothing happen. The suite's processes restore Python's handler at import, so the
subprocesses they start get SIGINT's default (Python's KeyboardInterrupt) however CI was started.
"""
from __future__ import annotations

import signal
import uuid
from typing import Any, Callable, Iterator

import pytest

from tests.helpers import faults as H
from tools.s3server import SeaweedServer
from tools.slowlink import SlowLink

TEST_BUCKET = "datacache-test"

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # see the module docstring
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedServer]:
    """The session's SeaweedFS server (bucket ``datacache-test``, credentials enforced)."""
    server = SeaweedServer(bucket=TEST_BUCKET)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_s3_url(s3_server: SeaweedServer) -> Callable[[], str]:
    """Factory of fresh, unique, empty prefixes ``s3://<bucket>/<uuid>/``."""
    return lambda: f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"


@pytest.fixture
def s3_store_url(make_s3_url: Callable[[], str]) -> str:
    """A fresh unique prefix ``s3://<bucket>/<uuid>/`` on the session server."""
    return make_s3_url()


@pytest.fixture
def s3_storage_options(s3_server: SeaweedServer) -> dict[str, Any]:
    """storage_options (key, secret, client_kwargs.endpoint_url) for the session server."""
    return s3_server.storage_options()


@pytest.fixture
def slowlink(s3_server: SeaweedServer) -> Iterator[Callable[..., SlowLink]]:
    """Factory: ``slowlink(bandwidth=..., latency=..., fail_every=...)`` starts a SlowLink in front of
    the session server; use ``s3_server.storage_options(link.endpoint_url)``. All are stopped after
    the test."""
    links: list[SlowLink] = []

    def make(**kwargs: Any) -> SlowLink:
        kwargs.setdefault("bandwidth", 0)
        kwargs.setdefault("latency", 0.0)
        link = SlowLink("127.0.0.1", s3_server.port, **kwargs).start()
        links.append(link)
        return link

    try:
        yield make
    finally:
        for link in links:
            link.stop()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 32 MB tmpfs mounted for the test: as root, or in a user namespace (tests/test_as_user.py
    runs these tests so as a normal user); skipped where mounting is not allowed."""
    import subprocess

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def cache(tmp_path):
    """A fresh node cache (RAM 4 MB, SSD 8 MB) in the test's directory, shared by every dataset of
    the test (one LMDB environment per path and process); closed afterwards."""
    from datacache import CacheConfig, NodeCache

    c = NodeCache(CacheConfig(ram_bytes="4MB", ssd_bytes="8MB", ram_dir=str(tmp_path / "ram"),
                              ssd_dir=str(tmp_path / "ssd")))
    yield c
    c.close()


@pytest.fixture
def small_dataset(s3_server: SeaweedServer, make_s3_url: Callable[[], str]) -> tuple[str, dict[str, Any], Any]:
    """A fresh 40-sample dataset on the session server: 5 shards of 8 samples, sample ``i`` being
    ``{"i": i, "data": tests.helpers.faults.payload(i, 1000)}``. Returns (url, storage_options, manifest)."""
    url, opts = make_s3_url(), s3_server.storage_options()
    return url, opts, H.write(url, opts, 40, 1000, shard_bytes=8 * 1000)



# --- Test tiers -------------------------------------------------------------------------------------------
# `make test` runs everything. `make test-fast` runs the fast tier, `-m "not server and not subprocess"`: the
# tests that need neither the S3 server nor a process of their own (the edit-run loop). A test is in the
# `server` tier when it uses a server fixture, and in the `subprocess` tier when tests/helpers/tiers.py lists
# it (SPAWNING) or it is marked `@pytest.mark.subprocess`. In the fast tier the list is checked, not trusted:
# a test there that starts a process (fork, spawn, subprocess) fails, naming what to mark.
SERVER_FIXTURES = {"s3_server", "make_s3_url", "s3_store_url", "s3_storage_options", "slowlink", "small_dataset",
                   "small_tmpfs"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "server: uses the session's S3 server (not in `make test-fast`)")
    config.addinivalue_line("markers", "subprocess: starts processes: DataLoader workers, the CLI, torchrun "
                            "(not in `make test-fast`)")
    # --dist loadfile hands the files out in collection order, which pytest_collection_modifyitems sets
    # (heaviest first); xdist's own reorder (most tests first) would send the slow 1-3-test files last
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.helpers.tiers import spawning, weight_order

    items[:] = [items[i] for i in weight_order([item.nodeid for item in items])]  # heaviest files first

    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        # a server fixture, or a backend parameter "s3" (whose fixture asks for the server itself)
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or "s3" in params.values():
            item.add_marker(pytest.mark.server)
        if spawning(item.nodeid):
            item.add_marker(pytest.mark.subprocess)


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """In `make test-fast` (DATACACHE_FAST_TIER=1), a test of the fast tier may start no process."""
    import os

    node = request.node
    checked = os.environ.get("DATACACHE_FAST_TIER") or os.environ.get("DATACACHE_TIER_PROBE")
    if not checked or node.get_closest_marker("subprocess") or node.get_closest_marker("server"):
        yield
        return
    from tests.helpers.tiers import forbid_processes

    with forbid_processes(node.nodeid):
        yield
