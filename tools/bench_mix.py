"""The ``mix`` scenario of ``tools/bench.py``: three datasets mixed by proportion, a cold epoch then a
warm one, per-stream counts and remote bytes (issue 15.8).

Datasets: three prefixes per system, each in the system's own format, of ``SIZES`` = 50 / 30 / 20 %
of the bench's samples (``--size``), the ids consecutive across them (stream k holds ids
``first_k .. first_k + n_k - 1``): the union is the class-sorted data of ``tools/bench_quality.py``
and a batch's ids tell each sample's stream.

Mix: ``PROPORTIONS`` = 0.4 / 0.3 / 0.3 of ``epoch_size`` = N, the three sizes summed. So stream 0 is
subsampled (0.4 N of its 0.5 N samples: 80 %), stream 1 is read once, stream 2 is repeated 1.5 x
(0.3 N of its 0.2 N: each sample once or twice). Expected per stream: ``round(p_i x N)``, the
rounding keeping the sum (largest remainder, on the decimal proportions). ``sampling="fixed"``
(both datacache and Streaming have the knob): stream 0's subset is the same every epoch, so the
warm epoch needs nothing from the link.

Systems, each through its documented mixing API, batch size, workers and persistent workers as
every scenario (``bench_systems.loader_kw``):

- datacache: ``StreamingDataset(streams=[datacache.Stream(url, proportion=p), ...], epoch_size=N,
  sampling="fixed")`` (``batching="random"``, the default) + ``datacache.DataLoader(ds, batch_size=B)``.
- streaming: ``StreamingDataset(streams=[streaming.Stream(remote=url, local=dir, proportion=p), ...],
  epoch_size=N, sampling_method="fixed", batch_size=B)`` (``batching_method="random"``, the default)
  + ``DataLoader(batch_size=B)``.
- litdata: ``CombinedStreamingDataset([StreamingDataset(url), ...], weights=PROPORTIONS,
  iterate_over_all=False)`` + ``StreamingDataLoader(batch_size=B)``: LitData draws each sample's
  stream at random by weight and ends the epoch when any stream runs out; it has no epoch size, no
  repeat and no subsample, so its counts are what that gives (shown, not exact).
- fsspec (the no-cache baseline) has no mixing: unavailable.

Figures per epoch: samples delivered per stream against expected, distinct samples and the most
copies of one sample; remote bytes at the proxy against ``needed`` = sum_i D_i x min(1, draws_i /
n_i) (each system's own D_i: the drawn samples' bytes); wall against the bound max(needed /
bandwidth, compute) (warm: compute); wait, first batch, quality (against a uniform random draw of
the union: the repeated stream's second copies lower it a little). A peer's counts are exact when
each is within one sample of p_i x N and they sum to N (``within_one``: any rounding that keeps the
sum); datacache's must equal the largest-remainder figures. Thread-safety: ``StreamCounts``
is used by one thread (the runner's measured loop); the rest are pure functions.
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

SIZES = ("0.5", "0.3", "0.2")  # shares of the bench's samples, one dataset each
PROPORTIONS = ("0.4", "0.3", "0.3")  # shares of epoch_size = the sum of the sizes
SAMPLING = "fixed"
PHASES = ["cold", "warm"]  # from an empty cache, then from the cache the cold epoch filled
UNAVAILABLE = {"fsspec": "the no-cache baseline has no mixing"}


def _apportion(shares: tuple[str, ...], total: int) -> list[int]:
    from datacache.mixing.streams import largest_remainder

    return largest_remainder([Fraction(s) for s in shares], total)


def layout(total: int) -> list[tuple[int, int]]:
    """(first id, samples) of each stream's dataset: ``SIZES`` of ``total`` samples."""
    sizes = _apportion(SIZES, total)
    return [(sum(sizes[:k]), n) for k, n in enumerate(sizes)]


def expected(sizes: list[int]) -> list[int]:
    """Samples per stream per epoch: round(p_i x epoch_size), the sum kept (epoch_size = sum of sizes)."""
    return _apportion(PROPORTIONS, sum(sizes))


def within_one(counts: list[int] | None, epoch_size: int) -> bool:
    """Whether per-stream counts are a rounding of p_i x epoch_size that keeps the sum: each within
    one sample of its exact share, summing to epoch_size. Largest remainder (``expected``, what
    datacache documents) is one such rounding; Streaming gives the shortfall to seeded random streams."""
    if not counts or len(counts) != len(PROPORTIONS) or sum(counts) != epoch_size:
        return False
    total = sum(Fraction(p) for p in PROPORTIONS)
    return all(abs(c - Fraction(p) / total * epoch_size) < 1 for c, p in zip(counts, PROPORTIONS))


