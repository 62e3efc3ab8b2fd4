"""Scenarios of ``tools/bench.py`` derived from another (issue 40's targets), the ``images`` scenario's
settings, and the targets of issue 40, each a ratio against a bound measured in the same run.

Derived scenarios: the base scenario's settings with one change, run beside the base so the
ratio between them comes from one run:

- ``small-1024``: ``small`` (100 MB of 1 KiB samples, warm, no compute) at batch 1024.
- ``raw-bytes``: ``raw`` over the ``bytes`` dataset: the same 64 KiB samples with the pixels stored as
  a Python ``bytes`` field (``tools/bench_write.py``), delivered as ``default_collate`` gives them.
- ``warm-bytes``: ``warm`` (20 ms step) over the ``bytes`` dataset.
- ``limited-bytes``: ``limited`` (C = D/2, 3 epochs) over the ``bytes`` dataset.
- ``raw-shards``: ``raw`` over the ``shards`` dataset: the same 64 KiB arrays in shards a sixteenth of
  ``--shard-bytes`` (1 MB by default: 500 shards, more per DataLoader worker than a pool of 64 open
  readers kept), the shape of a node's share of a large dataset.
- ``images``: JPEG bytes decoded and cropped in the workers, batch 64 (``tools/bench_images.py``).

datacache's ``never`` variant (``node_shuffle="never"``: the sliding window only, warm epochs
too) runs in ``raw``, ``raw-bytes``, ``small`` and ``small-1024``, beside the default's uniform
warm shuffle.

Targets (issue 40; ``checks``): raw >= 40 % of memcpy and within 10 % of ``datacache+never``
(``raw-shards``: the same figures and its ratio to raw, reported without a target);
raw-bytes >= 0.8 x raw's GB/s; small >= 600,000 samples/s; small-1024 >= 1,000,000 (warm and
warm-bytes <= 1.03 x compute, limited-bytes <= 1.05 x (D - C) per later epoch: their base's checks
in ``tools/bench_report.targets``); every scenario: CPU-seconds per GB at most each peer's
(``cpu_check``). Pure functions; no I/O.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from datacache.config import parse_size

DERIVED: dict[str, tuple[str, dict[str, Any]]] = {
    "small-1024": ("small", {"batch_size": 1024}),
    "raw-bytes": ("raw", {"dataset": "bytes"}),
    "warm-bytes": ("warm", {"dataset": "bytes"}),
    "limited-bytes": ("limited", {"dataset": "bytes"}),
    "raw-shards": ("raw", {"dataset": "shards"}),
}
SCENARIOS = tuple(DERIVED) + ("images",)
NEVER = ("raw", "raw-bytes", "small", "small-1024")  # where datacache+never runs


def base(name: str) -> str:
    """The scenario ``name`` is derived from (itself for a base scenario)."""
    return DERIVED[name][0] if name in DERIVED else name


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images-size", help="images scenario: JPEG bytes in all (default 200MB; 40MB with --quick)")
    p.add_argument("--image-bytes", default="100KB", help="images scenario: the JPEGs' mean size, to count them")
    p.add_argument("--images-batch-size", type=int, default=64)


def parse(a: argparse.Namespace) -> None:
    a.images_size = parse_size(a.images_size or ("40MB" if a.quick else "200MB"))
    a.image_bytes = parse_size(a.image_bytes)


def scenario(make: Callable[[str, argparse.Namespace], dict[str, Any]], name: str,
             a: argparse.Namespace) -> dict[str, Any]:
    """Scenario ``name``'s settings: ``make(base)``'s with the derived scenario's change; ``base`` set."""
    if name == "images":
        sc = make("raw", a)  # warm (a fill epoch, then the measured one), no compute
        sc.update(dataset="images", batch_size=a.images_batch_size)
    else:
        sc = make(base(name), a)
        sc.update(DERIVED.get(name, ("", {}))[1])
    sc.update(name=name, base=base(name))
    return sc


def runs_never(scenario_name: str) -> bool:
    return scenario_name in NEVER


def checks(sc: str, dc: dict[str, Any], meds: dict[tuple[str, str], dict[str, Any]]) -> list[tuple[bool | None, str]]:
    """Issue 40's targets for datacache in scenario ``sc`` (``dc``: its medians; ``meds``: every
    (scenario, system)'s medians of the same run)."""
    out: list[tuple[bool | None, str]] = []
    b = base(sc)
    if sc == "raw-shards":  # no target of its own: the shape of a large dataset, against raw's figures
        raw = meds.get(("raw", "datacache"))
        out.append((None, f"{100 * dc['gb_s'] / dc['memcpy_gb_s']:.0f}% of memcpy"))
        if raw and "failed" not in raw:
            out.append((None, f"{dc['gb_s'] / raw['gb_s']:.2f}x raw's GB/s"))
        return out
    if b == "raw" and sc != "images":
        frac = dc["gb_s"] / dc["memcpy_gb_s"]
        out.append((frac >= 0.40, f"{100 * frac:.0f}% of memcpy (>=40%)"))
        never = meds.get((sc, "datacache+never"))
        if never and "failed" not in never:
            r = dc["gb_s"] / never["gb_s"]
            out.append((r >= 0.90, f"{r:.2f}x node_shuffle='never' (>=0.90)"))
        raw = meds.get(("raw", "datacache"))
        if sc == "raw-bytes" and raw and "failed" not in raw:
            r = dc["gb_s"] / raw["gb_s"]
            out.append((r >= 0.80, f"{r:.2f}x raw's GB/s (>=0.80)"))
    if sc in ("small", "small-1024"):
        goal = 1_000_000 if sc == "small-1024" else 600_000
        out.append((dc["samples_s"] >= goal, f"{dc['samples_s']:,.0f} samples/s (>={goal:,})"))
    return out


def cpu_check(dc: dict[str, Any], peers: dict[str, dict[str, Any]], families: tuple[str, ...]
              ) -> list[tuple[bool | None, str]]:
    """CPU-seconds per GB delivered at most each peer family's (its lowest completed variant's); in
    the images scenario the loader's own (the decode excluded: the same work for every system)."""
    key = "loader_gb" if "loader_gb" in dc else "cpu_gb"
    if key not in dc:
        return []
    what = "loader CPU" if key == "loader_gb" else "CPU"
    out: list[tuple[bool | None, str]] = []
    for family in families:
        mine = [p[key] for name, p in peers.items() if name.split("+")[0] == family and "failed" not in p and key in p]
        if mine:
            best = min(mine)
            out.append((dc[key] <= best, f"{what} {dc[key]:.2f} s/GB vs {family} {best:.2f}"))
    return out


__all__ = ["DERIVED", "SCENARIOS", "add_args", "base", "checks", "cpu_check", "parse", "runs_never", "scenario"]
