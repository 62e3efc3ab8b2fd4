"""Where ``datacache write`` reads its samples: a folder, a Parquet or JSONL file (local or remote),
or a dataset. Each source is a lazy iterator of samples (files are read as they are written).

Folders: one sample per file (or, grouped, per WebDataset key). Files in class folders
(``root/<class>/...``, every file) also get ``label`` (the index of the class among the sorted class
folder names) and ``class`` (its name). ``shuffle`` writes the samples in a seeded random order;
without it, class folders come one after another, which a warning points out. A folder holding a
dataset another library wrote (an MDS or LitData ``index.json``, a datacache ``manifest.json``
below the top, a Hugging Face ``save_to_disk`` folder) is refused with what to do instead (``datacache
index`` it, then read it in place or write it from there), unless
``--src-type folder`` asks for its files as they are.

Foreign values become datacache field values (:func:`normalize`): bool -> int, lists and dicts ->
JSON text, a Hugging Face image (``{"bytes": ..., "path": ...}``) -> its bytes, a float32 (or
other non-float64) number -> a 0-d array of its dtype. Not thread-safe: one source per thread.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import DatacacheError, IntegrityError
from ..manifest import MANIFEST_NAME, load_manifest
from ..readers import get_format, open_shard
from ..readers.tar import member_key
from ..store.storage import open_store
from .common import UsageError, _download

__all__ = ["Source", "open_source", "normalize"]

_IMAGE_KEYS = {"bytes", "path"}


@dataclass
class Source:
    """What to write: ``kind`` (folder, parquet, jsonl, dataset), the samples, and for a folder of
    class folders the class names (``label`` indexes them) and a warning when they are sorted."""

    kind: str
    samples: Iterator[dict[str, Any]]
    classes: list[str] | None = None
    warnings: list[str] = field(default_factory=list)


def _value(v: Any, where: str, k: str, src: str) -> Any:
    if isinstance(v, dict) and "bytes" in v and set(v) <= _IMAGE_KEYS:  # a Hugging Face image
        if not isinstance(v["bytes"], (bytes, bytearray)):
            raise DatacacheError(f"{where}: image field {k!r} holds no bytes (path {v.get('path')!r} only)",
                                 url=src, hint="Embed the image bytes in the dataset (datasets' embed_storage)")
        return bytes(v["bytes"])
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=str)
    if isinstance(v, np.floating) and v.dtype != np.float64:
        return np.asarray(v)  # a 0-d array keeps float32 (a "float" field is float64)
    if not isinstance(v, (bytes, str, int, float, np.ndarray, np.integer, np.floating)):
        return str(v)  # dates, decimals...
    return v


def normalize(sample: dict[str, Any], where: str, src: str) -> dict[str, Any]:
    """Foreign (JSON/Arrow) values -> datacache field values (see the module docstring)."""
    out: dict[str, Any] = {}
    for k, v in sample.items():
        if v is None:
            raise DatacacheError(f"{where}: field {k!r} is null; datacache fields cannot be null", url=src,
                                 hint="Fill or drop null values first")
        out[str(k)] = _value(v, where, str(k), src)
    return out


def _src_type(src: str, explicit: str) -> str:
    if explicit != "auto":
        return explicit
    low = src.lower()
    if "://" in src:
        return "parquet" if low.endswith((".parquet", ".pq")) else \
            "jsonl" if low.endswith((".jsonl", ".ndjson")) else "dataset"
    if os.path.isdir(src):
        return "dataset" if os.path.isfile(os.path.join(src, MANIFEST_NAME)) else "folder"
    if not os.path.exists(src):
        raise DatacacheError("no such file or directory", url=src)
    if os.path.basename(src) == MANIFEST_NAME:  # a dataset named by its manifest
        return "dataset"
    if low.endswith((".parquet", ".pq")):
        return "parquet"
    if low.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    raise UsageError(f"cannot tell what {src} is (not a folder, .parquet or .jsonl); use --src-type")


# ------------------------------------------------------------------------------------- folders
_MARKERS = ("index.json", MANIFEST_NAME, "dataset_info.json", "state.json", "dataset_dict.json")


def _json_object(path: str) -> dict[str, Any]:
    """The JSON object in ``path``, or {} when it is none (too big, unreadable, not JSON)."""
    try:
        if os.path.getsize(path) > 64 << 20:
            return {}
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _layout(folder: str, names: set[str]) -> tuple[str, str] | None:
    """(what dataset layout ``folder``, holding the marker files ``names``, is; what to do), or None."""
    folder = os.path.normpath(folder)
    if "index.json" in names:
        doc = _json_object(os.path.join(folder, "index.json"))
        shards, chunks = doc.get("shards"), doc.get("chunks")
        if isinstance(shards, list) and shards and isinstance(shards[0], dict) and "raw_data" in shards[0]:
            return ("a MosaicML Streaming (MDS) dataset (index.json)",
                    f"read it in place after `datacache index {folder}` (then writing that folder converts it)")
        if isinstance(chunks, list) and isinstance(doc.get("config"), dict):
            return ("a LitData optimized dataset (index.json)",
                    f"read it in place after `datacache index {folder}` (then writing that folder converts it)")
    if MANIFEST_NAME in names and {"format", "shards"} <= set(_json_object(os.path.join(folder, MANIFEST_NAME))):
        return f"a datacache dataset ({MANIFEST_NAME})", "pass that folder itself as the source to convert it"
    if "dataset_dict.json" in names:
        return ("a Hugging Face datasets folder (save_to_disk)",
                f"read a split in place after `datacache index {os.path.join(folder, 'SPLIT')}` (then writing that "
                "folder converts it)")
    if {"dataset_info.json", "state.json"} <= names:
        return ("a Hugging Face datasets folder (save_to_disk)",
                f"read it in place after `datacache index {folder}` (then writing that folder converts it)")
    return None


def _refuse_foreign_layout(root: str, files: list[str]) -> None:
    """UsageError when ``root`` or a folder in it (``files``: paths relative to ``root``) holds a
    dataset a library wrote (MDS, LitData, datacache, Hugging Face): a folder source would store
    its index and shard files as raw samples."""
    markers: dict[str, set[str]] = {}
    for rel in files:
        folder, name = os.path.split(rel)
        if name in _MARKERS:
            markers.setdefault(folder, set()).add(name)
    for folder in sorted(markers, key=lambda f: (f.count(os.sep) + bool(f), f)):  # the outermost first
        found = _layout(os.path.join(root, folder), markers[folder])
        if found is not None:
            where = root if not folder else f"{os.path.join(root, folder)} (in {root})"
            raise UsageError(f"{where} is {found[0]}: datacache write would store its index and shard files as raw "
                             f"samples; {found[1]} (or pass --src-type folder to store the files anyway)")


def _folder_items(root: str, group: bool) -> list[tuple[str, list[tuple[str, str]]]]:
    """(key, [(field, relative path)]) per sample, in key order."""
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        files += [os.path.relpath(os.path.join(d, n), root) for n in names if not n.startswith(".")]
    if not group:
        return [(rel, [("data", rel)]) for rel in sorted(files)]
    split = sorted((*kf, rel) for rel in files if (kf := member_key(rel)) is not None)  # no extension: skipped
    items: list[tuple[str, list[tuple[str, str]]]] = []
    for key, ext, rel in split:
        if not items or items[-1][0] != key:
            items.append((key, []))
        items[-1][1].append((ext, rel))
    return items


def _class_names(items: list[tuple[str, list[tuple[str, str]]]]) -> list[str] | None:
    """The sorted class folder names, when every sample lies in one (and no field is named so)."""
    if not items or any("/" not in key or any(f in ("label", "class") for f, _ in fields)
                        for key, fields in items):
        return None
    return sorted({key.split("/", 1)[0] for key, _ in items})


def _folder_source(root: str, group: bool, shuffle: bool, seed: int, layouts: bool) -> Source:
    """``layouts``: refuse a folder holding another library's dataset (``_refuse_foreign_layout``)."""
    items = _folder_items(root, group)
    if layouts:
        _refuse_foreign_layout(root, [rel for _, fields in items for _, rel in fields])
    classes = _class_names(items)
    index = {name: i for i, name in enumerate(classes or [])}
    warnings = []
    if shuffle:
        random.Random(seed).shuffle(items)
    elif classes is not None and len(classes) > 1:
        warnings.append(f"{root}: samples are written class folder by class folder ({len(classes)} classes), "
                        f"so each shard holds few classes; pass --shuffle to mix them at write time")

    def samples() -> Iterator[dict[str, Any]]:
        for key, fields in items:
            sample: dict[str, Any] = {"__key__": key}
            for name, rel in fields:
                with open(os.path.join(root, rel), "rb") as f:
                    sample[name] = f.read()
            if classes is not None:
                cls = key.split("/", 1)[0]
                sample["label"], sample["class"] = index[cls], cls
            yield sample
    return Source("folder", samples(), classes, warnings)


