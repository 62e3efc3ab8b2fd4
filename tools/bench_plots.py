"""Charts and the profile summary of ``tools/bench.py`` (used by ``tools/bench_report.py``).

Pure functions of the report's medians and records; matplotlib is imported only inside ``charts``.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

ORDER = ("datacache", "datacache+never", "datacache+nopeers", "datacache+mds", "datacache+dropin",
         "datacache+match-streaming", "datacache+match-litdata", "datacache+node-sticky", "datacache+global",
         "streaming", "streaming+tuned", "streaming+match-datacache", "litdata", "litdata+tuned", "fsspec")


def order_key(system: str) -> int:
    return ORDER.index(system) if system in ORDER else 99


def charts(out: str, meds: dict[tuple[str, str], dict[str, Any]], scenarios: list[str],
           records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scenarios), 1, figsize=(8, 1.9 * len(scenarios) + 0.5), squeeze=False)
    for ax, sc in zip(axes[:, 0], scenarios):
        systems = sorted({s for (c, s) in meds if c == sc and "failed" not in meds[(c, s)]},
                         key=order_key)
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
        for r in sorted(cold, key=lambda r: order_key(r["system"])):
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
        names = sorted(lim, key=order_key)
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
