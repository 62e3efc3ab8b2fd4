"""Datasets other libraries wrote, as ``datacache index`` finds them at a prefix: MosaicML Streaming
(MDS ``index.json`` with ``shards``), LitData (``index.json`` with ``chunks`` and ``config``) and
Hugging Face ``save_to_disk`` folders (``state.json`` naming its Arrow files, beside
``dataset_info.json``).

:func:`detect` reads the layout's own index and returns a :class:`Layout`: the format to read the
files with, the files (the shards, as the layout lists them, never touched), the samples and
content hashes the layout's index declares for each, and the reader options the files need (MDS
columns and compression, LitData's data format and tree), which the manifest records.
:func:`check_hashes` checks a local copy against the hashes the foreign index lists (MDS writes
them when asked: ``hashes=["sha1", "xxh64"]``). Pure functions of the store's bytes; thread-safe.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import IntegrityError, ManifestError
from ..store.storage import Store
from .common import UsageError

__all__ = ["Layout", "detect", "check_hashes"]

_MAX_INDEX_BYTES = 1 << 30


@dataclass
class Layout:
    """A foreign dataset at a prefix: ``format`` (a registered reader), ``what`` (its name in words),
    ``shards`` (object names, in the dataset's order), and per shard the ``samples`` and ``hashes``
    (algorithm -> hex digest) its index declares, where it does; ``reader_options`` for every shard."""

    format: str
    what: str
    shards: list[str]
    samples: dict[str, int] = field(default_factory=dict)
    hashes: dict[str, dict[str, str]] = field(default_factory=dict)
    reader_options: dict[str, Any] = field(default_factory=dict)


def _json(store: Store, name: str) -> Any:
    size = store.size(name)
    if size > _MAX_INDEX_BYTES:
        raise ManifestError(f"{name} is {size} bytes, more than the {_MAX_INDEX_BYTES} read", url=store.url_of(name))
    try:
        return json.loads(store.read_bytes(name, size=size))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{name} is not valid JSON ({exc})", url=store.url_of(name),
                            hint="The dataset's own index is truncated or corrupt") from None


def _same(values: list[Any], what: str, url: str) -> Any:
    """The one value every shard declares for ``what`` (UsageError when shards differ)."""
    for v in values[1:]:
        if v != values[0]:
            raise UsageError(f"{url}: shards of this dataset differ in {what} ({values[0]!r} and {v!r}); "
                             "datacache reads a dataset whose shards share one; index each part on its own")
    return values[0]


def _mds(store: Store, doc: dict[str, Any]) -> Layout:
    url = store.url_of("index.json")
    shards = doc["shards"]
    if not shards:
        raise UsageError(f"{url}: the MDS index lists no shards")
    for s in shards:
        if s.get("format") != "mds" or s.get("version") != 2:
            raise UsageError(f"{url}: shard format {s.get('format')!r} version {s.get('version')!r}; datacache "
                             "reads MDS version 2 (what Streaming writes) only")
    columns = _same([[list(c) for c in zip(s["column_names"], s["column_encodings"], s["column_sizes"])]
                     for s in shards], "columns", url)
    compression = _same([s.get("compression") for s in shards], "compression", url)
    files = [s["zip_data"] if s.get("compression") else s["raw_data"] for s in shards]
    names = [f["basename"] for f in files]
    return Layout("mds", "MosaicML Streaming (MDS)", names,
                  samples={n: int(s["samples"]) for n, s in zip(names, shards)},
                  hashes={n: dict(f.get("hashes") or {}) for n, f in zip(names, files)},
                  reader_options={"columns": columns, "compression": compression})


def _litdata(store: Store, doc: dict[str, Any]) -> Layout:
    url = store.url_of("index.json")
    config, chunks = doc["config"], doc["chunks"]
    refused = {"encryption": config.get("encryption"), "ipc_compression": config.get("ipc_compression"),
               "compression_level": config.get("compression_level") not in (None, "chunk", "batch") or None}
    loader = config.get("item_loader", "PyTreeLoader")
    if loader != "PyTreeLoader" or any(refused.values()):
        what = f"item_loader {loader!r}" if loader != "PyTreeLoader" else \
            ", ".join(k for k, v in refused.items() if v)
        raise UsageError(f"{url}: a LitData dataset with {what}; datacache reads LitData's default layout "
                         "(PyTreeLoader chunks, plain or zstd-compressed); convert this one with "
                         "litdata.StreamingDataset and datacache.write_dataset()")
    names = [c["filename"] for c in chunks]
    return Layout("litdata", "LitData", names, samples={n: int(c["chunk_size"]) for n, c in zip(names, chunks)},
                  reader_options={"data_format": list(config["data_format"]), "data_spec": config.get("data_spec"),
                                  "compression": config.get("compression"),
                                  "compression_level": config.get("compression_level")})


def _hf(store: Store, names: set[str]) -> Layout:
    if "dataset_dict.json" in names:
        splits = _json(store, "dataset_dict.json").get("splits", [])
        first = store.url_of(str(splits[0]) if splits else "train")
        raise UsageError(f"{store.url} is a Hugging Face DatasetDict (splits {', '.join(map(str, splits))}): "
                         f"index one split's folder, e.g. datacache index {first}")
    state = _json(store, "state.json")
    files = [f["filename"] for f in state["_data_files"]]
    return Layout("arrow", "Hugging Face save_to_disk", files)


def detect(store: Store, names: set[str]) -> Layout | None:
    """The foreign dataset at ``store``'s prefix (``names``: its objects), or None."""
    try:
        if "index.json" in names:
            doc = _json(store, "index.json")
            if isinstance(doc, dict) and isinstance(doc.get("shards"), list):
                return _mds(store, doc)
            if isinstance(doc, dict) and isinstance(doc.get("chunks"), list) and isinstance(doc.get("config"), dict):
                return _litdata(store, doc)
        if "dataset_dict.json" in names or {"state.json", "dataset_info.json"} <= names:
            return _hf(store, names)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, UsageError):
            raise
        raise ManifestError(f"the dataset's own index lacks or has a bad field ({exc!r})", url=store.url,
                            hint="The index is not one this datacache reads; convert the dataset instead") from None
    return None


def _hasher(algo: str) -> Any:
    if algo in ("xxh32", "xxh64", "xxh128", "xxh3_64", "xxh3_128"):
        return getattr(xxhash, algo)()
    try:
        return hashlib.new(algo)
    except ValueError:
        return None


def check_hashes(path: str, expected: dict[str, str], url: str) -> int:
    """Check the local file ``path`` (a copy of ``url``) against ``expected`` (algorithm -> hex, from
    the foreign index); IntegrityError naming ``url`` on a mismatch. Returns how many were checked
    (algorithms neither hashlib nor xxhash knows are skipped)."""
    hashers = {algo: h for algo, want in expected.items() if (h := _hasher(algo)) is not None}
    if not hashers:
        return 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            for h in hashers.values():
                h.update(chunk)
    for algo, h in hashers.items():
        got = h.hexdigest()
        if got != expected[algo]:
            raise IntegrityError(f"{algo} of this shard is {got}, but the dataset's index.json lists {expected[algo]}",
                                 url=url, hint="The shard was changed or damaged after the dataset was written; "
                                 "restore it from the original, or rewrite the dataset")
    return len(hashers)
