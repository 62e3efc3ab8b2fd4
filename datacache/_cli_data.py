"""``datacache index`` and ``datacache write``: build manifests for existing files, convert data."""
from __future__ import annotations

import fnmatch
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import numpy as np

import readers
from readers.tar import member_key

from . import __version__
from ._cli_common import Ctx, UsageError, _download, _mbps, _Progress, _run_pool, _watch
from .config import format_size
from .errors import DatacacheError, IntegrityError, ManifestError, NotFoundError
from .errors import ReaderError as DcReaderError
from .manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    load_manifest,
    validate_shard_name,
)
from .storage import Store, open_store
from .writer import DatasetWriter

__all__ = ["cmd_index", "cmd_write"]

_HINT = "Check --format and --pattern"


def _probe(fmt: readers.ShardFormat, store: Store, name: str, size: int) -> tuple[int, dict[str, str]] | None:
    """The format's cheap check of a remote object (range reads): (samples, schema) if it tells them."""
    assert fmt.probe is not None
    try:
        return fmt.probe(lambda start, end: store.read_range(name, start, end), size, name)
    except readers.ReaderError as exc:
        raise DcReaderError(exc.message, url=store.url_of(name), hint=_HINT) from None


def _local_count(fmt: readers.ShardFormat, path: str, url: str) -> tuple[int, dict[str, str]]:
    """(samples, schema) of a local file, exactly as the dataset's reader will see it."""
    try:
        with fmt.open(path) as r:
            return len(r), r.field_kinds()
    except readers.ReaderError as exc:
        raise DcReaderError(f"cannot read as {fmt.name}: {str(exc).replace(path, 'file')}", url=url,
                            hint=_HINT) from None


def _merge_schemas(fmt: readers.ShardFormat, schemas: list[tuple[str, dict[str, str]]],
                   store: Store) -> dict[str, str]:
    if not schemas:
        return {}
    first_name, merged = schemas[0][0], dict(schemas[0][1])
    for name, schema in schemas[1:]:
        if fmt.union_schema:  # e.g. WebDataset samples may lack some fields: the union
            for k, v in schema.items():
                if merged.setdefault(k, v) != v:
                    raise ManifestError(f"field {k!r} is {v!r} here but {merged[k]!r} in {first_name}",
                                        url=store.url_of(name), hint="All shards of a dataset need one schema")
        elif schema != merged:
            raise ManifestError(f"schema {json.dumps(schema)} differs from {json.dumps(merged)} in {first_name}",
                                url=store.url_of(name), hint="All shards of a dataset need one schema; "
                                "use --pattern to index the files of one table")
    return merged


