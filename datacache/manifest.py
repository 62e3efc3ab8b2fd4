"""The dataset manifest: ``manifest.json`` at the dataset prefix.

A manifest names the reader format, the field schema and, per shard, its relative name, byte size,
sample count and content hash. The dataset id is derived from that content, so a changed dataset
gets a new id and a cache keyed by it never serves stale bytes. Manifests are immutable values
(thread-safe); ``load_manifest`` validates everything it reads, shard names first.
"""
from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from .errors import DatacacheError, ManifestError
from .hashing import ALGORITHM, hash_bytes

__all__ = ["MANIFEST_NAME", "FORMAT_VERSION", "ShardInfo", "Manifest", "validate_shard_name", "load_manifest"]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
_HASH_RE = re.compile(r"^[a-z0-9_]+:[0-9a-f]{16,128}$")
_MAX_MANIFEST_BYTES = 256 << 20


def validate_shard_name(name: Any, url: str | None = None) -> str:
    """Return ``name`` if it is a plain relative shard name, else raise ``ManifestError``.

    Rejected: non-strings, empty names, absolute paths, ``..`` or ``.`` components, empty
    components, backslashes, NUL and other control characters.
    """
    why = None
    if not isinstance(name, str) or not name:
        why = "is empty or not a string"
    elif name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        why = "is an absolute path"
    elif "\\" in name:
        why = "contains a backslash"
    elif any(ord(c) < 32 for c in name):
        why = "contains a NUL or control character"
    elif any(part in ("", ".", "..") for part in name.split("/")):
        why = "contains '..', '.' or an empty path component"
    elif len(name) > 1024:
        why = "is longer than 1024 characters"
    if why:
        raise ManifestError(
            f"unsafe shard name {name!r}: it {why}", url=url,
            hint="Shard names must be plain relative names such as 'shard-000000.dcz'; rebuild the manifest",
        )
    return name


@dataclass(frozen=True)
class ShardInfo:
    """One shard: relative ``name``, ``bytes`` on the store, ``samples`` it holds, content ``hash``."""

    name: str
    bytes: int
    samples: int
    hash: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "samples": self.samples, "hash": self.hash}


def compute_dataset_id(fmt: str, schema: dict[str, str], shards: tuple[ShardInfo, ...]) -> str:
    """Content-derived id: a hash over format, schema and every shard's name, size, count and hash."""
    canon = json.dumps([fmt, schema, [s.to_dict() for s in shards]], sort_keys=True, separators=(",", ":"))
    return "ds-" + hash_bytes(canon.encode()).split(":", 1)[1][:24]