# --------------------------------------------------------------------------------- files, datasets
def _local_copy(src: str, storage_options: dict[str, Any], tmpdir: str) -> str:
    """``src`` itself when local, else a copy of the remote object (read through the store)."""
    if "://" not in src:
        return src
    prefix, name = src.rsplit("/", 1)
    with closing(open_store(prefix + "/", storage_options)) as store:
        path = os.path.join(tmpdir, "source")
        open(path, "wb").close()
        store.read_into(name, path)
    return path


def _jsonl_samples(src: str, storage_options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="datacache-write-src-") as tmpdir, \
            open(_local_copy(src, storage_options, tmpdir), encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise DatacacheError(f"line {lineno} is not valid JSON ({exc})", url=src) from None
            if not isinstance(obj, dict):
                raise DatacacheError(f"line {lineno} is not a JSON object", url=src)
            yield normalize(obj, f"line {lineno}", src)


def _parquet_samples(src: str, storage_options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="datacache-write-src-") as tmpdir, \
            open_shard("parquet", _local_copy(src, storage_options, tmpdir)) as r:
        for i, row in enumerate(r):
            yield normalize(row, f"row {i}", src)


def _dataset_samples(url: str, storage_options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with closing(open_store(url, storage_options)) as store:
        m = load_manifest(store)
        fmt = get_format(m.format)
        with tempfile.TemporaryDirectory(prefix="datacache-write-src-") as tmpdir:
            for info in m.shards:
                path, h = _download(store, info.name, info.bytes, tmpdir, lambda n: None)
                try:
                    if h != info.hash:
                        raise IntegrityError(f"content hash {h} != manifest {info.hash}", url=store.url_of(info.name),
                                             hint="Run `datacache verify` on the source")
                    with fmt.open(path, **m.reader_options()) as r:
                        for i, sample in enumerate(r):
                            yield normalize(sample, f"{info.name} sample {i}", store.url_of(info.name))
                finally:
                    os.unlink(path)


def open_source(src: str, src_type: str, *, group: bool, shuffle: bool, seed: int,
                storage_options: dict[str, Any]) -> Source:
    """The samples of ``src`` (see the module docstring); ``shuffle`` only for folders."""
    kind = _src_type(src, src_type)
    if shuffle and kind != "folder":
        raise UsageError(f"--shuffle shuffles the files of a folder; {src} is a {kind} source "
                         f"(read it with shuffle=True instead)")
    if kind == "folder":
        return _folder_source(src, group, shuffle, seed, layouts=src_type == "auto")
    if kind == "jsonl":
        return Source(kind, _jsonl_samples(src, storage_options))
    if kind == "parquet":
        return Source(kind, _parquet_samples(src, storage_options))
    return Source(kind, _dataset_samples(src, storage_options))