# ---------------------------------------------------------------- datasets and the run's spec
def dataset(total: int, write: Callable[[int, int, int], dict[str, Any]]) -> dict[str, Any]:
    """The mix's datasets for one format: ``write(k, first, n)`` writes (or finds) stream k's and
    returns its info; the mix's info (bytes and samples summed, ``streams``), or the first failure."""
    parts = []
    for k, (first, n) in enumerate(layout(total)):
        info = write(k, first, n)
        if "bytes" not in info:
            return info
        parts.append({**info, "first": first, "n": n})
    return {"bytes": sum(p["bytes"] for p in parts), "files": sum(p.get("files", 1) for p in parts),
            "n": sum(p["n"] for p in parts), "sample_bytes": parts[0]["sample_bytes"], "url": parts[0]["url"],
            "streams": parts}


def spec_part(info: dict[str, Any]) -> dict[str, Any]:
    """What a mix adds to a run's spec: the streams with their proportions, the epoch size and the
    id bounds of the streams (for ``StreamCounts``)."""
    streams = [{"url": p["url"], "proportion": float(w), "n": p["n"]} for p, w in zip(info["streams"], PROPORTIONS)]
    bounds = [p["first"] for p in info["streams"]] + [info["n"]]
    return {"streams": streams, "epoch_size": info["n"], "stream_bounds": bounds}


def record_part(info: dict[str, Any]) -> dict[str, Any]:
    """What a mix adds to every record: sizes, bytes, proportions, expected counts, needed bytes."""
    sizes = [p["n"] for p in info["streams"]]
    draws = expected(sizes)
    needed = sum(p["bytes"] * min(1.0, d / p["n"]) for p, d in zip(info["streams"], draws))
    return {"mix": {"sizes": sizes, "stream_bytes": [p["bytes"] for p in info["streams"]],
                    "proportions": [float(w) for w in PROPORTIONS], "expected": draws, "epoch_size": sum(sizes),
                    "needed": needed, "subsampled": sum(d < n for d, n in zip(draws, sizes)),
                    "sampling": SAMPLING}}


# ---------------------------------------------------------------- the loaders (in the runner)
def build(spec: dict[str, Any], lkw: dict[str, Any], streaming_ready: Callable[[Any], None]
          ) -> tuple[Any, Callable[[int], None], Callable[[], dict[str, Any]], Callable[[], None]]:
    """(loader, set_epoch, stats, close) of the mix for the spec's system (default settings)."""
    system, bs, cache_dir, streams = spec["system"], spec["scenario"]["batch_size"], spec["cache_dir"], spec["streams"]
    if system == "datacache":
        import datacache

        cfg = datacache.CacheConfig(ram_dir=os.path.join(cache_dir, "ram"), ssd_dir=spec["ssd_dir"])
        mixed = [datacache.Stream(s["url"], proportion=s["proportion"], storage_options=spec["storage_options"])
                 for s in streams]
        ds = datacache.StreamingDataset(streams=mixed, epoch_size=spec["epoch_size"], sampling=SAMPLING, cache=cfg,
                                        shuffle=True, seed=0)
        return datacache.DataLoader(ds, batch_size=bs, **lkw), ds.set_epoch, ds.stats, ds.close
    if system == "streaming":
        import streaming
        import torch.utils.data as tud
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = streaming.StreamingDataset(
            streams=[streaming.Stream(remote=s["url"], local=os.path.join(cache_dir, f"local{k}"),
                                      proportion=s["proportion"]) for k, s in enumerate(streams)],
            epoch_size=spec["epoch_size"], sampling_method=SAMPLING, shuffle=True, shuffle_seed=0, batch_size=bs)
        streaming_ready(ds)
        return tud.DataLoader(ds, batch_size=bs, **lkw), lambda e: None, lambda: {}, lambda: None
    if system == "litdata":
        import litdata

        parts = [litdata.StreamingDataset(s["url"], cache_dir=os.path.join(cache_dir, f"lit{k}"), shuffle=True, seed=0,
                                          storage_options=spec["litdata_options"]) for k, s in enumerate(streams)]
        ds = litdata.CombinedStreamingDataset(parts, weights=[s["proportion"] for s in streams],
                                              iterate_over_all=False, seed=0)
        return litdata.StreamingDataLoader(ds, batch_size=bs, **lkw), lambda e: None, lambda: {}, lambda: None
    raise ValueError(f"{system}: {UNAVAILABLE.get(system, 'no mix runner')}")


