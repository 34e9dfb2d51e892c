"""Two engines side by side, from two runs of the benchmark suite: what a user picks an engine by.

Reads two `results.json` files of `bench/suite.py` (one `--engine sglang`, one `--engine vllm`,
same machine, shape, prompts and trainer) and writes a markdown page: each engine's versions,
flags and command line (from the results' `meta`), then one table per question: policy sync
by stage (scenario 1), hot-load against a restart (2), serving during swaps (3), rollout
throughput by concurrency and resident adapters (10), engine memory across versions (11),
rollout/trainer agreement (9), the shared-mode hand-over (release/resume against sleep/wake:
from a suite run in `--mode shared`, or from `bench/gpu/gpu_check.py --mode shared` results given
with `--handover`), and every goal of either run, met or missed. A number a run does not hold
shows as "–"; nothing is estimated.

    python bench/report/compare_engines.py OUT/suite-sglang/results.json OUT/suite-vllm/results.json \\
        --handover OUT/check-sglang-shared/results.json OUT/check-vllm-shared/results.json \\
        --out OUT/engines.md
    python bench/report/compare_engines.py sglang-1.json,sglang-2.json vllm-1.json,vllm-2.json   # runs merged
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from bench.benchlib import md_table

SYNC_STAGES = [("step_to_served_ms", "optimizer step → first response by the new version"),
               ("publish_to_served_ms", "publish → served"), ("ready_to_loaded_ms", "adapter_ready → loaded"),
               ("engine_load_ms", "engine load (inside)"), ("loaded_to_served_ms", "loaded → first response"),
               ("probe_wait_ms", "  the probe's wait after the switch"), ("overhead_ms", "tandem's own overhead")]
HOTLOAD = [("hotload_total_ms_p50", "hot-load → first response, p50 ms"),
           ("restart_total_ms_p50", "restart → first response, p50 ms"),
           ("restart_boot_ms_p50", "  of which the engine's boot, p50 ms"),
           ("merge_total_ms_p50", "merge + weights reload → first response, p50 ms"),
           ("restart_over_hotload", "restart / hot-load")]
SWAPS = [("requests", "requests"), ("errors", "failed"), ("swaps", "versions swapped in"),
         ("tokens_per_s", "tokens/s"), ("served_by_older_than_newest", "responses older than the newest")]
HANDOVER = [("drain_ms", "drain requests in flight"), ("release_ms", "release (SGLang) / sleep (vLLM)"),
            ("resume_ms", "resume (SGLang) / wake up (vLLM)"), ("lent_ms", "GPU with the trainer")]

MEASURED = {"gpu_mib": "GPU memory of the engine", "rss_mib": "RSS of the engine's processes"}


class ResultsError(ValueError):
    """A results file that is not a suite's results.json."""


def load(path: Path) -> dict[str, Any]:
    """A suite's results.json; refused, naming the file, when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultsError(f"cannot read {path} as JSON ({exc}); give the results.json a suite run wrote") from exc
    if not isinstance(data, dict) or "meta" not in data or "scenarios" not in data:
        raise ResultsError(f"{path} has no 'meta' and 'scenarios': it is not a results.json of bench/suite.py "
                           "(gpu_check's results go after --handover)")
    return data


def load_parts(spec: str) -> dict[str, Any]:
    """One engine's results from one or more results.json, comma-separated (`a.json,b.json`: suite
    runs with different `--only`, each within a host's time per command): the first run's `meta`,
    and every run's scenarios, a later run's replacing an earlier one's of the same name."""
    parts = [load(Path(p)) for p in spec.split(",") if p]
    if not parts:
        raise ResultsError(f"no results.json in {spec!r}")
    merged = {"meta": parts[0]["meta"], "scenarios": {}}
    for part in parts:
        if part["meta"].get("engine") != merged["meta"].get("engine"):
            raise ResultsError(f"{spec} joins runs of engines {parts[0]['meta'].get('engine')!r} and "
                               f"{part['meta'].get('engine')!r}: give each engine's runs as one argument")
        merged["scenarios"].update(part["scenarios"])
    return merged