def cmd_index(ctx: Ctx) -> int:
    a = ctx.args
    fmt = readers.get_format(a.format)
    pattern = a.pattern or f"*{fmt.extension}"
    with closing(open_store(a.url, ctx.storage_options)) as store:
        if not a.force and store.exists(MANIFEST_NAME):
            raise UsageError(f"{store.url_of(MANIFEST_NAME)} already exists; pass --force to replace it")
        objects = [(n, s) for n, s in store.list() if n != MANIFEST_NAME and fnmatch.fnmatchcase(n, pattern)]
        if not objects:
            raise NotFoundError(f"no objects match {pattern!r} under this prefix", url=store.url,
                                hint="Check the URL and --pattern")
        for n, _ in objects:
            validate_shard_name(n, store.url_of(n))
        total = sum(s for _, s in objects)
        t0, stop = time.monotonic(), threading.Event()
        counts: dict[str, tuple[int, dict[str, str]]] = {}
        hashes: dict[str, str] = {}

        # 1. cheap checks first, by the format: Parquet footers (row counts, schema), tar first headers.
        def probe(item: tuple[str, int]) -> None:
            if stop.is_set():
                return
            found = _probe(fmt, store, *item)
            if found is not None:
                counts[item[0]] = found
        if fmt.probe is not None:
            _run_pool(objects, probe, a.threads, stop, "datacache-index")

        # 2. hash every object (and count tar/lmdb samples in the local copy hashing makes).
        progress = _Progress(ctx, total, "hashing", len(objects), "objects")
        on_bytes = _watch(stop, progress)

        def digest(item: tuple[str, int], tmpdir: str) -> None:
            if stop.is_set():
                return
            name, size = item
            path, h = _download(store, name, size, tmpdir, on_bytes)
            try:
                if name not in counts:  # the probe could not tell: count in the local copy
                    counts[name] = _local_count(fmt, path, store.url_of(name))
            finally:
                os.unlink(path)
            hashes[name] = h
            progress.item_done()
        try:
            with tempfile.TemporaryDirectory(prefix="datacache-index-") as tmpdir:
                _run_pool(objects, lambda item: digest(item, tmpdir), a.threads, stop, "datacache-index")
        finally:
            progress.close()
        schema = _merge_schemas(fmt, [(n, counts[n][1]) for n, _ in objects], store)
        shards = tuple(ShardInfo(n, s, counts[n][0], hashes[n]) for n, s in objects)
        manifest = Manifest(format=fmt.name, schema=schema, shards=shards,
                            extra={"indexed_by": f"datacache {__version__}", "pattern": pattern})
        store.write_bytes(MANIFEST_NAME, manifest.to_json().encode())
        url = store.url_of(MANIFEST_NAME)
    seconds = time.monotonic() - t0
    ctx.emit({"url": url, "dataset_id": manifest.dataset_id, "format": fmt.name, "schema": schema,
              "num_shards": len(shards), "num_samples": manifest.num_samples, "total_bytes": total,
              "seconds": round(seconds, 3)},
             [f"wrote {url}: {len(shards)} {fmt.name} shards, {manifest.num_samples:,} samples, {format_size(total)} "
              f"(read once to hash, {_mbps(total, seconds):.1f} MB/s)",
              f"  dataset id  {manifest.dataset_id}", f"  schema      {json.dumps(schema)}"])
    return 0


# -------------------------------------------------------------------------------------- write
def _normalize(sample: dict[str, Any], where: str, src: str) -> dict[str, Any]:
    """JSON/Arrow values -> datacache field values: bool -> int, list/dict -> JSON text."""
    out: dict[str, Any] = {}
    for k, v in sample.items():
        if v is None:
            raise DatacacheError(f"{where}: field {k!r} is null; datacache fields cannot be null", url=src,
                                 hint="Fill or drop null values first")
        if isinstance(v, bool):
            v = int(v)
        elif isinstance(v, (list, dict)):
            v = json.dumps(v, default=str)
        elif not isinstance(v, (bytes, str, int, float, np.ndarray, np.integer, np.floating)):
            v = str(v)  # dates, decimals...
        out[str(k)] = v
    return out


def _src_type(src: str, explicit: str) -> str:
    if explicit != "auto":
        return explicit
    if "://" in src:
        return "dataset"
    if os.path.isdir(src):
        return "dataset" if os.path.isfile(os.path.join(src, MANIFEST_NAME)) else "folder"
    if not os.path.exists(src):
        raise DatacacheError("no such file or directory", url=src)
    low = src.lower()
    if low.endswith((".parquet", ".pq")):
        return "parquet"
    if low.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    raise UsageError(f"cannot tell what {src} is (not a folder, .parquet or .jsonl); use --src-type")


