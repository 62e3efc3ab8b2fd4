"""Messages of the command line and the S3 launcher: an unknown dataset id, a bad bucket name, the
launcher's settings, progress in logs. Real subprocesses; the S3 tests use the SeaweedFS server.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datacache import open_store, write_dataset
from tools.s3server import DEFAULT_KEY, DEFAULT_SECRET, find_weed

ROOT = Path(__file__).resolve().parents[1]


def _env(base: Path, s3: Any | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))}
    env.update(DATACACHE_RAM_DIR=str(base / "ram"), DATACACHE_SSD_DIR=str(base / "ssd"),
               DATACACHE_RAM_BYTES="4MB", DATACACHE_SSD_BYTES="8MB")
    if s3 is not None:
        env.update(AWS_ENDPOINT_URL=s3.endpoint_url, AWS_ACCESS_KEY_ID=s3.access_key,
                   AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_DEFAULT_REGION="us-east-1")
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _dataset(s3: Any, shards: int = 10) -> str:
    url = f"s3://{s3.bucket}/{uuid.uuid4().hex}/"
    rng = np.random.default_rng(uuid.uuid4().int)
    write_dataset([{"x": i, "data": rng.bytes(4000)} for i in range(4 * shards)], url, shard_bytes=16000,
                  storage_options=s3.storage_options(), progress=False)
    return url


def test_clear_an_unknown_dataset_id_says_so(s3_server: Any, tmp_path: Path) -> None:
    env = _env(tmp_path, s3_server)
    url = _dataset(s3_server, shards=2)
    warm = _run(["-m", "datacache.cli", "warm", url, "--json", "-q"], env)
    assert warm.returncode == 0, warm.stderr
    known = json.loads(warm.stdout)["dataset_id"]
    p = _run(["-m", "datacache.cli", "clear", "--dataset", "ds-nosuchdataset"], env)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    (line,) = _lines(p.stderr)
    assert line.startswith("datacache: error:") and "ds-nosuchdataset" in line
    assert known in line and "datacache stat" in line
    p = _run(["-m", "datacache.cli", "clear", "--dataset", known, "--json"], env)
    assert p.returncode == 0 and json.loads(p.stdout)["removed"] == 2, p.stderr


def test_s3server_refuses_a_bad_bucket_name_at_once() -> None:
    p = _run(["-m", "tools.s3server", "--bucket", "nc"], dict(os.environ), timeout=30)  # it waited 60 s
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in _lines(p.stderr) if "error" in ln]
    assert len(errors) == 1 and "'nc'" in errors[0] and "3 to 63" in errors[0], p.stderr


@pytest.mark.timeout(120)
def test_s3server_prints_the_defaults_a_client_needs(tmp_path: Path) -> None:
    try:
        find_weed()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    bucket = f"msg-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-m", "tools.s3server", "--bucket", bucket], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True,  # type: ignore[union-attr]
                     name="test-s3server-out").start()
    try:
        out = []
        while not out or "log:" not in out[-1]:
            out.append(lines.get(timeout=90))  # hang guard: the server starts in seconds
        text = "".join(out)
        assert DEFAULT_KEY in text and DEFAULT_SECRET in text and "http://127.0.0.1:" in text, text
        line = lines.get(timeout=30)
        assert "storage_options=" in line, line
        opts = json.loads(line.split("storage_options=", 1)[1])
        store = open_store(f"s3://{bucket}/x/", opts)  # the printed options reach the server
        store.write_bytes("hello", b"hi")
        assert store.read_bytes("hello") == b"hi"
        store.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_progress_off_a_terminal_is_plain_lines(s3_server: Any, tmp_path: Path) -> None:
    url = _dataset(s3_server)
    # stderr is a pipe; read as bytes (text mode would turn each "\r" into a newline)
    p = subprocess.run([sys.executable, "-m", "datacache.cli", "warm", url], env=_env(tmp_path, s3_server),
                       cwd=ROOT, capture_output=True, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert "\r" not in err, err
    progress = [ln for ln in err.split("\n") if ln.startswith("warming:")]
    assert progress and "100%" in progress[-1] and "10/10 shards" in progress[-1], err
    assert len(progress) <= 11  # about one per 10 %, not one per update


def test_write_progress_off_a_terminal_is_plain_lines(tmp_path: Path) -> None:
    """``datacache write`` (the writer's own progress, total unknown): plain lines, no ``\\r``."""
    src = tmp_path / "src.jsonl"
    src.write_text("".join(f'{{"i": {i}, "text": "{"x" * 200}"}}\n' for i in range(2000)))
    p = subprocess.run([sys.executable, "-m", "datacache.cli", "write", str(src), str(tmp_path / "ds"),
                        "--shard-bytes", "64KB"], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                       capture_output=True, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert "\r" not in err, err
    progress = [ln for ln in err.split("\n") if ln.startswith("writing ")]
    assert progress and "shards" in progress[-1], err
