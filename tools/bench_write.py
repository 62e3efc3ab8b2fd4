"""The benchmark's datasets: the same samples written in each system's own format (``write``, used by
``tools/bench_systems.py write``, after it imported the system's package; ``ensure_datasets``, used
by ``tools/bench.py``, writes each one once under the server's bucket). Samples are written in
id order by one writer process, so the write position is the sample id: the class-sorted data of
``tools/bench_quality.py``.

Datasets (``KINDS``): ``main``, ``small`` and ``mix`` hold the pixels as an array; ``bytes`` the same
``--size`` of 64 KiB samples with the pixels as a Python ``bytes`` field; ``images`` JPEG bytes
(``tools/bench_images.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from tools import bench_images, bench_mix
from tools.bench_launch import launch

# A new tag when a system's written format changes, so DIR/s3 never serves a stale layout
# (datacache: incompressible blocks stored raw since the raw-block format; blocks zstd shrinks by
# less than 1/8 since min_saving).
FORMAT_TAGS = {"datacache": "datacache-rawblocks-8"}
KINDS = {"bytes": "bytes", "images": "jpeg"}  # dataset -> its samples' kind (default: "array")
SHARD_DIVISOR = {"shards": 16}  # dataset -> its shards' size as a fraction of --shard-bytes (default: 1)


# ---------------------------------------------------------------- samples (the same for every system)
def sample_side(sample_bytes: int) -> int:
    return int((sample_bytes // 4) ** 0.5)


def make_sample(i: int, side: int) -> dict[str, Any]:
    """Sample ``i``: incompressible image-like pixels (like JPEG bytes), a label and the id."""
    img = np.frombuffer(np.random.default_rng(i).bytes(side * side * 4), dtype=np.uint8).reshape(side, side, 4)
    return {"image": img, "label": int(img[0, 0, 0]) % 10, "id": i}


def make(kind: str, i: int, sample_bytes: int, n: int) -> dict[str, Any]:
    """Sample ``i`` (of ``n``) of a dataset of ``kind``: "array" (``make_sample``), "bytes" (the same
    pixels as ``bytes``) or "jpeg" (``bench_images.sample``)."""
    if kind == "jpeg":
        return bench_images.sample(i, n)
    s = make_sample(i, sample_side(sample_bytes))
    if kind == "bytes":
        s["image"] = s["image"].tobytes()
    return s


def mds_columns(kind: str, side: int) -> dict[str, str]:
    """The MDS columns (Streaming) of a dataset of ``kind``."""
    first = {"array": ("image", f"ndarray:uint8:{side},{side},4"), "bytes": ("image", "bytes"),
             "jpeg": ("jpeg", "bytes")}[kind]
    return dict([first, ("label", "int"), ("id", "int")])


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


# ---------------------------------------------------------------- the datasets of a run (tools/bench.py)
def ensure_datasets(a: argparse.Namespace, server: Any, systems: list[str], datasets: list[str]) -> dict[str, Any]:
    """Write each needed (system format, dataset) once; returns {(system, dataset): info or unavailable}."""
    opts = server.storage_options()
    fs = _s3fs(opts)
    out: dict[str, Any] = {}
    for ds in datasets:
        total, sb = (a.small_size, a.small_sample_bytes) if ds == "small" else (a.size, a.sample_bytes)
        if ds == "images":
            total, sb = a.images_size, a.image_bytes
        n = total // sb
        for system in systems:
            fmt = "datacache" if system == "fsspec" else system
            key = f"{fmt}/{ds}"
            base = f"{server.bucket}/{FORMAT_TAGS.get(fmt, fmt)}"
            if key in out:
                pass
            elif ds == "mix":  # three datasets, consecutive ids: tools/bench_mix.py
                out[key] = bench_mix.dataset(n, lambda k, first, m, fmt=fmt, base=base, sb=sb, ds=ds: _dataset(
                    a, fs, opts, fmt, f"{base}-mix{k}-{first}+{m}x{sb}-{a.shard_bytes}", m, sb, f"{ds}{k}", first))
            else:
                tag = f"-{ds}" if ds in KINDS or ds in SHARD_DIVISOR else ""
                shard = a.shard_bytes // SHARD_DIVISOR.get(ds, 1)
                out[key] = _dataset(a, fs, opts, fmt, f"{base}{tag}-{n}x{sb}-{shard}", n, sb, ds, shard_bytes=shard)
            out[f"{system}/{ds}"] = out[key]
            if ds == "mix" and system in bench_mix.UNAVAILABLE:
                out[f"{system}/{ds}"] = {"unavailable": bench_mix.UNAVAILABLE[system]}
    return out


def _dataset(a: argparse.Namespace, fs: Any, opts: dict[str, Any], fmt: str, prefix: str, n: int, sb: int,
             label: str, first: int = 0, *, shard_bytes: int | None = None) -> dict[str, Any]:
    """The info of ``n`` samples (ids from ``first``) of ``sb`` B in format ``fmt`` at ``s3://prefix/``
    in shards of ``shard_bytes`` (default ``--shard-bytes``), written there unless its
    bench-meta.json says it already is."""
    shard_bytes = shard_bytes or a.shard_bytes
    meta_path = f"{prefix}/bench-meta.json"
    if fs.exists(meta_path):
        return json.loads(fs.cat_file(meta_path))
    print(f"writing {n} samples of {sb} B as {fmt} to s3://{prefix}/ ...", flush=True)
    spec = {"system": fmt, "n": n, "first": first, "sample_bytes": sb, "shard_bytes": shard_bytes,
            "kind": KINDS.get(label, "array"),
            "url": f"s3://{prefix}/", "storage_options": opts, "tmp": a.tmp}
    info = launch("write", spec, os.path.join(a.tmp, f"write-{fmt}-{label}"), timeout=1800)
    if "bytes" in info:
        info = {"n": n, "sample_bytes": sb, "shard_bytes": shard_bytes, "url": f"s3://{prefix}/",
                **info}  # a JPEG writer's mean size wins
        fs.pipe_file(meta_path, json.dumps(info).encode())
    return info


# ---------------------------------------------------------------- writers (in the runner)
def write(spec: dict[str, Any]) -> dict[str, Any]:
    """Write ``spec["n"]`` samples (ids ``spec["first"]`` (0) on) at ``spec["url"]`` in ``spec["system"]``'s
    format; returns its bytes."""
    system, n, side, shard = spec["system"], spec["n"], sample_side(spec["sample_bytes"]), spec["shard_bytes"]
    kind, sb = spec.get("kind", "array"), spec["sample_bytes"]
    opts = spec["storage_options"]  # the server itself: setup traffic never crosses the link
    ids = range(spec.get("first", 0), spec.get("first", 0) + n)  # a mix's streams: consecutive id ranges
    sizes: list[int] = []  # the JPEGs' (their mean is the images dataset's sample_bytes)
    samples = (_counted(make(kind, i, sb, n), sizes) for i in ids)  # in id order: the class-sorted data
    if system == "datacache":
        import datacache

        # overwrite: bench.py writes only where its bench-meta.json is missing, which an earlier
        # run that stopped after the dataset but before the meta leaves behind
        m = datacache.write_dataset(samples, spec["url"], storage_options=opts, shard_bytes=shard, progress=False,
                                    overwrite=True)
        return {"bytes": m.total_bytes, "files": len(m.shards), **_mean_jpeg(kind, sizes, ids)}
    tmp = tempfile.mkdtemp(prefix=f"bench-write-{system}-", dir=spec.get("tmp"))
    try:
        if system == "streaming":
            from streaming import MDSWriter

            with MDSWriter(out=tmp, columns=mds_columns(kind, side), size_limit=shard) as w:
                for s in samples:
                    w.write(s)
        elif system == "litdata":
            from litdata import optimize

            os.environ.setdefault("DATA_OPTIMIZER_CACHE_FOLDER", tmp + "-optimizer-cache")
            optimize(fn=_lit_sample, inputs=[(kind, i, sb, n) for i in ids], output_dir=tmp, chunk_bytes=shard,
                     num_workers=1, reorder_files=False, verbose=False, start_method="fork")
        else:
            raise ValueError(f"{system} has no writer (it reads the datacache shards)")
        files = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs]
        _upload_dir(tmp, spec["url"], opts)
        return {"bytes": sum(os.path.getsize(f) for f in files if not f.endswith(".json")), "files": len(files),
                **_mean_jpeg(kind, sizes, ids)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp + "-optimizer-cache", ignore_errors=True)


def _counted(sample: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    if "jpeg" in sample:
        sizes.append(len(sample["jpeg"]))
    return sample


def _mean_jpeg(kind: str, sizes: list[int], ids: range) -> dict[str, int]:
    """{"sample_bytes": the JPEGs' mean size} for a JPEG dataset ({} otherwise); ``sizes`` as the
    writer counted them (LitData's optimize makes its samples in its own process: counted again)."""
    if kind != "jpeg":
        return {}
    sizes = sizes or [len(bench_images.jpeg(i)) for i in ids]
    return {"sample_bytes": sum(sizes) // len(sizes)}


def _lit_sample(arg: tuple[str, int, int, int]) -> dict[str, Any]:
    return make(*arg)