def _folder_samples(root: str, group: bool) -> Iterator[dict[str, Any]]:
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        files += [os.path.relpath(os.path.join(d, n), root) for n in names if not n.startswith(".")]
    if not group:
        for rel in sorted(files):
            with open(os.path.join(root, rel), "rb") as f:
                yield {"__key__": rel, "data": f.read()}
        return
    items = []
    for rel in files:
        split = member_key(rel)
        if split is not None:  # no extension: skipped, as WebDataset does
            items.append((*split, rel))
    sample: dict[str, Any] = {}
    for key, ext, rel in sorted(items):
        if sample and sample["__key__"] != key:
            yield sample
            sample = {}
        sample.setdefault("__key__", key)
        with open(os.path.join(root, rel), "rb") as f:
            sample[ext] = f.read()
    if sample:
        yield sample


def _jsonl_samples(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise DatacacheError(f"line {lineno} is not valid JSON ({exc})", url=path) from None
            if not isinstance(obj, dict):
                raise DatacacheError(f"line {lineno} is not a JSON object", url=path)
            yield _normalize(obj, f"line {lineno}", path)


def _parquet_samples(path: str) -> Iterator[dict[str, Any]]:
    with readers.open_shard("parquet", path) as r:
        for i, row in enumerate(r):
            yield _normalize(row, f"row {i}", path)


def _dataset_samples(url: str, storage_options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with closing(open_store(url, storage_options)) as store:
        m = load_manifest(store)
        fmt = readers.get_format(m.format)
        with tempfile.TemporaryDirectory(prefix="datacache-write-src-") as tmpdir:
            for info in m.shards:
                path, h = _download(store, info.name, info.bytes, tmpdir, lambda n: None)
                try:
                    if h != info.hash:
                        raise IntegrityError(f"content hash {h} != manifest {info.hash}", url=store.url_of(info.name),
                                             hint="Run `datacache verify` on the source")
                    with fmt.open(path) as r:
                        yield from r
                finally:
                    os.unlink(path)


def cmd_write(ctx: Ctx) -> int:
    a = ctx.args
    kind = _src_type(a.src, a.src_type)
    if kind == "folder":
        samples = _folder_samples(a.src, a.group)
    elif kind == "jsonl":
        samples = _jsonl_samples(a.src)
    elif kind == "parquet":
        samples = _parquet_samples(a.src)
    else:
        samples = _dataset_samples(a.src, ctx.storage_options)
    t0 = time.monotonic()
    with closing(open_store(a.dest, ctx.storage_options)) as dest:
        if not a.force and dest.exists(MANIFEST_NAME):
            raise UsageError(f"{dest.url_of(MANIFEST_NAME)} already exists; pass --force to overwrite the dataset")
        n = 0
        with DatasetWriter(dest.url, format=a.format, shard_bytes=a.shard_bytes, progress=not ctx.quiet,
                           store=dest, overwrite=a.force) as w:
            for sample in samples:
                if a.format == "tar" and "__key__" in sample:  # tar members cannot name a "__" field
                    sample = dict(sample)
                    sample["key"] = sample.pop("__key__")
                try:
                    w.write(sample)
                except (ValueError, TypeError) as exc:
                    key = sample.get("__key__", sample.get("key"))
                    where = f"sample {n}" + (f" ({key})" if isinstance(key, str) else "")
                    raise DatacacheError(f"{where}: {exc}", url=a.src) from exc
                n += 1
            if n == 0:
                raise DatacacheError("no samples found", url=a.src)
        m = w.manifest
        assert m is not None
        url = dest.url
    seconds = time.monotonic() - t0
    ctx.emit({"src": a.src, "src_type": kind, "url": url, "dataset_id": m.dataset_id, "format": m.format,
              "schema": m.schema, "num_shards": len(m.shards), "num_samples": m.num_samples,
              "total_bytes": m.total_bytes, "seconds": round(seconds, 3)},
             [f"wrote {m.num_samples:,} samples from {a.src} ({kind}) to {url}: {len(m.shards)} {m.format} shards, "
              f"{format_size(m.total_bytes)} in {seconds:.1f} s",
              f"  dataset id  {m.dataset_id}", f"  schema      {json.dumps(m.schema)}"])
    return 0


# ------------------------------------------------------------------------------------- verify
