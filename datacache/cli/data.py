"""``datacache index`` and ``datacache write``: build manifests for existing files, convert data."""
from __future__ import annotations

import fnmatch
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import closing
from typing import Any

from .._version import __version__
from ..config import format_size
from ..errors import DatacacheError, IntegrityError, ManifestError, NotFoundError
from ..errors import ReaderError as DcReaderError
from ..manifest import MANIFEST_NAME, Manifest, ShardInfo, validate_shard_name
from ..progress import Progress
from ..readers import ReaderError as ShardReaderError
from ..readers import ShardFormat, get_format
from ..store.storage import Store, open_store
from ..writer import DatasetWriter
from .common import Ctx, UsageError, _download, _mbps, _run_pool, _watch
from .foreign import Layout, check_hashes, detect
from .sources import open_source

__all__ = ["cmd_index", "cmd_write"]

_HINT = "Check --format and --pattern"


def _probe(fmt: ShardFormat, store: Store, name: str, size: int) -> tuple[int, dict[str, str]] | None:
    """The format's cheap check of a remote object (range reads): (samples, schema) if it tells them."""
    assert fmt.probe is not None
    try:
        return fmt.probe(lambda start, end: store.read_range(name, start, end), size, name)
    except ShardReaderError as exc:
        raise DcReaderError(exc.message, url=store.url_of(name), hint=_HINT) from None


def _local_count(fmt: ShardFormat, path: str, url: str, options: dict[str, Any]) -> tuple[int, dict[str, str]]:
    """(samples, schema) of a local file, exactly as the dataset's reader will see it."""
    try:
        with fmt.open(path, **options) as r:
            return len(r), r.field_kinds()
    except ShardReaderError as exc:
        raise DcReaderError(f"cannot read as {fmt.name}: {str(exc).replace(path, 'file')}", url=url,
                            hint=None if options else _HINT) from None


def _unit_rows(fmt: ShardFormat, path: str, url: str) -> list[int]:
    """Samples per unit of a local file's layout (its last unit, cut short by the file's end, left
    out), as the writer records them for its own shards (``Manifest.unit_rows``)."""
    assert fmt.layout is not None
    with open(path, "rb") as f:
        def read(start: int, end: int) -> bytes:
            return os.pread(f.fileno(), end - start, start)
        try:
            lay = fmt.layout(read, os.fstat(f.fileno()).st_size, url)
        except ShardReaderError as exc:
            raise DcReaderError(exc.message, url=url) from None
    return [b - a for a, b in zip(lay.first, lay.first[1:])]


