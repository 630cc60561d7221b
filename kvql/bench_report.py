"""`kvql bench`'s report (bench.py runs it): the figure `plot` (a panel per workload, throughput vs number of queries
per system, each kvql point annotated with its speed-up and hit rate, and a summary panel), the table, and the
noise flags: a point whose others' CPU share passes BUSY_SHARE or whose repeats spread past SPREAD is marked `!`,
a noisy run gets one warning line, in red on the figure. Imports nothing heavy (matplotlib when plotting)."""

from __future__ import annotations

import textwrap
from pathlib import Path

TITLES = {"fewshot": "few-shot QA, one shared prefix", "chat": "chat, the conversation grows",
          "tot": "tree of thought, n sampled branches", "json": "JSON extraction under a schema",
          "classify": "classification into 4 labels"}
NAMES = {"hf_one_at_a_time": "transformers generate, one at a time", "hf_generate_batch": "transformers generate_batch",
         "kvql": "kvql"}  # display names
BUSY_SHARE = 0.25
"""Other processes' share of the machine's CPU capacity above which a run or a point is flagged busy."""
SPREAD = 0.2
"""A point's median time over its best, less 1, above which it is flagged noisy (with 2 repeats or more)."""


def point_noise(row: dict) -> str | None:
    """Why a row's times are unreliable (`busy 40%`, `spread 31%`), or None."""
    why = []
    if (row.get("others_share") or 0) > BUSY_SHARE:
        why.append(f"busy {row['others_share']:.0%}")
    if (row.get("spread") or 0) > SPREAD:
        why.append(f"spread {row['spread']:.0%}")
    return ", ".join(why) or None


def noise_warning(results: dict) -> str | None:
    """One line saying the run's numbers are unreliable and why (other processes' CPU share over the run,
    points flagged by `point_noise`), or None for a quiet run."""
    machine = results.get("machine") or {}
    rows = [r for rows in results["workloads"].values() for r in rows]
    noisy = sum(point_noise(r) is not None for r in rows)
    why = []
    share = machine.get("others_share")
    if share is not None and share > BUSY_SHARE:
        why.append(f"other processes used {share:.0%} of the machine's {machine.get('cores', '?')} cores during "
                   "the run")
    if noisy:
        why.append(f"{noisy} of {len(rows)} points noisy (busy over {BUSY_SHARE:.0%} or repeats spread over "
                   f"{SPREAD:.0%}: marked !)")
    if not why:
        return None
    return "WARNING: a noisy run, its times are unreliable: " + "; ".join(why) + ". Rerun on a quiet machine."


def title(results: dict) -> str:
    m = results.get("meta") or {}
    return (f"kvql bench: {m.get('model', 'model')} on {m.get('device', '?')} ({m.get('dtype', '?')}), "
            f"{m.get('threads', '?')} threads, {m.get('date', '')}").rstrip(", ")


