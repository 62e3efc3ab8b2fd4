"""Datasets written by the libraries datacache reads in place (MosaicML Streaming 0.13.0, LitData
0.2.76, Hugging Face datasets), and those libraries' own reading of them, for tests/test_foreign.py.

The libraries are test-only dependencies (``make venv`` installs them; see the Makefile). Each
``write_*`` writes a small dataset of several shards into a folder; each ``*_reading`` returns what
the library itself gives for every sample of that folder, in order.
"""
from __future__ import annotations

import decimal
import io
import json
import os
import sys
import tempfile
from contextlib import closing
from typing import Any

import datasets  # before Streaming's stand-ins for torchvision, which datasets looks for
import numpy as np

from tools.bench_systems import import_system

__all__ = ["MDS_COLUMNS", "write_mds", "streaming_reading", "write_litdata", "litdata_reading", "write_hf",
           "hf_reading", "same", "upload"]

MDS_COLUMNS = {"id": "int", "b": "bytes", "s": "str", "u8": "uint8", "i16": "int16", "f16": "float16",
               "f32": "float32", "f64": "float64", "a": "ndarray", "af": "ndarray:int16:2,3", "ad": "ndarray:float32",
               "si": "str_int", "sf": "str_float", "sd": "str_decimal", "j": "json", "jpg": "jpeg", "png": "png",
               "pil": "pil", "jl": "list[jpeg]", "p": "pkl"}


def _image(k: int) -> Any:
    from PIL import Image

    return Image.fromarray(np.full((4, 5, 3), k * 7 % 256, np.uint8))


def _jpeg(k: int) -> Any:
    from PIL import Image

    buf = io.BytesIO()
    _image(k).save(buf, format="JPEG")
    return Image.open(io.BytesIO(buf.getvalue()))


def _mds_sample(k: int, rng: np.random.Generator) -> dict[str, Any]:
    return {"id": k, "b": bytes([k % 256]) * (k % 9), "s": "é" * (k % 5), "u8": k % 256, "i16": -k, "f16": k / 4,
            "f32": k / 3, "f64": k / 7, "a": rng.random((k % 3 + 1, 2)),
            "af": np.arange(6, dtype=np.int16).reshape(2, 3) * k,
            "ad": rng.random(k % 4 + 1).astype(np.float32), "si": k * 10**12, "sf": k / 9,
            "sd": decimal.Decimal(k) / 8, "j": {"k": [k, "v"], "n": None}, "jpg": _jpeg(k), "png": _image(k),
            "pil": _image(k), "jl": [_jpeg(k), _jpeg(k + 1)], "p": {"set": {k}}}


def _import_streaming() -> None:
    """Import ``streaming`` with the bench's stand-ins for torchvision and transformers, then take the
    stand-ins out of ``sys.modules`` (``datasets`` looks there for a real ``transformers``)."""
    import_system("streaming")
    for name in [n for n, m in sys.modules.items() if getattr(m, "__bench_stub__", False)]:
        del sys.modules[name]


def write_mds(out: str, *, compression: str | None = None, n: int = 30, size_limit: int = 6000,
              columns: dict[str, str] | None = None, hashes: tuple[str, ...] = ("sha1", "xxh64")) -> None:
    """``n`` samples of every MDS encoding (``columns``: a subset) into several shards at ``out``."""
    _import_streaming()
    from streaming import MDSWriter

    columns = columns or MDS_COLUMNS
    rng = np.random.default_rng(n)
    with MDSWriter(out=out, columns=columns, compression=compression, hashes=list(hashes),
                   size_limit=size_limit) as w:
        for k in range(n):
            w.write({c: v for c, v in _mds_sample(k, rng).items() if c in columns})


def streaming_reading(folder: str) -> list[dict[str, Any]]:
    """Every sample as Streaming 0.13.0's MDS reader decodes it (shard by shard, compressed shards
    inflated by Streaming's own ``decompress``)."""
    _import_streaming()
    from streaming.base.compression import decompress
    from streaming.base.format.mds.reader import MDSReader

    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    out = []
    with tempfile.TemporaryDirectory() as raw_dir:
        for shard in index["shards"]:
            if shard["compression"]:
                with open(os.path.join(folder, shard["zip_data"]["basename"]), "rb") as f:
                    raw = decompress(shard["compression"], f.read())
                with open(os.path.join(raw_dir, shard["raw_data"]["basename"]), "wb") as f:
                    f.write(raw)
            reader = MDSReader.from_json(raw_dir if shard["compression"] else folder, None, shard)
            reader.validate(allow_unsafe_types=True)
            out += [reader.decode_sample(reader.get_sample_data(i)) for i in range(reader.samples)]
    return out


