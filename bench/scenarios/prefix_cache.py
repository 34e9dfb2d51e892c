"""Scenario 6, prefix cache across versions: the share of a shared system prompt's tokens the
engine serves from its prefix cache, on the first request to a freshly swapped version and on
the requests that follow.

SGLang keys its radix cache per adapter, so a new version starts cold and is warm from its
second request; the gateway passes SGLang's count through as
`usage.prompt_tokens_details.cached_tokens`. The transformers engine has no prefix cache
(it reports 0), so on the CPU profile the scenario only shows the plumbing.
"""

from __future__ import annotations

import statistics
from typing import Any

import httpx

from bench.benchlib import Ctx, md_table, new_version, plt, save_figure

SYSTEM = ("You are a careful assistant for a numbers game. Answer with digits only, keep answers "
          "short, never explain, and when unsure write the numbers one to nine in order. ") * 3
USERS = ["Count for me.", "Write some numbers.", "What is the answer?", "Say something.", "More numbers."]


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None and ctx.client is not None
    swaps = 2 if ctx.quick else 4
    per_swap = len(USERS)
    run = ctx.client.run(ctx.run_name)
    rows = []
    with httpx.Client(base_url=ctx.stack.gateway_url, timeout=60) as http:
        for swap in range(1, swaps + 1):
            version = new_version(run)
            for i, user in enumerate(USERS[:per_swap]):
                body = {"model": f"{run.name}@v{version}", "max_tokens": 4,
                        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
                resp = http.post("/v1/chat/completions", json=body)
                resp.raise_for_status()
                usage = resp.json()["usage"]
                cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                rows.append({"swap": swap, "version": version, "request": i + 1, "prompt_tokens": usage["prompt_tokens"],
                             "cached_tokens": cached, "cached_share": cached / usage["prompt_tokens"]})
            ctx.progress(f"swap {swap}/{swaps}: v{version}, cached share per request "
                         + " ".join(f"{r['cached_share']:.2f}" for r in rows[-per_swap:]))
    by_request = {i: statistics.fmean(r["cached_share"] for r in rows if r["request"] == i)
                  for i in range(1, per_swap + 1)}
    table = md_table(["request # after the swap", *[str(i) for i in by_request]],
                     [["cached share of the prompt (mean over swaps)", *by_request.values()]])
    table += f"\n\n{swaps} swaps; prompt {rows[0]['prompt_tokens']} tokens, the system part shared by all."
    if ctx.engine == "transformers":
        table += " The transformers engine has no prefix cache: every share is 0 by construction."
    plot_name = "prefix_cache.png"
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 3))
    ax.bar([str(i) for i in by_request], list(by_request.values()), color="#4c72b0")
    ax.set_ylim(0, 1)
    ax.set_xlabel("request # on a freshly swapped version")
    ax.set_ylabel("cached share of prompt")
    ax.set_title(f"Prefix cache after a swap ({ctx.engine})")
    save_figure(fig, ctx.out / plot_name)
    return {"name": "prefix_cache", "title": "6. Prefix cache across versions",
            "summary": {"swaps": swaps, "cached_share_by_request": by_request}, "rows": rows, "goals": [],
            "table": table, "plots": [plot_name]}
