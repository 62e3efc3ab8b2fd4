"""Stopping and crashing: Ctrl-C during ``datacache warm`` and mid-epoch abandons the downloads in
flight and leaves no temp files; DataLoader workers of a SIGKILLed training process stop at once.

Real processes and signals, the SeaweedFS server behind a SlowLink proxy so downloads are in flight
when the signal comes. The tests wait on the proxy's byte counter and the processes' output, never
on sleeps, and have hang guards; the stop times are printed (``pytest -s``), not asserted.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from datacache import CacheConfig, NodeCache, load_manifest, open_store
from datacache.hashing import hash_file
from tests.helpers import faults as H

ROOT = Path(__file__).resolve().parents[1]
KB = 1 << 10
SIZE = 8 * KB  # payload bytes per sample; 8 samples per 64 KB shard


def _env(s3: Any, endpoint: str, base: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key,
               AWS_DEFAULT_REGION="us-east-1", DATACACHE_RAM_DIR=str(base / "ram"),
               DATACACHE_SSD_DIR=str(base / "ssd"), DATACACHE_RAM_BYTES="8MB", DATACACHE_SSD_BYTES="0")
    return env


def _write(s3: Any, shards: int) -> str:
    url = f"s3://{s3.bucket}/{uuid.uuid4().hex}/"
    H.write(url, s3.storage_options(), 8 * shards, SIZE, shard_bytes=8 * SIZE)
    return url


def _leftovers(base: Path) -> list[str]:
    return H.leftovers(base / "ram" / "data", base / "ssd" / "data")


def _bytes_down(link: Any) -> int:
    return link.snapshot()["bytes_down"]


def _stopped(proc: subprocess.Popen[str], sig: int, timeout: float = 60) -> tuple[str, str, float]:
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)  # hang guard
    return out, err, time.monotonic() - t0


@pytest.mark.timeout(180)
def test_warm_ctrl_c_abandons_downloads_in_flight(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    url = _write(s3_server, shards=12)
    link = slowlink(bandwidth=16_000)  # 4 s per 64 KB shard alone: two in flight take 8 s
    proc = subprocess.Popen([sys.executable, "-m", "datacache.cli", "warm", url, "--threads", "2", "-q"],
                            env=_env(s3_server, link.endpoint_url, tmp_path), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    manifest_bytes = open_store(url, s3_server.storage_options()).size("manifest.json")
    H.wait_for(lambda: _bytes_down(link) > manifest_bytes + 16 * KB or proc.poll() is not None, 60,
               "warm to be mid-download")
    assert proc.poll() is None, proc.communicate()
    out, err, seconds = _stopped(proc, signal.SIGINT)
    print(f"\nwarm stopped {seconds:.2f} s after SIGINT")
    assert proc.returncode == 130, (out, err)
    lines = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert _leftovers(tmp_path) == []
    m = load_manifest(open_store(url, s3_server.storage_options()))
    by_key = {m.cache_key(i): s for i, s in enumerate(m.shards)}
    with NodeCache(CacheConfig(ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"), ram_bytes="8MB",
                               ssd_bytes=0)) as c:
        if c.reconciled is not None:  # we are alone: nothing partial or orphaned was left behind
            assert c.reconciled["partial"] == 0 and c.reconciled["orphans"] == 0, c.reconciled
        for key, e in c.entries():
            for t, rec in e.tiers.items():
                assert hash_file(c.tiers[t].file_path(rec["file"])) == by_key[key].hash


# A training loop (no DataLoader workers, sample mode) that stops on Ctrl-C; one line per sample.
_TRAIN = """
import json, sys, time
from datacache import CacheConfig, PrefetchConfig, StreamingDataset
spec = json.loads(sys.argv[1])
ds = StreamingDataset(spec["url"], storage_options=spec["opts"], cache=CacheConfig(**spec["cache"]),
                      prefetch=PrefetchConfig(threads=2, max_threads=2, lookahead_bytes="64KB",
                                              max_lookahead_bytes="64KB", adaptive=False))
