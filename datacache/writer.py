"""Write a dataset to any fsspec URL: shards rolled at a byte size, the manifest last.

Shards are built in a local temporary directory by the format's ``ShardWriter`` (from
``readers``), hashed, uploaded, then deleted locally; ``manifest.json`` is written only after every
shard is on the store, so a reader never sees a manifest naming shards that are not there yet.

Rewrites are safe: every write names its shards with its own ``write_id``
(``shard-<write_id>-000000.dcz``), so a rewrite never touches the live dataset's shards. The new
manifest replaces the old one in one atomic step (one PUT; on local file systems temp file, fsync,
``os.replace``); only after that are the old dataset's shards deleted. A write that fails or is
aborted deletes only its own shards: the old dataset stays complete and readable. An existing
dataset is replaced only with ``overwrite=True`` (the CLI's ``--force``).
``DatasetWriter`` is not thread-safe: one writer per thread.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import statistics
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ._version import __version__
from .config import parse_size
from .errors import DatacacheError, DatasetExistsError
from .hashing import hash_file
from .manifest import MANIFEST_NAME, Manifest, ShardInfo, load_manifest
from .progress import Progress
from .readers import codec, get_format
from .store.storage import Store, open_store

__all__ = ["DatasetWriter", "write_dataset"]

_SIZE_OPTION = re.compile(r".*_(bytes|size)$")  # writer_options that are sizes (block_bytes, map_size...)


def _sizes(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every ``*_bytes`` / ``*_size`` value given as a string ("1MB") parsed."""
    return {k: parse_size(v) if isinstance(v, str) and _SIZE_OPTION.match(k) else v for k, v in options.items()}


