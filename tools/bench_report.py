"""The report of ``tools/bench.py``: medians, bounds, datacache's targets, the markdown table, charts.

Per (scenario, system, rep) the measured epochs are summed (wall, wait, samples, batches); medians
are taken over reps. Bounds: link = bytes that must cross the link / bandwidth (D for a cold
epoch, D - C for a limited epoch after the first, 0 when warm); compute = batches x step time;
memcpy = D / measured copy rate. The relevant bound is the largest of the three.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
from collections import defaultdict
from typing import Any

PEERS = ("streaming", "litdata")
ORDER = ("datacache", "streaming", "streaming+tuned", "litdata", "litdata+tuned", "fsspec")


def _needed_bytes(scenario: str, epoch_index: int, D: int, C: int | None) -> int:
    if scenario in ("cold", "ranks", "throttle"):
        return D
    if scenario == "limited":
        return D if epoch_index == 0 else D - (C or 0)
    return 0


def summarize_run(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (scenario, system, rep): totals over its measured epochs and its bounds."""
    r0 = recs[0]
    if "wall" not in r0:
        why = f"unavailable: {r0['unavailable']}" if "unavailable" in r0 else f"failed: {r0.get('error')}"
        return {"failed": " ".join(why.split())}
    m = [r for r in recs if r["phase"] == "measured"]
    sc, D, C = r0["scenario"], r0["D"], r0["C"]
    bad = next((r for r in recs if "aborted" in r), None)
    if bad is not None:
        return {"failed": f"aborted in epoch {bad['epoch'] + 1}: {bad['aborted']}", "aborted": True}
    wall = sum(r["wall"] for r in m)
    needed = r0.get("predicted_remote") or [_needed_bytes(sc, i, D, C) for i in range(len(m))]
    link = sum(needed[:len(m)]) / r0["bandwidth"]
    compute = sum(r["compute"] for r in m)
    memcpy = D * len(m) / r0["memcpy_rate"]
    remote = [r["remote_bytes"] for r in m]
    if sc in ("cold", "ranks", "throttle"):
        remote = [r0["run_remote_bytes"]]  # the whole process: dataset open + epoch
    samples = sum(r["samples"] for r in m)
    return {"wall": wall, "wait_pct": 100 * sum(r["wait"] for r in m) / wall, "remote": remote,
            "samples_s": samples / wall, "samples": samples, "first_batch": m[0].get("first_batch") or 0.0,
            "gb_s": samples * r0["sample_bytes"] / wall / 1e9,
            "memcpy_gb_s": r0["memcpy_rate"] / 1e9, "link": link, "compute": compute, "memcpy": memcpy,
            "bound": max(link, compute, memcpy), "D": D, "C": C,
            "exactly_once": all(r["samples"] == r0["n"] == r.get("unique_samples", r0["n"]) for r in m),
            **({"throttled": r0["throttled_requests"], "storm": r0["storm"],
                "late_rate": r0["late_requests_per_s"]} if "storm" in r0 else {}),
            **({"predicted": r0["predicted_remote"]} if r0.get("predicted_remote") else {})}


