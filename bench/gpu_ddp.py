"""Data-parallel training against one process, on the same jobs: the real worker, torchrun, a real Redis.

For each backend it trains the same jobs twice, each time from a fresh run with the same seed:
once with one trainer process, once with `--ranks` ranks (`TANDEM_PARALLEL__RANKS`), and
compares what they published version by version: the loss and gradient norm the trainer
reported, and the float32 master weights (or the adapter) of each version. It also reports the
trainer's `train_s` for both.

    python bench/gpu_ddp.py --backend unsloth --shape 0.5b --out $OUT/ddp
    python bench/gpu_ddp.py --backend peft --device cpu --shape tiny --out /tmp/ddp   # a dry run

With fewer GPUs than ranks the ranks share the GPUs and sum the gradients over gloo (the trainer
warns): that checks the data-parallel path on CUDA with a backend, not its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis
from benchlib import SHAPES
from safetensors.torch import load_file

from tandem.adapters import AdapterStore
from tandem.dev.stack import free_port, redis_server_binary
from tandem.jobs import TrainJob, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec


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


def jobs(run: str, count: int, vocab: int, seed: int) -> list[TrainJob]:
    """`count` steps of 4 groups x 8 trajectories, prompts and completions of uneven lengths."""
    rng = random.Random(seed)
    out = []
    for step in range(1, count + 1):
        groups = []
        for _ in range(4):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 160))]
            trajs = []
            for _ in range(8):
                n = rng.randint(16, 192)
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
    for job in jobs(run, args.jobs, vocab, seed=11):
        enqueue(conn, job)
    env = {**os.environ, "TANDEM_REDIS__URL": url, "TANDEM_STORE__ROOT": str(root), "TANDEM_GPUS__MODE": "cpu",
           "TANDEM_BACKEND__KIND": args.backend, "TANDEM_BACKEND__DEVICE": args.device, "HF_HUB_OFFLINE": "1",
           "TANDEM_WORKER_NAME": f"bench-{run}", "TANDEM_METRICS__ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    if ranks > 1:
        env["TANDEM_PARALLEL__RANKS"] = str(ranks)
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
            "tokens": ma["tokens"], "ranks": mb.get("ranks"),
        })
    return rows


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
    (args.out / f"{args.backend}-ranks{args.ranks}.json").write_text(json.dumps(result, indent=2))
    for row in rows:
        print(f"[gpu_ddp] v{row['version']}: max |diff| {row['max_abs_diff']:.3g} (max |w| {row['max_abs_weight']:.3g}) "
              f"loss {row['loss'][0]:.5f}/{row['loss'][1]:.5f} grad_norm {row['grad_norm'][0]:.4f}/{row['grad_norm'][1]:.4f} "
              f"train_s {row['train_s'][0]:.3f}/{row['train_s'][1]:.3f} microbatches {row['microbatches']}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if one["exit"] == 0 and many["exit"] == 0 and len(rows) == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
