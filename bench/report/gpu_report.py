"""Turn results.json files of bench/gpu/gpu_check.py into a markdown table and a reward plot.

    python bench/report/gpu_report.py docs/results/gpu-2026-11-22/*.json --png docs/img/gpu_reward.png
    python bench/report/gpu_report.py sglang.json vllm.json --png reward.png --title "SGLang and vLLM on one H100"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(summary: dict, q: str) -> float:
    """The engine's adapter load time (results before vLLM called it `sglang_load_ms`)."""
    return float(summary.get(f"engine_load_ms_{q}", summary.get(f"sglang_load_ms_{q}")))


def label(summary: dict) -> str:
    """engine (results before vLLM name none: SGLang), mode, shape."""
    return f"{summary.get('engine', 'sglang')}, {summary['mode']}, {summary['shape']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--title", default="SGLang + Unsloth on H200", help="the plot's title: say engines and GPU")
    args = parser.parse_args()
    runs = [json.loads(p.read_text()) for p in args.results]
    print("| run | reward first 5 → last 5 | publish→serving p50 / p95 ms | engine load p50 / p95 ms | "
          "rollout / train / sync p50 s | engine boot s | peak GPU MiB inference / trainer | GPU MiB growth |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        s = r["summary"]
        growth = s["gpu_mib_growth_step4_to_last"] or {}
        print(f"| {label(s)} | {s['reward_first5']:.2f} → {s['reward_last5']:.2f} | "
              f"{s['publish_to_serving_ms_p50']:.0f} / {s['publish_to_serving_ms_p95']:.0f} | "
              f"{load(s, 'p50'):.1f} / {load(s, 'p95'):.1f} | "
              f"{s['rollout_s_p50']:.2f} / {s['train_s_p50']:.2f} / {s['sync_s_p50']:.2f} | "
              f"{s['boot']['engine_boot_s']} | {s['peak_gpu_mib_by_side']['inference']:.0f} / "
              f"{s['peak_gpu_mib_by_side']['trainer']:.0f} | "
              f"{', '.join(f'GPU{g} {v:+.0f}' for g, v in growth.items())} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        s = r["summary"]
        ax.plot([x["step"] for x in r["rows"]], [x["reward"] for x in r["rows"]], marker="o", ms=3,
                label=label(s))
    ax.set_xlabel("train step")
    ax.set_ylabel("mean reward (share of digit tokens)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{args.title}: reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
