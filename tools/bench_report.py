"""The report of ``tools/bench.py``: medians, bounds, datacache's targets, the markdown tables, charts.

    python tools/bench_report.py DIR [--readme FILE.md ...]

regenerates ``DIR/results.md`` and the charts from ``DIR/results.jsonl`` (every repetition, as
the run wrote it) and ``DIR/run.json`` (its command, settings, machine, commit), and with
``--readme`` replaces the generated blocks of each Markdown file given: the full block (between
``bench_text.BEGIN`` and ``END``) and the headline table (between ``bench_text.HEADLINE_BEGIN``
and ``HEADLINE_END``), whichever the file holds.
``python tools/bench_report.py docs/bench --readme README.md docs/benchmarks.md`` rebuilds the
published tables (the headline in the README, the full block in docs/benchmarks.md) from the
committed raw file.

Per (scenario, system, rep) the measured epochs are summed (wall, wait, samples, batches); medians
are taken over the repetitions that completed, and every cell prints n (completed of run); a
repetition that failed is listed with its cause, and a system none of whose repetitions completed
is shown as failed, never as a rival datacache beat. Bounds: link = bytes that must cross the link
/ bandwidth (D for a cold epoch, D - C for a limited epoch after the first, 0 when warm); compute =
batches x step time, the step timed in the same run after each epoch with no batch moving
(``bench_systems.measured_step``: a 20 ms sleep takes 20.2 ms on the 2-core VM); memcpy = D /
measured copy rate. The relevant bound is the largest of the three (images: also the decode's CPU
over the workers, ``tools/bench_images.py``). CPU s/GB: the CPU-seconds of every process of the run
in the measured epochs (``tools/bench_cpu.py``) per GB delivered (samples x sample bytes; images: the
JPEG bytes). Quality: ``tools/bench_quality.py`` (1.0 = a uniform random permutation).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools import bench_cpu, bench_derived, bench_images, bench_mix, bench_nodes, bench_peers  # noqa: E402
from tools.bench_plots import charts, order_key, summarize_profile  # noqa: E402,F401 - bench.py uses it
from tools.bench_text import (  # noqa: E402,F401
    BEGIN,
    END,
    HEADLINE_BEGIN,
    HEADLINE_END,
    NOTES,
    head_lines,
    headline_block,
    machine_line,
    readme_block,
    replace_blocks,
)

PEERS = ("streaming", "litdata")


def _needed_bytes(scenario: str, epoch_index: int, D: int, C: int | None) -> int:
    if scenario in ("cold", "ranks", "throttle"):
        return D
    if scenario == "limited":
        return D if epoch_index == 0 else D - (C or 0)
    if scenario == "shuffle":
        return D if epoch_index == 0 else 0
    return 0


def failure(r0: dict[str, Any]) -> str | None:
    """Why this run has no figures ('unavailable: ...', 'failed: ...', 'aborted ...'), or None."""
    if "wall" not in r0:
        why = f"unavailable: {r0['unavailable']}" if "unavailable" in r0 else f"failed: {r0.get('error')}"
        return " ".join(why.split())
    return None


def summarize_run(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (scenario, system, rep): totals over its measured epochs and its bounds."""
    r0 = recs[0]
    why = failure(r0)
    if why:
        return {"failed": why, "unavailable": why.startswith("unavailable")}
    m = [r for r in recs if r["phase"] != "fill"]
    sc, D, C = bench_derived.base(r0["scenario"]), r0["D"], r0["C"]
    bad = next((r for r in recs if "aborted" in r), None)
    if bad is not None:
        return {"failed": f"aborted in epoch {bad['epoch'] + 1}: {bad['aborted']}", "aborted": True}
    if sc == "mix":  # its own figures (per-stream counts, needed bytes): tools/bench_mix.py
        return bench_mix.summary(recs)
    if sc == "peers":  # store and peer bytes, each node against its bound: tools/bench_peers.py
        return bench_peers.summary(recs)
    wall = sum(r["wall"] for r in m)
    needed = r0.get("predicted_remote") or [_needed_bytes(sc, i, D, C) for i in range(len(m))]
    link = sum(needed[:len(m)]) / r0["bandwidth"]
    compute = sum(r["compute"] for r in m)
    nominal = sum(r.get("compute_nominal", r["compute"]) for r in m)
    memcpy = D * len(m) / r0["memcpy_rate"]
    decode_bound = cpu_figures(m, 1).get("decode_bound", 0.0)  # images: the decode spread over the workers
    remote = [r["remote_bytes"] for r in m]
    if sc in ("cold", "ranks", "throttle"):
        remote = [r0["run_remote_bytes"]]  # the whole process: dataset open + epoch
    samples = sum(r["samples"] for r in m)
    quality = [r["quality"] for r in m if r.get("quality") is not None]
    return {"wall": wall, "wait_pct": 100 * sum(r["wait"] for r in m) / wall, "remote": remote,
            "samples_s": samples / wall, "samples": samples, "first_batch": m[0].get("first_batch") or 0.0,
            "gb_s": samples * r0["sample_bytes"] / wall / 1e9,
            "memcpy_gb_s": r0["memcpy_rate"] / 1e9, "link": link, "compute": compute, "compute_nominal": nominal,
            "memcpy": memcpy,
            "bound": max(link, compute, memcpy, decode_bound), "D": D, "C": C,
            "exactly_once": all(r["samples"] == r0["n"] == r.get("unique_samples", r0["n"]) for r in m),
            **({"quality": sum(quality) / len(quality)} if quality else {}),
            **(_shuffle_targets(recs) if sc == "shuffle" else {}),
            **({"throttled": r0["throttled_requests"], "storm": r0["storm"],
                "late_rate": r0["late_requests_per_s"]} if "storm" in r0 else {}),
            **({"predicted": r0["predicted_remote"]} if r0.get("predicted_remote") else {}),
            **cpu_figures(m, samples * r0["sample_bytes"])}