class DatasetWriter:
    """Context manager that writes samples into shards at ``url`` and the manifest on exit.

    ``samples`` are dicts of field -> bytes / str / int / float / numpy array; the schema is taken
    from the first sample unless given. Sizes (``shard_bytes``, ``*_bytes`` / ``*_size``
    ``writer_options``) may be ints or strings such as ``"64MB"``. If ``url`` already holds a
    dataset, ``DatasetExistsError`` is raised unless ``overwrite=True``. On an exception inside the
    ``with`` block no manifest is written and only this write's shards are deleted, so a half-written
    dataset is never visible and the previous one stays intact. Writing no sample is an error.
    """

    def __init__(self, url: str, *, format: str = "zstd", shard_bytes: int | str = 64 << 20,
                 storage_options: Mapping[str, Any] | None = None, schema: dict[str, str] | None = None,
                 progress: bool = True, writer_options: Mapping[str, Any] | None = None,
                 store: Store | None = None, overwrite: bool = False) -> None:
        self._fmt = get_format(format)
        self.shard_bytes = parse_size(shard_bytes)
        if not self.shard_bytes:
            raise ValueError(f"shard_bytes must be a positive size such as '64MB', got {shard_bytes!r}")
        self._writer_options = _sizes(writer_options or {})
        self._store = store or open_store(url, dict(storage_options or {}))
        self._own_store = store is None
        self.overwrite = overwrite
        try:
            self._refuse_existing()
        except BaseException:
            if self._own_store:
                self._store.close()
            raise
        self.write_id = secrets.token_hex(4)
        self.schema = dict(schema) if schema else None
        self._tmp = tempfile.mkdtemp(prefix="datacache-write-")
        self._shards: list[ShardInfo] = []
        self._unit_rows: list[int] = []  # samples per whole unit of every shard written (readers.base.ShardLayout)
        self._current: Any = None
        self._current_path = ""
        self._current_count = 0
        self._closed = False
        self._bar = Progress(not progress, None, f"writing {self._store.url}")
        self.manifest: Manifest | None = None

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _refuse_existing(self) -> None:
        if not self.overwrite and self._store.exists(MANIFEST_NAME):
            raise DatasetExistsError(
                "a dataset already exists here", url=self._store.url_of(MANIFEST_NAME),
                hint="Pass overwrite=True to write_dataset/DatasetWriter (CLI: --force) to replace it, "
                     "or write to another URL")

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample; rolls to a new shard once the current one reaches ``shard_bytes``."""
        if self._closed:
            raise RuntimeError("DatasetWriter is closed")
        if self.schema is None:
            self.schema = codec.infer_schema(sample)
        codec.check_sample(sample, self.schema)
        if self._current is None:
            self._open_shard()
        before = self._current.bytes_written
        self._current.write(sample)
        self._current_count += 1
        self._bar.add(self._current.bytes_written - before)
        if self._current.bytes_written >= self.shard_bytes:
            self._finish_shard()

    def write_all(self, samples: Iterable[Mapping[str, Any]]) -> None:
        for s in samples:
            self.write(s)

    def _open_shard(self) -> None:
        name = f"shard-{self.write_id}-{len(self._shards):06d}{self._fmt.extension}"
        self._current_path = os.path.join(self._tmp, name)
        self._current = self._fmt.ShardWriter(self._current_path, self.schema, **self._writer_options)
        self._current_count = 0

    def _finish_shard(self) -> None:
        self._current.close()
        self._unit_rows += self._current.unit_rows
        path, self._current = self._current_path, None
        name = os.path.basename(path)
        info = ShardInfo(name, os.path.getsize(path), self._current_count, hash_file(path))
        self._bar.item_done()
        self._shards.append(info)  # before the upload: abort() deletes a partly uploaded object too
        self._store.put_file(path, name)
        os.unlink(path)

    def close(self) -> Manifest:
        """Finish the last shard, commit the manifest (the dataset is live from then on), delete the
        replaced dataset's shards, and return the manifest. Idempotent. If the manifest upload itself
        fails, the new shards are left in place (the upload may have landed) and the error raised."""
        if self._closed:
            if self.manifest is None:
                raise RuntimeError("DatasetWriter was aborted: no dataset was written")
            return self.manifest
        try:
            if self._current is not None:
                self._finish_shard()
            if not self._shards:
                raise DatacacheError(
                    "no samples were written (an empty dataset is almost always a bug)", url=self._store.url,
                    hint="Check the samples passed to write_dataset/DatasetWriter (an exhausted iterator?); "
                         "nothing was written")
            self._refuse_existing()  # again: a dataset may have appeared while this one was written
            old = self._live_manifest()
        except BaseException:
            self.abort()
            raise
        extra: dict[str, Any] = {"written_by": f"datacache {__version__}", "write_id": self.write_id}
        if self._unit_rows:  # the part mix cuts its parts along units (datacache.plan.part_shuffle.part_rows)
            extra["unit_rows"] = int(statistics.median_low(self._unit_rows))
        manifest = Manifest(format=self._fmt.name, schema=self.schema or {}, shards=tuple(self._shards),
                            extra=extra)
        try:
            self._store.write_bytes(MANIFEST_NAME, manifest.to_json().encode())  # the commit
            self.manifest = manifest
            if old is not None:
                self._delete_replaced(old, manifest)
        finally:
            self._cleanup()
        return manifest

    def _live_manifest(self) -> Manifest | None:
        """The manifest this write replaces (None if none, or unreadable: its shards are then kept)."""
        if not self._store.exists(MANIFEST_NAME):
            return None
        try:
            return load_manifest(self._store)
        except DatacacheError as exc:
            warnings.warn(f"datacache: replacing an unreadable manifest; its shards are kept: {exc}", stacklevel=4)
            return None

    def _delete_replaced(self, old: Manifest, new: Manifest) -> None:
        """Delete the shards of ``old`` that a DatasetWriter created and ``new`` does not name.
        Files that ``datacache index`` (or anyone else) put there are never deleted."""
        keep = {s.name for s in new.shards}
        doomed = [s.name for s in old.shards if s.name not in keep and _written_by_us(old, s.name)]
        failed = self._store.delete_many(doomed)
        if failed:
            names = ", ".join(name for name, _ in failed[:5]) + (" ..." if len(failed) > 5 else "")
            warnings.warn(f"datacache: {self._store.url}: the new dataset is live, but {len(failed)} old shard(s) "
                          f"could not be deleted ({names}: {failed[0][1]}); delete them by hand", stacklevel=3)

    def abort(self) -> None:
        """Drop everything this write uploaded; no manifest is written, the previous dataset (if
        any) is untouched. Idempotent."""
        if self._closed:
            return
        if self._current is not None:
            self._current.close()
            self._current = None
        self._store.delete_many([s.name for s in self._shards])  # best effort: without a manifest they are invisible
        self._cleanup()

    def _cleanup(self) -> None:
        self._closed = True
        self._bar.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._own_store:
            self._store.close()


def _written_by_us(m: Manifest, name: str) -> bool:
    """True if shard ``name`` of ``m`` was created by a DatasetWriter (this one or an older one)."""
    if "write_id" in m.extra:
        return name.startswith(f"shard-{m.extra['write_id']}-")
    if m.extra:
        return False  # indexed (`datacache index`) or foreign: the files are not ours
    try:
        ext = get_format(m.format).extension
    except Exception:  # noqa: BLE001 - an unknown format: not ours to delete
        return False
    return re.fullmatch(rf"shard-\d{{6}}{re.escape(ext)}", name) is not None  # writers before write ids


def write_dataset(samples: Iterable[Mapping[str, Any]], url: str, *, format: str = "zstd",
                  shard_bytes: int | str = 64 << 20, storage_options: Mapping[str, Any] | None = None,
                  overwrite: bool = False, **kwargs: Any) -> Manifest:
    """Write ``samples`` as a dataset at ``url`` and return its manifest (see ``DatasetWriter``).
    An existing dataset at ``url`` is replaced only with ``overwrite=True``."""
    with DatasetWriter(url, format=format, shard_bytes=shard_bytes, storage_options=storage_options,
                       overwrite=overwrite, **kwargs) as w:
        w.write_all(samples)
    assert w.manifest is not None
    return w.manifest