class StreamCounts:
    """One epoch's sample ids, counted per stream (the streams' id ranges ``bounds[k]..bounds[k+1]``)."""

    def __init__(self, bounds: list[int]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.ids: list[np.ndarray] = []

    def add(self, ids: list[int] | np.ndarray) -> None:
        self.ids.append(np.asarray(ids, dtype=np.int64))

    def summary(self) -> dict[str, list[int]]:
        """``stream_samples`` (delivered), ``stream_unique`` (distinct) and ``stream_max_copies`` per stream."""
        k = len(self.bounds) - 1
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)
        uniq, copies = np.unique(ids, return_counts=True)
        of = np.clip(np.searchsorted(self.bounds, uniq, side="right") - 1, 0, k - 1)
        most = [int(copies[of == i].max()) if (of == i).any() else 0 for i in range(k)]
        return {"stream_samples": np.bincount(of, weights=copies, minlength=k).astype(int).tolist(),
                "stream_unique": np.bincount(of, minlength=k).tolist(), "stream_max_copies": most}


# ---------------------------------------------------------------- the report
def summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (mix, system, rep) that completed: totals over both epochs (as every scenario's summary,
    so medians, charts and the progress line work) and each epoch's figures (``cold_*``, ``warm_*``)."""
    r0, mix = recs[0], recs[0]["mix"]
    link = mix["needed"] / r0["bandwidth"]  # the cold epoch's; the warm epoch needs no bytes
    out: dict[str, Any] = {"D": r0["D"], "C": None, "needed": mix["needed"], "link": link, "memcpy": 0.0,
                           "subsampled": mix["subsampled"], "shard_bytes": r0["shard_bytes"]}
    exact = equal = len(recs) == len(PHASES)
    for r in recs:
        p = r["phase"]
        bound = max(link if p == "cold" else 0.0, r["compute"])
        exact = exact and within_one(r.get("stream_samples"), mix["epoch_size"])
        equal = equal and r.get("stream_samples") == mix["expected"]
        out.update({f"{p}_wall": r["wall"], f"{p}_wait_pct": 100 * r["wait"] / r["wall"],
                    f"{p}_first": r["first_batch"] or 0.0, f"{p}_remote": r["remote_bytes"], f"{p}_bound": bound,
                    f"{p}_compute": r["compute"], f"{p}_quality": r.get("quality", 0.0), f"{p}_samples": r["samples"]})
    wall = sum(r["wall"] for r in recs)
    samples = sum(r["samples"] for r in recs)
    out.update(wall=wall, wait_pct=100 * sum(r["wait"] for r in recs) / wall, remote=[r["remote_bytes"] for r in recs],
               samples=samples, samples_s=samples / wall, first_batch=recs[0]["first_batch"] or 0.0,
               compute=sum(r["compute"] for r in recs), bound=sum(out[f"{r['phase']}_bound"] for r in recs),
               exactly_once=float(exact), counts_equal=float(equal),
               quality=statistics.mean(r.get("quality", 0.0) for r in recs),
               counts=" | ".join(f"{r['phase']} " + ", ".join(f"{s}/{e}" for s, e in zip(r.get("stream_samples", []),
                                                                                   mix["expected"])) for r in recs))
    return out


def checks(dc: dict[str, Any]) -> list[tuple[bool | None, str]]:
    """datacache's targets in the mix: the counts it documents (largest remainder), the cold epoch's
    bytes (the drawn samples' bytes, plus at most one shard per subsampled stream: a subset reads
    whole shards and the first samples of one more), none warm, the walls against their bounds."""
    allowed = dc["needed"] + dc["shard_bytes"] * dc["subsampled"]
    cold, warm = dc["cold_wall"] / dc["cold_bound"], dc["warm_wall"] / dc["warm_bound"]
    return [(dc["counts_equal"] == 1, "every stream's count exact in both epochs"),
            (dc["cold_remote"] <= 1.01 * allowed, f"cold remote {dc['cold_remote'] / dc['needed']:.3f} x the drawn "
             f"samples' bytes (<= {allowed / dc['needed']:.3f}: + one shard per subsampled stream)"),
            (dc["warm_remote"] == 0, f"warm remote {dc['warm_remote']:.0f} B (=0)"),
            (cold <= 1.10, f"cold wall {cold:.2f}x bound (<=1.10)"),
            (warm <= 1.05, f"warm wall {warm:.2f}x compute (<=1.05)")]