def cpu_figures(m: list[dict[str, Any]], delivered: float) -> dict[str, Any]:
    """CPU of the measured epochs ``m`` (every process of the run: ``tools/bench_cpu.py``): seconds,
    seconds per GB delivered, the training process's share; with the images scenario's decode
    clock, the loader's own CPU (the run's less the decode's) and the decode bound. {} for records
    made before the bench counted CPU."""
    if not m or any("cpu_s" not in r for r in m):
        return {}
    cpu = sum(r["cpu_s"] for r in m)
    out = {"cpu_s": cpu, "cpu_gb": bench_cpu.per_gb(cpu, delivered),
           "cpu_main_pct": 100 * sum(r["cpu_main_s"] for r in m) / cpu if cpu > 0 else 0.0}
    if all("decode_cpu_s" in r for r in m):
        f = [bench_images.figures(r, r["workers"]) for r in m]
        decode = sum(x["decode_s"] for x in f)
        out.update(decode_s=decode, decode_bound=sum(x["bound"] for x in f), loader_cpu_s=cpu - decode,
                   loader_pct=100 * (cpu - decode) / cpu if cpu > 0 else 0.0,
                   loader_gb=bench_cpu.per_gb(cpu - decode, delivered))
    return out


def _shuffle_targets(recs: list[dict[str, Any]]) -> dict[str, float]:
    f = shuffle_figures(recs)
    return {"warm_quality": f.get("warm_quality", 0.0), "cold_after5": f.get("cold_after5", 0.0)}


def runs_of(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[list[dict[str, Any]]]]:
    """{(scenario, system): [one rep's records, ...]} (profile runs, rep -1, left out)."""
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("rep", 0) >= 0 and "scenario" in r:
            runs[(r["scenario"], r["system"], r["rep"])].append(r)
    by: dict[tuple[str, str], list[list[dict[str, Any]]]] = defaultdict(list)
    for (sc, system, _), recs in sorted(runs.items(), key=lambda kv: kv[0][2]):
        by[(sc, system)].append(recs)
    return by