try:
    for sample in ds:
        print(int(sample["i"]), flush=True)
        time.sleep(0.005)  # the training step
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.timeout(180)
def test_ctrl_c_mid_epoch_stops_prefetching_and_leaves_no_temp_files(s3_server: Any, slowlink: Any,
                                                                     tmp_path: Path) -> None:
    url = _write(s3_server, shards=24)
    link = slowlink(bandwidth=64_000)
    spec = {"url": url, "opts": s3_server.storage_options(link.endpoint_url),
            "cache": H.cache_kw(tmp_path, ram="8MB")}
    proc = subprocess.Popen([sys.executable, "-c", _TRAIN, json.dumps(spec)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the first sample: the epoch is running
    assert first.strip().isdigit(), proc.communicate()
    link.bandwidth = 2_000  # from now on a shard takes ~30 s: the fetch in flight is still going at the signal
    ram_data = tmp_path / "ram" / "data"
    H.wait_for(lambda: any(n.startswith(".tmp-") for n in H.files(ram_data)) or proc.poll() is not None, 60,
               "a fetch in flight (its temp file)")
    assert proc.poll() is None, proc.communicate()
    out, err, seconds = _stopped(proc, signal.SIGINT)
    print(f"\ntraining loop stopped {seconds:.2f} s after SIGINT")
    assert proc.returncode == 130, err
    assert _leftovers(tmp_path) == []


# A training loop through datacache.DataLoader with a 10 ms step: from the second batch on, the next
# batch is taken by the read-ahead thread while the step runs (datacache.pytorch.loader._ReadAhead).
_AHEAD = """
import json, sys, time
import datacache
from datacache import CacheConfig, StreamingDataset
spec = json.loads(sys.argv[1])
ds = StreamingDataset(spec["url"], storage_options=spec["opts"], cache=CacheConfig(**spec["cache"]))
try:
    for batch in datacache.DataLoader(ds, batch_size=4, num_workers=2):
        print(len(batch["i"]), flush=True)
        time.sleep(0.01)  # the training step
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


@pytest.mark.timeout(180)
def test_ctrl_c_while_the_next_batch_is_read_ahead_stops_the_loop(s3_server: Any, slowlink: Any,
                                                                  tmp_path: Path) -> None:
    """A Ctrl-C (to the whole process group, as a terminal sends it) while the training loop waits for
    the batch its read-ahead thread is taking, behind a link slowed to a crawl: the loop gets its
    KeyboardInterrupt and the process ends (130) without a traceback or a temp file."""
    url = _write(s3_server, shards=24)
    link = slowlink(bandwidth=64_000)
    spec = {"url": url, "opts": s3_server.storage_options(link.endpoint_url),
            "cache": H.cache_kw(tmp_path, ram="8MB")}
    proc = subprocess.Popen([sys.executable, "-c", _AHEAD, json.dumps(spec)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    for _ in range(3):  # past the first step: the read-ahead runs
        line = proc.stdout.readline()
        assert line.strip().isdigit(), (line, proc.communicate())
    link.bandwidth = 2_000  # a shard now takes ~30 s: the batch read ahead waits on a fetch in flight
    ram_data = tmp_path / "ram" / "data"
    H.wait_for(lambda: any(n.startswith(".tmp-") for n in H.files(ram_data)) or proc.poll() is not None, 60,
               "a fetch in flight (its temp file)")
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)  # hang guard
    print(f"\ntraining loop stopped {time.monotonic() - t0:.2f} s after SIGINT")
    assert proc.returncode == 130 and out.splitlines()[-1] == "interrupted", (out, err)
    assert "Traceback" not in err, err
    # no temp file; partial copies (a scratch file and its state, as one unit) stay for the next job
    assert [n for n in _leftovers(tmp_path) if not n.endswith(".part")] == []


# A training process with two DataLoader workers; prints the worker pids, then one line per batch.
_LOADER = """
import json, sys, time
from torch.utils.data import DataLoader
from datacache import CacheConfig, StreamingDataset
spec = json.loads(sys.argv[1])
ds = StreamingDataset(spec["url"], storage_options=spec["opts"], cache=CacheConfig(**spec["cache"]))
it = iter(DataLoader(ds, batch_size=4, num_workers=2))
print(json.dumps([w.pid for w in it._workers]), flush=True)
for batch in it:
    print(len(batch["i"]), flush=True)
    time.sleep(0.01)  # the training step
"""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, not reaped by an init that does not reap, is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.timeout(180)
def test_workers_of_a_killed_training_process_stop_downloading(s3_server: Any, slowlink: Any,
                                                               tmp_path: Path) -> None:
    url = _write(s3_server, shards=48)  # 3 MB: 24 s through the link
    link = slowlink(bandwidth=128_000)
    spec = {"url": url, "opts": s3_server.storage_options(link.endpoint_url),
            "cache": H.cache_kw(tmp_path, ram="8MB")}
    proc = subprocess.Popen([sys.executable, "-c", _LOADER, json.dumps(spec)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("["), proc.communicate()
        pids = json.loads(line)
        assert proc.stdout.readline().strip() == "4", proc.communicate()  # the first batch came
        H.wait_for(lambda: _bytes_down(link) > 256 * KB, 60, "the workers to be downloading")
        t0 = time.monotonic()
        proc.kill()
        b0 = _bytes_down(link)
        H.wait_for(lambda: not any(map(_alive, pids)), 60, "the orphaned workers to exit")  # hang guard
        seconds = time.monotonic() - t0
    finally:
        proc.kill()
        for pid in pids:  # whatever still runs (the workers hold the output pipe open)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=60)
    after = _bytes_down(link) - b0
    print(f"\nworkers gone {seconds:.2f} s after the training process; {after} B came after SIGKILL")
    # Bytes already on their way when the kill came: at most a few 64 KB proxy chunks, not the
    # downloads that orphaned workers kept running (128 KB per second they live).
    assert after <= 4 * 64 * KB, after


# A training loop over datacache.DataLoader whose workers, once forked, report and then wait in
# multiprocessing's bootstrap (an after-fork hook, before torch's worker loop) until released.
_STARTING = """
import json, multiprocessing.util, os, sys
import numpy as np
import datacache
from datacache import CacheConfig, StreamingDataset
spec, release = json.loads(sys.argv[1]), int(sys.argv[2])

class Hold:
    def __call__(self, _):
        os.write(1, b"starting\\n")
        os.read(release, 1)  # a Ctrl-C that kills the worker here is what the test looks for

hold = Hold()
multiprocessing.util.register_after_fork(hold, hold)
ds = StreamingDataset(spec["url"], cache=CacheConfig(**spec["cache"]))
try:
    for batch in datacache.DataLoader(ds, batch_size=4, num_workers=2):
        pass
except KeyboardInterrupt:
    os.write(1, b"interrupted\\n")
    os._exit(130)
"""


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_ctrl_c_while_dataloader_workers_start_is_a_keyboard_interrupt(tmp_path: Path) -> None:
    """A Ctrl-C that finds DataLoader workers still starting: the workers take it in torch's
    worker loop and exit quietly, so the training process gets its ``KeyboardInterrupt`` and not
    torch's "worker exited unexpectedly" (which replaced it when the training process was slow)."""
    url = f"file://{tmp_path}/ds"
    H.write(url, None, 64, 64, shard_bytes=1024)
    spec = {"url": url, "cache": H.cache_kw(tmp_path, ram="8MB")}
    release_r, release_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", _STARTING, json.dumps(spec), str(release_r)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=[release_r],
                            start_new_session=True)  # a process group of its own: the terminal's Ctrl-C
    os.close(release_r)
    try:
        assert proc.stdout is not None
        for _ in range(2):
            assert proc.stdout.readline() == "starting\n", proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)  # pending in every process of the group when this returns
        os.write(release_w, b"xx")
        out, err = proc.communicate(timeout=60)  # hang guard
    finally:
        os.close(release_w)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 130 and out == "interrupted\n", (proc.returncode, out, err)
    assert "Traceback" not in err, err  # no worker died of the Ctrl-C
