"""One runner per system for ``tools/bench.py``; each run is its own process (fresh imports, caches).

    python tools/bench_systems.py write SPEC.json    # write the dataset in a system's own format
    python tools/bench_systems.py run SPEC.json      # run one (system, scenario, rep); torchrun-able

SPEC is written by ``tools/bench.py``. A run writes its epoch records (JSON) to ``spec["result"]``
(``.rank<N>`` appended under torchrun) or ``{"unavailable": reason}`` when the system's package
cannot be imported here. Peers are imported only inside their own runner, so datacache alone
needs none of them.

Every loader gets ``loader_kw``: the scenario's workers and ``persistent_workers=True`` (each
peer reshuffles per epoch and reads every sample exactly once with persistent workers: checked
with ``first_ids`` and ``unique_samples`` per epoch), and the scenario's batch size.

Systems (each with its defaults; ``tuned`` changes the one documented setting; ``match-X`` sets
the system's documented shuffle knobs toward X's shuffle quality):

- ``datacache``: its documented usage, ``datacache.DataLoader(ds, batch_size=B)``, which puts the
  dataset in batched mode (batches are collated in the worker into a shared-memory ring and cross
  to the main process without a copy; see ``datacache.pytorch.batches``). match-streaming:
  ``window`` = every shard of the dataset; match-litdata: ``window=1`` (one shard run at a time)
  and ``node_shuffle="never"`` (warm epochs too);
  dropin (warm only): the drop-in line, ``torch.utils.data.DataLoader(StreamingDataset(url),
  batch_size=B)`` over samples (torch's per-sample path), beside the default; never (raw, raw-bytes,
  small, small-1024): ``node_shuffle="never"``, the warm epoch in the sliding window's order.
- the images scenario: every system's samples pass through the same ``bench_images.Decode`` (JPEG
  decode and random crop, timed on the thread's CPU clock), through its documented hook: datacache
  and LitData ``StreamingDataset(transform=)``, Streaming a subclass's ``__getitem__``.
- CPU: ``run_epoch`` records the CPU-seconds of the run's processes between its barriers
  (``tools/bench_cpu.py``), the images scenario the decode's (``decode_cpu_s``).
- ``streaming`` (mosaicml-streaming): MDS shards (``MDSWriter``, no compression), S3 through boto3
  (``S3_ENDPOINT_URL``); tuned: ``predownload`` = 4 shards of samples per worker (default 8 x batch),
  or, with a cache limit C, ``shuffle_block_size`` = the samples of C/2 (the default py1e blocks of
  262144 samples spread every epoch over the whole dataset, so a cache of D/2 thrashes);
  match-datacache: ``shuffle_algo="py1e"``, ``num_canonical_nodes=1``, ``shuffle_block_size`` =
  datacache's ``DEFAULT_WINDOW`` shards of samples (the same mixing span as datacache's window).
  Fork safety: the main process downloads ``index.json`` with a boto3 client that forked DataLoader
  workers inherit with its pooled keep-alive connection; two processes then share one socket and a
  GET can wait for its 60 s read timeout (seen here as 61 s stalls). Streaming drops that client
  when it pickles the downloader for spawned workers; the runner drops it the same way before the
  workers fork, so each worker opens its own connections.
  It imports ``torchvision`` (for ``streaming.vision``) and ``transformers`` (three names used in
  isinstance checks and the text datasets) at import time; neither is used by ``StreamingDataset``
  or ``MDSWriter``, and PyPI's torchvision does not import beside this torch build, so this runner
  (only) injects inert stub modules for them (``_stub_streaming_imports``).
- ``litdata``: ``optimize`` chunks, ``litdata.StreamingDataset`` + ``StreamingDataLoader``, S3 via
  boto3/obstore; tuned: ``max_pre_download=8`` (default 2). obstore refuses a plain-http endpoint
  unless its client options allow http: this runner adds ``allow_http`` to LitData's obstore client
  options (the emulated link is http on loopback); nothing else changes. No match variant: LitData
  mixes within a chunk only (``item_shuffle_window``), it has no knob that mixes across chunks.
  With ``max_cache_size`` = C < D (limited) 0.2.76 stalls: its node-wide disk-slot counter
  (``.litdata_cache_slots``, ``reader._acquire_cache_slot``) counts more chunks than are on disk
  (16 slots used, 14 chunk files, seen at 500 MB), so no further chunk may download and a worker
  raises ``ChunkWaitTimeoutError`` after 120 s: shown as failed.
- the mix scenario: each system's mixing API, in ``tools/bench_mix.py``.
- ``fsspec``: the no-cache baseline: the datacache shards read whole with s3fs (one ``cat_file``
  per shard, no prefetch, no cache: the shard bytes are decoded and dropped), shard order shuffled
  per epoch, samples shuffled within a shard.
"""
from __future__ import annotations

