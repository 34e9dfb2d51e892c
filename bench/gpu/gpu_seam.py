"""On a GPU: real SGLang through tandem's own engine client (`SGLangEngine`), checked against itself.

What tandem's gateway and controller see of SGLang goes through `engines/sglang.py` and
`engines/sglang_outputs.py`; this runs them against a real server started the way tandem
starts it (`engines.own_engine`, the shipped flags):

1. Whole vs streamed: for every prompt and adapter (base, A-D), greedy with and without a stop
   string, n = 1 and n = 3: the streamed increments, folded, equal the whole result token for
   token, logprob for logprob, and text for text.
2. Mixed batches through the client: `complete` calls for base and A-D fired at once equal each
   request's solo output (the version-swap shape included).
3. Unloading after one-call n > 1 sampling (sglang#36894: an unload after n > 1 sampling was
   reported to hang the scheduler): rounds of load, n = 8 in one call, unload under a timeout;
   says whether one-call `n` can come back (`gateway.fan_out_n` off).

    python bench/gpu/gpu_seam.py --out $OUT/seam --sglang-python /tmp/sgpython --shape 0.5b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tandem_inference.engines.base import Engine, Generated, Sampling
from tandem_inference.errors import EngineTimeout
from tandem_inference.gateway.outputs import Output

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from bench.benchlib import SHAPES
from bench.gpu import one_engine

ADAPTERS = ["A", "B", "C", "D"]
NEW_TOKENS = 40


def fold(pieces: list[Generated], n: int) -> list[Output]:
    outs = [Output() for _ in range(n)]
    for piece in pieces:
        outs[piece.index].update(piece)
    return outs


def compare(whole: Generated, streamed: Output) -> dict[str, Any]:
    """Token ids, text and finish reason must be equal; logprobs within bfloat16 noise."""
    tokens = whole.token_ids == streamed.token_ids
    diff = max((abs(a - b) for a, b in zip(whole.logprobs, streamed.logprobs, strict=False)), default=0.0)
    return {"tokens": tokens, "text": whole.text == streamed.text, "finish": whole.finish_reason == streamed.finish_reason,
            "logprobs": len(whole.logprobs) == len(streamed.logprobs), "max_logprob_diff": diff}


async def whole_vs_stream(engine: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    rows = []
    for p, ids in enumerate(prompts):
        for adapter in [None, *ADAPTERS]:
            # the first request of a prompt fills the prefix cache: both sides below then find it there
            await engine.complete(ids, Sampling(max_tokens=1, temperature=0.0), adapter=adapter)
            for stop, n, temperature in (((), 1, 0.0), ((" the", "\n"), 1, 0.0), ((), 3, 0.0), (("e",), 3, 1.0)):
                sampling = Sampling(max_tokens=NEW_TOKENS, temperature=temperature, stop=stop)
                if temperature > 0:  # sampled: no reference to compare with; the stream must be well formed
                    streamed = fold([g async for g in engine.stream(ids, sampling, n=n, adapter=adapter)], n)
                    ok = all(len(o.logprobs) == len(o.token_ids) > 0 for o in streamed)
                    rows.append({"prompt": p, "adapter": adapter, "n": n, "stop": stop, "T": temperature, "ok": ok})
                    continue
                whole = await engine.complete(ids, sampling, n=n, adapter=adapter)
                streamed = fold([g async for g in engine.stream(ids, sampling, n=n, adapter=adapter)], n)
                checks = [compare(w, s) for w, s in zip(whole, streamed, strict=True)]
                ok = all(c["tokens"] and c["text"] and c["finish"] and c["logprobs"] and c["max_logprob_diff"] < 0.02
                         for c in checks)
                rows.append({"prompt": p, "adapter": adapter, "n": n, "stop": stop, "T": temperature, "ok": ok,
                             "lengths": [len(w.token_ids) for w in whole], "checks": checks})
    bad = [r for r in rows if not r["ok"]]
    print(f"  whole vs streamed: {len(rows) - len(bad)}/{len(rows)} agree", flush=True)
    return {"rows": rows, "disagree": len(bad)}


async def mixed(engine: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    greedy = Sampling(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    everyone: list[str | None] = [None, *ADAPTERS]
    solo = {}
    for p, ids in enumerate(prompts):
        for a in everyone:
            (solo[p, a],) = await engine.complete(ids, greedy, adapter=a)
    batches = {
        "prompts x {base, A, B, C, D}, 32 requests": [(i % len(prompts), everyone[i % 5]) for i in range(32)],
        "A, B, C, D one each": [(0, a) for a in ADAPTERS],
        "one prompt with A and with B (a version swap)": [(1, "A"), (1, "B")],
    }
    rows = []
    for name, batch in batches.items():
        got = await asyncio.gather(*(engine.complete(prompts[p], greedy, adapter=a) for p, a in batch))
        firsts = [next((k for k, (x, y) in enumerate(zip(g.token_ids, solo[r].token_ids, strict=False)) if x != y), None)
                  for r, (g,) in zip(batch, got, strict=True)]
        rows.append({"batch": name, "requests": len(batch), "exact": sum(k is None for k in firsts),
                     "wrong_from_first_decode_step": sum(1 for k in firsts if k is not None and k <= 1)})
        print(f"  {name}: {rows[-1]['exact']}/{len(batch)} exact", flush=True)
    distinct = len({tuple(solo[0, a].token_ids) for a in everyone})
    return {"distinct_solo_outputs": distinct, "rows": rows}


async def unload_after_n(engine: Engine, adapters: dict[str, Path], prompts: list[list[int]], rounds: int,
                         timeout_s: float, work: Path) -> dict[str, Any]:
    """Rounds of: load a fresh copy, sample n = 8 (fanned out as 8 calls, or one call), unload."""
    rows = []
    for k in range(rounds):
        for one_call in (False, True):
            name = f"n-probe-{k}-{'one' if one_call else 'fan'}"
            copy = work / name
            shutil.copytree(adapters[ADAPTERS[k % len(ADAPTERS)]], copy)
            await engine.load_adapter(name, str(copy))
            sampling = Sampling(max_tokens=NEW_TOKENS, temperature=1.0)
            if one_call:
                calls = [engine.complete(ids, sampling, n=8, adapter=name) for ids in prompts]
            else:
                calls = [engine.complete(ids, sampling, adapter=name) for ids in prompts for _ in range(8)]
            await asyncio.gather(*calls)
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(engine.unload_adapter(name), timeout_s)
                rows.append({"round": k, "one_call_n": one_call, "unloaded": True,
                             "unload_ms": (time.perf_counter() - t0) * 1000})
            except (TimeoutError, EngineTimeout) as exc:
                rows.append({"round": k, "one_call_n": one_call, "unloaded": False, "error": repr(exc)})
                print(f"  round {k} ({'one call' if one_call else 'fanned out'}): unload did not return "
                      f"in {timeout_s} s", flush=True)
                return {"rows": rows, "hung": 1}
    print(f"  unload after n=8, fanned out and in one call: {len(rows)}/{len(rows)} returned", flush=True)
    return {"rows": rows, "hung": 0}


async def check(args: argparse.Namespace) -> dict[str, Any]:
    from tandem_trainer.tiny_model import build_random_adapter, build_tiny_model

    work = args.out / "work"
    shape = {**SHAPES[args.shape], "initializer_range": 0.02}
    model = build_tiny_model(work / "model", **shape)
    adapters = {name: build_random_adapter(model, work / name, rank=16, seed=i + 1, scale=0.02)
                for i, name in enumerate(ADAPTERS)}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 24))] for _ in range(4)]
    inference = one_engine.settings(args.engine, model, work, port=args.port, sglang_python=args.sglang_python,
                                    unload_timeout_s=args.unload_timeout_s)
    async with httpx.AsyncClient() as http, one_engine.serving(inference, http, args.out / f"{args.engine}.log") as (
            engine, boot_s, argv):
        for name, path in adapters.items():
            await engine.load_adapter(name, str(path))
        result: dict[str, Any] = {"argv": [a for a in argv if not a.startswith("/tmp")], "boot_s": boot_s,
                                  "info": (await engine.info()).__dict__}
        print("== whole vs streamed", flush=True)
        result["whole_vs_stream"] = await whole_vs_stream(engine, prompts)
        print("== mixed batches through the client", flush=True)
        result["mixed"] = await mixed(engine, prompts)
        print("== unload after one-call n > 1", flush=True)
        result["unload_after_n"] = await unload_after_n(engine, adapters, prompts, args.rounds,
                                                          args.unload_timeout_s, work)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    one_engine.add_arguments(parser, port=30181)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--unload-timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(check(args))
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    ok = (result["whole_vs_stream"]["disagree"] == 0
          and all(r["wrong_from_first_decode_step"] == 0 for r in result["mixed"]["rows"]))
    print("seam check:", "ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
