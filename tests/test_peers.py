"""The peer tier in one process: settings, signatures, placement, the server's refusals and ranges,
and the reader's fallbacks from faulty peers (``tests/helpers/faulty_peer.py``: corrupt bytes, 5xx,
404, a stall, a cut transfer, a slow holder that gets hedged). The datasets are local directories
(a real ``file://`` store), the caches real node caches; the multi-node runs are in
tests/test_peers_nodes.py."""
from __future__ import annotations

import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datacache import CacheConfig, PeerConfig
from datacache.dist import DistInfo
from datacache.peer.auth import HEADER, Signer
from datacache.peer.membership import exchange, resolve
from datacache.peer.placement import fit, name_hashes, owners, rendezvous
from datacache.peer.server import serve
from datacache.peer.tier import PeerTier
from datacache.read.shard_source import ShardSource
from tests.helpers import faults as H
from tests.helpers.faulty_peer import FaultyPeer
from tools.s3server import free_ports

TOKEN = "t0ken-" + "x" * 20


def _dataset(tmp_path: Path) -> tuple[str, Any]:
    url = str(tmp_path / "ds")
    return url, H.write(url, None, 64, 2000, shard_bytes=8 * 2000)


def _source(tmp_path: Path, url: str, node: str) -> ShardSource:
    return ShardSource.open(url, cache=CacheConfig(ram_bytes="4MB", ssd_bytes=0, ram_dir=str(tmp_path / node / "ram"),
                                                   ssd_dir=str(tmp_path / node / "ssd")))


def _tier(src: ShardSource, peers: list[str], me: int, owner: int | None, **cfg: Any) -> PeerTier:
    m = resolve(PeerConfig(peers=peers, token=TOKEN, node_rank=me, **cfg), DistInfo())
    assert m is not None
    shards = src.manifest.shards
    own = None if owner is None else np.full(len(shards), owner)
    src.peers = PeerTier(m, src.cache, src.manifest.dataset_id, [s.name for s in shards], [s.bytes for s in shards],
                         [s.hash for s in shards], owner=own)
    return src.peers


def _peer_stats(src: ShardSource) -> dict[str, int]:
    st = src.cache.stats()
    return {k: int(st.get(f"peer_{k}", 0)) for k in ("bytes_from_peers", "bytes_from_store", "corrupt",
                                                      "fallbacks", "hedged", "refused", "bytes_served")}


def test_settings_resolve_argument_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not PeerConfig().enabled  # nothing set: the tier is off
    monkeypatch.setenv("DATACACHE_PEERS", "10.0.0.1:7761, 10.0.0.2:7761")
    monkeypatch.setenv("DATACACHE_PEER_TOKEN", "sekrit-token")
    cfg = PeerConfig()
    assert cfg.peers == ("10.0.0.1:7761", "10.0.0.2:7761") and cfg.token == "sekrit-token" and cfg.enabled
    assert "sekrit" not in repr(cfg), repr(cfg)
    assert PeerConfig(peers="off").enabled is False
    assert PeerConfig(peers=["h:1"], token="a").peers == ("h:1",)
    m = resolve(cfg, DistInfo(3, 4, 1, 2))  # rank 3 of 2 ranks a node: node 1
    assert m is not None and m.me == 1 and m.bind == ("10.0.0.2", 7761) and "sekrit" not in repr(m)
    assert resolve(PeerConfig(bind="127.0.0.5"), DistInfo()).bind == ("127.0.0.5", 7761)  # type: ignore[union-attr]
    monkeypatch.delenv("DATACACHE_PEER_TOKEN")
    with pytest.raises(ValueError, match="DATACACHE_PEER_TOKEN"):
        PeerConfig()
    with pytest.raises(ValueError, match="host:port"):
        PeerConfig(peers="nohost", token="a")
    with pytest.raises(ValueError, match="lists 2 nodes"):
        resolve(PeerConfig(token="a"), DistInfo(2, 3, 0, 1))


def test_signatures_are_checked_in_time_and_content() -> None:
    s = Signer(TOKEN)
    h = s.sign("GET", "/v1/held/abc", now=1000)
    assert s.verify("GET", "/v1/held/abc", h, 30, now=1010) == 200
    assert s.verify("GET", "/v1/held/abd", h, 30, now=1010) == 403  # another path
    assert s.verify("GET", "/v1/held/abc", h, 30, now=1031) == 403  # too old
    assert Signer("other").verify("GET", "/v1/held/abc", h, 30, now=1000) == 403
    assert s.verify("GET", "/v1/held/abc", None, 30) == 401 and s.verify("GET", "/", "junk", 30) == 403
    assert TOKEN not in repr(s) and TOKEN not in h


def test_rendezvous_moves_only_the_new_nodes_share() -> None:
    names = [f"shard-{i:06d}" for i in range(4000)]
    four = [f"10.0.0.{k}:7761" for k in range(4)]
    a, b = owners(names, four), owners(names, four + ["10.0.0.9:7761"])
    moved = a != b
    assert np.all(b[moved] == 4), "a shard moved between two old nodes"
    assert 0.15 < moved.mean() < 0.25 and np.bincount(a).min() > 900
    assert np.array_equal(owners(names, four[::-1]), 3 - a), "the owner depends on the order of the list"
    assert rendezvous(names[:3], four).shape == (3, 4)