import _thread
import json
import os
import sys
import tempfile
import threading
import time
import types
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools import bench_cpu, bench_images, bench_mix, bench_nodes, bench_peers  # noqa: E402
from tools.bench_quality import BatchQuality  # noqa: E402
from tools.bench_write import _s3fs, write  # noqa: E402

PACKAGES = {"streaming": "mosaicml-streaming==0.13.0", "litdata": "litdata==0.2.76"}


# ---------------------------------------------------------------- peers' import work-arounds
def _stub_streaming_imports() -> None:
    """Inert stand-ins for torchvision / transformers, which mosaicml-streaming imports at import time
    for its vision/text dataset classes and a loader isinstance check, none of which the bench uses."""
    def stub(name: str, **attrs: Any) -> None:
        if name in sys.modules:
            return
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so submodules resolve to the stubs below
        mod.__dict__.update(attrs, __bench_stub__=True)
        sys.modules[name] = mod

    def unavailable(*_: Any, **__: Any) -> Any:
        raise RuntimeError("stub: torchvision/transformers are not available in the benchmark")

    stub("torchvision")
    stub("torchvision.datasets", VisionDataset=type("VisionDataset", (), {}), CIFAR10=unavailable)
    stub("torchvision.transforms")
    stub("torchvision.transforms.functional", to_tensor=unavailable)
    stub("transformers")
    stub("transformers.feature_extraction_utils", BatchFeature=type("BatchFeature", (dict,), {}))
    stub("transformers.tokenization_utils_base", BatchEncoding=type("BatchEncoding", (dict,), {}))
    stub("transformers.models")
    stub("transformers.models.auto")
    stub("transformers.models.auto.tokenization_auto", AutoTokenizer=unavailable)


def _litdata_allow_http() -> None:
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}


def import_system(system: str) -> None:
    """Import the system's package (raises ImportError with the reason if it cannot run here)."""
    if system == "streaming":
        _stub_streaming_imports()
        import streaming  # noqa: F401
    elif system == "litdata":
        import litdata  # noqa: F401
        _litdata_allow_http()
    elif system in ("datacache", "fsspec"):
        import s3fs  # noqa: F401

        import datacache  # noqa: F401
    else:
        raise ImportError(f"unknown system {system!r}")


