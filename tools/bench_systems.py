"""One runner per system for ``tools/bench.py``; each run is its own process (fresh imports, caches).

    python tools/bench_systems.py write SPEC.json    # write the dataset in a system's own format
    python tools/bench_systems.py run SPEC.json      # run one (system, scenario, rep); torchrun-able

SPEC is written by ``tools/bench.py``. A run writes its epoch records (JSON) to ``spec["result"]``
(``.rank<N>`` appended under torchrun) or ``{"unavailable": reason}`` when the system's package
cannot be imported here. Peers are imported only inside their own runner, so datacache alone
needs none of them.

Systems (each with its defaults; ``tuned`` changes the one documented setting):

- ``datacache``: its documented usage, batched mode: ``StreamingDataset(batch_size=B)`` +
  ``DataLoader(batch_size=None, persistent_workers=True)`` (batches are collated in the worker into a
  shared-memory ring and cross to the main process without a copy; see ``datacache._batches``).
- ``streaming`` (mosaicml-streaming): MDS shards (``MDSWriter``, no compression), S3 through boto3
  (``S3_ENDPOINT_URL``); tuned: ``predownload`` = 4 shards of samples per worker (default 8 x batch),
  or, with a cache limit C, ``shuffle_block_size`` = the samples of C/2 (the default py1e blocks of
  262144 samples spread every epoch over the whole dataset, so a cache of D/2 thrashes).
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
  options (the emulated link is http on loopback); nothing else changes.
- ``fsspec``: the no-cache baseline: the datacache shards read whole with s3fs (one ``cat_file``
  per shard, no prefetch, no cache: the shard bytes are decoded and dropped), shard order shuffled
  per epoch, samples shuffled within a shard.
"""
from __future__ import annotations

import _thread
import json
import os
import shutil
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


