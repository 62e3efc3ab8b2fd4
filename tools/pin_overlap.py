"""Pinned memory on a GPU: is ``datacache.DataLoader(pin_memory=True)``'s batch handed over pinned
without a second copy, and is the host-to-device copy of batch N+1 hidden behind the step of batch N?

    python tools/pin_overlap.py [--mb 512] [--sample-kb 64] [--batch 128] [--step-ms 4] [--workers 4]
                                [--epochs 3] [--json FILE]

Needs a CUDA device (exits 2 without one, having measured nothing). Writes a local dataset of
incompressible float32 arrays into a temporary directory, fills the node cache with one epoch, then
runs three loaders over the same warm cache, one after the other, each for ``--epochs`` epochs:

- ``pinned``: ``datacache.DataLoader(pin_memory=True)``: the workers' batch rings are registered as
  pinned memory in the training process, so torch's pinning thread takes each batch as it is;
- ``copy-pinned``: the same loader with that registration turned off in this process, so torch's
  pinning thread copies each batch into pinned memory of its own: what the registration saves;
- ``pageable``: ``pin_memory=False``: a ``non_blocking`` copy from pageable memory, which the host
  waits for.

The training loop is the usual double buffer: the copy of batch N+1 is queued on a copy stream
before the step of batch N (a chain of matrix products sized to ``--step-ms``) is queued on the
default stream, and the step waits for its own batch's copy only. The host batch is dropped after the
default stream has been told to wait for its copy (the order ``datacache.pytorch.batches`` asks of a
copy on another stream). CUDA events time every copy and step; per mode the report gives:

- ``hidden``: the share of the copies' GPU time that falls inside some step (1.0: every copy overlaps
  compute);
- ``gpu busy``: the steps' time over the span from the first step's start to the last one's end
  (1.0: the GPU never waited for data);
- ``H2D GB/s`` over the copies' own time, the host's time inside ``.to()`` per batch, the training
  process's CPU-seconds per GB (torch's pinning thread counts there), and ``zero-copy``: the share
  of batches whose tensor lies inside a ring this process registered.

Medians over the measured epochs. Nothing here is a test: ``tests/test_field_types.py`` checks the
pinned batches' values on any machine.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

try:
    import datacache
except ModuleNotFoundError:  # run from the checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import datacache
from datacache.pytorch import batches as _batches

MODES = ("pinned", "copy-pinned", "pageable")
Interval = tuple[float, float]


def hidden(copies: Sequence[Interval], steps: Sequence[Interval]) -> float:
    """The share of the copies' total time that lies inside some step. ``steps``: disjoint
    intervals sorted by start (one stream's kernels); ``copies`` in any order. 0.0 for no copy time."""
    starts = [s for s, _ in steps]
    total = covered = 0.0
    for c0, c1 in copies:
        total += c1 - c0
        i = max(bisect.bisect_right(starts, c0) - 1, 0)
        while i < len(steps) and steps[i][0] < c1:
            covered += max(0.0, min(c1, steps[i][1]) - max(c0, steps[i][0]))
            i += 1
    return covered / total if total > 0 else 0.0


def busy(steps: Sequence[Interval]) -> float:
    """The steps' own time over the span from the first one's start to the last one's end."""
    span = steps[-1][1] - steps[0][0]
    return sum(e - s for s, e in steps) / span if span > 0 else 1.0


def _write(root: str, mb: int, sample_kb: int) -> str:
    url = os.path.join(root, "ds")
    n = mb * 1024 // sample_kb
    floats = sample_kb * 256

    def samples() -> Iterator[dict[str, Any]]:
        rng = np.random.default_rng(0)
        for i in range(n):
            yield {"x": rng.standard_normal(floats, dtype=np.float32), "id": i}

    datacache.write_dataset(samples(), url, shard_bytes=32 << 20)
    return url


class Step:
    """A chain of matrix products on the default stream sized to about ``ms`` milliseconds."""

    def __init__(self, ms: float, device: torch.device) -> None:
        self.a = torch.randn(2048, 2048, device=device)
        self.n = 1
        per = self._time(20) / 20
        self.n = max(1, round(ms / per))

    def __call__(self) -> None:
        x = self.a
        for _ in range(self.n):
            x = x @ self.a
            x = x * (1.0 / 2048)

    def _time(self, reps: int) -> float:
        self()  # warm-up
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            self()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1)