@dataclass(frozen=True)
class Manifest:
    """An immutable, validated dataset manifest."""

    format: str
    schema: dict[str, str]
    shards: tuple[ShardInfo, ...]
    dataset_id: str = ""
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.dataset_id:
            object.__setattr__(self, "dataset_id", compute_dataset_id(self.format, self.schema, self.shards))

    @property
    def num_samples(self) -> int:
        return self.offsets[-1]

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @cached_property
    def offsets(self) -> list[int]:
        """Global index of each shard's first sample, plus the total at the end."""
        out = [0]
        for s in self.shards:
            out.append(out[-1] + s.samples)
        return out

    def locate(self, index: int) -> tuple[int, int]:
        """Map a global sample index to (shard number, index within the shard)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for a dataset of {self.num_samples} samples")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return shard, index - self.offsets[shard]

    @property
    def unit_rows(self) -> int:
        """Samples per unit (a dcz block) as the writer recorded them (``extra["unit_rows"]``, their
        median), or 0 where it did not (an older or foreign writer) or the value is not a positive
        integer."""
        v = self.extra.get("unit_rows")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    def reader_options(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The keyword arguments for the format's reader: what the manifest records for these files
        (``extra["reader_options"]``: e.g. an MDS dataset's columns, from its ``index.json``), with
        the caller's ``given`` options over them."""
        recorded = self.extra.get("reader_options")
        return {**(recorded if isinstance(recorded, dict) else {}), **(given or {})}

    def cache_key(self, shard: int) -> str:
        """The node-cache key of a shard: dataset id plus relative name."""
        return f"{self.dataset_id}/{self.shards[shard].name}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "dataset_id": self.dataset_id,
            "format": self.format,
            "schema": self.schema,
            "num_samples": self.num_samples,
            "total_bytes": self.total_bytes,
            "hash_algorithm": ALGORITHM,
            "shards": [s.to_dict() for s in self.shards],
            "extra": self.extra,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, url: str | None = None) -> "Manifest":
        """Parse and validate a manifest; every problem raises ``ManifestError`` naming ``url``."""
        hint = "Rewrite it with datacache.write_dataset or `datacache index`"
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest is not valid JSON (truncated or corrupt?): {exc}", url=url,
                                hint=hint) from exc
        if not isinstance(doc, dict):
            raise ManifestError("manifest must be a JSON object", url=url, hint=hint)
        try:
            return cls._from_doc(doc, url)
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"manifest is missing or has an invalid field: {exc!r}", url=url, hint=hint) from exc

    @classmethod
    def _from_doc(cls, doc: dict[str, Any], url: str | None) -> "Manifest":
        version = int(doc["format_version"])
        if version > FORMAT_VERSION:
            raise ManifestError(f"manifest format_version {version} is newer than this datacache supports "
                                f"({FORMAT_VERSION})", url=url, hint="Upgrade datacache")
        _check_algorithm(doc.get("hash_algorithm", ALGORITHM), "the manifest's hash_algorithm", url)
        schema = doc["schema"]
        if not isinstance(schema, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in schema.items()):
            raise ValueError("schema must map field names to kind strings")
        shards = []
        for raw in doc["shards"]:
            name = validate_shard_name(raw["name"], url)
            size, samples, digest = raw["bytes"], raw["samples"], raw["hash"]
            if not (isinstance(size, int) and isinstance(samples, int)) or size < 0 or samples < 0:
                raise ValueError(f"shard {name!r}: bytes and samples must be non-negative integers")
            if not isinstance(digest, str) or not _HASH_RE.match(digest):
                raise ValueError(f"shard {name!r}: hash {digest!r} is not '<algorithm>:<hex>'")
            _check_algorithm(digest.split(":", 1)[0], f"shard {name!r}'s hash", url)
            shards.append(ShardInfo(name, size, samples, digest))
        if len({s.name for s in shards}) != len(shards):
            raise ValueError("duplicate shard names")
        m = cls(format=str(doc["format"]), schema=dict(schema), shards=tuple(shards),
                dataset_id=str(doc["dataset_id"]), format_version=version, extra=dict(doc.get("extra") or {}))
        declared = doc.get("num_samples")
        if declared is not None and declared != m.num_samples:
            raise ValueError(f"num_samples {declared} != sum of shard samples {m.num_samples}")
        if m.dataset_id != compute_dataset_id(m.format, m.schema, m.shards):
            raise ManifestError("dataset_id does not match the manifest's content (edited by hand?)", url=url,
                                hint="Rebuild the manifest with `datacache index` or datacache.write_dataset")
        return m


def _check_algorithm(algorithm: Any, what: str, url: str | None) -> None:
    """ManifestError unless ``algorithm`` is the one datacache verifies shards with."""
    if algorithm != ALGORITHM:
        raise ManifestError(f"{what} is {algorithm!r}, but this datacache verifies shards only with "
                            f"{ALGORITHM!r}", url=url,
                            hint=f"Rebuild the manifest with `datacache index` or datacache.write_dataset "
                            f"(they hash with {ALGORITHM})")


def load_manifest(store: Any) -> Manifest:
    """Read and validate ``manifest.json`` from a ``Store``."""
    url = store.url_of(MANIFEST_NAME)
    try:
        size = store.size(MANIFEST_NAME)
    except DatacacheError as exc:
        if isinstance(exc, FileNotFoundError) and getattr(exc, "code", None) == "NoSuchBucket":
            bucket = store.url.split("://", 1)[-1].split("/", 1)[0]
            raise type(exc)(f"the bucket {bucket!r} does not exist", url=url,
                            hint="Check the bucket name in the URL (and the endpoint: another store may "
                            "hold it)") from exc
        if isinstance(exc, FileNotFoundError):
            raise type(exc)(f"no {MANIFEST_NAME} at this prefix", url=url,
                            hint="Check the URL, or build one with `datacache index` / "
                            "datacache.write_dataset") from exc
        raise
    if size > _MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {size} bytes, more than the {_MAX_MANIFEST_BYTES} allowed", url=url)
    return Manifest.from_json(store.read_bytes(MANIFEST_NAME, size=size), url=url)