def test_owners_fit_the_nodes_caches_when_they_differ() -> None:
    """Node 0's cache holds 0.1 D, the others' 0.4 D: node 0 keeps owning only what fits, the rest of
    its share goes to nodes with room; no node owns more than its cache; nothing else moves."""
    names = [f"shard-{i:06d}" for i in range(2000)]
    sizes = np.full(len(names), 1000)
    addrs = [f"10.0.0.{k}:7761" for k in range(4)]
    base = owners(names, addrs, sizes)
    d = int(sizes.sum())
    budgets = [d // 10, 4 * d // 10, 4 * d // 10, 4 * d // 10]
    fitted = fit(base, sizes, budgets, name_hashes(names), addrs)
    load = np.bincount(fitted, weights=sizes, minlength=4)
    assert all(load <= budgets) and load[0] >= budgets[0] - 1000
    assert np.all(fitted[base != 0] == base[base != 0]), "a shard of a node with room moved"
    assert np.array_equal(fit(base, sizes, [d] * 4, name_hashes(names), addrs), base)  # room everywhere: unchanged


def test_addresses_and_token_are_exchanged_through_the_jobs_store() -> None:
    """2 nodes x 2 ranks, each rank a thread with its own client of one c10d TCPStore: every rank
    gets both nodes' addresses and one token."""
    import torch.distributed as tdist

    port = free_ports(1)[0]
    master = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    got: dict[int, tuple[tuple[str, ...], str]] = {}

    def rank(r: int) -> None:
        client = tdist.TCPStore("127.0.0.1", port, is_master=False)
        got[r] = exchange(client, DistInfo(r, 4, r % 2, 2), None)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and len({v for v in got.values()}) == 1, got
    peers, token = got[0]
    assert len(peers) == 2 and len(token) == 64 and peers[0] != peers[1]
    del master


def test_the_server_refuses_bad_tokens_and_serves_content_keys_only(tmp_path: Path) -> None:
    url, m = _dataset(tmp_path)
    src = _source(tmp_path, url, "node0")
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    tier = _tier(src, [addr, "127.0.0.1:9"], 0, owner=0)
    src.fetch(1).release()  # now cached: the server can serve it
    server = serve(src.cache, tier.membership)
    assert server is not None and serve(src.cache, tier.membership) is server  # once per process and node
    info = m.shards[1]
    path = f"/v1/shard/{m.dataset_id}/{info.hash}/{info.name}"
    data = Path(url, info.name).read_bytes()

    def get(target: str, header: str | None, rng: str | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://{addr}{target}", headers={
            **({HEADER: header} if header else {}), **({"Range": rng} if rng else {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    try:
        assert get(path, None)[0] == 401
        code, body = get(path, Signer("wrong").sign("GET", path))
        assert code == 403 and data[:64] not in body
        assert get(path, Signer(TOKEN).sign("GET", path, now=0))[0] == 403  # expired
        assert get(path, Signer(TOKEN).sign("GET", path)) == (200, data)
        assert get(path, Signer(TOKEN).sign("GET", path), "bytes=100-199") == (206, data[100:200])
        other = f"/v1/shard/{m.dataset_id}/xxh3_128:{'0' * 32}/{info.name}"  # another content, same name
        assert get(other, Signer(TOKEN).sign("GET", other))[0] == 404
        for bad in (f"/v1/shard/{m.dataset_id}/{info.hash}/..%2F..%2Fetc%2Fpasswd",
                    f"/v1/shard/{m.dataset_id}/{info.hash}/a/../../x"):
            assert get(bad, Signer(TOKEN).sign("GET", bad))[0] in (400, 404)
        held = f"/v1/held/{m.dataset_id}"
        code, ids = get(held, Signer(TOKEN).sign("GET", held))
        assert code == 200 and len(ids) == 8  # one shard held
        st = _peer_stats(src)
        assert st["refused"] == 3 and st["bytes_served"] == len(data) + 100
    finally:
        server.close()
        src.close()


@pytest.mark.parametrize("mode", ["corrupt", "500", "404", "stall", "cut"])
def test_a_failing_peer_gives_way_to_the_store(tmp_path: Path, mode: str) -> None:
    url, m = _dataset(tmp_path)
    peer = FaultyPeer(url, mode)
    src = _source(tmp_path, url, "node0")
    try:
        _tier(src, ["127.0.0.1:9", peer.addr], 0, owner=1, stall_timeout=0.3)
        h = src.fetch(2)
        assert Path(h.path).read_bytes() == Path(url, m.shards[2].name).read_bytes()
        h.release()
        st = _peer_stats(src)
        assert peer.requests == 1 and st["fallbacks"] == 1 and st["corrupt"] == int(mode == "corrupt")
        assert st["bytes_from_store"] == m.shards[2].bytes and st["bytes_from_peers"] == 0
    finally:
        peer.close()
        src.close()


def test_a_corrupt_holder_is_refetched_from_the_next_one(tmp_path: Path) -> None:
    url, m = _dataset(tmp_path)
    bad, good = FaultyPeer(url, "corrupt"), FaultyPeer(url, "ok")
    src = _source(tmp_path, url, "node0")
    try:
        peers = ["127.0.0.1:9", bad.addr, good.addr]
        order = rendezvous([s.name for s in m.shards], peers)
        shard = next(i for i, o in enumerate(order) if [k for k in o if k] == [1, 2])  # the corrupt one asked first
        _tier(src, peers, 0, owner=0)
        src.fetch(shard).release()
        st = _peer_stats(src)
        assert (bad.requests, good.requests) == (1, 1)
        assert st["corrupt"] == 1 and st["bytes_from_peers"] == m.shards[shard].bytes and st["bytes_from_store"] == 0
    finally:
        bad.close()
        good.close()
        src.close()


def test_a_slow_holder_is_hedged_by_the_store(tmp_path: Path) -> None:
    url, m = _dataset(tmp_path)
    slow = FaultyPeer(url, "slow")
    src = _source(tmp_path, url, "node0")
    try:
        _tier(src, ["127.0.0.1:9", slow.addr], 0, owner=0, hedge_delay=0.05, hedge_bandwidth="10MB")
        h = src.fetch(3)
        assert Path(h.path).read_bytes() == Path(url, m.shards[3].name).read_bytes()
        h.release()
        st = _peer_stats(src)
        assert st["hedged"] == 1 and st["bytes_from_store"] == m.shards[3].bytes and st["bytes_from_peers"] == 0
    finally:
        slow.close()
        src.close()


def test_an_owner_takes_back_its_shards_from_the_peers_that_hold_them(tmp_path: Path) -> None:
    """Node 1 holds 4 shards node 0 owns (stand-ins: node 0 was not up when they were read): node 0's
    repair fetches them from node 1, never from the store, up to its limit."""
    url, m = _dataset(tmp_path)
    a, b = _source(tmp_path, url, "a"), _source(tmp_path, url, "b")
    addrs = [f"127.0.0.1:{p}" for p in free_ports(2)]
    _tier(a, addrs, 0, owner=0)
    tb = _tier(b, addrs, 1, owner=0)
    for i in range(4):
        b.fetch(i, via_peers=False).release()
    server = serve(b.cache, tb.membership)
    assert server is not None
    try:
        assert a.repair(limit=3) == 3
        held = [i for i in range(len(m.shards)) if a.cache.contains(a.key(i))]
        st = _peer_stats(a)
        assert len(held) == 3 and set(held) < {0, 1, 2, 3}
        assert st["bytes_from_peers"] == sum(m.shards[i].bytes for i in held) and st["bytes_from_store"] == 0
        assert a.repair() == 1 and a.repair() == 0  # the last one; then nothing a peer holds is missing
    finally:
        server.close()
        a.close()
        b.close()


def test_a_standby_process_takes_over_the_nodes_server(tmp_path: Path) -> None:
    """Two datacache processes of one node: the first serves, the second waits on the node's server
    lock; when the first is killed, the second serves on the same address (one server per node,
    alive while any datacache process of the node is)."""
    import subprocess
    import sys
    import time

    from datacache.peer import server as server_mod

    cfg = {"ram_bytes": "1MB", "ssd_bytes": 0, "ram_dir": str(tmp_path / "ram"), "ssd_dir": str(tmp_path / "ssd")}
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    script = (f"import sys, time; from datacache import CacheConfig, NodeCache, PeerConfig; from datacache.dist import "
              f"DistInfo; from datacache.peer import resolve, serve; c = NodeCache(CacheConfig(**{cfg!r})); "
              f"assert serve(c, resolve(PeerConfig(peers=[{addr!r}], token={TOKEN!r}), DistInfo())) is not None; "
              "print('serving', flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "serving"
        from datacache import NodeCache

        cache = NodeCache(CacheConfig(**cfg))  # type: ignore[arg-type]
        membership = resolve(PeerConfig(peers=[addr], token=TOKEN), DistInfo())
        assert membership is not None and serve(cache, membership) is None  # the child serves; we stand by

        def answers() -> bool:
            try:
                urllib.request.urlopen(f"http://{addr}/v1/held/x", timeout=2)
            except urllib.error.HTTPError as exc:
                return exc.code == 401
            except OSError:
                return False
            return False

        assert answers()
        child.kill()
        child.wait()
        deadline = time.monotonic() + 60
        lease = server_mod._leases[str(Path(cache.control_dir) / f"peer-server-{addr.rsplit(':', 1)[1]}.lock")]
        # the standby's thread listens, then records its server: wait for both (it answered first once)
        while not (answers() and lease.server is not None):
            assert time.monotonic() < deadline, "nobody took over the node's server"
            time.sleep(0.05)
        assert lease.server is not None  # this process serves now
        lease.server.close()
        cache.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