def _merge_schemas(fmt: ShardFormat, schemas: list[tuple[str, dict[str, str]]],
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


_KNOWN_SPLITS = ("train", "test", "validation", "valid", "val", "dev")


def _in_split(name: str, split: str) -> bool:
    """Whether object ``name`` belongs to ``split`` in the Hugging Face layouts: a folder named so
    (``default/train/0000.parquet``) or a file ``train-00000-of-00003.parquet`` / ``train.parquet``."""
    *dirs, base = name.split("/")
    return split in dirs or base.startswith(f"{split}-") or base.split(".", 1)[0] == split


def _pattern_objects(a: Any, store: Store, fmt: ShardFormat, listing: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The objects ``--format`` / ``--pattern`` / ``--split`` pick (NotFoundError for none, UsageError
    for several splits without a choice)."""
    pattern = a.pattern or f"*{fmt.extension}"
    objects = [(n, s) for n, s in listing if n != MANIFEST_NAME and fnmatch.fnmatchcase(n, pattern)
               and (a.split is None or _in_split(n, a.split))]
    if not objects:
        where = f" in split {a.split!r}" if a.split else ""
        raise NotFoundError(f"no objects match {pattern!r}{where} under this prefix", url=store.url,
                            hint="Check the URL, --pattern and --split")
    splits = sorted({s for n, _ in objects for s in _KNOWN_SPLITS if _in_split(n, s)})
    if len(splits) > 1 and a.split is None and a.pattern is None:
        raise UsageError(f"objects of several splits match {pattern!r} under {store.url} ({', '.join(splits)}); "
                         f"pass --split {'train' if 'train' in splits else splits[0]} (or --pattern)")
    return objects


def _foreign_objects(layout: Layout, store: Store, listing: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The shards ``layout`` lists, with their sizes (NotFoundError naming one the store lacks)."""
    sizes = dict(listing)
    for name in layout.shards:
        validate_shard_name(name, store.url_of(name))
        if name not in sizes:
            raise NotFoundError(f"the dataset's index lists {name!r} but the store has no such object",
                                url=store.url_of(name), hint="The dataset is incomplete: restore the shard")
    return [(n, sizes[n]) for n in layout.shards]


def _select(a: Any, store: Store) -> tuple[ShardFormat, list[tuple[str, int]], Layout | None]:
    """(the format, the objects to index, the foreign layout found when no --format was given)."""
    listing = store.list()
    if a.format is not None:
        fmt = get_format(a.format)
        return fmt, _pattern_objects(a, store, fmt, listing), None
    layout = detect(store, {n for n, _ in listing})
    if layout is None:
        raise UsageError(f"no MosaicML Streaming, LitData or Hugging Face dataset at {store.url} (no index.json, "
                         "state.json); pass --format parquet, tar or lmdb to index such files")
    if a.pattern or a.split:
        raise UsageError(f"{store.url} is a {layout.what} dataset: its index names the shards, so --pattern and "
                         "--split do not apply")
    return get_format(layout.format), _foreign_objects(layout, store, listing), layout


def cmd_index(ctx: Ctx) -> int:
    a = ctx.args
    with closing(open_store(a.url, ctx.storage_options)) as store:
        if not a.force and store.exists(MANIFEST_NAME):
            raise UsageError(f"{store.url_of(MANIFEST_NAME)} already exists; pass --force to replace it")
        fmt, objects, layout = _select(a, store)
        options = layout.reader_options if layout is not None else {}
        for n, _ in objects:
            validate_shard_name(n, store.url_of(n))
        total = sum(s for _, s in objects)
        t0, stop = time.monotonic(), threading.Event()
        counts: dict[str, tuple[int, dict[str, str]]] = {}
        hashes: dict[str, str] = {}
        units: dict[str, list[int]] = {}  # a foreign shard's samples per whole unit of its layout

        # 1. cheap checks first, by the format: Parquet footers (row counts, schema), tar first headers.
        def probe(item: tuple[str, int]) -> None:
            if stop.is_set():
                return
            found = _probe(fmt, store, *item)
            if found is not None:
                counts[item[0]] = found
        if fmt.probe is not None:
            _run_pool(objects, probe, a.threads, stop, "datacache-index")

        # 2. hash every object (and count tar/lmdb samples in the local copy hashing makes; check a
        # foreign shard against its own index's hashes and sample count).
        progress = Progress(ctx.quiet, total, "hashing", len(objects), "objects")
        on_bytes = _watch(stop, progress)

        def digest(item: tuple[str, int], tmpdir: str) -> None:
            if stop.is_set():
                return
            name, size = item
            path, h = _download(store, name, size, tmpdir, on_bytes, stop.is_set)
            try:
                if layout is not None:
                    check_hashes(path, layout.hashes.get(name, {}), store.url_of(name))
                if name not in counts:  # the probe could not tell: count in the local copy
                    counts[name] = _local_count(fmt, path, store.url_of(name), options)
                if layout is not None and fmt.layout is not None and not options.get("compression"):
                    units[name] = _unit_rows(fmt, path, store.url_of(name))
            finally:
                os.unlink(path)
            declared = layout.samples.get(name) if layout is not None else None
            if declared is not None and declared != counts[name][0]:
                raise IntegrityError(f"the shard holds {counts[name][0]} samples, the dataset's index declares "
                                     f"{declared}", url=store.url_of(name), hint="The shard or its index is damaged")
            hashes[name] = h
            progress.item_done()
        try:
            with tempfile.TemporaryDirectory(prefix="datacache-index-") as tmpdir:
                _run_pool(objects, lambda item: digest(item, tmpdir), a.threads, stop, "datacache-index")
        finally:
            progress.close()
        schema = _merge_schemas(fmt, [(n, counts[n][1]) for n, _ in objects], store)
        shards = tuple(ShardInfo(n, s, counts[n][0], hashes[n]) for n, s in objects)
        rows = sorted(r for u in units.values() for r in u)
        how = {"foreign": layout.what, "reader_options": options,
               **({"unit_rows": rows[(len(rows) - 1) // 2]} if rows else {})} if layout is not None else \
            {"pattern": a.pattern or f"*{fmt.extension}", **({"split": a.split} if a.split else {})}
        manifest = Manifest(format=fmt.name, schema=schema, shards=shards,
                            extra={"indexed_by": f"datacache {__version__}", **how})
        store.write_bytes(MANIFEST_NAME, manifest.to_json().encode())
        url = store.url_of(MANIFEST_NAME)
    seconds = time.monotonic() - t0
    what = f"{layout.what} dataset, " if layout is not None else ""
    ctx.emit({"url": url, "dataset_id": manifest.dataset_id, "format": fmt.name, "schema": schema,
              "num_shards": len(shards), "num_samples": manifest.num_samples, "total_bytes": total,
              "seconds": round(seconds, 3)},
             [f"wrote {url}: {what}{len(shards)} {fmt.name} shards, {manifest.num_samples:,} samples, "
              f"{format_size(total)} (read once to hash, {_mbps(total, seconds):.1f} MB/s)",
              f"  dataset id  {manifest.dataset_id}", f"  schema      {json.dumps(schema)}"])
    return 0


# -------------------------------------------------------------------------------------- write
def cmd_write(ctx: Ctx) -> int:
    a = ctx.args
    source = open_source(a.src, a.src_type, group=a.group, shuffle=a.shuffle, seed=a.seed,
                         storage_options=ctx.storage_options)
    kind, samples = source.kind, source.samples
    for warning in source.warnings:
        print(f"datacache: warning: {warning}", file=sys.stderr)
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
    classes = [] if source.classes is None else [f"  classes     {json.dumps(source.classes)} (label = index)"]
    ctx.emit({"src": a.src, "src_type": kind, "url": url, "dataset_id": m.dataset_id, "format": m.format,
              "schema": m.schema, "num_shards": len(m.shards), "num_samples": m.num_samples,
              "total_bytes": m.total_bytes, "seconds": round(seconds, 3), "classes": source.classes},
             [f"wrote {m.num_samples:,} samples from {a.src} ({kind}) to {url}: {len(m.shards)} {m.format} shards, "
              f"{format_size(m.total_bytes)} in {seconds:.1f} s",
              f"  dataset id  {m.dataset_id}", f"  schema      {json.dumps(m.schema)}", *classes])
    return 0


# ------------------------------------------------------------------------------------- verify
