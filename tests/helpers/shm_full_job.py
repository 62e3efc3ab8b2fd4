"""A training loop whose ``/dev/shm`` fills up under it (issue 37 point 2), run by
tests/test_fastpath.py as its own process in a private mount namespace with a small tmpfs on
``/dev/shm`` (``run``), where the RAM tier is too in MODE ``release``.

Usage: ``python tests/helpers/shm_full_job.py URL BASE MODE``. Two DataLoader workers yield batches
of 32; once the second batch is in, this process fills ``/dev/shm`` to its last byte. MODE ``hold``
keeps every batch (the workers' rings run out of slots, so later batches need fresh shared memory:
the error must arrive, not a hang); ``release`` drops each batch once checked (the rings' slots are
reused: every batch must arrive). Prints one JSON line: the sample ids received and the error
raised, as ``"<type>: <last line of its message>"``, or null.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import datacache
from datacache import CacheConfig, StreamingDataset
from tests.helpers.faults import ROOT, fill_up

SHM_MB = 48


def run(url: str, base: Path, mode: str, timeout: float = 120) -> dict[str, Any]:
    """This job's JSON line, run in a private mount namespace (a user namespace too when not root)
    over a ``SHM_MB`` tmpfs on ``/dev/shm``; skips where such a namespace cannot be made."""
    ns = ["--mount"] if os.getuid() == 0 else ["--user", "--map-root-user", "--mount"]
    script = f'mount -t tmpfs -o size={SHM_MB}m tmpfs /dev/shm && echo mounted >&2 && exec "$@"'
    cmd = ["unshare", *ns, "--propagation", "private", "--", "sh", "-c", script, "sh",
           sys.executable, "-m", "tests.helpers.shm_full_job", url, str(base), mode]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # the bug: a batch dropped, the training loop waits for ever
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"the job hung for {timeout} s with /dev/shm full ({mode}); its stderr ends:\n{err[-3000:]}")
    if "mounted" not in r.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {r.stderr.strip()[-500:]}")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(url: str, base: str, mode: str) -> int:
    # hold: the RAM tier elsewhere, so that nothing it frees in /dev/shm lets a batch through after all
    ram_dir = "/dev/shm/datacache-job" if mode == "release" else f"{base}/ram"
    cfg = CacheConfig(ram_bytes="8MB", ssd_bytes=0, ram_dir=ram_dir, ssd_dir=f"{base}/ssd")
    ds = StreamingDataset(url, cache=cfg, shuffle=False)
    loader = datacache.DataLoader(ds, batch_size=32, num_workers=2)
    ids: list[int] = []
    held, error = [], None
    try:
        for n, batch in enumerate(loader):
            assert torch.equal(batch["x"][:, 0].long(), batch["i"]) and bool((batch["x"] == batch["x"][:, :1]).all())
            ids += batch["i"].tolist()
            if mode == "hold":
                held.append(batch)
            del batch
            if n == 1:
                try:
                    fill_up(Path("/dev/shm"), leave=0)
                except OSError:  # full: what was asked
                    pass
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks it
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
    print(json.dumps({"ids": ids, "error": error}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