def median_of(sums: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the completed summaries, with ``n`` (completed), ``reps`` (run) and the failures."""
    ok = [s for s in sums if "failed" not in s]
    fails = [s["failed"] for s in sums if "failed" in s]
    if not ok:
        return {"failed": fails[0], "aborted": any(s.get("aborted") for s in sums), "n": 0, "reps": len(sums),
                "failures": fails, "unavailable": all(s.get("unavailable") for s in sums)}
    med: dict[str, Any] = {k: statistics.median(s[k] for s in ok if k in s) for k in ok[0]
                           if isinstance(ok[0][k], (int, float))}
    med["remote"] = [statistics.median(s["remote"][i] for s in ok) for i in range(len(ok[0]["remote"]))]
    med.update(n=len(ok), reps=len(sums), failures=fails, C=ok[0]["C"])
    if "predicted" in ok[0]:
        med["predicted"] = ok[0]["predicted"]
    return med


def medians(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {key: median_of([summarize_run(recs) for recs in reps]) for key, reps in runs_of(records).items()}


def n_cell(m: dict[str, Any]) -> str:
    """'3', or '2 of 3 (failed: cause)'."""
    if m["n"] == m["reps"]:
        return str(m["n"])
    return f"{m['n']} of {m['reps']} (failed: {m['failures'][0][:80]})"


def versus(family: str, dc: dict[str, Any], peers: dict[str, dict[str, Any]],
           once: str = "every sample exactly once") -> tuple[bool | None, str]:
    """datacache against the family's fastest completed variant; None (no comparison) when none
    completed every sample exactly once (``once``: what ``exactly_once`` means in the scenario): a
    failed or lossy peer is never counted as beaten."""
    members = {name: p for name, p in peers.items() if name.split("+")[0] == family}
    if not members:
        return None, f"{family} not run"
    ok = {name: p for name, p in members.items() if "failed" not in p}
    fam = {name: p for name, p in ok.items() if p.get("exactly_once", 1) == 1}
    if not fam:
        why = f"not {once}" if ok else "; ".join(
            f"{name} failed" if not p.get("unavailable") else f"{name} unavailable" for name, p in members.items())
        return None, f"no comparison with {family} ({why})"
    name, best = min(fam.items(), key=lambda kv: kv[1]["wall"])
    q = f", quality {best['quality']:.2f}" if "quality" in best else ""
    return dc["wall"] < best["wall"], (f"{'ahead of' if dc['wall'] < best['wall'] else 'behind'} {family} "
                                       f"({best['wall'] / dc['wall']:.2f}x {name}{q})")


def targets(name: str, dc: dict[str, Any], peers: dict[str, dict[str, Any]],
            meds: dict[tuple[str, str], dict[str, Any]] | None = None) -> str:
    """datacache's targets for the scenario: 'met' or 'MISSED', with the figures (``meds``: every
    median of the run, for the targets that are ratios to another scenario or variant)."""
    if "failed" in dc:
        return "MISSED (datacache did not run)"
    sc = bench_derived.base(name)
    D, C = dc["D"], dc["C"]
    checks: list[tuple[bool | None, str]] = bench_derived.checks(name, dc, meds or {})
    if sc == "cold":
        checks += [(dc["wall"] <= 1.10 * dc["link"], f"wall {dc['wall'] / dc['link']:.2f}x link (<=1.10)"),
                   (dc["remote"][0] <= 1.01 * D, f"remote {dc['remote'][0] / D:.3f} D (<=1.01)")]
    elif sc == "warm":
        checks += [(dc["wall"] <= 1.03 * dc["compute"], f"wall {dc['wall'] / dc['compute']:.3f}x compute (<=1.03; "
                    f"{dc['wall'] / dc['compute_nominal']:.3f}x the steps' nominal time)"),
                   (dc["wait_pct"] <= 3, f"wait {dc['wait_pct']:.1f}% (<=3)"),
                   (dc["remote"][0] == 0, f"remote {dc['remote'][0]} B (=0)")]
    elif sc == "limited":
        later = dc["remote"][1:] or [0]
        worst = max(later) / max(D - C, 1)
        checks.append((worst <= 1.05, f"epochs 2+ remote <= {worst:.3f} (D-C) (<=1.05)"))
    elif sc == "ranks":
        checks.append((dc["remote"][0] <= 1.01 * D, f"node remote {dc['remote'][0] / D:.3f} D (<=1.01)"))
    elif sc == "nodes":
        later = sum(dc["remote"][1:])
        checks.append((later <= 0.01 * D, f"epochs 2+ remote {later / D:.4f} D (<=0.01)"))
        pred = dc.get("predicted") or []
        if pred:
            off = max(abs(m - p) / max(p, 0.01 * D) for m, p in zip(dc["remote"], pred))
            model = " / ".join(f"{p / 1e6:.1f}" for p in pred)
            checks.append((off <= 0.05, f"model {model} MB, off {off:.3f} (<=0.05)"))
    elif sc == "small":
        best = max((p["samples_s"] for p in peers.values() if "failed" not in p), default=None)
        if best is not None:
            checks.append((dc["samples_s"] >= 2 * best, f"{dc['samples_s'] / best:.2f}x best peer samples/s (>=2)"))
    elif sc == "throttle":
        checks += [(dc["exactly_once"] == 1, "every sample exactly once"),
                   (dc["throttled"] > 0, f"{dc['throttled']:.0f} requests throttled in a {dc['storm']:.0f} s storm"),
                   (dc["late_rate"] <= 2, f"{dc['late_rate']:.2f} requests/s after its first 5 s (<=2)"),
                   (dc["wall"] <= dc["link"] + dc["storm"] + 10, f"wall {dc['wall']:.1f} s <= link + storm + 10 s")]
    elif sc == "mix":
        checks += bench_mix.checks(dc)
    elif sc == "peers":
        checks += bench_peers.checks(dc)
    elif sc == "shuffle":  # issue 14's targets; the speeds are side by side in the shuffle table
        checks += [(dc["warm_quality"] >= 0.95, f"warm quality {dc['warm_quality']:.2f} of random (>=0.95)"),
                   (dc["cold_after5"] >= 0.8, f"cold quality after the first 5 % >= {dc['cold_after5']:.2f} (>=0.8)")]
    if sc != "shuffle":
        once = "every stream's count within one of p x epoch_size" if sc == "mix" else "every sample exactly once"
        checks += [versus(family, dc, peers, once) for family in PEERS]
    checks += bench_derived.cpu_check(dc, peers, PEERS)
    ok = all(c for c, _ in checks if c is not None)
    return ("met: " if ok else "MISSED: ") + "; ".join(t if c is not False else f"**{t}**" for c, t in checks)


def _throughput(name: str, m: dict[str, Any]) -> str:
    sc = bench_derived.base(name)
    if "decode_s" in m:  # images
        return (f"{m['samples_s']:,.0f} images/s; loader {m['loader_pct']:.0f}% of the CPU, {m['loader_gb']:.2f} s/GB "
                f"(decode {m['decode_s']:.1f} s)")
    if sc == "raw":
        return f"{m['gb_s']:.2f} GB/s ({100 * m['gb_s'] / m['memcpy_gb_s']:.0f}% memcpy)"
    if sc == "throttle":
        once = "exactly once" if m["exactly_once"] == 1 else "NOT exactly once"
        return f"{m['samples_s']:,.0f} samples/s, {m['throttled']:.0f} throttled requests, {once}"
    return f"{m['samples_s']:,.0f} samples/s"


def systems_in(meds: dict[tuple[str, str], dict[str, Any]], sc: str) -> list[str]:
    return sorted({s for (c, s) in meds if c == sc}, key=order_key)


def table(meds: dict[tuple[str, str], dict[str, Any]], scenarios: list[str]) -> str:
    rows = ["| scenario | system | n | wall s | wait % | CPU s/GB | first batch s | quality | remote MB | samples "
            "| throughput | bound s | wall / bound | datacache target |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for sc in scenarios:
        systems = systems_in(meds, sc)
        peers = {s: meds[(sc, s)] for s in systems if s.split("+")[0] in PEERS}
        for s in systems:
            m = meds[(sc, s)]
            if "failed" in m:
                rows.append(f"| {sc} | {s} | 0 of {m['reps']} | {m['failed'][:160]} | | | | | | | | | | |")
                continue
            remote = " / ".join(f"{b / 1e6:.1f}" for b in m["remote"])
            q = f"{m['quality']:.2f}" if "quality" in m else "-"
            tgt = targets(sc, m, peers, meds) if s == "datacache" else ""
            ratio = f"{m['wall'] / m['bound']:.2f}" if m["bound"] > 0 else "-"
            rows.append(f"| {sc} | {s} | {n_cell(m)} | {m['wall']:.2f} | {m['wait_pct']:.1f} | {_cpu_cell(m)} "
                        f"| {m['first_batch']:.2f} "
                        f"| {q} | {remote} | {m['samples']:,.0f} | {_throughput(sc, m)} | {m['bound']:.2f} | {ratio} "
                        f"| {tgt} |")
    return "\n".join(rows)


def _cpu_cell(m: dict[str, Any]) -> str:
    return f"{m['cpu_gb']:.2f}" if "cpu_gb" in m else "-"


def shuffle_figures(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The shuffle scenario's figures of one rep, per phase (cold, warm)."""
    why = failure(recs[0]) or next((f"aborted: {r['aborted']}" for r in recs if "aborted" in r), None)
    if why:
        return {"failed": why}
    out: dict[str, Any] = {}
    for r in recs:
        curve = r.get("quality_curve") or []
        out.update({f"{r['phase']}_wall": r["wall"], f"{r['phase']}_first": r["first_batch"] or 0.0,
                    f"{r['phase']}_remote": r["remote_bytes"], f"{r['phase']}_quality": r.get("quality", 0.0),
                    f"{r['phase']}_after5": min((c for c in curve[1:] if c is not None), default=0.0),
                    f"{r['phase']}_cpu_gb": cpu_figures([r], r["samples"] * r["sample_bytes"]).get("cpu_gb", -1.0)})
        out[f"{r['phase']}_curve"] = curve
    out["exactly_once"] = float(all(r["samples"] == r["n"] == r.get("unique_samples") for r in recs))
    return out