def _in_ring(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies inside a batch ring this process registered as pinned memory."""
    ptr = t.data_ptr()
    with _batches._RINGS_LOCK:
        states = [state for _, state in _batches._ATTACHED_RINGS.values()]
    return any(s.pinned and s.pinned <= ptr < s.pinned + len(s.mm) for s in states)


def _epoch(loader: Any, step: Step, copy_stream: torch.cuda.Stream, device: torch.device) -> dict[str, Any]:
    """One epoch of the double-buffered loop; its figures once the GPU is done."""
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    base = ev()
    base.record()
    copies, steps, host_ms, zero_copy, nbytes = [], [], [], 0, 0

    def queue(host: dict[str, Any]) -> tuple[torch.Tensor, torch.cuda.Event]:
        nonlocal zero_copy, nbytes
        x = host["x"]
        zero_copy += _in_ring(x)
        nbytes += x.numel() * x.element_size()
        c0, c1 = ev(), ev()
        t = time.perf_counter()
        with torch.cuda.stream(copy_stream):
            c0.record(copy_stream)
            gpu = x.to(device, non_blocking=True)
            c1.record(copy_stream)
        host_ms.append((time.perf_counter() - t) * 1e3)
        copies.append((c0, c1))
        return gpu, c1

    cpu0, wall0 = time.process_time(), time.perf_counter()
    it = iter(loader)
    host = next(it)
    nxt = queue(host)
    while nxt is not None:
        gpu, ready = nxt
        torch.cuda.current_stream().wait_event(ready)
        gpu.record_stream(torch.cuda.current_stream())
        host = None  # dropped after the wait above: its slot is reused only once the copy is done
        host = next(it, None)
        nxt = queue(host) if host is not None else None
        s0, s1 = ev(), ev()
        s0.record()
        step()
        s1.record()
        steps.append((s0, s1))
        del gpu
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    at = lambda e: base.elapsed_time(e)  # noqa: E731
    c_iv = [(at(a), at(b)) for a, b in copies]
    s_iv = [(at(a), at(b)) for a, b in steps]
    copy_ms = sum(b - a for a, b in c_iv)
    return {"batches": len(s_iv), "wall_s": wall, "hidden": hidden(c_iv, s_iv), "gpu_busy": busy(s_iv),
            "h2d_gbs": nbytes / copy_ms / 1e6 if copy_ms else 0.0, "host_ms": statistics.median(host_ms),
            "cpu_s_per_gb": cpu / (nbytes / 1e9), "zero_copy": zero_copy / len(c_iv),
            "step_ms": statistics.median(b - a for a, b in s_iv)}


@contextlib.contextmanager
def _registration(on: bool) -> Iterator[None]:
    """``copy-pinned``: this process registers no ring, so torch pins each batch by copying it."""
    saved = _batches._register
    if not on:
        _batches._register = lambda mm: 0
    try:
        yield
    finally:
        _batches._register = saved


def _mode(mode: str, url: str, cfg: datacache.CacheConfig, args: argparse.Namespace, step: Step,
          device: torch.device) -> list[dict[str, Any]]:
    ds = datacache.StreamingDataset(url, cache=cfg, seed=0)
    loader = datacache.DataLoader(ds, batch_size=args.batch, num_workers=args.workers, persistent_workers=True,
                                  pin_memory=mode != "pageable")
    copy_stream = torch.cuda.Stream()
    out = []
    try:
        with _registration(mode != "copy-pinned"):
            for epoch in range(args.epochs + 1):  # the first: the workers' start and their rings' first use
                ds.set_epoch(epoch + 1)
                r = _epoch(loader, step, copy_stream, device)
                if epoch:
                    out.append(r)
                print(f"  {mode} epoch {epoch}{' (not counted)' if not epoch else ''}: " + _line(r), flush=True)
    finally:
        del loader
        ds.close()
    return out


def _line(r: dict[str, Any]) -> str:
    return (f"hidden {r['hidden']:.2f}  gpu busy {r['gpu_busy']:.2f}  H2D {r['h2d_gbs']:.1f} GB/s  "
            f"host {r['host_ms']:.3f} ms/batch  CPU {r['cpu_s_per_gb']:.3f} s/GB  zero-copy {r['zero_copy']:.2f}  "
            f"wall {r['wall_s']:.2f} s  step {r['step_ms']:.2f} ms")


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=512, help="dataset size in MB")
    p.add_argument("--sample-kb", type=int, default=64)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=4.0, help="the simulated training step on the GPU")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3, help="measured epochs per mode")
    p.add_argument("--json", help="write the per-mode medians and every epoch here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("pin_overlap: no CUDA device here (torch.cuda.is_available() is False); nothing measured. "
              "Run it on a machine with a GPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    step = Step(args.step_ms, device)
    with tempfile.TemporaryDirectory(prefix="pin-overlap-") as root, \
            tempfile.TemporaryDirectory(prefix="pin-overlap-ram-", dir=_ram_root()) as ram:
        print(f"writing {args.mb} MB of {args.sample_kb} KiB samples ...", flush=True)
        url = _write(root, args.mb, args.sample_kb)
        cfg = datacache.CacheConfig(ram_dir=ram, ssd_dir=os.path.join(root, "ssd"), ram_bytes=f"{2 * args.mb}MB")
        fill = datacache.StreamingDataset(url, cache=cfg, seed=0)
        sum(1 for _ in datacache.DataLoader(fill, batch_size=args.batch, num_workers=args.workers))
        fill.close()
        report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "args": vars(args),
                  "step_matmuls": step.n, "shm_free_mb": _shm_free_mb(), "modes": {}}
        for mode in MODES:
            runs = _mode(mode, url, cfg, args, step, device)
            report["modes"][mode] = {"median": _median(runs), "epochs": runs}
    print(f"\n{report['device']}, torch {report['torch']}, batch {args.batch} x {args.sample_kb} KiB, "
          f"step {args.step_ms} ms, {args.workers} workers, /dev/shm free {report['shm_free_mb']} MB "
          f"(the rings live there); medians of {args.epochs} epochs per mode:")
    for mode in MODES:
        print(f"  {mode:12s} " + _line(report["modes"][mode]["median"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _shm_free_mb() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").free >> 20
    except OSError:
        return None


def _ram_root() -> str | None:
    """/dev/shm where it exists (the RAM tier's default home), else the temporary directory's."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


if __name__ == "__main__":
    sys.exit(main())
