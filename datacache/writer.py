"""Write a dataset to any fsspec URL: shards rolled at a byte size, the manifest last.

Shards are built in a local temporary directory by the format's ``ShardWriter`` (from
``readers``), hashed, uploaded, then deleted locally; ``manifest.json`` is written only after every
shard is on the store, so a reader never sees a manifest naming shards that are not there yet.
``DatasetWriter`` is not thread-safe: one writer per thread.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

from tqdm.auto import tqdm

import readers
from readers import codec

from .hashing import hash_file
from .manifest import MANIFEST_NAME, Manifest, ShardInfo
from .storage import Store, open_store

__all__ = ["DatasetWriter", "write_dataset"]


class DatasetWriter:
    """Context manager that writes samples into shards at ``url`` and the manifest on exit.

    ``samples`` are dicts of field -> bytes / str / int / float / numpy array; the schema is taken
    from the first sample unless given. On an exception inside the ``with`` block no manifest is
    written (the partial shards are deleted), so a half-written dataset is never visible.
    """

    def __init__(self, url: str, *, format: str = "zstd", shard_bytes: int = 64 << 20,
                 storage_options: Mapping[str, Any] | None = None, schema: dict[str, str] | None = None,
                 progress: bool = True, writer_options: Mapping[str, Any] | None = None,
                 store: Store | None = None) -> None:
        self._fmt = readers.get_format(format)
        self._store = store or open_store(url, dict(storage_options or {}))
        self._own_store = store is None
        self.shard_bytes = int(shard_bytes)
        self.schema = dict(schema) if schema else None
        self._writer_options = dict(writer_options or {})
        self._tmp = tempfile.mkdtemp(prefix="datacache-write-")
        self._shards: list[ShardInfo] = []
        self._current: Any = None
        self._current_path = ""
        self._current_count = 0
        self._closed = False
        self._bar = tqdm(desc=f"writing {self._store.url}", unit="B", unit_scale=True, disable=not progress)
        self.manifest: Manifest | None = None

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

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
        self._bar.update(self._current.bytes_written - before)
        if self._current.bytes_written >= self.shard_bytes:
            self._finish_shard()

    def write_all(self, samples: Iterable[Mapping[str, Any]]) -> None:
        for s in samples:
            self.write(s)

    def _open_shard(self) -> None:
        name = f"shard-{len(self._shards):06d}{self._fmt.extension}"
        self._current_path = os.path.join(self._tmp, name)
        self._current = self._fmt.ShardWriter(self._current_path, self.schema, **self._writer_options)
        self._current_count = 0

    def _finish_shard(self) -> None:
        self._current.close()
        path, self._current = self._current_path, None
        name = os.path.basename(path)
        info = ShardInfo(name, os.path.getsize(path), self._current_count, hash_file(path))
        self._store.put_file(path, name)
        os.unlink(path)
        self._shards.append(info)

    def close(self) -> Manifest:
        """Finish the last shard, write the manifest, and return it. Idempotent."""
        if self._closed:
            assert self.manifest is not None
            return self.manifest
        if self._current is not None:
            self._finish_shard()
        manifest = Manifest(format=self._fmt.name, schema=self.schema or {}, shards=tuple(self._shards))
        self._store.write_bytes(MANIFEST_NAME, manifest.to_json().encode())
        self.manifest = manifest
        self._cleanup()
        return manifest

    def abort(self) -> None:
        """Drop everything written so far; no manifest is written. Idempotent."""
        if self._closed:
            return
        if self._current is not None:
            self._current.close()
            self._current = None
        for s in self._shards:
            try:
                self._store.delete(s.name)
            except Exception:  # best effort: without a manifest the shards are invisible anyway
                pass
        self._cleanup()

    def _cleanup(self) -> None:
        self._closed = True
        self._bar.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._own_store:
            self._store.close()


def write_dataset(samples: Iterable[Mapping[str, Any]], url: str, *, format: str = "zstd",
                  shard_bytes: int = 64 << 20, storage_options: Mapping[str, Any] | None = None,
                  **kwargs: Any) -> Manifest:
    """Write ``samples`` as a dataset at ``url`` and return its manifest (see ``DatasetWriter``)."""
    with DatasetWriter(url, format=format, shard_bytes=shard_bytes, storage_options=storage_options,
                       **kwargs) as w:
        w.write_all(samples)
    assert w.manifest is not None
    return w.manifest