def _lit_item(k: int, rng: np.random.Generator, shape: str) -> Any:
    import torch

    if shape == "tuple":
        return (k, f"n{k}", rng.random((2, 2)).astype(np.float64))
    item = {"id": k, "f": k / 3, "ok": k % 2 == 0, "s": "é" * (k % 4), "b": bytes([k % 256]) * (k % 5),
            "a": rng.random((2, 3)).astype(np.float32), "v": np.arange(k % 5 + 1, dtype=np.int16),
            "t": torch.full((2, 2), float(k)), "tv": torch.arange(k % 3 + 1), "nest": [k, {"x": float(k)}]}
    if shape == "pickled":
        item["p"] = {k, k + 1}  # a set: LitData pickles it
    return item


def write_litdata(out: str, *, compression: str | None = None, level: str | None = None, n: int = 30,
                  chunk_size: int = 7, shape: str = "dict") -> None:
    """``n`` items (``shape``: ``dict`` of every required leaf type, ``tuple``, ``pickled``) into
    chunks of ``chunk_size`` at ``out``, through LitData's own writer (what ``optimize`` runs)."""
    import_system("litdata")
    from litdata.streaming.writer import BinaryWriter

    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(n)
    kw: dict[str, Any] = {"compression_level": level} if level else {}
    w = BinaryWriter(out, chunk_size=chunk_size, compression=compression, **kw)
    for k in range(n):
        w[k] = _lit_item(k, rng, shape)
    w.done()
    w.merge(1)


def litdata_reading(folder: str) -> list[Any]:
    """Every item as ``litdata.StreamingDataset`` gives it."""
    import_system("litdata")
    import litdata

    ds = litdata.StreamingDataset(folder)
    return [ds[i] for i in range(len(ds))]


def write_hf(out: str, n: int = 40) -> None:
    """A Hugging Face dataset of ``n`` rows saved with ``save_to_disk`` in 3 Arrow files."""
    features = datasets.Features({"id": datasets.Value("int64"), "text": datasets.Value("string"),
                                  "score": datasets.Value("float64"), "f32": datasets.Value("float32"),
                                  "blob": datasets.Value("binary"), "tags": datasets.Sequence(datasets.Value("int32")),
                                  "vec": datasets.Sequence(datasets.Value("float32"), length=3),
                                  "meta": {"a": datasets.Value("string"), "b": datasets.Value("int64")}})
    rows = {"id": list(range(n)), "text": [f"row {i} é" for i in range(n)], "score": [i / 7 for i in range(n)],
            "f32": [i / 3 for i in range(n)], "blob": [bytes([i]) * i for i in range(n)],
            "tags": [list(range(i % 4)) for i in range(n)], "vec": [[i, i + 0.5, -i] for i in range(n)],
            "meta": [{"a": str(i), "b": i * 2} for i in range(n)]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(out, num_shards=3)


def hf_reading(folder: str) -> list[dict[str, Any]]:
    """Every row as ``datasets.load_from_disk`` gives it."""
    return list(datasets.load_from_disk(folder))


def _image_of(data: bytes) -> Any:
    """The image in ``data``: an encoded file (JPEG, PNG), or MDS's raw ``pil`` encoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        width, height, mode_size = np.frombuffer(data, "<u4", 3).tolist()
        return Image.frombytes(data[12:12 + mode_size].decode(), (width, height), data[12 + mode_size:])


def same(ours: Any, theirs: Any, where: str = "") -> None:
    """Assert ``ours`` equals the library's ``theirs``: same structure, same values, arrays and
    tensors with the same dtype and shape, numpy scalars of the same type, images with the same
    pixels (``ours`` may be the encoded bytes of ``theirs``)."""
    import torch
    from PIL import Image

    if isinstance(theirs, Image.Image):
        if isinstance(ours, (bytes, bytearray)):
            ours = _image_of(ours)
        assert isinstance(ours, Image.Image), where
        assert (ours.mode, ours.size, ours.tobytes()) == (theirs.mode, theirs.size, theirs.tobytes()), where
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype, where
        assert ours.shape == theirs.shape and np.array_equal(ours, theirs), where
    elif isinstance(theirs, np.generic):
        assert type(ours) is type(theirs) and ours == theirs, where
    elif isinstance(theirs, dict):
        assert type(ours) is type(theirs) and list(ours) == list(theirs), where
        for k in theirs:
            same(ours[k], theirs[k], f"{where}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, memoryview):  # LitData hands bytes over as views of its map
        assert ours == bytes(theirs), where
    else:
        assert type(ours) is type(theirs) and ours == theirs, (where, ours, theirs)


def upload(folder: str, url: str, storage_options: dict[str, Any]) -> int:
    """Copy every file of ``folder`` under ``url``; returns the bytes copied."""
    from datacache import open_store

    total = 0
    with closing(open_store(url, storage_options)) as store:
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            store.write_bytes(name, data)
            total += len(data)
    return total
