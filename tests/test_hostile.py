"""Hostile input at the dataset level: unsafe shard names, symlinks out of the dataset, unsafe tar
members, zstd bombs, absurd declared sizes, cache directories that are not ours, credentials.
Nothing outside the cache directories is ever written, memory stays bounded, and credentials appear
in no error, log record, repr, stats or CLI output. Reader-level cases (every unsafe tar member
kind, bombs with and without a content size, crafted indexes) are in test_readers.py.
"""
from __future__ import annotations

import io
import json
import logging
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tarfile
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

from datacache import (
    CacheError,
    IntegrityError,
    Manifest,
    ManifestError,
    NodeCache,
    NotFoundError,
    ReaderError,
    ShardInfo,
    StreamingDataset,
    open_store,
)
from datacache.hashing import hash_bytes
from tests.helpers import faults as H
from tests.helpers.as_user import give_away
from tests.helpers.crafted import bomb_frame, craft_dcz

SIZE = 1000
FORK = mp.get_context("fork")


def publish(url: str, opts: dict[str, Any] | None, fmt: str, schema: dict[str, str],
            shards: list[tuple[str, bytes, int]], hashes: dict[str, str] | None = None,
            sizes: dict[str, int] | None = None) -> Manifest:
    """Upload ``(name, bytes, samples)`` shards and a manifest declaring them (hashes and sizes may
    be overridden: a hostile manifest)."""
    infos = []
    with open_store(url, opts) as store:
        for name, data, samples in shards:
            store.write_bytes(name, data)
            infos.append(ShardInfo(name, (sizes or {}).get(name, len(data)), samples,
                                   (hashes or {}).get(name, hash_bytes(data))))
        m = Manifest(format=fmt, schema=schema, shards=tuple(infos))
        store.write_bytes("manifest.json", m.to_json().encode())
    return m


# --------------------------------------------------------------------------- shard names
@pytest.mark.parametrize("backend", ["file", "s3"])
@pytest.mark.parametrize("name", ["../escape.dcz", "/etc/passwd", "a\\..\\b.dcz", "a\x00b.dcz"],
                         ids=["dotdot", "absolute", "backslash", "nul"])
def test_unsafe_shard_names_are_rejected(name: str, backend: str, request: pytest.FixtureRequest,
                                         tmp_path: Path) -> None:
    if backend == "s3":
        url, opts = request.getfixturevalue("make_s3_url")(), request.getfixturevalue("s3_storage_options")
    else:
        url, opts = f"file://{tmp_path}/data/ds/", None
    ok = ShardInfo("ok.dcz", 1, 1, "xxh3_128:" + "0" * 32)
    doc = Manifest(format="zstd", schema={"i": "int"}, shards=(ok,)).to_dict()
    doc["shards"][0]["name"] = name
    with open_store(url, opts) as store:
        store.write_bytes("manifest.json", json.dumps(doc).encode())
        manifest_url = store.url_of("manifest.json")
    before = H.tree(tmp_path)
    with pytest.raises(ManifestError, match="unsafe shard name") as info:
        StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path / "cache"))
    assert info.value.url == manifest_url
    assert {k: v for k, v in H.tree(tmp_path).items() if not k.startswith("cache")} == before


# --------------------------------------------------------------------------- symlinks
@pytest.mark.parametrize("target", ["other-bytes", "same-bytes"])
def test_symlinked_shard_pointing_outside_the_dataset(target: str, tmp_path: Path) -> None:
    """On file:// the OS follows a symlink like any reader would; the manifest's size and hash
    decide: the bytes are copied into a new regular file inside the cache, or refused. Nothing
    outside the cache directories is written, and no cache file is ever a link."""
    url, n = f"file://{tmp_path}/ds", 40
    m = H.write(url, None, n, SIZE, shard_bytes=8 * SIZE)
    victim = tmp_path / "ds" / m.shards[1].name
    outside = tmp_path / "outside"
    outside.mkdir()
    real = victim.read_bytes()
    secret = bytes(b ^ 0xFF for b in real) if target == "other-bytes" else real  # same size either way
    (outside / "target").write_bytes(secret)
    victim.unlink()
    victim.symlink_to(outside / "target")
    before = {d: H.tree(tmp_path / d) for d in ("ds", "outside")}

    ds = StreamingDataset(url, cache=H.cache_config(tmp_path / "cache", ram="1MB", ssd="1MB"), on_error="raise")
    if target == "other-bytes":
        with pytest.raises(IntegrityError) as info:
            list(ds)
        assert info.value.url == url + "/" + m.shards[1].name
        assert ds.cache.contains(ds.manifest.cache_key(1)) is None
    else:
        H.assert_exactly_once(ds, n, SIZE)
        assert ds.cache.contains(ds.manifest.cache_key(1)) == "ram"
    cache_root = tmp_path / "cache"
    for dirpath, dirnames, filenames in os.walk(cache_root):
        for f in dirnames + filenames:
            p = Path(dirpath, f)
            assert not p.is_symlink() and p.resolve().is_relative_to(cache_root.resolve()), p
            if p.is_file() and p.stat().st_size == len(secret) and target == "other-bytes":
                assert p.read_bytes() != secret, f"refused bytes were kept at {p}"
    assert {d: H.tree(tmp_path / d) for d in ("ds", "outside")} == before
    ds.close()
    ds.cache.close()


