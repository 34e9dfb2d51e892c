"""Data-parallel training against one process, on the same jobs: the real worker, torchrun, a real Redis.

For each backend it trains the same jobs twice, each time from a fresh run with the same seed:
once with one trainer process, once with `--ranks` ranks (`TANDEM_PARALLEL__RANKS`), and
compares what they published version by version: the loss and gradient norm the trainer
reported, and the float32 master weights (or the adapter) of each version. It also reports the
trainer's `train_s` for both, the tokens per second it makes of it, and (`--breakdown`) where a
step's time goes: the trainer's CUDA-synchronised stage timings (stage_clock.py), per version.

    python bench/gpu/gpu_ddp.py --backend unsloth --shape 0.5b --out $OUT/ddp
    python bench/gpu/gpu_ddp.py --backend peft --shape 8b --sequences 64 --lengths 512:2048 --breakdown --out $OUT/ddp
    python bench/gpu/gpu_ddp.py --backend peft --device cpu --shape tiny --out /tmp/ddp   # a dry run

Job size: `--sequences` per job in groups of 8; without `--lengths` prompts of 32-160 and
completions of 16-192 tokens (the first measurement's jobs), with `--lengths A:B` sequences of A
to B tokens, a quarter of each the prompt.

With fewer GPUs than ranks the ranks share the GPUs and sum the gradients over gloo (the trainer
warns): that checks the data-parallel path on CUDA with a backend, not its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis
from safetensors.torch import load_file

from tandem.adapters import AdapterStore
from tandem.dev.composition import redis_server_binary
from tandem.dev.ports import free_port
from tandem.jobs import TrainJob, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from bench.benchlib import SHAPES


def redis_server(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A throwaway redis-server on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError("redis-server did not start")


def jobs(run: str, count: int, vocab: int, seed: int, sequences: int = 32,
         lengths: tuple[int, int] | None = None) -> list[TrainJob]:
    """`count` steps of `sequences` trajectories in groups of 8, of uneven lengths (see the module's doc)."""
    rng = random.Random(seed)
    out = []
    for step in range(1, count + 1):
        groups = []
        for _ in range(max(1, sequences // 8)):
            if lengths is None:
                prompt_len, completion = (32, 160), (16, 192)
            else:
                prompt_len = (lengths[0] // 4, lengths[0] // 4)
                completion = (lengths[0] - prompt_len[0], lengths[1] - prompt_len[0])
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
            trajs = []
            for _ in range(8):
                n = rng.randint(*completion)
                trajs.append({"prompt_ids": prompt, "completion_ids": [rng.randrange(3, vocab) for _ in range(n)],
                              "rollout_logprobs": [rng.uniform(-9.0, -4.0) for _ in range(n)], "reward": rng.random()})
            groups.append({"trajectories": trajs})
        out.append(TrainJob.model_validate({"job_id": f"{run}-{step}", "run": run, "step": step, "groups": groups,
                                            "timeout_s": 1200}))
    return out


def train(args: argparse.Namespace, url: str, root: Path, model: Path, run: str, ranks: int) -> dict[str, Any]:
    conn = redis.Redis.from_url(url)
    Registry(conn).create_run(RunSpec(
        name=run, base_model=str(model), lora=LoraConfig(r=16, alpha=32.0), seed=7,
        optimizer=OptimizerConfig(lr=args.lr), loss=LossConfig(epochs=1), max_staleness_steps=args.jobs,
    ))
    vocab = SHAPES[args.shape].get("vocab_size", 512)
    lengths = tuple(int(x) for x in args.lengths.split(":")) if args.lengths else None
    for job in jobs(run, args.jobs, vocab, seed=11, sequences=args.sequences, lengths=lengths):  # type: ignore[arg-type]
        enqueue(conn, job)
    env = {**os.environ, "TANDEM_REDIS__URL": url, "TANDEM_STORE__ROOT": str(root), "TANDEM_GPUS__MODE": "cpu",
           "TANDEM_BACKEND__KIND": args.backend, "TANDEM_BACKEND__DEVICE": args.device, "HF_HUB_OFFLINE": "1",
           "TANDEM_WORKER_NAME": f"bench-{run}", "TANDEM_METRICS__ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    if ranks > 1:
        env["TANDEM_PARALLEL__RANKS"] = str(ranks)
    if args.breakdown:
        env["TANDEM_BACKEND__STEP_BREAKDOWN"] = "true"
    if args.micro_batch_tokens:
        env["TANDEM_BACKEND__MICRO_BATCH_TOKENS"] = str(args.micro_batch_tokens)
    log = args.out / f"{run}.log"
    t0 = time.monotonic()
    with log.open("wb") as f:
        done = subprocess.run([sys.executable, "-m", "tandem_trainer.main", "--burst"], env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=args.timeout)
    wall = time.monotonic() - t0
    manifests = Registry(conn).manifests(run)
    print(f"[gpu_ddp] {run}: exit {done.returncode}, {len(manifests)} versions in {wall:.0f} s", flush=True)
    return {"exit": done.returncode, "wall_s": wall, "manifests": [m.model_dump(mode="json") for m in manifests]}


def weights(root: Path, run: str, version: int) -> dict[str, Any]:
    directory = AdapterStore(root).version_dir(run, version)
    master = directory / "trainer" / "lora_master.safetensors"
    return load_file(str(master if master.is_file() else directory / "adapter" / "adapter_model.safetensors"))


def compare(root: Path, one: dict[str, Any], many: dict[str, Any], run_one: str, run_many: str) -> list[dict[str, Any]]:
    rows = []
    for a, b in zip(one["manifests"], many["manifests"], strict=False):
        wa, wb = weights(root, run_one, a["version"]), weights(root, run_many, b["version"])
        diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
        scale = max(float(wa[k].float().abs().max()) for k in wa)
        ma, mb = a["metrics"], b["metrics"]
        rows.append({
            "version": a["version"], "max_abs_diff": diff, "max_abs_weight": scale,
            "loss": [ma["loss"], mb["loss"]], "grad_norm": [ma["grad_norm"], mb["grad_norm"]],
            "train_s": [ma["train_s"], mb["train_s"]], "microbatches": [ma["microbatches"], mb["microbatches"]],
            "tokens": ma["tokens"], "ranks": mb.get("ranks"), "sequence_tokens": ma.get("sequence_tokens"),
            "stages": [{k: v for k, v in m.items() if k.startswith("stage_")} for m in (ma, mb)],
        })
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the versions after the first (its step loads and warms up): train_s, tokens per
    second (trained tokens / train_s) and each stage, for one process and for the ranks."""
    steady = rows[1:] or rows
    out: dict[str, Any] = {"versions": [r["version"] for r in steady]}
    for side, name in ((0, "one"), (1, "many")):
        train_s = statistics.mean(r["train_s"][side] for r in steady)
        stages: dict[str, float] = {}
        for r in steady:
            for key, value in r["stages"][side].items():
                if key.endswith("_s"):
                    stages[key] = stages.get(key, 0.0) + value / len(steady)
        out[name] = {"train_s": train_s, "tokens_per_s": statistics.mean(r["tokens"] / r["train_s"][side] for r in steady),
                     "stages": stages}
    out["speedup"] = out["one"]["train_s"] / out["many"]["train_s"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["unsloth", "peft"], default="unsloth")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--model", type=Path, help="a model built earlier (default: build the shape)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--sequences", type=int, default=32, help="sequences per job (groups of 8)")
    parser.add_argument("--lengths", help="A:B, sequences of A to B tokens (default: the short mix)")
    parser.add_argument("--breakdown", action="store_true", help="the trainer's stage timings per version")
    parser.add_argument("--micro-batch-tokens", type=int, help="TANDEM_BACKEND__MICRO_BATCH_TOKENS")
    parser.add_argument("--tag", default="", help="a suffix of the result file's name")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-ddp-{os.getpid()}"
    work.mkdir(parents=True)
    model = args.model
    if model is None:
        from tandem_trainer.tiny_model import build_tiny_model

        model = build_tiny_model(work / f"model-{args.shape}", **SHAPES[args.shape])
    root = work / "adapters"
    root.mkdir()
    server, url = redis_server(work)
    try:
        one = train(args, url, root, model, f"{args.backend}-one", 1)
        many = train(args, url, root, model, f"{args.backend}-ranks", args.ranks)
        rows = compare(root, one, many, f"{args.backend}-one", f"{args.backend}-ranks")
    finally:
        server.terminate()
    result = {"backend": args.backend, "device": args.device, "shape": args.shape, "ranks": args.ranks,
              "sequences": args.sequences, "lengths": args.lengths, "breakdown": args.breakdown,
              "summary": summary(rows) if rows else None,
              "one": {"exit": one["exit"], "wall_s": one["wall_s"]}, "many": {"exit": many["exit"], "wall_s": many["wall_s"]},
              "versions": rows}
    try:
        import torch

        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        result["torch"] = torch.__version__
        if args.backend == "unsloth":
            import importlib.metadata as md

            result["unsloth"] = md.version("unsloth")
    except Exception as exc:  # noqa: BLE001 - the facts are extras
        result["versions_error"] = str(exc)
    (args.out / f"{args.backend}-{args.shape}-ranks{args.ranks}{args.tag}.json").write_text(json.dumps(result, indent=2))
    for row in rows:
        print(f"[gpu_ddp] v{row['version']}: max |diff| {row['max_abs_diff']:.3g} (max |w| {row['max_abs_weight']:.3g}) "
              f"loss {row['loss'][0]:.5f}/{row['loss'][1]:.5f} grad_norm {row['grad_norm'][0]:.4f}/{row['grad_norm'][1]:.4f} "
              f"train_s {row['train_s'][0]:.3f}/{row['train_s'][1]:.3f} microbatches {row['microbatches']}", flush=True)
    if result["summary"]:
        one_s, many_s = result["summary"]["one"], result["summary"]["many"]
        print(f"[gpu_ddp] steady state: one {one_s['train_s']:.3f} s ({one_s['tokens_per_s']:.0f} tok/s), "
              f"{args.ranks} ranks {many_s['train_s']:.3f} s ({many_s['tokens_per_s']:.0f} tok/s): "
              f"{result['summary']['speedup']:.2f} x", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if one["exit"] == 0 and many["exit"] == 0 and len(rows) == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
