"""The benchmark's CPU accounting (tools/bench_cpu.py) and the images scenario's decode (tools/bench_images.py):
CPU burnt in DataLoader workers (persistent or reaped) and in a helper process is counted, a session is
counted once over its ranks, and the JPEG transform crops and times itself. No timing assertions: CPU
seconds burnt are lower bounds the kernel's accounting must show, whatever the machine's load."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tools import bench_cpu, bench_images

BURN = 0.3  # CPU-seconds each worker or helper burns


def _burn(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def _loader(persistent: bool):  # noqa: ANN202 - a torch DataLoader
    import torch.utils.data as tud

    class Burn(tud.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            _burn(BURN)
            yield np.zeros(1)

    return tud.DataLoader(Burn(), batch_size=None, num_workers=2, persistent_workers=persistent)


@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["persistent workers", "workers reaped", "a helper process"])
def test_cpu_burnt_in_workers_and_helpers_is_counted(how: str) -> None:
    """Each of 2 workers (or one helper subprocess) burns 0.3 CPU-seconds while the training
    process waits: the tree's CPU grows by at least that, beyond the training process's own."""
    loader = _loader(persistent=how == "persistent workers") if how != "a helper process" else None
    before = bench_cpu.snapshot(how="tree")
    if loader is None:
        code = f"import time\nt = time.process_time()\nwhile time.process_time() - t < {BURN}: pass"
        subprocess.run([sys.executable, "-c", code], check=True)
        burnt = BURN
    else:
        assert len(list(loader)) == 2
        burnt = 2 * BURN
    after = bench_cpu.snapshot(how="tree")
    d = bench_cpu.delta(before, after)
    assert d["cpu_s"] - d["cpu_main_s"] >= 0.9 * burnt, d  # 10 ms ticks per process: a little below
    if how == "persistent workers":
        assert d["cpu_procs"] >= 3, d  # the workers are still alive, and counted as such
    del loader


def test_a_session_is_counted_once_and_nodes_are_summed() -> None:
    rank = {"cpu_s": 4.0, "cpu_main_s": 1.0, "cpu_procs": 6, "cpu_sid": 10, "cpu_scope": "session"}
    two_ranks = [rank, {**rank, "cpu_s": 4.1, "cpu_main_s": 1.2}]  # torchrun: both see the whole session
    assert bench_cpu.node_total(two_ranks) == {"cpu_s": 4.1, "cpu_main_s": 2.2, "cpu_procs": 6,
                                               "cpu_scope": "session"}
    nodes = [rank, {**rank, "cpu_sid": 11}]  # simulated nodes: a session each
    assert bench_cpu.node_total(nodes)["cpu_s"] == 8.0
    assert bench_cpu.node_total([rank, {"wall": 1.0}]) == {}  # a rank without figures: none
    assert bench_cpu.per_gb(2.0, 500e6) == pytest.approx(4.0)


def test_a_snapshot_counts_this_process_and_its_own_cpu() -> None:
    before = bench_cpu.snapshot(how="tree")
    _burn(0.05)
    after = bench_cpu.snapshot(how="tree")
    assert before["procs"] >= 1 and before["sid"] == os.getsid(0) and before["scope"] == "tree"
    assert after["main_s"] >= before["main_s"] and after["cpu_s"] >= before["cpu_s"]
    assert bench_cpu.delta(before, None) == {}


def test_jpegs_are_deterministic_real_and_decode_to_random_224_crops(tmp_path: Path) -> None:
    """Image i's JPEG is the same bytes each time, a real JPEG of ImageNet-like size; the transform
    crops it to a 224 x 224 x 3 uint8 array and its clock counts every thread's decode CPU."""
    from PIL import Image

    a, b = bench_images.jpeg(3), bench_images.jpeg(3)
    assert a == b and a[:2] == b"\xff\xd8" and 10_000 < len(a) < 400_000
    with Image.open(__import__("io").BytesIO(a)) as im:
        assert im.format == "JPEG" and 360 <= im.width < 680 and 270 <= im.height < 500
    decode = bench_images.Decode(str(tmp_path))
    outs = []
    threads = [threading.Thread(target=lambda i=i: outs.append(decode(bench_images.sample(i, 10))), name=f"d{i}")
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o["id"] for o in outs) == [0, 1, 2, 3]
    assert all(o["image"].shape == (224, 224, 3) and o["image"].dtype == np.uint8 for o in outs)
    assert bench_images.DecodeClock.total(str(tmp_path)) > 0 and os.listdir(tmp_path) == [str(os.getpid())]
    for w, h, seed in ((500, 375, 1), (30, 400, 2), (640, 480, 3)):
        top, left, ch, cw = bench_images._box(w, h, seed)
        assert 0 <= top and top + ch <= h and 0 <= left and left + cw <= w and ch > 0 and cw > 0