def num(value: Any, fmt: str = "{:.1f}") -> str:
    """A number as the page shows it: "–" for none (or NaN), counts as they are, the rest by `fmt`."""
    if value is None or (isinstance(value, float) and value != value):
        return "–"
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else fmt.format(value)


def escaped(text: str) -> str:
    """Text for a markdown table cell (a '|' would end the cell)."""
    return text.replace("|", "\\|")


def scenario(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A scenario's result, or None when the run did not hold it or it failed."""
    res = run["scenarios"].get(name)
    return None if res is None or res.get("error") else res


def side_by_side(runs: Sequence[dict[str, Any]], labels: Sequence[str], header: str,
                 rows: Sequence[tuple[str, Callable[[dict[str, Any]], str]]]) -> str:
    """A table of one row per quantity, one column per engine."""
    return md_table([header, *labels], [[label, *(cell(r) for r in runs)] for label, cell in rows])


def label(run: dict[str, Any]) -> str:
    meta = run["meta"]
    env = meta.get(f"{meta['engine']}_env") or {}
    version = env.get(meta["engine"])
    return f"{meta['engine']} {version}" if version else meta["engine"]


def setup(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    def meta(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: str(r["meta"].get(key, "–"))

    def env(r: dict[str, Any]) -> str:
        m = r["meta"]
        return ", ".join(f"{k} {v}" for k, v in (m.get(f"{m['engine']}_env") or m.get("packages") or {}).items())

    def flags(r: dict[str, Any]) -> str:
        s = r["meta"].get("settings", {})
        return "<br>".join(f"`{k.removeprefix('TANDEM_')}={v}`" for k, v in sorted(s.items())
                           if k.startswith(("TANDEM_ENGINE__", "TANDEM_GPUS__")) and not k.endswith("_PYTHON"))

    def command(r: dict[str, Any]) -> str:
        cmd = (r["meta"].get("engine_log") or {}).get("engine_command")
        return f"`{cmd}`" if cmd else "–"

    return side_by_side(runs, labels, "", [
        ("date", meta("timestamp")), ("quick run", meta("quick")), ("mode", meta("mode")), ("model shape", meta("shape")),
        ("GPUs", lambda r: ", ".join(r["meta"].get("machine", {}).get("gpus") or []) or "none"),
        ("engine environment", env),
        ("trainer environment", lambda r: ", ".join(f"{k} {v}" for k, v in (r["meta"].get("trainer_env") or {}).items())
         or "–"),
        ("tandem's engine settings", flags), ("engine command", command),
        ("engine boot, s", lambda r: num((r["meta"].get("engine_log") or {}).get("engine_boot_s"))),
    ])


def p50_p95(name: str, key: str) -> Callable[[dict[str, Any]], str]:
    """A cell of scenario `name`'s summary entry `key`: "p50 / p95", or "–" where the run has none."""
    def cell(r: dict[str, Any]) -> str:
        s = (scenario(r, name) or {}).get("summary", {}).get(key)
        return f"{num(s['p50'])} / {num(s['p95'])}" if s else "–"
    return cell


def sync(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    return side_by_side(runs, [f"{x} p50 / p95 ms" for x in labels], "stage",
                        [(t, p50_p95("sync", k)) for k, t in SYNC_STAGES])


def summary_rows(name: str, keys: Sequence[tuple[str, str]]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    def cell(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: num((scenario(r, name) or {}).get("summary", {}).get(key))
    return [(title, cell(key)) for key, title in keys]


def swaps(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    return side_by_side(runs, labels, "", [*summary_rows("swaps", SWAPS),
                                           ("TTFT p50 / p95 ms", p50_p95("swaps", "ttft_ms")),
                                           ("latency p50 / p95 ms", p50_p95("swaps", "latency_ms"))])


def throughput(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    grids = [{(c["concurrency"], c["adapters"]): c for c in (scenario(r, "throughput") or {}).get("rows", [])}
             for r in runs]
    cells = sorted(set().union(*grids), key=lambda k: (k[1], k[0]))
    if not cells:
        return "Neither run holds the throughput scenario."
    rows = []
    for key in cells:
        got = [g.get(key) for g in grids]
        tps = [c["tokens_per_s"] if c else None for c in got]
        ratio = tps[1] / tps[0] if tps[0] and tps[1] is not None else None
        rows.append([key[0], key[1], *(num(t, "{:.0f}") for t in tps), num(ratio, "{:.2f}"),
                     *(f"{num(c['latency_ms_p50'], '{:.0f}')} / {num(c['latency_ms_p95'], '{:.0f}')}" if c else "–"
                       for c in got),
                     *(f"{c['errors']} / {c['refused']}" if c else "–" for c in got)])
    return md_table(["clients", "adapters", *(f"{x} tokens/s" for x in labels), f"{labels[1]} / {labels[0]}",
                     *(f"{x} latency p50 / p95 ms" for x in labels), *(f"{x} failed / 429" for x in labels)], rows)


def memory(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    def measured(r: dict[str, Any]) -> dict[str, Any] | None:
        s = (scenario(r, "memory") or {}).get("summary")
        return s[s["measured"]] if s else None

    def field(key: str, fmt: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: num((measured(r) or {}).get(key), fmt)

    def verdict(r: dict[str, Any]) -> str:
        goals = (scenario(r, "memory") or {}).get("goals") or []
        return ("flat (met)" if goals[0]["met"] else "**growing (missed)**") if goals else "–"

    def host(key: str, fmt: str) -> Callable[[dict[str, Any]], str]:
        """The engine's host memory (RSS) beside a GPU series: where a GPU engine keeps its CPU copies of adapters."""
        def cell(r: dict[str, Any]) -> str:
            s = (scenario(r, "memory") or {}).get("summary") or {}
            return num((s.get("rss_mib") or {}).get(key), fmt) if s.get("measured") != "rss_mib" else "–"
        return cell

    rows = [
        ("what is measured", lambda r: MEASURED.get(((scenario(r, "memory") or {}).get("summary") or {})
                                                     .get("measured", ""), "–")),
        ("versions", summary_rows("memory", [("versions", "")])[0][1]),
        ("after the first version, MiB", field("first", "{:.0f}")), ("after the last, MiB", field("last", "{:.0f}")),
        ("max, MiB", field("max", "{:.0f}")), ("MiB per 10 versions", field("slope_mib_per_10", "{:+.1f}")),
        ("growth", lambda r: num(100 * m["growth"], "{:+.1f} %") if (m := measured(r)) else "–"),
        ("growth ≤ 5 %", verdict)]
    if any(((scenario(r, "memory") or {}).get("summary") or {}).get("measured") == "gpu_mib" for r in runs):
        rows += [("host memory (RSS of the engine's processes) after the first version, MiB", host("first", "{:.0f}")),
                 ("… after the last, MiB", host("last", "{:.0f}")),
                 ("… MiB per 10 versions", host("slope_mib_per_10", "{:+.1f}"))]
    return side_by_side(runs, labels, "", rows)


def agreement(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    """One row a setting, or a setting and trainer backend where a run recomputed with several
    (`--agreement-backends`; rows of runs before it carry no backend)."""
    settings = [(0.3, 1.0), (0.7, 1.0), (1.0, 1.0), (0.3, 0.9), (0.7, 0.9), (1.0, 0.9)]
    backends = sorted({x.get("backend", "") for r in runs for x in (scenario(r, "agreement") or {}).get("rows", [])})
    several = len(backends) > 1

    def at(b: str, t: float, p: float) -> Callable[[dict[str, Any]], str]:
        def cell(r: dict[str, Any]) -> str:
            row = next((x for x in (scenario(r, "agreement") or {}).get("rows", [])
                        if x["temperature"] == t and x["top_p"] == p and "control" not in x
                        and (not several or x.get("backend", "") == b)), None)
            return f"{row['mean_abs']:.1e} / {row['max_abs']:.1e} / {row['over_outlier']:.4f}" if row else "–"
        return cell

    return side_by_side(runs, [f"{x}: mean / max \\|Δ\\| / share > 0.1" for x in labels],
                        "trainer backend, T, top_p" if several else "T, top_p",
                        [((f"{b or '–'}, " if several else "") + f"{t}, {p}", at(b, t, p))
                         for b in (backends if several else [""]) for t, p in settings])


def handover(runs: Sequence[dict[str, Any]], labels: Sequence[str], checks: Sequence[dict[str, Any] | None]) -> str:
    def of(i: int) -> dict[str, Any] | None:
        """The hand-over summary: the suite's own (shared mode), else the gpu_check run's."""
        own = (runs[i]["meta"].get("engine_log") or {}).get("handover")
        if own and own.get("count"):
            return dict(own)
        check = checks[i]
        return dict(check["summary"]["handover"]) if check and (check["summary"].get("handover") or {}).get("count") \
            else None

    found = [of(i) for i in range(len(runs))]
    if not any(found):
        return ("Neither run holds a shared-mode hand-over: run the suite with `--mode shared`, or give "
                "`bench/gpu/gpu_check.py --mode shared` results with `--handover`.")

    def key(k: str) -> Callable[[int], str]:
        return lambda i: f"{num(found[i][k]['p50'])} / {num(found[i][k]['max'])}" if found[i] and found[i][k] else "–"

    rows = [["hand-overs", *(str(f["count"]) if f else "–" for f in found)]]
    rows += [[f"{title}, p50 / max ms", *(key(k)(i) for i in range(len(runs)))] for k, title in HANDOVER]
    return md_table(["", *labels], rows)


def goals(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    table: dict[tuple[str, str], list[str]] = {}
    for i, r in enumerate(runs):
        for res in r["scenarios"].values():
            for g in res.get("goals", []):
                cells = table.setdefault((res["title"], escaped(g["name"])), ["–"] * len(runs))
                cells[i] = f"{num(g['value'], '{:.4g}')} ({'met' if g['met'] else '**missed**'})"
    return md_table(["scenario", "goal", *labels], [[t, n, *cells] for (t, n), cells in table.items()])


def page(runs: Sequence[dict[str, Any]], checks: Sequence[dict[str, Any] | None]) -> str:
    labels = [label(r) for r in runs]
    if labels[0] == labels[1]:
        labels = [f"{x} ({r['meta']['timestamp']})" for x, r in zip(labels, runs, strict=True)]
    parts = [
        (f"# {labels[0]} against {labels[1]} on the same loop", setup(runs, labels)),
        ("## Policy sync (scenario 1)", sync(runs, labels)),
        ("## Hot-load against a restart (scenario 2)", side_by_side(runs, labels, "", summary_rows("hotload", HOTLOAD))),
        ("## Serving during swaps (scenario 3)", swaps(runs, labels)),
        ("## Rollout throughput (scenario 10)", throughput(runs, labels)),
        ("## Engine memory across versions (scenario 11)", memory(runs, labels)),
        ("## Rollout/trainer agreement (scenario 9)", agreement(runs, labels)),
        ("## Shared-mode hand-over", handover(runs, labels, checks)),
        ("## Goals", goals(runs, labels)),
    ]
    return "\n\n".join(f"{title}\n\n{body}" for title, body in parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs=2, help="two results.json of bench/suite.py (first: the baseline); "
                        "each may be several runs of one engine, comma-separated")
    parser.add_argument("--handover", nargs=2, type=Path, default=None, metavar=("FIRST", "SECOND"),
                        help="results.json of bench/gpu/gpu_check.py --mode shared, one per engine, in the same order")
    parser.add_argument("--out", type=Path, default=None, help="write the page here (default: print it)")
    args = parser.parse_args(argv)
    try:
        runs = [load_parts(p) for p in args.results]
        checks: list[dict[str, Any] | None] = [None, None]
        if args.handover:
            checks = [json.loads(p.read_text()) for p in args.handover]
    except (ResultsError, OSError, ValueError) as exc:
        print(f"compare_engines: {exc}", file=sys.stderr)
        return 2
    text = page(runs, checks)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