def medians(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("rep", 0) >= 0:
            runs[(r["scenario"], r["system"], r["rep"])].append(r)
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for (sc, system, _), recs in runs.items():
        by[(sc, system)].append(summarize_run(recs))
    out = {}
    for key, sums in by.items():
        ok = [s for s in sums if "failed" not in s]
        if not ok:
            out[key] = {"failed": sums[0]["failed"], "aborted": any(s.get("aborted") for s in sums), "reps": 0}
            continue
        med = {k: statistics.median(s[k] for s in ok) for k in ok[0] if isinstance(ok[0][k], (int, float))}
        med["remote"] = [statistics.median(s["remote"][i] for s in ok) for i in range(len(ok[0]["remote"]))]
        med["reps"] = len(ok)
        med["C"] = ok[0]["C"]
        if "predicted" in ok[0]:
            med["predicted"] = ok[0]["predicted"]
        out[key] = med
    return out


def targets(sc: str, dc: dict[str, Any], peers: dict[str, dict[str, Any]]) -> str:
    """datacache's targets for the scenario: 'met' or 'MISSED', with the figures."""
    if "failed" in dc:
        return "MISSED (datacache did not run)"
    D, C, checks = dc["D"], dc["C"], []
    if sc == "cold":
        checks += [(dc["wall"] <= 1.10 * dc["link"], f"wall {dc['wall'] / dc['link']:.2f}x link (<=1.10)"),
                   (dc["remote"][0] <= 1.01 * D, f"remote {dc['remote'][0] / D:.3f} D (<=1.01)")]
    elif sc == "warm":
        checks += [(dc["wall"] <= 1.05 * dc["compute"], f"wall {dc['wall'] / dc['compute']:.2f}x compute (<=1.05)"),
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
    elif sc == "raw":
        frac = dc["gb_s"] / dc["memcpy_gb_s"]
        checks.append((frac >= 0.25, f"{100 * frac:.0f}% of memcpy (>=25%)"))
    for family in PEERS:
        ran = [p for name, p in peers.items() if name.split("+")[0] == family and "failed" not in p]
        fam = [p for p in ran if p.get("exactly_once", 1) == 1]  # a run that lost samples is no rival
        if ran and not fam:
            checks.append((True, f"ahead of {family} (not every sample exactly once)"))
        elif fam:
            best = min(p["wall"] for p in fam)
            checks.append((dc["wall"] < best, f"{'ahead of' if dc['wall'] < best else 'behind'} {family} "
                                              f"({best / dc['wall']:.2f}x)"))
        elif any(p.get("aborted") for name, p in peers.items() if name.split("+")[0] == family):
            checks.append((True, f"ahead of {family} (aborted)"))
        else:
            checks.append((True, f"{family} n/a"))
    ok = all(c for c, _ in checks)
    return ("met: " if ok else "MISSED: ") + "; ".join(t if c else f"**{t}**" for c, t in checks)


def table(meds: dict[tuple[str, str], dict[str, Any]], scenarios: list[str]) -> str:
    rows = ["| scenario | system | wall s | wait % | first batch s | remote MB | samples | throughput | bound s "
            "| wall / bound | datacache target |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for sc in scenarios:
        systems = sorted({s for (c, s) in meds if c == sc}, key=lambda s: ORDER.index(s) if s in ORDER else 99)
        peers = {s: meds[(sc, s)] for s in systems if s.split("+")[0] in PEERS}
        for s in systems:
            m = meds[(sc, s)]
            if "failed" in m:
                rows.append(f"| {sc} | {s} | {m['failed'][:160]} | | | | | | | | |")
                continue
            remote = " / ".join(f"{b / 1e6:.1f}" for b in m["remote"])
            thr = f"{m['samples_s']:,.0f} samples/s" if sc == "small" else \
                f"{m['gb_s']:.2f} GB/s ({100 * m['gb_s'] / m['memcpy_gb_s']:.0f}% memcpy)" if sc == "raw" else \
                f"{m['samples_s']:,.0f} samples/s, {m['throttled']:.0f} throttled requests, " \
                f"{'exactly once' if m['exactly_once'] == 1 else 'NOT exactly once'}" if sc == "throttle" else \
                f"{m['samples_s']:,.0f} samples/s"
            tgt = targets(sc, m, peers) if s == "datacache" else ""
            ratio = f"{m['wall'] / m['bound']:.2f}" if m["bound"] > 0 else "-"
            rows.append(f"| {sc} | {s} | {m['wall']:.2f} | {m['wait_pct']:.1f} | {m['first_batch']:.2f} | {remote} | "
                        f"{m['samples']:,.0f} | {thr} | {m['bound']:.2f} | {ratio} | {tgt} |")
    return "\n".join(rows)


def machine() -> str:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    return (f"{platform.node()}: {os.cpu_count()} CPUs, {mem / 2**30:.1f} GiB RAM, Python {platform.python_version()}, "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}")


def write_report(out: str, records: list[dict[str, Any]], *, command: str, settings: dict[str, Any]) -> str:
    meds = medians(records)
    scenarios = list(dict.fromkeys(r["scenario"] for r in records))
    t = table(meds, scenarios)
    s = settings
    head = ["# datacache benchmark\n", f"- machine: {machine()}", f"- command: `{command}`",
            f"- link: {s['bandwidth'] / 1e6:.0f} MB/s shared, {s['latency'] * 1e3:.0f} ms per request; dataset "
            f"{s['size'] / 1e6:.0f} MB of {s['sample_bytes']} B samples in {s['shard_bytes'] / 1e6:.0f} MB shards "
            f"(small: {s['small_size'] / 1e6:.0f} MB of {s['small_sample_bytes']} B); batch {s['batch_size']} "
            f"(small {s['small_batch_size']}), {s['workers']} workers, {s['compute'] * 1e3:.0f} ms compute per batch; "
            f"medians of {s['reps']} rep(s)",
            "- remote MB is measured at the link proxy; for limited it is per epoch; bound = max(link, compute, "
            "memcpy) (see tools/bench_report.py); first batch s: from iter(loader) to the first batch",
            "- peers: defaults, and `+tuned`: streaming `predownload` = 4 shards per worker (limited: "
            "`shuffle_block_size` = samples of C/2), litdata `max_pre_download=8`; work-arounds (stub torchvision/"
            "transformers imports for streaming, obstore `allow_http` for litdata, streaming's boto3 client "
            "dropped before the workers fork) are documented in tools/bench_systems.py",
            "- a run that pulls more than 8 x D in one epoch (thrashing), or moves no batch and no byte for 90 s "
            "(stalled), is stopped and reported as aborted\n"]
    text = "\n".join(head) + "\n" + t + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    try:
        charts(out, meds, scenarios, records)
    except ImportError as exc:  # matplotlib missing: the table is still written
        text += f"\n(no charts: {exc})\n"
    return text


def charts(out: str, meds: dict[tuple[str, str], dict[str, Any]], scenarios: list[str],
           records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scenarios), 1, figsize=(8, 1.9 * len(scenarios) + 0.5), squeeze=False)
    for ax, sc in zip(axes[:, 0], scenarios):
        systems = sorted({s for (c, s) in meds if c == sc and "failed" not in meds[(c, s)]},
                         key=lambda s: ORDER.index(s) if s in ORDER else 99)
        walls = [meds[(sc, s)]["wall"] for s in systems]
        ax.barh(systems, walls, color=["tab:green" if s == "datacache" else "tab:gray" for s in systems])
        failed = [s for (c, s) in meds if c == sc and "failed" in meds[(c, s)]]
        if failed:
            ax.text(0.99, 0.5, "not shown: " + ", ".join(f"{s} ({meds[(sc, s)]['failed'].split(':')[0]})"
                                                        for s in failed),
                    transform=ax.transAxes, ha="right", va="center", fontsize=7, color="tab:red")
        bound = max((meds[(sc, s)]["bound"] for s in systems), default=0)
        if bound:
            ax.axvline(bound, color="tab:red", ls="--", lw=1, label="bound")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_title(f"{sc}: wall s (lower is better)", fontsize=9)
        ax.invert_yaxis()
        ax.tick_params(labelsize=8)
    _save(fig, out, "bench_wall.png")
    cold = [r for r in records if r["scenario"] == "cold" and r.get("rep") == 0 and r.get("link_timeline")]
    if cold:  # when did each system keep the link busy?
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for r in sorted(cold, key=lambda r: ORDER.index(r["system"]) if r["system"] in ORDER else 99):
            ts = [0.0] + [t for t, _ in r["link_timeline"]] + [r["wall"]]
            bs = [0.0] + [b / 1e6 for _, b in r["link_timeline"]] + [r["remote_bytes"] / 1e6]
            ax.plot(ts, bs, label=r["system"], lw=2 if r["system"] == "datacache" else 1)
        bw = cold[0]["bandwidth"] / 1e6
        ax.plot([0, cold[0]["D"] / 1e6 / bw], [0, cold[0]["D"] / 1e6], "k--", lw=1, label=f"{bw:.0f} MB/s from t=0")
        ax.set_xlabel("s since the epoch began")
        ax.set_ylabel("remote MB (at the proxy)")
        _titled(ax, "cold epoch: bytes across the link over time (rep 0)")
        _save(fig, out, "bench_cold_link.png")
    lim = {s: m for (c, s), m in meds.items() if c == "limited" and "failed" not in m}
    if lim:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        names = sorted(lim, key=lambda s: ORDER.index(s) if s in ORDER else 99)
        width = 0.8 / max(len(names), 1)
        for i, s in enumerate(names):
            xs = [e + i * width for e in range(len(lim[s]["remote"]))]
            ax.bar(xs, [b / 1e6 for b in lim[s]["remote"]], width, label=s)
        m = next(iter(lim.values()))
        ax.axhline((m["D"] - m["C"]) / 1e6, color="tab:red", ls="--", lw=1, label="D - C")
        ax.set_xlabel("epoch")
        epochs = range(len(m["remote"]))
        ax.set_xticks([e + 0.4 - width / 2 for e in epochs], [str(e + 1) for e in epochs])
        ax.set_ylabel("remote MB")
        _titled(ax, "limited (C = D/2): remote bytes per epoch")
        _save(fig, out, "bench_limited.png")


def _titled(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.legend(fontsize=7)


def _save(fig: Any, out: str, name: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=100)
    plt.close(fig)


def progress_line(recs: list[dict[str, Any]]) -> str:
    r0 = recs[0]
    head = f"{r0['scenario']:8s} {r0['system']:16s} rep {r0['rep']}:"
    s = summarize_run(recs)
    if "failed" in s:
        return f"{head} {s['failed'][:300]}"
    remote = "/".join(f"{b / 1e6:.1f}" for b in s["remote"])
    storm = (f", {s['throttled']} requests throttled in a {s['storm']:.0f} s storm, "
             f"{'exactly once' if s['exactly_once'] else 'NOT exactly once'}") if "storm" in s else ""
    return (f"{head} wall {s['wall']:.2f} s (bound {s['bound']:.2f}), wait {s['wait_pct']:.1f}% (first batch "
            f"{s['first_batch']:.2f} s), remote {remote} MB, {s['samples_s']:,.0f} samples/s{storm}")


def summarize_profile(base: str, top: int = 25) -> str:
    """Top frames by self and by inclusive samples from py-spy's raw output; writes ``base + '.md'``."""
    raw = base + ".pyspy.txt"
    if not os.path.exists(raw):
        return base + ".txt (pyinstrument, main process)" if os.path.exists(base + ".txt") else "no profile written"
    own: dict[str, int] = defaultdict(int)
    incl: dict[str, int] = defaultdict(int)
    where: dict[str, int] = defaultdict(int)
    total = 0
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            total += n
            parts = stack.split(";")
            procs = [p for p in parts if p.startswith("process ")]
            thread = next((p for p in parts if p.startswith("thread ")), "thread ?")
            name = thread.split(": ", 1)[1] if ": " in thread else "(unnamed)"
            where[f"{'main process' if len(procs) <= 1 else 'DataLoader worker'} / {name}"] += n
            frames = [fr for fr in parts if not fr.startswith(("process ", "thread "))]
            if frames:
                own[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n
    lines = [f"# py-spy profile ({total} samples, all processes and threads, idle excluded)\n",
             "## by process / thread\n", "| samples | % | where |", "|---|---|---|"]
    def rows(counts: dict[str, int], fmt: str) -> list[str]:
        best = sorted(counts.items(), key=lambda x: -x[1])[:top]
        return [f"| {n} | {100 * n / max(total, 1):.1f} | {fmt.format(k)} |" for k, n in best]

    lines += rows(where, "{}")
    lines += ["\n## self\n", "| samples | % | frame |", "|---|---|---|"]
    lines += rows(own, "`{}`")
    lines += ["\n## inclusive (datacache and readers frames)\n", "| samples | % | frame |", "|---|---|---|"]
    lines += rows({fr: n for fr, n in incl.items() if "datacache/" in fr or "readers/" in fr}, "`{}`")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return base + ".md"