def _cells(counts: list[list[int]], exp: list[int]) -> str:
    med = [int(statistics.median(col)) for col in zip(*counts)] if counts else []
    return " · ".join(f"{m:,}/{e:,}" for m, e in zip(med, exp))


def table(runs: dict[str, list[list[dict[str, Any]]]], failure: Callable[[dict[str, Any]], str | None],
          order: Callable[[str], int]) -> str:
    """The mix table: per system and epoch, samples per stream (delivered/expected; distinct; most
    copies of a sample), remote and needed MB, wall, bound, wait, CPU-seconds per GB delivered (every
    process of the run: ``tools/bench_cpu.py``), first batch, quality (medians)."""
    rows = ["| system | n | epoch | samples per stream (delivered/expected) | distinct | most copies | remote MB "
            "| needed MB | wall s | wall / bound | wait % | CPU s/GB | first batch s | quality |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in sorted(runs, key=order):
        reps = runs[s]
        ok = [recs for recs in reps if failure(recs[0]) is None and not any("aborted" in r for r in recs)]
        if not ok:
            why = failure(reps[0][0]) or next(f"aborted: {r['aborted']}" for r in reps[0] if "aborted" in r)
            rows.append(f"| {s} | 0 of {len(reps)} | {why[:160]} | | | | | | | | | | | |")
            continue
        n = str(len(ok)) if len(ok) == len(reps) else f"{len(ok)} of {len(reps)}"
        mix = ok[0][0]["mix"]
        for i, phase in enumerate(PHASES):
            ep = [recs[i] for recs in ok if len(recs) > i]
            if not ep:
                continue
            med = {k: statistics.median(r[k] for r in ep) for k in ("remote_bytes", "wall", "wait", "compute")}
            first = statistics.median(r["first_batch"] or 0.0 for r in ep)
            quality = statistics.median(r.get("quality", 0.0) for r in ep)
            bound = max(mix["needed"] / ep[0]["bandwidth"] if phase == "cold" else 0.0, med["compute"])
            counts = _cells([r.get("stream_samples", []) for r in ep], mix["expected"])
            uniq = " · ".join(f"{statistics.median(c):,.0f}" for c in zip(*(r.get("stream_unique", []) for r in ep)))
            most = " · ".join(f"{max(c)}" for c in zip(*(r.get("stream_max_copies", []) for r in ep)))
            needed = mix["needed"] / 1e6 if phase == "cold" else 0.0
            cpu = "-" if any("cpu_s" not in r for r in ep) else \
                f"{statistics.median(r['cpu_s'] / max(r['samples'] * r['sample_bytes'], 1) * 1e9 for r in ep):.2f}"
            rows.append(f"| {s} | {n} | {phase} | {counts} | {uniq} | {most} | {med['remote_bytes'] / 1e6:.1f} "
                        f"| {needed:.1f} | {med['wall']:.2f} | {med['wall'] / bound:.2f} | "
                        f"{100 * med['wait'] / med['wall']:.1f} | {cpu} | {first:.2f} | {quality:.2f} |")
    return "\n".join(rows)


def describe(records: list[dict[str, Any]]) -> str:
    """One line over the mix table: the streams, the draw, what each stream does."""
    r = next((r for r in records if r.get("scenario") == "mix" and "mix" in r), None)
    if r is None:
        return ""
    m = r["mix"]
    what = ["subsampled" if e < n else "repeated" if e > n else "once" for e, n in zip(m["expected"], m["sizes"])]
    streams = "; ".join(f"stream {k}: {n:,} samples ({b / 1e6:.1f} MB), proportion {p}, {e:,} per epoch ({w})"
                        for k, (n, b, p, e, w) in enumerate(zip(m["sizes"], m["stream_bytes"], m["proportions"],
                                                                m["expected"], what)))
    return (f"Three datasets mixed by proportion, epoch_size = {m['epoch_size']:,} (their total), "
            f"sampling `{m['sampling']}`: {streams}. needed MB: the drawn samples' bytes (the cold epoch's link "
            "bound with the bandwidth); distinct and most copies: per stream, over the epoch.")
