"""Several datasets in one: ``Stream`` (one source and its weight) and the per-epoch draw counts.

A mixed ``StreamingDataset(streams=[...])`` reads every epoch exactly ``draws[i]`` samples of
stream ``i``. The weights (at most one per stream):

- ``proportion`` (relative): stream ``i`` gets ``p_i / sum(p)`` of ``epoch_size`` (default: the
  sum of the streams' sizes), rounded by largest remainder so that the draws sum to
  ``epoch_size`` exactly;
- ``repeat`` (a float, absolute): ``round(repeat * size)`` samples; ``choose`` (an int,
  absolute): that many. With an explicit ``epoch_size`` the absolute draws are scaled to it
  (largest remainder again);
- no weight: ``repeat=1``; without any weights an epoch is the union of the streams, every
  sample exactly once.

Relative and absolute weights cannot be mixed across streams (as in MosaicML Streaming). Pure
functions and an immutable ``Stream``: thread-safe.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

__all__ = ["Stream", "draw_counts", "largest_remainder", "load_streams", "BATCHINGS", "SAMPLINGS"]

BATCHINGS = ("random", "stratified", "per_stream")
SAMPLINGS = ("balanced", "fixed")


def _positive(url: str, name: str, value: Any, integer: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value <= 0:
        kind = "an int >= 1" if integer else "a number > 0"
        raise ValueError(f"datacache: stream {url}: {name}={value!r}, expected {kind}: give a positive weight, "
                         "or drop the stream")


@dataclass(frozen=True)
class Stream:
    """One source of a mixed ``StreamingDataset`` (see the module docstring). Immutable.

    ``url``: the dataset's prefix (a ``manifest.json`` under it); ``storage_options`` and
    ``reader_options``: this stream's own fsspec and reader options; at most one of
    ``proportion``, ``repeat`` and ``choose``.
    """

    url: str
    proportion: float | None = field(default=None, kw_only=True)
    repeat: float | None = field(default=None, kw_only=True)
    choose: int | None = field(default=None, kw_only=True)
    storage_options: Mapping[str, Any] | None = field(default=None, kw_only=True, compare=False, repr=False)
    reader_options: Mapping[str, Any] | None = field(default=None, kw_only=True, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(f"datacache: Stream url={self.url!r}, expected a dataset URL string")
        given = [n for n in ("proportion", "repeat", "choose") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"datacache: stream {self.url}: {' and '.join(given)} given, expected at most one "
                             "of proportion, repeat and choose")
        for n in given:
            _positive(self.url, n, getattr(self, n), integer=n == "choose")

    @property
    def relative(self) -> bool:
        """Whether the weight is a share of the epoch (``proportion``)."""
        return self.proportion is not None

    @property
    def weight_name(self) -> str:
        return next((n for n in ("proportion", "repeat", "choose") if getattr(self, n) is not None), "no weight")

    def absolute(self, size: int) -> Fraction:
        """Samples this stream asks for (``repeat``, ``choose``, or its size without a weight)."""
        if self.choose is not None:
            return Fraction(self.choose)
        return Fraction(self.repeat if self.repeat is not None else 1) * size


def _key(url: str) -> str:
    return url.rstrip("/")


def check_streams(streams: Sequence[Stream]) -> None:
    """``ValueError`` for no streams, a non-``Stream``, two streams of one URL, or relative and
    absolute weights mixed."""
    if not streams:
        raise ValueError("datacache: streams=[] is empty: pass at least one datacache.Stream")
    seen: dict[str, str] = {}
    for s in streams:
        if not isinstance(s, Stream):
            raise ValueError(f"datacache: streams holds {s!r}, expected datacache.Stream objects")
        if _key(s.url) in seen:
            raise ValueError(f"datacache: stream {s.url}: the same URL as another stream ({seen[_key(s.url)]}); "
                             "give a stream once and weight it with proportion, repeat or choose")
        seen[_key(s.url)] = s.url
    rel = [s for s in streams if s.relative]
    if rel and len(rel) != len(streams):
        other = next(s for s in streams if not s.relative)
        raise ValueError(f"datacache: stream {other.url}: {other.weight_name} (absolute) mixed with relative "
                         f"proportion of stream {rel[0].url}: give every stream a proportion, or every stream "
                         "repeat/choose (or no weight)")


def largest_remainder(shares: Sequence[Fraction], total: int) -> list[int]:
    """``shares`` (any non-negative scale) apportioned to integers summing to ``total``: each the
    floor of its exact share, the rest one each to the largest remainders (ties: earlier first)."""
    s = sum(shares)
    exact = [Fraction(x) * total / s for x in shares]
    out = [math.floor(x) for x in exact]
    rest = total - sum(out)
    for i in sorted(range(len(exact)), key=lambda i: (-(exact[i] - out[i]), i))[:rest]:
        out[i] += 1
    return out


def draw_counts(streams: Sequence[Stream], sizes: Sequence[int], epoch_size: int | None) -> list[int]:
    """Samples each stream gives per epoch (see the module docstring). ``sizes``: the streams'
    sample counts."""
    check_streams(streams)
    if epoch_size is not None and (isinstance(epoch_size, bool) or not isinstance(epoch_size, int)
                                   or epoch_size < 1):
        raise ValueError(f"datacache: epoch_size={epoch_size!r}, expected an int >= 1 (or None: the sum of the "
                         "streams' sizes)")
    if streams[0].relative:
        return largest_remainder([Fraction(s.proportion) for s in streams],  # type: ignore[arg-type]
                                 sum(sizes) if epoch_size is None else epoch_size)
    asked = [s.absolute(n) for s, n in zip(streams, sizes)]
    if epoch_size is None:
        return [int(round(a)) for a in asked]
    return largest_remainder(asked, epoch_size)


_MIX_KEYS = ("streams", "epoch_size", "batching", "sampling")
_STREAM_KEYS = ("url", "proportion", "repeat", "choose", "storage_options", "reader_options")


def load_streams(path: str) -> dict[str, Any]:
    """A mix from a JSON or YAML file (``.yaml``/``.yml``: needs PyYAML): ``{"streams": [{"url":
    ..., "proportion": ...}, ...], "epoch_size": ..., "batching": ..., "sampling": ...}`` (or just
    the list of streams), as ``StreamingDataset`` keyword arguments with ``Stream`` objects.
    ``ValueError`` naming the file for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise ValueError(f"{path}: a YAML streams file needs PyYAML (pip install pyyaml); or write it "
                                 "as JSON") from None
            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the streams file: {exc}") from None
    if isinstance(doc, list):
        doc = {"streams": doc}
    if not isinstance(doc, Mapping) or not isinstance(doc.get("streams"), list) or set(doc) - set(_MIX_KEYS):
        raise ValueError(f"{path}: expected a mapping of {', '.join(_MIX_KEYS)} (streams: a list of "
                         f"mappings of {', '.join(_STREAM_KEYS)}), or the list of streams")
    out: dict[str, Any] = {k: doc[k] for k in _MIX_KEYS[1:] if k in doc}
    streams = []
    for i, st in enumerate(doc["streams"]):
        if not isinstance(st, Mapping) or "url" not in st or set(st) - set(_STREAM_KEYS):
            raise ValueError(f"{path}: stream {i + 1} is {st!r}: expected a mapping with url and at most "
                             f"{', '.join(_STREAM_KEYS[1:])}")
        streams.append(Stream(st["url"], **{k: v for k, v in st.items() if k != "url"}))
    out["streams"] = streams
    return out
