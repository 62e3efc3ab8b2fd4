"""The main job on an embedded default: ``make demo``.

Starts the embedded object store (SeaweedFS) behind the slow-link emulator (``tools/slowlink.py``:
50 MB/s shared, 20 ms per request by default), writes a synthetic image-like dataset (~500 MB of
64 KB samples) unless it is already there, and trains a small torch model for 2 epochs through
``datacache.StreamingDataset`` and a ``DataLoader`` with 2 workers. It prints a live progress line,
then a cold-vs-warm table against the link and compute bounds, and writes a PNG of the per-step
data wait. Every process it started is stopped, also on Ctrl-C.

The compute bound is measured the same way for every epoch: the training step alone, replayed on
a few kept batches after the epochs, times the epoch's batches. The step's time inside each
epoch's loop is shown beside it: in a cold epoch the data pipeline (fetching, hashing, decoding in
the workers) shares the CPUs with the model, so the step itself runs slower there (issue 37.17).

``--url s3://...`` runs the same loop over your own dataset (credentials and endpoint from the
usual AWS variables) without the emulator. ``--compute sleep:0.02`` replaces the model with 20 ms
of simulated compute per batch (the setting the issue's figures use).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import datacache  # noqa: E402
from datacache.config import format_size, parse_size  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEP = 8  # batches kept from the last epoch to time the step alone


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="your dataset (s3://bucket/prefix/); default: the embedded store + emulator")
    p.add_argument("--size", default="500MB", help="synthetic dataset size (default 500MB)")
    p.add_argument("--sample-bytes", default="64KiB")
    p.add_argument("--shard-bytes", default="16MB")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--bandwidth", default="50MB", help="emulated link, bytes/s (default 50MB)")
    p.add_argument("--latency", type=float, default=0.02, help="emulated per-request latency, s")
    p.add_argument("--compute", default="model", help="'model' (a small CNN) or 'sleep:SECONDS' per batch")
    p.add_argument("--ram-bytes", default="2GB")
    p.add_argument("--out", default=os.path.join(HERE, "demo-out"))
    p.add_argument("--keep-cache", action="store_true", help="do not empty the cache first (no cold epoch)")
    return p.parse_args(argv)


def synthetic(n: int, sample_bytes: int) -> Any:
    """Image-like samples: incompressible pixels (like JPEG bytes) and a label derived from them."""
    side = int((sample_bytes // 4) ** 0.5)
    rng = np.random.default_rng(0)
    for i in range(n):
        img = rng.integers(0, 256, size=(side, side, 4), dtype=np.uint8)
        yield {"image": img, "label": int(img[0, 0, 0]) % 10, "id": i}


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 16, kernel_size=5, stride=4)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        return self.head(x.mean(dim=(2, 3)))


def make_step(spec: str) -> Any:
    if spec.startswith("sleep:"):
        delay = float(spec.split(":", 1)[1])
        return lambda batch: time.sleep(delay)
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: dict[str, Any]) -> None:
        x = batch["image"].permute(0, 3, 1, 2).float().div_(255)
        loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def run_epoch(ds: Any, loader: Any, epoch: int, step: Any, meter: Any, keep: list[Any] | None = None) -> dict[str, Any]:
    """One epoch through ``loader``, timed; ``keep``: gets copies of the first ``KEEP`` batches."""
    ds.set_epoch(epoch)
    waits, computes = [], []
    remote0 = meter()
    t_start = time.perf_counter()
    bar = tqdm(total=len(ds), desc=f"epoch {epoch + 1}", unit="batch", dynamic_ncols=True)  # batched mode: batches
    it = iter(loader)
    samples = 0
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        if keep is not None and len(keep) < KEEP:
            keep.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
            t1 = time.perf_counter()
        step(batch)
        t2 = time.perf_counter()
        waits.append(t1 - t0)
        computes.append(t2 - t1)
        samples += len(next(iter(batch.values())))
        if len(waits) % 5 == 0:
            st = ds.cache.stats()
            wall = t2 - t_start
            bar.set_postfix_str(f"{samples / wall:.0f} samples/s, wait {100 * sum(waits) / wall:.0f}%, "
                                f"hits ram/ssd {st['hits_ram']}/{st['hits_ssd']}, "
                                f"remote {(meter() - remote0) / 1e6:.0f} MB")
        bar.update(1)
    bar.close()
    wall = time.perf_counter() - t_start
    return {"epoch": epoch, "wall": wall, "wait": sum(waits), "compute": sum(computes), "samples": samples,
            "batches": len(waits), "remote_bytes": meter() - remote0, "waits": waits}


def step_alone(step: Any, batches: list[Any], reps: int = 12) -> float:
    """The median time of one training step on ``batches`` (cycled ``reps`` times) with no data
    pipeline running: what a step costs when it has the CPUs to itself."""
    times = []
    for i in range(max(reps, len(batches))):
        t0 = time.perf_counter()
        step(batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _name(r: dict[str, Any]) -> str:
    return f"{r['epoch'] + 1} ({'cold' if r['epoch'] == 0 else 'warm'})"


def report(results: list[dict[str, Any]], dataset_bytes: int, bandwidth: float | None) -> str:
    """The cold-vs-warm table: per epoch its wall time, the step's time inside its loop, and the
    bounds; the compute bound is ``compute_bound`` (the step alone, the same measure for every
    epoch), the link bound the epoch's remote bytes / ``bandwidth``."""
    rows = ["| epoch | wall s | data wait s | step time in loop s | remote MB | link bound s | compute bound s "
            "(step alone) | wall / max(bounds) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        link = r["remote_bytes"] / bandwidth if bandwidth else 0.0
        bound = max(link, r["compute_bound"])
        ratio = f"{r['wall'] / bound:.2f}" if bound > 0 else "-"
        rows.append(f"| {_name(r)} | {r['wall']:.1f} | {r['wait']:.1f} ({100 * r['wait'] / r['wall']:.0f} %) | "
                    f"{r['compute']:.1f} | {r['remote_bytes'] / 1e6:.1f} | {link:.1f} | {r['compute_bound']:.1f} | "
                    f"{ratio} |")
    walls = ", ".join(f"{'cold' if r['epoch'] == 0 else 'warm'} {r['wall']:.1f} s" for r in results)
    slower = results[0]["wall"] / results[-1]["wall"] if len(results) > 1 and results[-1]["wall"] > 0 else None
    rows += [f"\nwall time side by side: {walls}" + (f" (cold {slower:.1f}x the warm)" if slower else ""),
             f"dataset: {format_size(dataset_bytes)}; link bound = remote bytes / bandwidth",
             f"compute bound = batches x the step's median time alone ({1000 * results[0]['step_alone']:.1f} ms, "
             f"replayed on kept batches after the epochs): the same measure for every epoch",
             "step time in loop = the step's time inside that epoch's loop, where it shares the CPUs with the data "
             "pipeline (fetching, hashing, decoding): higher in a cold epoch"]
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for r in results:
        ax.plot(np.arange(len(r["waits"])), np.array(r["waits"]) * 1000,
                label=f"epoch {r['epoch'] + 1} ({'cold' if r['epoch'] == 0 else 'warm'})", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("data wait per step (ms)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("datacache: time the training loop waited for data")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    bandwidth = float(parse_size(args.bandwidth)) if not args.url else None
    with ExitStack() as stack:
        if args.url:
            url, opts = args.url, {}
            meter = None
        else:
            from tools.s3server import SeaweedServer
            from tools.slowlink import SlowLink

            print("starting the embedded object store (SeaweedFS) ...", flush=True)
            server = stack.enter_context(SeaweedServer("demo", data_dir=os.path.join(args.out, "s3")))
            link = stack.enter_context(SlowLink("127.0.0.1", server.port, bandwidth=bandwidth, latency=args.latency))
            url = f"s3://{server.bucket}/synthetic-{args.size}-{args.sample_bytes}/"
            ensure_dataset(url, server.storage_options(), args)
            opts = server.storage_options(link.endpoint_url)
            meter = lambda: link.bytes_down  # noqa: E731
            print(f"slow link: {format_size(bandwidth)}/s shared, {args.latency * 1000:.0f} ms per request, "
                  f"at {link.endpoint_url}", flush=True)
        cfg = datacache.CacheConfig(ram_bytes=args.ram_bytes, ssd_bytes="4GB",
                                    ram_dir=f"/dev/shm/datacache-demo-{os.getuid()}",
                                    ssd_dir=os.path.join(args.out, "cache"))
        cache = stack.enter_context(datacache.NodeCache(cfg))
        stack.callback(cache.clear, tiers=("ram",))  # give /dev/shm back when the demo ends
        if not args.keep_cache:
            cache.clear()
        cache.reset_stats()
        ds = datacache.StreamingDataset(url, storage_options=opts, cache=cache, seed=0, batch_size=args.batch_size)
        stack.callback(ds.close)
        if meter is None:
            meter = lambda: ds.cache.stats()["remote_bytes"]  # noqa: E731
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers,  # batched mode
                                             persistent_workers=args.workers > 0)
        compute = args.compute
        if compute == "model" and not (ds.manifest.schema.get("image") == "ndarray"
                                       and ds.manifest.schema.get("label") == "int"):
            print("dataset has no 'image' array and 'label' int: simulating 20 ms of compute per batch", flush=True)
            compute = "sleep:0.02"
        step = make_step(compute)
        kept: list[Any] = []
        results = [run_epoch(ds, loader, e, step, meter, kept if e == args.epochs - 1 else None)
                   for e in range(args.epochs)]
        alone = step_alone(step, kept) if kept else 0.0
        for r in results:
            r.update(step_alone=alone, compute_bound=alone * r["batches"])
        table = report(results, ds.manifest.total_bytes, bandwidth)
        png = os.path.join(args.out, "data_wait.png")
        plot(results, png)
        with open(os.path.join(args.out, "demo.json"), "w") as f:
            json.dump({"args": vars(args), "results": [{k: v for k, v in r.items() if k != "waits"} for r in results],
                       "cache": ds.stats()}, f, indent=1, default=str)
        print("\n" + table)
        print(f"\nper-step data wait plot: {png}")
    return 0


def ensure_dataset(url: str, storage_options: dict[str, Any], args: argparse.Namespace) -> None:
    store = datacache.open_store(url, storage_options)
    if store.exists("manifest.json"):
        print(f"dataset already at {url}", flush=True)
        return
    sample_bytes = parse_size(args.sample_bytes)
    n = parse_size(args.size) // sample_bytes
    print(f"writing {n} synthetic samples ({args.size}) to {url} ...", flush=True)
    datacache.write_dataset(synthetic(n, sample_bytes), url, storage_options=storage_options,
                            shard_bytes=parse_size(args.shard_bytes))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: stopped every process the demo started", file=sys.stderr)
        sys.exit(130)