# --------------------------------------------------------------------------- tar members
def _tar(members: list[tuple[str, bytes]], link: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return buf.getvalue()


@pytest.mark.parametrize("evil", ["../../evil.cls", "/tmp/evil.cls", "symlink"])
def test_tar_shard_with_unsafe_members(evil: str, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ds"
    good = _tar([(f"{i:06d}.cls", str(i).encode()) for i in range(4)])
    bad_members = [("000004.cls", b"4")] + ([] if evil == "symlink" else [(evil, b"pwned")])
    bad = _tar(bad_members, link="000005.cls" if evil == "symlink" else None)
    m = publish(url, None, "tar", {}, [("a.tar", good, 4), ("b.tar", bad, 2 if evil != "symlink" else 1)])
    before = H.tree(tmp_path)
    ds = StreamingDataset(url, cache=H.cache_config(tmp_path / "cache"), shuffle=False)
    with pytest.raises(ReaderError, match="unsafe|not a regular file") as info:
        list(ds)
    assert info.value.url == url + "/b.tar" and info.value.__cause__ is not None
    ds.close()
    ds = StreamingDataset(url, cache=ds.cache, shuffle=False, on_error="skip")
    with pytest.warns(UserWarning, match="skipping shard"):
        assert [bytes(s["cls"]) for s in ds] == [b"0", b"1", b"2", b"3"]
    after = {k: v for k, v in H.tree(tmp_path).items() if not k.startswith("cache")}
    assert after == before and not any("evil" in k for k in H.tree(tmp_path))  # nothing was extracted
    assert m.shards[1].name == "b.tar"
    ds.close()
    ds.cache.close()


# --------------------------------------------------------------------------- bounded memory
def _capped(fn: Callable[[], Any], headroom: int, conn: Any) -> None:
    def kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    resource.setrlimit(resource.RLIMIT_AS, (kib("VmSize") * 1024 + headroom, resource.RLIM_INFINITY))
    start = kib("VmHWM")
    try:
        out = fn()
        conn.send(("no error", repr(out), (kib("VmHWM") - start) * 1024))
    except BaseException as exc:
        conn.send((type(exc).__name__, f"{exc}\n{traceback.format_exc()}", (kib("VmHWM") - start) * 1024))


def run_capped(fn: Callable[[], Any], headroom: int = 2 << 30, timeout: float = 60) -> tuple[str, str, int]:
    """Run ``fn`` in a forked child whose address space may grow by ``headroom`` bytes only.
    Returns (outcome: exception class name or "no error", text, resident memory growth in bytes)."""
    parent, child = FORK.Pipe(duplex=False)
    proc = FORK.Process(target=_capped, args=(fn, headroom, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(timeout), "the capped child did not answer"
        return parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _epoch(url: str, opts: dict[str, Any] | None, base: Path, refused: bool = False) -> Any:
    ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(base, ram="64MB", ssd="64MB"))
    try:
        return len(list(ds))
    finally:
        requests, entries = ds.store.stats()["requests"], ds.cache.entries()
        ds.close()
        ds.cache.close()
        if refused and (requests > 32 or entries):  # gave up at once, and nothing was admitted
            raise AssertionError(f"{requests} requests, entries {entries}")


@pytest.mark.timeout(120)
def test_shard_declaring_100gb_is_refused_quickly_in_bounded_memory(s3_server: Any, make_s3_url: Any,
                                                                   tmp_path: Path) -> None:
    url, opts = make_s3_url(), s3_server.storage_options()
    real = b"x" * 50_000
    m = publish(url, opts, "zstd", {"x": "bytes"}, [("huge.dcz", real, 1)], sizes={"huge.dcz": 100 * 10**9})
    assert m.total_bytes == 100 * 10**9
    outcome, text, growth = run_capped(lambda: _epoch(url, opts, tmp_path / "cache", refused=True))
    assert outcome == "IntegrityError", text
    assert f"{url}huge.dcz" in text and "expected at least" in text
    assert growth < 128 << 20, f"resident memory grew by {growth} bytes"
    assert H.leftovers(tmp_path / "cache" / "ram" / "data", tmp_path / "cache" / "ssd" / "data") == []


@pytest.mark.timeout(120)
def test_zstd_bomb_in_a_dataset_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    declared = 70_000
    bomb = craft_dcz(tmp_path / "bomb.dcz", [(bomb_frame(512 << 20, declared), declared, [(0, declared)])])
    url = f"file://{tmp_path}/ds"
    publish(url, None, "zstd", {"x": "bytes"}, [("bomb.dcz", Path(bomb).read_bytes(), 1)])
    outcome, text, growth = run_capped(lambda: _epoch(url, None, tmp_path / "cache"))
    assert outcome == "ReaderError", text
    assert f"{url}/bomb.dcz" in text and "decompress" in text
    assert growth < 128 << 20, f"resident memory grew by {growth} bytes"


# --------------------------------------------------------------------------- cache directories
@pytest.mark.parametrize("which", ["ssd/control", "ssd/control/locks", "ssd/data", "ram/data"])
def test_cache_dir_owned_by_another_user_is_refused(which: str, tmp_path: Path) -> None:
    path = tmp_path / which
    for p in reversed([path, *path.parents]):
        if p.is_relative_to(tmp_path) and p != tmp_path:
            p.mkdir(mode=0o700, exist_ok=True)
    owner = give_away(path)  # root: chown; a normal user: tests/test_as_user.py
    with pytest.raises(CacheError, match=f"owned by uid {owner},") as info:
        NodeCache(H.cache_config(tmp_path, ram="1MB", ssd="1MB"))
    assert info.value.url == str(path)


def test_symlinked_control_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "ssd").mkdir(mode=0o700)
    (tmp_path / "ssd" / "control").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CacheError, match="symlink"):
        NodeCache(H.cache_config(tmp_path, ram="1MB", ssd="1MB"))
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_pass_through_dir_is_private(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with NodeCache(H.cache_config(tmp_path, ram=0, ssd=0)) as cache:  # both tiers off: control/pass
            assert cache.pass_dir == str(tmp_path / "ssd" / "control" / "pass")
            assert os.stat(cache.pass_dir).st_mode & 0o777 == 0o700
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- credentials
@pytest.mark.timeout(120)
def test_credentials_never_appear_in_errors_logs_repr_stats_or_cli(s3_server: Any, make_s3_url: Any, slowlink: Any,
                                                                   tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from datacache import RetryConfig

    url, n = make_s3_url(), 40
    m = H.write(url, s3_server.storage_options(), n, SIZE, shard_bytes=8 * SIZE)
    with open_store(url, s3_server.storage_options()) as store:
        store.delete(m.shards[3].name)
    key, secret = s3_server.access_key, s3_server.secret_key
    link = slowlink(fail_every=3)  # retries: DEBUG records about each failed attempt
    opts = s3_server.storage_options(link.endpoint_url)
    caplog.set_level(logging.DEBUG)
    ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path),
                          retry=RetryConfig(attempts=8, base_delay=0.01, max_delay=0.05, deadline=20))
    with pytest.raises(NotFoundError) as info:  # the deleted shard, named by its URL
        list(ds)
    assert info.value.url is not None and info.value.url.endswith(m.shards[3].name)
    texts = {"error": "".join(traceback.format_exception(info.value)), "repr": repr(ds), "stats": repr(ds.stats()),
             "datacache logs": "\n".join(f"{r.getMessage()} {r.args}" for r in caplog.records
                                         if r.name.startswith("datacache")),
             "logs at INFO and above": "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)}
    assert "retrying" in texts["datacache logs"] and ds.stats()["storage_retries"] > 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DATACACHE_"))}
    cli = subprocess.run([sys.executable, "-m", "datacache.cli", "stat", "--json", "--storage-options",
                          json.dumps(opts), "--ram-dir", str(tmp_path / "ram"), "--ssd-dir", str(tmp_path / "ssd")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["tiers"]["ram"]["entries"] > 0
    texts["cli"] = cli.stdout + cli.stderr
    for what, text in texts.items():
        assert secret not in text and key not in text, f"a credential appears in the {what}"
    # Every record (botocore's own DEBUG dumps included) is free of the secret; botocore's DEBUG
    # request dumps do show the access key id in the Authorization header (see README).
    assert secret not in caplog.text
    ds.close()
    ds.cache.close()
