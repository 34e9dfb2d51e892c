"""The hot-load scenario's report from its rows: p50 totals and parts, the ratios (b)/(a) and
(c)/(a), the goal "hot-load at least 100x faster than an engine restart", a markdown table and
a plot. Warm-up rows and failed steps stay out of the p50s; failures are named.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

GOAL_RATIO = 100.0
GOAL_NAME = "hot-load ≥ 100× faster than an engine restart"
PARTS = {
    "hot-load": [("load_ms", "load"), ("first_response_ms", "first response")],
    "restart": [("stop_ms", "stop"), ("boot_ms", "boot"), ("load_ms", "load"), ("first_response_ms", "first response")],
    "merge-reload": [("merge_save_ms", "merge + save"), ("reload_ms", "reload"), ("first_response_ms", "first response")],
}
LABELS = {"hot-load": "(a) hot-load", "restart": "(b) restart", "merge-reload": "(c) merge + reload"}


def report(ctx: Any, rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """The scenario's result: summary, rows, goal, markdown table and the plot."""
    measured = {a: [r for r in rows if r["approach"] == a and not r.get("warmup") and "total_ms" in r]
                for a in PARTS}
    p50 = {a: p50_of([r["total_ms"] for r in rs]) for a, rs in measured.items()}
    parts = {a: {label: p50_of([r[key] for r in measured[a]]) for key, label in PARTS[a]} for a in PARTS}
    hot = p50["hot-load"]
    ratio = {a: (p50[a] / hot if hot and p50[a] is not None else None) for a in ("restart", "merge-reload")}
    merged = measured["merge-reload"]
    errors = [f"{r['approach']} {r['i']}: {r['error']}" for r in rows if r.get("error")]
    warmup = next((r for r in rows if r.get("warmup")), None)
    summary: dict[str, Any] = {
        "engine": ctx.engine,
        "model": str(ctx.model),
        "hotloads": len(measured["hot-load"]),
        "restarts": len(measured["restart"]),
        "merges": len(merged),
        "hotload_total_ms_p50": hot,
        "hotload_load_ms_p50": parts["hot-load"]["load"],
        "hotload_first_response_ms_p50": parts["hot-load"]["first response"],
        "hotload_warmup_total_ms": warmup.get("total_ms") if warmup else None,
        "restart_total_ms_p50": p50["restart"],
        "restart_stop_ms_p50": parts["restart"]["stop"],
        "restart_boot_ms_p50": parts["restart"]["boot"],
        "restart_load_ms_p50": parts["restart"]["load"],
        "restart_first_response_ms_p50": parts["restart"]["first response"],
        "merge_total_ms_p50": p50["merge-reload"],
        "merge_save_ms_p50": parts["merge-reload"]["merge + save"],
        "merge_reload_ms_p50": parts["merge-reload"]["reload"],
        "merge_first_response_ms_p50": parts["merge-reload"]["first response"],
        "merge_process_ms_p50": p50_of([r["merge_process_ms"] for r in merged]),
        "restart_over_hotload": ratio["restart"],
        "merge_over_hotload": ratio["merge-reload"],
        "merged_changed_served_weights": all(r["base_changed"] for r in merged) if merged else None,
        "merged_answers_like_adapter": all(r.get("matches_adapter") for r in merged) if merged else None,
        "errors": errors,
    }
    note = ""
    if ctx.engine == "transformers":
        note = "the goal is stated for a GPU engine (SGLang, vLLM); this run used the transformers engine"
    if ratio["restart"] is None:
        note = "; ".join(filter(None, [note, "not measured: " + ("; ".join(errors) or "no restart or hot-load")]))
    goals = [{"name": GOAL_NAME, "value": None if ratio["restart"] is None else round(ratio["restart"], 1),
              "target": GOAL_RATIO, "at_most": False, "met": bool(ratio["restart"] and ratio["restart"] >= GOAL_RATIO),
              "note": note}]
    plots = ["hotload.png"] if plot(out / "hotload.png", parts, p50, ratio, ctx.engine) else []
    return {"name": "hotload", "title": "Hot-load against the alternatives", "summary": summary, "rows": rows,
            "goals": goals, "table": table(measured, p50, parts, ratio, warmup, errors), "plots": plots}


def table(measured: dict[str, list[dict[str, Any]]], p50: dict[str, float | None],
          parts: dict[str, dict[str, float | None]], ratio: dict[str, float | None],
          warmup: dict[str, Any] | None, errors: list[str]) -> str:
    lines = ["| approach | n | p50 total ms | parts, p50 ms each | × hot-load |", "|---|---|---|---|---|"]
    for a in PARTS:
        x = "1" if a == "hot-load" else num(ratio[a])
        shown = " · ".join(f"{label} {num(ms)}" for label, ms in parts[a].items())
        lines.append(f"| {LABELS[a]} | {len(measured[a])} | {num(p50[a])} | {shown} | {x} |")
    if warmup and "total_ms" in warmup:
        lines.append(f"| first hot-load (warm-up, not in the p50) | 1 | {num(warmup['total_ms'])} | load "
                     f"{num(warmup['load_ms'])} · first response {num(warmup['first_response_ms'])} | – |")
    lines += [""] + [f"Not measured: {e}" for e in errors] if errors else []
    return "\n".join(lines)


def plot(path: Path, parts: dict[str, dict[str, float | None]], p50: dict[str, float | None],
         ratio: dict[str, float | None], engine: str) -> bool:
    """Stacked bars of the p50 parts on a log scale, total and ratio on top; False without matplotlib.

    Each bar stacks its parts largest first: on a log scale a part drawn above a larger one
    gets a band about as thin as its share, so the picture does not overstate small parts.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {"load": "#4c72b0", "first response": "#55a868", "stop": "#8172b2", "boot": "#c44e52",
              "merge + save": "#dd8452", "reload": "#937860"}
    values = [ms for segs in parts.values() for ms in segs.values() if ms]
    if not values:
        return False
    floor = min(values) / 3
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    seen: set[str] = set()
    for x, (approach, segs) in enumerate(parts.items()):
        bottom = floor
        for label, ms in sorted(segs.items(), key=lambda kv: -(kv[1] or 0)):
            if not ms:
                continue
            ax.bar(x, ms, bottom=bottom, width=0.6, color=colors[label], label=None if label in seen else label)
            seen.add(label)
            bottom += ms
        if p50[approach] is not None:
            times = "" if approach == "hot-load" else f"\n{ratio[approach]:,.0f}× hot-load"
            ax.text(x, bottom * 1.15, f"{num(p50[approach])} ms{times}", ha="center", va="bottom", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylim(floor, max(values) * 40)
    ax.set_xticks(range(len(parts)), [LABELS[a] for a in parts])
    ax.set_ylabel("ms until the new policy answers (p50 parts, log scale)")
    ax.set_title(f"Hot-load against the alternatives ({engine} engine)")
    ax.legend(loc="upper left", fontsize=8, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def p50_of(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def num(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}"
