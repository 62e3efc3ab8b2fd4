"""The benchmark's datasets: the same samples written in each system's own format (used by
``tools/bench_systems.py write``, after it imported the system's package). Samples are written in
id order by one writer process, so the write position is the sample id: the class-sorted data of
``tools/bench_quality.py``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np


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


# ---------------------------------------------------------------- writers
def write(spec: dict[str, Any]) -> dict[str, Any]:
    """Write ``spec["n"]`` samples at ``spec["url"]`` in ``spec["system"]``'s format; returns its bytes."""
    system, n, side, shard = spec["system"], spec["n"], sample_side(spec["sample_bytes"]), spec["shard_bytes"]
    opts = spec["storage_options"]  # the server itself: setup traffic never crosses the link
    samples = (make_sample(i, side) for i in range(n))  # in id order: the class-sorted data (bench_quality)
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