def shuffle_table(records: list[dict[str, Any]], curves: bool = True) -> str:
    """Cold and warm side by side: quality (overall; the worst 5 % of the cold epoch after its
    first 5 %), first batch, wall, remote bytes; with ``curves``, the cold quality per 5 %."""
    rows = ["| system | n | cold: first batch s | wall s | CPU s/GB | remote MB | quality | worst 5 % after the first "
            "| warm: first batch s | wall s | CPU s/GB | remote MB | quality |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    curve_rows = []
    runs = {s: reps for (sc, s), reps in runs_of(records).items() if sc == "shuffle"}
    for s in sorted(runs, key=order_key):
        figs = [shuffle_figures(recs) for recs in runs[s]]
        ok = [f for f in figs if "failed" not in f]
        if not ok:
            rows.append(f"| {s} | 0 of {len(figs)} | {figs[0]['failed'][:160]} | | | | | | | | | | |")
            continue
        med = {k: statistics.median(f[k] for f in ok) for k in ok[0] if not k.endswith("_curve")}
        n = str(len(ok)) if len(ok) == len(figs) else f"{len(ok)} of {len(figs)}"
        cpu = {p: f"{med[p + '_cpu_gb']:.2f}" if med.get(p + "_cpu_gb", -1) >= 0 else "-" for p in ("cold", "warm")}
        rows.append(f"| {s} | {n} | {med['cold_first']:.2f} | {med['cold_wall']:.2f} | {cpu['cold']} "
                    f"| {med['cold_remote'] / 1e6:.1f} | {med['cold_quality']:.2f} | {med['cold_after5']:.2f} "
                    f"| {med['warm_first']:.2f} | {med['warm_wall']:.2f} | {cpu['warm']} "
                    f"| {med['warm_remote'] / 1e6:.1f} | {med['warm_quality']:.2f} |")
        curve = [statistics.median(c for c in col if c is not None) if any(c is not None for c in col) else None
                 for col in zip(*(f["cold_curve"] for f in ok))]
        curve_rows.append(f"| {s} | " + " ".join("-" if c is None else f"{c:.2f}" for c in curve) + " |")
    text = "\n".join(rows)
    if curves and curve_rows:
        text += ("\n\nCold epoch, quality of the batches in each 5 % of the epoch (median over reps):\n\n"
                 "| system | quality per 5 % of the cold epoch |\n|---|---|\n" + "\n".join(curve_rows))
    return text


OWN_TABLE = ("shuffle", "mix", "peers")  # scenarios with their own table (cold and warm apart)


def mix_table(records: list[dict[str, Any]]) -> str:
    """The mix scenario's table with its description line (tools/bench_mix.py)."""
    runs = {s: reps for (sc, s), reps in runs_of(records).items() if sc == "mix"}
    return bench_mix.describe(records) + "\n\n" + bench_mix.table(runs, failure, order_key)


def write_report(out: str, records: list[dict[str, Any]], *, run: dict[str, Any]) -> str:
    """DIR/results.md (and the charts) from the records and the run's description; returns the text."""
    meds = medians(records)
    scenarios = list(dict.fromkeys(r["scenario"] for r in records if "scenario" in r))
    main = [sc for sc in scenarios if sc not in OWN_TABLE]
    text = "# datacache benchmark\n\n" + "\n".join(head_lines(run, scenarios)) + "\n\n"
    text += table(meds, main) + "\n" if main else ""
    if "shuffle" in scenarios:
        text += "\n## shuffle\n\n" + shuffle_table(records) + "\n"
        placement = bench_peers.placement_table(records)
        text += "\n" + placement + "\n" if placement else ""
    if "mix" in scenarios:
        text += "\n## mix\n\n" + mix_table(records) + "\n"
        if ("mix", "datacache") in meds:
            peers = {s: meds[("mix", s)] for s in systems_in(meds, "mix") if s.split("+")[0] in PEERS}
            text += "\ndatacache's targets: " + targets("mix", meds[("mix", "datacache")], peers) + "\n"
    nodes = bench_nodes.report(records)
    text += "\n" + nodes if nodes else ""
    if "peers" in scenarios:
        text += "\n## peers\n\n" + bench_peers.report(records, order_key) + "\n"
        if ("peers", "datacache") in meds:
            others = {s: meds[("peers", s)] for s in systems_in(meds, "peers") if s.split("+")[0] in PEERS}
            text += "\ndatacache's targets: " + targets("peers", meds[("peers", "datacache")], others) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    try:
        charts(out, meds, scenarios, records)
    except ImportError as exc:  # matplotlib missing: the table is still written
        text += f"\n(no charts: {exc})\n"
    return text


def readme_tables(records: list[dict[str, Any]], run: dict[str, Any], bench_dir: str = "docs/bench") -> str:
    """The full generated block: the run's description, the tables, datacache's targets;
    ``bench_dir``: the published results' folder relative to the file the block goes in."""
    meds = medians(records)
    scenarios = list(dict.fromkeys(r["scenario"] for r in records if "scenario" in r))
    verdicts = {sc: targets(sc, meds[(sc, "datacache")], {s: meds[(sc, s)] for s in systems_in(meds, sc)
                                                            if s.split("+")[0] in PEERS}, meds)
                for sc in scenarios if (sc, "datacache") in meds}
    shuffle = shuffle_table(records, curves=False) if "shuffle" in scenarios else ""
    placement = bench_peers.placement_table(records) if "shuffle" in scenarios else ""
    shuffle += "\n\n" + placement if shuffle and placement else ""
    main = [sc for sc in scenarios if sc not in OWN_TABLE]
    return readme_block(run, scenarios, table(meds, main) if main else "", shuffle, verdicts,
                        mix_table(records) if "mix" in scenarios else "", bench_nodes.report(records), bench_dir,
                        bench_peers.report(records, order_key) if "peers" in scenarios else "")


def _why(m: dict[str, Any]) -> str:
    """A failed median's cause in a word or two."""
    text = m.get("failed", "")
    for word, said in (("thrashing", "thrashed"), ("stalled", "stalled")):
        if f"({word})" in text:
            return f"aborted ({said})"
    return "not run" if m.get("unavailable") else "failed"


def _pick(meds: dict[tuple[str, str], dict[str, Any]], sc: str, system: str) -> tuple[dict[str, Any] | None, str]:
    """A system's figures in a scenario: its default variant, else its ``+tuned`` one (and why);
    (None, why) when neither completed."""
    m = meds.get((sc, system))
    if m is None:
        return None, "not run"
    if "failed" not in m:
        return m, ""
    tuned = meds.get((sc, f"{system}+tuned"))
    if tuned is not None and "failed" not in tuned:
        return tuned, f"+tuned (default {_why(m).replace('aborted (', '').rstrip(')')})"
    return None, _why(m)


def _later_remote(m: dict[str, Any]) -> str:
    """Remote bytes per epoch after the first (their mean), against the bound D - C."""
    later = statistics.mean(m["remote"][1:] or m["remote"])
    return f"{later / 1e6:.0f} MB ({later / max(m['D'] - (m['C'] or 0), 1):.2f} ×)"


HEADLINE = (  # (scenario, what the row shows, the cell from one system's medians)
    ("cold", "cold epoch: wall (× link bound)", lambda m: f"{m['wall']:.1f} s ({m['wall'] / m['link']:.2f} ×)"),
    ("warm", "warm epoch: wall (× compute)", lambda m: f"{m['wall']:.2f} s ({m['wall'] / m['compute']:.2f} ×)"),
    ("limited", "cache of D/2: MB per later epoch (× D − C)", _later_remote),
    ("small", "1 KiB samples from the cache: samples/s", lambda m: f"{m['samples_s']:,.0f}"),
    ("images", "JPEGs decoded and cropped in the workers: images/s (the loader's share of the CPU)",
     lambda m: f"{m['samples_s']:,.0f} ({m['loader_pct']:.0f} %)" if "loader_pct" in m else f"{m['samples_s']:,.0f}"),
)
CPU_ROW = ("cold", "warm", "small", "images")  # the scenarios of the headline's CPU row, where they ran


def cpu_row(meds: dict[tuple[str, str], dict[str, Any]]) -> tuple[str, ...] | None:
    """The headline's row of CPU-seconds per GB delivered (every process of the run), one figure per
    scenario of ``CPU_ROW`` that ran, for each system's default settings (or ``+tuned``, as the rows)."""
    scs = [sc for sc in CPU_ROW if "cpu_gb" in meds.get((sc, "datacache"), {})]
    if not scs:
        return None
    cells = []
    for system in ("datacache",) + PEERS:
        figs = []
        for sc in scs:
            m, _ = _pick(meds, sc, system)
            figs.append(f"{m['cpu_gb']:.1f}" if m is not None and "cpu_gb" in m else "–")
        cells.append(" · ".join(figs))
    return (f"CPU-seconds per GB delivered, all processes: {' · '.join(scs)}", *cells)


def headline_rows(records: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """The README's headline figures (each scenario that ran): datacache, Streaming, LitData,
    each through its default settings (a peer whose default failed through its ``+tuned``
    variant, said so), and the shuffle quality of the cold and the warm epoch."""
    meds = medians(records)
    rows = []
    for sc, what, cell in HEADLINE:
        if (sc, "datacache") not in meds:
            continue
        cells = []
        for system in ("datacache",) + PEERS:
            m, why = _pick(meds, sc, system)
            cells.append(why if m is None else cell(m) + (f", {why}" if why else ""))
        rows.append((what, *cells))
    cpu = cpu_row(meds)
    if cpu:
        rows.append(cpu)
    runs = {s: reps for (sc, s), reps in runs_of(records).items() if sc == "shuffle"}
    if "datacache" in runs:
        cells = []
        for system in ("datacache",) + PEERS:
            ok = [f for f in (shuffle_figures(recs) for recs in runs.get(system, [])) if "failed" not in f]
            cells.append(f"{statistics.median(f['cold_quality'] for f in ok):.2f} / "
                         f"{statistics.median(f['warm_quality'] for f in ok):.2f}" if ok else
                         ("not run" if system not in runs else "failed"))
        rows.append(("shuffle quality, cold / warm epoch", *cells))
    return rows


def regenerate(path: str, records: list[dict[str, Any]], run: dict[str, Any], bench_dir: str) -> list[str]:
    """Replace the generated blocks that the Markdown file ``path`` holds (the full block, the
    headline table, or both) from the records; returns the begin markers replaced."""
    rel = os.path.relpath(os.path.abspath(bench_dir), os.path.dirname(os.path.abspath(path))).replace(os.sep, "/")
    return replace_blocks(path, {(BEGIN, END): readme_tables(records, run, rel),
                                 (HEADLINE_BEGIN, HEADLINE_END): headline_block(run, headline_rows(records))})


def progress_line(recs: list[dict[str, Any]]) -> str:
    r0 = recs[0]
    head = f"{r0['scenario']:8s} {r0['system']:26s} rep {r0['rep']}:"
    s = summarize_run(recs)
    if "failed" in s:
        return f"{head} {s['failed'][:300]}"
    remote = "/".join(f"{b / 1e6:.1f}" for b in s["remote"])
    storm = (f", {s['throttled']} requests throttled in a {s['storm']:.0f} s storm, "
             f"{'exactly once' if s['exactly_once'] else 'NOT exactly once'}") if "storm" in s else ""
    q = f", quality {s['quality']:.2f}" if "quality" in s else ""
    q += f", per stream (delivered/expected): {s['counts']}" if "counts" in s else ""
    q += f", CPU {s['cpu_gb']:.2f} s/GB" if "cpu_gb" in s else ""
    q += f" (loader {s['loader_pct']:.0f}% of it, decode excluded)" if "loader_pct" in s else ""
    return (f"{head} wall {s['wall']:.2f} s (bound {s['bound']:.2f}), wait {s['wait_pct']:.1f}% (first batch "
            f"{s['first_batch']:.2f} s), remote {remote} MB, {s['samples_s']:,.0f} samples/s{q}{storm}")


def load(dirpath: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The records of DIR/results.jsonl and the run's description DIR/run.json."""
    with open(os.path.join(dirpath, "results.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    path = os.path.join(dirpath, "run.json")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: missing; it is written by tools/bench.py beside results.jsonl (rerun the bench)")
    with open(path) as f:
        return records, json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="a bench output directory (results.jsonl, run.json), e.g. docs/bench")
    p.add_argument("--readme", nargs="+", metavar="FILE.md", default=[],
                   help="also replace the generated blocks of these Markdown files (the full block and/or the "
                        "headline table, whichever each holds), e.g. README.md docs/benchmarks.md")
    a = p.parse_args(argv)
    records, run = load(a.dir)
    print(write_report(a.dir, records, run=run))
    for path in a.readme:
        done = regenerate(path, records, run, a.dir)
        what = " and ".join("headline table" if b == HEADLINE_BEGIN else "benchmark block" for b in done)
        print(f"{path}: {what} regenerated from {os.path.join(a.dir, 'results.jsonl')}")
    return 0


__all__ = ["NOTES", "headline_rows", "machine_line", "medians", "progress_line", "readme_tables", "regenerate",
           "summarize_profile", "summarize_run", "table", "targets", "write_report"]

if __name__ == "__main__":
    sys.exit(main())