# ---------------------------------------------------------------- samples (the same for every system)
def sample_side(sample_bytes: int) -> int:
    return int((sample_bytes // 4) ** 0.5)


def make_sample(i: int, side: int) -> dict[str, Any]:
    """Sample ``i``: incompressible image-like pixels (like JPEG bytes), a label and the id."""
    img = np.frombuffer(np.random.default_rng(i).bytes(side * side * 4), dtype=np.uint8).reshape(side, side, 4)
    return {"image": img, "label": int(img[0, 0, 0]) % 10, "id": i}


def _s3fs(opts: dict[str, Any]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(key=opts["key"], secret=opts["secret"], client_kwargs=opts["client_kwargs"])


def _upload_dir(local: str, url: str, opts: dict[str, Any]) -> None:
    fs = _s3fs(opts)
    prefix = url[len("s3://"):].rstrip("/")
    for dirpath, _, files in os.walk(local):
        for f in files:
            path = os.path.join(dirpath, f)
            fs.put_file(path, f"{prefix}/{os.path.relpath(path, local)}")


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
        import datacache  # noqa: F401
        import s3fs  # noqa: F401
    else:
        raise ImportError(f"unknown system {system!r}")


# ---------------------------------------------------------------- writers
def write(spec: dict[str, Any]) -> dict[str, Any]:
    """Write ``spec["n"]`` samples at ``spec["url"]`` in ``spec["system"]``'s format; returns its bytes."""
    system, n, side, shard = spec["system"], spec["n"], sample_side(spec["sample_bytes"]), spec["shard_bytes"]
    opts = spec["storage_options"]  # the server itself: setup traffic never crosses the link
    samples = (make_sample(i, side) for i in range(n))
    import_system(system)
    if system == "datacache":
        import datacache

        # overwrite: bench.py writes only where its bench-meta.json is missing, which an earlier
        # run that stopped after the dataset but before the meta leaves behind
        m = datacache.write_dataset(samples, spec["url"], storage_options=opts, shard_bytes=shard, progress=False,
                                    overwrite=True)
        return {"bytes": m.total_bytes, "files": len(m.shards)}
    tmp = tempfile.mkdtemp(prefix=f"bench-write-{system}-", dir=spec.get("tmp"))
    try:
        if system == "streaming":
            from streaming import MDSWriter

            cols = {"image": f"ndarray:uint8:{side},{side},4", "label": "int", "id": "int"}
            with MDSWriter(out=tmp, columns=cols, size_limit=shard) as w:
                for s in samples:
                    w.write(s)
        elif system == "litdata":
            from litdata import optimize

            os.environ.setdefault("DATA_OPTIMIZER_CACHE_FOLDER", tmp + "-optimizer-cache")
            optimize(fn=_lit_sample, inputs=[(i, side) for i in range(n)], output_dir=tmp, chunk_bytes=shard,
                     num_workers=1, reorder_files=False, verbose=False, start_method="fork")
        else:
            raise ValueError(f"{system} has no writer (it reads the datacache shards)")
        files = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs]
        _upload_dir(tmp, spec["url"], opts)
        return {"bytes": sum(os.path.getsize(f) for f in files if not f.endswith(".json")), "files": len(files)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp + "-optimizer-cache", ignore_errors=True)


def _lit_sample(arg: tuple[int, int]) -> dict[str, Any]:
    return make_sample(*arg)


# ---------------------------------------------------------------- loaders
def build(spec: dict[str, Any]) -> tuple[Any, Callable[[int], None], Callable[[], dict[str, Any]], Callable[[], None]]:
    """(loader, set_epoch, stats, close) for the spec's system and scenario."""
    sc, system = spec["scenario"], spec["system"]
    bs, workers, cache_dir, C = sc["batch_size"], sc["workers"], spec["cache_dir"], sc.get("cache_bytes")
    import torch.utils.data as tud

    if system == "datacache":
        import datacache

        cfg = datacache.CacheConfig(ram_dir=os.path.join(cache_dir, "ram"), ssd_dir=spec["ssd_dir"],
                                    **({"ram_bytes": C, "ssd_bytes": 0} if C else {}))
        ds = datacache.StreamingDataset(spec["url"], storage_options=spec["storage_options"], cache=cfg,
                                        shuffle=True, seed=0, batch_size=bs)
        loader = tud.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
        return loader, ds.set_epoch, ds.stats, ds.close
    if system == "streaming":
        import streaming
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        kw: dict[str, Any] = {}
        if spec["variant"] == "tuned" and C:  # shuffle blocks that fit in half the cache
            kw["shuffle_block_size"] = max(bs, C // 2 // spec["sample_bytes"])
        elif spec["variant"] == "tuned":  # 4 shards ahead per worker
            kw["predownload"] = 4 * spec["samples_per_shard"]
        if C:
            kw["cache_limit"] = C
        ds = streaming.StreamingDataset(remote=spec["url"], local=os.path.join(cache_dir, "local"), shuffle=True,
                                        shuffle_seed=0, batch_size=bs, **kw)
        for stream in ds.streams:  # fork safety, see the module docstring
            downloader = getattr(stream, "_downloader", None)
            if getattr(downloader, "_s3_client", None) is not None:
                downloader._s3_client = None
        loader = tud.DataLoader(ds, batch_size=bs, num_workers=workers)
        return loader, lambda e: None, lambda: {}, lambda: None
    if system == "litdata":
        import litdata

        kw = {"max_pre_download": 8} if spec["variant"] == "tuned" else {}
        if C:
            kw["max_cache_size"] = C
        ds = litdata.StreamingDataset(spec["url"], cache_dir=os.path.join(cache_dir, "lit"), shuffle=True, seed=0,
                                      storage_options=spec["litdata_options"], **kw)
        loader = litdata.StreamingDataLoader(ds, batch_size=bs, num_workers=workers)
        return loader, lambda e: None, lambda: {}, lambda: None
    if system == "fsspec":
        ds = FsspecShards(spec["url"], spec["storage_options"])
        loader = tud.DataLoader(ds, batch_size=bs, num_workers=workers)
        return loader, ds.set_epoch, lambda: {}, lambda: None
    raise ValueError(system)


def _iterable_base() -> type:
    import torch.utils.data as tud

    return tud.IterableDataset


class FsspecShards(_iterable_base()):  # type: ignore[misc]
    """No cache, no prefetch: each consumer reads its shards whole with s3fs when it reaches them."""

    def __init__(self, url: str, opts: dict[str, Any]) -> None:
        super().__init__()
        self.url, self.opts, self.epoch = url.rstrip("/"), opts, 0
        self.shards = [s["name"] for s in json.loads(_s3fs(opts).cat_file(f"{self.url}/manifest.json"))["shards"]]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        import torch.utils.data as tud

        import readers

        info = tud.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        rng = np.random.default_rng([0, self.epoch])
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


def _batch_ids(batch: Any) -> list[int]:
    v = batch["id"] if isinstance(batch, dict) else batch[0]
    return [int(i) for i in (v.tolist() if hasattr(v, "tolist") else v)]


def run_epoch(loader: Any, compute: float, meter_url: str, barrier: Callable[[], None],
              max_bytes: float = float("inf")) -> dict[str, Any]:
    """One epoch: wall, data wait (time in ``next``, worker start-up included), remote bytes at the
    proxy. Stops early ("aborted") once the epoch has pulled more than ``max_bytes`` (thrashing)."""
    barrier()
    m0 = meter(meter_url)
    t0 = time.perf_counter()
    wait, first, aborted = 0.0, None, None
    batches = samples = 0
    it = None
    stop, tripped, timeline, arrivals, seen = threading.Event(), [], [], [], set()

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
                batch = next(it)
            except StopIteration:
                break
            wait += time.perf_counter() - ta
            first = time.perf_counter() - t0 if first is None else first
            arrivals.append(round(time.perf_counter() - t0, 4))
            ids = _batch_ids(batch)
            samples += len(ids)
            seen.update(ids)
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
    m1 = meter(meter_url)
    return {"wall": wall, "own_wall": own, "wait": wait, "first_batch": first, "compute": batches * compute,
            "batches": batches, "samples": samples, "unique_samples": len(seen), "remote_bytes": m1["bytes_down"] - m0["bytes_down"],
            "requests": m1["requests"] - m0["requests"], "link_timeline": timeline, "batch_times": arrivals,
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
    barrier: Callable[[], None] = lambda: None
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
            measured = phase == "measured"
            if prof is not None and measured:
                prof.start()
            rec = run_epoch(loader, sc["compute"] if measured else 0.0, spec["meter_url"], barrier,
                            spec.get("max_epoch_bytes") or float("inf"))
            if prof is not None and measured:
                prof.stop()
            rec.update(epoch=e, phase=phase, stats=_jsonable(stats()))
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