def plot(results: dict, path: str | Path | None = None):
    """One figure: a 2x3 grid, a panel per workload (queries/s vs number of queries, per system; each
    kvql point annotated with its speed-up over one at a time and its cache hit rate) and a summary
    panel (kvql's speed-up per workload at the largest size). A noisy point's note is red with its reason
    (`point_noise`), a noisy run's `noise_warning` the legend's title, in red. Saved to `path` when given;
    returns the matplotlib Figure."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    systems = [s for s in ("hf_one_at_a_time", "hf_generate_batch", "kvql") if s in results.get("systems", NAMES)]
    style = {"kvql": dict(color="#1f77b4", linewidth=2.5, marker="o", zorder=3),
             "hf_one_at_a_time": dict(color="#7f7f7f", linewidth=1.5, marker="s", linestyle="--"),
             "hf_generate_batch": dict(color="#ff7f0e", linewidth=1.5, marker="^", linestyle="--")}
    names = list(results["workloads"])
    fig = Figure(figsize=(15, 8.8), layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    for ax, w in zip(axes, names):
        rows = results["workloads"][w]
        sizes = [r["n"] for r in rows]
        top = 0.0
        for system in systems:
            points = [(r["n"], r[system]) for r in rows if r.get(system) is not None]
            if points:
                ax.plot(*zip(*points), label=NAMES[system], **style[system])
                top = max(top, max(q for _, q in points))
        for r in rows:
            if r.get("kvql") is None:
                continue
            speedup = r.get("kvql_vs_hf_one_at_a_time")
            label = (f"{speedup:.1f}x\n" if speedup else "") + f"hit {r['hit_rate']:.0%}"
            noise = point_noise(r)  # in red, with its `!` as in the table
            ax.annotate(label + (f"\n! {noise}" if noise else ""), (r["n"], r["kvql"]), textcoords="offset points",
                        xytext=(0, 7), ha="center", va="bottom", fontsize=8,
                        color="red" if noise else style["kvql"]["color"])
        ax.set_title(f"{w}: {TITLES.get(w, '')}".rstrip(": "), fontsize=11)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(min(sizes) / 1.3, max(sizes) * 1.3)
        ax.set_ylim(0, top * 1.3 if top > 0 else 1)
        ax.set_xlabel("queries in the workload")
        ax.set_ylabel("queries / s (higher is better)")
        ax.grid(alpha=0.3)
    for ax in axes[len(names):-1]:
        ax.set_visible(False)
    _summary_panel(axes[-1], results, names)
    handles, labels = axes[0].get_legend_handles_labels()
    warning = noise_warning(results)
    # a noisy run's warning is the legend's title, in red: laid out with the figure, read with the lines
    legend = fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=10, frameon=False,
                        title=textwrap.fill(warning, 150) if warning else None,
                        title_fontproperties={"size": 12, "weight": "bold"})
    legend.get_title().set_color("red")
    fig.suptitle(title(results) + "\nkvql points: speed-up over transformers generate one at a time, and kvql's "
                 "cache hit rate", fontsize=13)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _summary_panel(ax, results: dict, names: list[str]) -> None:
    """kvql's speed-up over each baseline per workload, at the largest size run."""
    n = max(results.get("sizes") or [r["n"] for w in names for r in results["workloads"][w]])
    baselines = [s for s in ("hf_one_at_a_time", "hf_generate_batch") if s in results.get("systems", NAMES)]
    width = 0.8 / max(len(baselines), 1)
    top = 1.0
    for k, system in enumerate(baselines):
        xs, ys = [], []
        for i, w in enumerate(names):
            row = next((r for r in results["workloads"][w] if r["n"] == n), None)
            if row and row.get(f"kvql_vs_{system}"):
                xs.append(i + (k - (len(baselines) - 1) / 2) * width)
                ys.append(row[f"kvql_vs_{system}"])
        bars = ax.bar(xs, ys, width, color={"hf_one_at_a_time": "#7f7f7f", "hf_generate_batch": "#ff7f0e"}[system],
                      label=f"vs {NAMES[system]}")
        ax.bar_label(bars, fmt="%.1fx", fontsize=8)
        top = max([top, *ys])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, top * 1.45)
    ax.set_title(f"kvql speed-up at n = {n} (1x: as fast)", fontsize=11)
    ax.set_ylabel("speed-up (x)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, axis="y")


def table(results: dict) -> str:
    """The console table: a header, then per workload and size the baseline's seconds (transformers
    generate one at a time), kvql's (each `best/median` with several repeats), the speed-ups, answers
    equal, the hit rate and the point's noise (`point_noise`, marked `!`); `noise_warning`'s line above
    and below the rows when the run was noisy."""
    repeats = (results.get("meta") or {}).get("repeats", 1)
    warning = noise_warning(results)
    seconds = (f"seconds: best/median of {repeats} repeats" if repeats > 1 else "seconds: one run (--repeats N: best "
               "and median of N)")
    lines = [title(results), "baseline: transformers generate, one at a time; speed-up: kvql's queries/s over "
             "the baseline's (best times);", "answers equal: kvql's answers vs the baseline's (n/a: constrained or "
             f"sampled); {seconds}", *([warning] if warning else []), ""]
    width = 11 if repeats > 1 else 8
    head = (f"{'workload':<9} {'n':>3} {'baseline s':>{width}} {'kvql s':>{width}} {'speed-up':>9} "
            f"{'vs gen_batch':>12} {'answers equal':>13} {'hit rate':>8} {'optimal':>8}  noise")
    lines += [head, "-" * len(head)]

    def fmt(v, spec, suffix=""):
        return format(v, spec) + suffix if v is not None else "n/a"

    def secs(r, system):
        best, median = r.get("seconds", {}).get(system), r.get("median_seconds", {}).get(system)
        return fmt(best, ".2f") + (f"/{median:.2f}" if repeats > 1 and median is not None else "")

    for w, rows in results["workloads"].items():
        for r in rows:
            eq = r.get("answers_equal")
            noise = point_noise(r)
            lines.append(f"{w:<9} {r['n']:>3} {secs(r, 'hf_one_at_a_time'):>{width}} {secs(r, 'kvql'):>{width}} "
                         f"{fmt(r.get('kvql_vs_hf_one_at_a_time'), '.2f', 'x'):>9} "
                         f"{fmt(r.get('kvql_vs_hf_generate_batch'), '.2f', 'x'):>12} "
                         f"{(f'{eq[0]}/{eq[1]}' if eq else 'n/a'):>13} {r['hit_rate']:>8.2f} "
                         f"{r['optimal_hit_rate']:>8.2f}  {'! ' + noise if noise else ''}".rstrip())
            for k, v in r.items():
                if k.endswith("_error"):
                    lines.append(f"    {NAMES.get(k[:-6], k[:-6])} failed: {v}")
    if warning:
        lines += ["", warning]
    return "\n".join(lines)


def print_table(results: dict) -> None:
    print(table(results))