# ---------------------------------------------------------------- loaders
def loader_kw(spec: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader settings every system gets (workers, persistent workers, prefetch)."""
    sc = spec["scenario"]
    persistent = bool(sc.get("persistent_workers", True)) and sc["workers"] > 0
    return {"num_workers": sc["workers"], "persistent_workers": persistent}


def _streaming_ready(ds: Any) -> None:
    """Fork safety for a Streaming dataset (see the module docstring): drop the boto3 client that
    downloaded ``index.json``, so each forked worker opens its own connections."""
    for stream in ds.streams:
        downloader = getattr(stream, "_downloader", None)
        if getattr(downloader, "_s3_client", None) is not None:
            downloader._s3_client = None


def build(spec: dict[str, Any]) -> tuple[Any, Callable[[int], None], Callable[[], dict[str, Any]], Callable[[], None]]:
    """(loader, set_epoch, stats, close) for the spec's system, variant and scenario; every loader
    gets ``loader_kw(spec)`` and the scenario's batch size."""
    sc, system, variant = spec["scenario"], spec["system"], spec["variant"]
    bs, cache_dir, C, lkw = sc["batch_size"], spec["cache_dir"], sc.get("cache_bytes"), loader_kw(spec)
    import torch.utils.data as tud

    if spec.get("streams"):  # the mix scenario: tools/bench_mix.py
        return bench_mix.build(spec, lkw, _streaming_ready)
    if system == "datacache":
        import datacache

        cfg = datacache.CacheConfig(ram_dir=os.path.join(cache_dir, "ram"), ssd_dir=spec["ssd_dir"],
                                    **({"ram_bytes": C, "ssd_bytes": 0} if C else {}))
        window = {"match-litdata": {"window": 1, "node_shuffle": "never"},  # one shard run at a time, as LitData reads
                  "window": {"node_shuffle": "window"},  # the cold epoch through the window, not a part mix
                  "never": {"node_shuffle": "never"},  # the sliding window only, warm epochs too
                  "match-streaming": {"window": spec.get("shards", 1)}}.get(variant, {})  # every shard
        batched = {"batch_size": bs} if variant == "torch" else {}
        ds = datacache.StreamingDataset(spec["url"], storage_options=spec["storage_options"], cache=cfg,
                                        shuffle=True, seed=0, **window, **batched, **_transform(spec),
                                        **bench_peers.dataset_kwargs(spec))
        if variant == "dropin":  # the line users write first: torch's DataLoader over samples
            loader = tud.DataLoader(ds, batch_size=bs, **lkw)
        elif batched:  # batched mode through torch's own DataLoader (no StatefulDataLoader)
            loader = tud.DataLoader(ds, batch_size=None, **lkw)
        else:
            loader = datacache.DataLoader(ds, batch_size=bs, **lkw)  # the README's line: batched mode
        return loader, ds.set_epoch, ds.stats, ds.close
    if system == "streaming":
        import streaming
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        kw: dict[str, Any] = {}
        if variant == "tuned" and C:  # shuffle blocks that fit in half the cache
            kw["shuffle_block_size"] = max(bs, C // 2 // spec["sample_bytes"])
        elif variant == "tuned":  # 4 shards ahead per worker
            kw["predownload"] = 4 * spec["samples_per_shard"]
        elif variant == "match-datacache":  # py1e blocks of datacache's window of shards
            from datacache.plan.epoch import DEFAULT_WINDOW

            kw.update(shuffle_algo="py1e", num_canonical_nodes=1,
                      shuffle_block_size=DEFAULT_WINDOW * spec["samples_per_shard"])
        if C:
            kw["cache_limit"] = C
        kw.update(bench_nodes.loader_kwargs(system, sc))
        kind = streaming.StreamingDataset
        if _transform(spec):  # Streaming's documented hook: a subclass's __getitem__
            kind = bench_images.streaming_dataset(kind, _transform(spec)["transform"])
        ds = kind(remote=spec["url"], local=os.path.join(cache_dir, "local"), shuffle=True, shuffle_seed=0,
                  batch_size=bs, **kw)
        _streaming_ready(ds)
        loader = tud.DataLoader(ds, batch_size=bs, **lkw)
        return loader, lambda e: None, lambda: {}, lambda: None
    if system == "litdata":
        import litdata

        kw = {"max_pre_download": 8} if variant == "tuned" else {}
        if C:
            kw["max_cache_size"] = C
        ds = litdata.StreamingDataset(spec["url"], cache_dir=os.path.join(cache_dir, "lit"), shuffle=True, seed=0,
                                      storage_options=spec["litdata_options"], **kw, **_transform(spec))
        loader = litdata.StreamingDataLoader(ds, batch_size=bs, **lkw)
        return loader, lambda e: None, lambda: {}, lambda: None
    if system == "fsspec":
        ds = FsspecShards(spec["url"], spec["storage_options"])
        loader = tud.DataLoader(ds, batch_size=bs, **lkw)
        return loader, ds.set_epoch, lambda: {}, lambda: None
    raise ValueError(system)


def decode_dir(spec: dict[str, Any]) -> str:
    """Where the images scenario's decode clocks live (in the run's cache directory)."""
    return os.path.join(spec["cache_dir"], "decode-clock")


def _transform(spec: dict[str, Any]) -> dict[str, Any]:
    """{"transform": the per-sample transform} of the spec's dataset ({} but for images); one
    object per spec, so a system's hooks all get the same one."""
    if spec["scenario"].get("dataset") != "images":
        return {}
    if "_transform" not in spec:
        os.makedirs(decode_dir(spec), exist_ok=True)
        spec["_transform"] = bench_images.Decode(decode_dir(spec))
    return {"transform": spec["_transform"]}


def _iterable_base() -> type:
    import torch.utils.data as tud

    return tud.IterableDataset


class FsspecShards(_iterable_base()):  # type: ignore[misc]
    """No cache, no prefetch: each consumer reads its shards whole with s3fs when it reaches them."""

    def __init__(self, url: str, opts: dict[str, Any]) -> None:
        super().__init__()
        self.url, self.opts, self.epoch, self.iters = url.rstrip("/"), opts, 0, 0
        self.shards = [s["name"] for s in json.loads(_s3fs(opts).cat_file(f"{self.url}/manifest.json"))["shards"]]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        import torch.utils.data as tud

        from datacache import readers

        # a persistent worker's copy never sees set_epoch: it counts its own epochs instead
        epoch, self.iters = self.epoch + self.iters, self.iters + 1
        info = tud.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        rng = np.random.default_rng([0, epoch])
        order = rng.permutation(len(self.shards))[rank * nw + wid::world * nw]
        fs, fmt = _s3fs(self.opts), readers.get_format("zstd")
        for s in order:
            data = fs.cat_file(f"{self.url}/{self.shards[s]}")
            with tempfile.NamedTemporaryFile(dir="/dev/shm", suffix=".dcz") as f:
                f.write(data)
                f.flush()
                with fmt.open(f.name) as reader:
                    samples = list(reader.iter_range(0, len(reader)))
            for j in rng.permutation(len(samples)):
                yield samples[j]


# ---------------------------------------------------------------- the measured loop
def meter(url: str) -> dict[str, int]:
    """The link's counters, read at the proxy (never self-reported)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


STALL_S = 90.0


def _batch_ids(batch: Any) -> np.ndarray:
    """The batch's sample ids, copied (a batch may live in a slot its loader reuses)."""
    v = batch["id"] if isinstance(batch, dict) else batch[0]
    return np.array(v.numpy() if hasattr(v, "numpy") else v, dtype=np.int64)


def _count_ids(batches: list[np.ndarray], quality: Any, per_stream: Any) -> int:
    """After the epoch: feeds the batches' ids to the quality and per-stream counters; the
    distinct samples."""
    for ids in batches:
        if quality is not None:
            quality.add(ids)
        if per_stream is not None:
            per_stream.add(ids)
    return len(np.unique(np.concatenate(batches))) if batches else 0


STEP_SAMPLES = 40  # simulated steps timed after each epoch, with no batch moving: the compute bound


def measured_step(compute: float, n: int = STEP_SAMPLES) -> float:
    """Mean seconds one simulated step (``time.sleep(compute)``) takes on this machine now, timed
    over ``n`` steps while no batch moves. A sleep overshoots its argument (0.2 ms per 20 ms step
    on the 2-core VM, 1 % of an epoch), and that overshoot is the training loop's, not the
    loader's: the compute bound is ``batches x`` this, measured in the same run."""
    if not compute:
        return 0.0
    t = time.perf_counter()
    for _ in range(n):
        time.sleep(compute)
    return (time.perf_counter() - t) / n


def run_epoch(loader: Any, compute: float, meter_url: str, barrier: Callable[[], None],
              max_bytes: float = float("inf"), n: int = 0, bounds: list[int] | None = None,
              bitmap: bool = False) -> dict[str, Any]:
    """One epoch: wall, data wait (time in ``next``, worker start-up included: ``startup`` is the
    time in ``iter(loader)``; ``batch_waits``: each batch's, beside ``batch_times``: when each
    came), remote bytes at the proxy, shuffle quality of the batches on the class-sorted ``n``
    samples (``tools/bench_quality.py``), with a mix's stream ``bounds`` the
    samples per stream (``bench_mix.StreamCounts``). Stops early ("aborted") once the epoch has
    pulled more than ``max_bytes`` (thrashing). With peer links on the meter
    (``tools/bench_peers.py``) the bytes they carried too; with ``bitmap`` the set of sample ids
    read (``ids_bits``, joined over the nodes by ``bench_peers.finish``)."""
    barrier()
    m0 = meter(meter_url)
    cpu0 = bench_cpu.snapshot()
    t0 = time.perf_counter()
    first, aborted = None, None
    batches = 0
    it, startup, quality = None, 0.0, BatchQuality(n) if n else None
    per_stream = bench_mix.StreamCounts(bounds) if bounds else None
    stop, tripped, timeline, arrivals, got, waits = threading.Event(), [], [], [], [], []

    def watchdog() -> None:  # samples the link; interrupts the loop (even in next()) once the epoch
        last = (0, 0, time.perf_counter())  # thrashes, or stalls (no batch and no byte for STALL_S)
        while not stop.wait(0.25):
            pulled = meter(meter_url)["bytes_down"] - m0["bytes_down"]
            now = time.perf_counter()
            timeline.append((round(now - t0, 3), pulled))
            if pulled > max_bytes:
                tripped.append(f"{pulled / 1e6:.0f} MB pulled this epoch (thrashing)")
            elif (pulled, len(arrivals)) != last[:2]:
                last = (pulled, len(arrivals), now)
            elif now - last[2] > STALL_S:
                tripped.append(f"no batch and no byte for {STALL_S:.0f} s (stalled)")
            if tripped:
                _thread.interrupt_main()
                return

    threading.Thread(target=watchdog, daemon=True, name="bench-watchdog").start()
    try:
        while True:
            ta = time.perf_counter()
            try:
                if it is None:
                    it = iter(loader)  # worker start-up counts as waiting for data
                    startup = time.perf_counter() - ta
                batch = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            waits.append(now - ta)
            first = now - t0 if first is None else first
            arrivals.append(now - t0)
            got.append(_batch_ids(batch))  # a copy; counted after the epoch, outside the timing
            batches += 1
            if compute:
                time.sleep(compute)  # the simulated training step
    except KeyboardInterrupt:
        if not tripped:
            raise
        aborted = f"stopped after {batches} batches: {tripped[0]}"
    finally:
        stop.set()
    own = time.perf_counter() - t0
    barrier()
    wall = time.perf_counter() - t0  # the node's wall: until the last rank is done
    cpu = bench_cpu.delta(cpu0, bench_cpu.snapshot())  # every process of the run (tools/bench_cpu.py)
    m1 = meter(meter_url)
    step = measured_step(compute)  # outside the epoch's timing
    unique = _count_ids(got, quality, per_stream)
    samples = sum(len(ids) for ids in got)
    head = got[0][:8].tolist() if got else None  # the epoch's order differs from the last one's?
    arrivals = [round(t, 4) for t in arrivals]
    wait, waits = sum(waits), [round(t, 5) for t in waits]
    return {"wall": wall, "own_wall": own, "wait": wait, "first_batch": first, "compute": batches * step,
            "compute_nominal": batches * compute,
            "batches": batches, "samples": samples, "unique_samples": unique,
            "remote_bytes": m1["bytes_down"] - m0["bytes_down"],
            "requests": m1["requests"] - m0["requests"], "link_timeline": timeline, "batch_times": arrivals,
            "batch_waits": waits,
            "startup": startup, "first_ids": head, **(quality.summary() if quality is not None else {}),
            **(per_stream.summary() if per_stream is not None else {}),
            **cpu, **bench_peers.peer_delta(m0, m1),
            **({"ids_bits": bench_peers.ids_bits(got, n)} if bitmap and n else {}),
            **({"aborted": aborted} if aborted else {})}


def _profiler(spec: dict[str, Any]) -> Any:
    if not spec.get("profile"):
        return None
    from pyinstrument import Profiler

    return Profiler(interval=0.001, async_mode="disabled")


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    sc = spec["scenario"]
    node = os.environ.get("BENCH_NODE")
    if node is not None:  # a simulated node of the nodes scenario: its own cache directories
        spec = {**spec, "cache_dir": f"{spec['cache_dir']}-node{node}", "ssd_dir": f"{spec['ssd_dir']}-node{node}"}
        if spec.get("profile") and node != "0":  # node 0's pyinstrument report keeps the name bench.py reads
            spec["profile"] += f".node{node}"
    def no_barrier() -> None:
        return None

    barrier: Callable[[], None] = no_barrier
    bench_peers.node_env(spec)  # the peers scenario's peer list and token for this node, or none
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        barrier = dist.barrier
    loader, set_epoch, stats, close = build(spec)
    prof = _profiler(spec)
    records = []
    try:
        for e, phase in enumerate(sc["phases"]):
            set_epoch(e)
            measured = phase != "fill"  # measured, or the shuffle scenario's cold and warm
            if prof is not None and measured:
                prof.start()
            decoded = _decode_total(spec)
            rec = run_epoch(loader, sc["compute"] if measured else 0.0, spec["meter_url"], barrier,
                            spec.get("max_epoch_bytes") or float("inf"), spec.get("n", 0), spec.get("stream_bounds"),
                            bitmap=int(sc.get("nodes", 1)) > 1)
            if prof is not None and measured:
                prof.stop()
            now = stats()
            rec.update(epoch=e, phase=phase, stats=_jsonable(now), peer_stats=bench_peers.peer_stats(now))
            if decoded is not None:  # the images scenario: the decode's CPU in the epoch
                rec["decode_cpu_s"] = round(_decode_total(spec) - decoded, 3)
            records.append(rec)
            if "aborted" in rec:
                break
    finally:
        close()
    if prof is not None:
        base = spec["profile"]
        with open(base + ".txt", "w") as f:
            f.write(prof.output_text(unicode=False, color=False, show_all=False))
        with open(base + ".html", "w") as f:
            f.write(prof.output_html())
    return records


def _decode_total(spec: dict[str, Any]) -> float | None:
    """The images scenario's decode CPU-seconds so far, every process's (None elsewhere)."""
    if spec["scenario"].get("dataset") != "images":
        return None
    return bench_images.DecodeClock.total(decode_dir(spec)) if os.path.isdir(decode_dir(spec)) else 0.0


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}


def main(argv: list[str]) -> int:
    cmd, path = argv[0], argv[1]
    with open(path) as f:
        spec = json.load(f)
    out = spec["result"]
    if os.environ.get("RANK") is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        out += f".rank{os.environ['RANK']}"
    try:
        import_system(spec["system"])
    except Exception as exc:  # noqa: BLE001 - any import failure makes the system unavailable here
        why = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ModuleNotFoundError) and exc.name in ("streaming", "litdata"):
            why = f"not installed (pip install --no-deps {PACKAGES[exc.name]}, see tools/bench.py)"
        result: Any = {"unavailable": why[:300]}
    else:
        result = write(spec) if cmd == "write" else {"records": run(spec)}
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
