"""The GPU check: a real GPU engine (SGLang or vLLM) and the real Unsloth trainer, as tandem runs
them, on the toy task.

Runs on a machine with NVIDIA GPUs. Each side runs in its own Python environment (given as
an interpreter: a venv's python, or a wrapper that sets PYTHONPATH), exactly as the images do:
the engine under the inference service's launcher, Unsloth in the trainer worker.
For each step it records rollout time, train time, publish -> serving latency, the engine's
adapter load time and the reward; for the run, engine boot time, peak GPU memory of each
side (and whether it grows), the engine's command line and, in shared mode, every hand-over of
the GPU (SGLang's release/resume, vLLM's sleep/wake-up). Results go to OUT/results.json.

    python bench/gpu/gpu_check.py --mode split  --shape tiny --out $OUT/split-tiny
    python bench/gpu/gpu_check.py --mode shared --shape 0.5b --out $OUT/shared-0.5b \
        --sglang-python /opt/sglang/bin/python --trainer-python /opt/trainer/bin/python
    python bench/gpu/gpu_check.py --engine vllm --mode shared --shape 0.5b --out $OUT/vllm-shared-0.5b \
        --vllm-python /opt/vllm/bin/python --trainer-python /opt/trainer/bin/python

`--engine transformers --backend peft` runs the same script on a CPU (a dry run of the
orchestration; the numbers then say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from tandem import Client, LoraConfig, OptimizerConfig
from tandem.dev import toy
from tandem.dev.composition import StackConfig
from tandem.events import EventKind

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from bench.benchlib import KERNELS, SHAPES, BenchStack, gpu_memory, sglang_flags
from bench.gpu import gpu_rank_kill
from bench.report import engine_log

PROMPTS = ["Write some numbers.", "Count for me.", "Say something.", "What is the answer?"]


class GpuMemory(threading.Thread):
    """Samples nvidia-smi: used memory per GPU and per process, every `period_s`."""

    def __init__(self, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.samples: list[dict] = []
        self.stop_flag = threading.Event()
        self.available = shutil.which("nvidia-smi") is not None

    def sample(self) -> dict:
        return {"t": time.time(), **(gpu_memory() or {"gpu_mib": {}, "pid_mib": {}})}

    def run(self) -> None:
        while self.available and not self.stop_flag.is_set():
            try:
                self.samples.append(self.sample())
            except (subprocess.SubprocessError, ValueError):
                pass
            self.stop_flag.wait(self.period_s)


def descendants(pid: int) -> set[int]:
    """pid and every process below it (SGLang runs a scheduler and a detokenizer as children)."""
    out = {pid}
    try:
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    except OSError:
        return out
    for child in children:
        out |= descendants(int(child))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["split", "shared"], default="split")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=None, help="default: 5e-3 tiny, 2e-3 larger")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine", choices=["sglang", "vllm", "transformers"], default="sglang")
    parser.add_argument("--backend", choices=["unsloth", "peft", "auto"], default="unsloth")
    parser.add_argument("--tandem-python", default=sys.executable)
    parser.add_argument("--sglang-python", default="python3")
    parser.add_argument("--vllm-python", default="python3")
    parser.add_argument("--trainer-python", default=sys.executable)
    parser.add_argument("--inference-gpus", default="[0]")
    parser.add_argument("--trainer-gpus", default="[1]")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=8)
    parser.add_argument("--mem-fraction", type=float, default=None)
    parser.add_argument("--kill-rank", type=int, default=None,
                        help="SIGKILL this data-parallel trainer rank part-way through one job (gpu_rank_kill.py)")
    parser.add_argument("--kill-at-step", type=int, default=None, help="the step of --kill-rank (default: half-way)")
    parser.add_argument("--kernels", choices=KERNELS, default="shipped",
                        help="SGLang's kernels: shipped (what tandem's command line gets) or bench (triton attention, "
                             "PyTorch sampling: the first GPU runs')")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    kill_step = (args.kill_at_step or max(2, args.steps // 2)) if args.kill_rank is not None else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lr = args.lr or (5e-3 if args.shape == "tiny" else 2e-3)

    from tandem_trainer.tiny_model import build_tiny_model

    t0 = time.monotonic()
    model = build_tiny_model(out.parent / f"model-{args.shape}", **SHAPES[args.shape])
    print(f"[gpu_check] model {args.shape} at {model} in {time.monotonic() - t0:.1f} s", flush=True)
    env = {
        "TANDEM_GPUS__MODE": args.mode if args.engine != "transformers" else "cpu",
        "TANDEM_GPUS__INFERENCE": args.inference_gpus,
        "TANDEM_GPUS__TRAINER": args.trainer_gpus if args.mode == "split" else "[7]",
        "TANDEM_ENGINE__KIND": args.engine,
        "TANDEM_ENGINE__SGLANG_PYTHON": args.sglang_python,
        "TANDEM_ENGINE__VLLM_PYTHON": args.vllm_python,
        "TANDEM_ENGINE__MAX_LORA_RANK": "16",
        "TANDEM_ENGINE__CUDA_GRAPH_MAX_BS": str(args.cuda_graph_max_bs),
        # SGLang's kernels as the GPU runs measured them; vLLM runs with tandem's flags alone (as bench/suite.py)
        "TANDEM_ENGINE__EXTRA_ARGS": json.dumps(sglang_flags(args.kernels) if args.engine == "sglang" else []),
        "TANDEM_BACKEND__KIND": args.backend,
        "TANDEM_LOG_LEVEL": "INFO",
        # NVLink multicast stays off on shared hosts, also in the trainer's ranks
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    }
    if args.mode == "shared" and args.engine == "transformers":
        env["TANDEM_GPUS__MODE"] = "shared"
    if args.mem_fraction or args.mode == "shared":
        env["TANDEM_ENGINE__MEM_FRACTION_STATIC"] = str(args.mem_fraction or 0.6)
    config = StackConfig(state_dir=out / "stack", model=str(model), gateway_port=0, extra_env=env,
                         ready_timeout_s=1200, cpu_threads=None)
    memory = GpuMemory()
    memory.start()
    rows: list[dict] = []
    boot: dict[str, float] = {}
    kill: dict | None = None
    stack = BenchStack(config, engine=args.engine, tandem_python=args.tandem_python,
                       trainer_python=args.trainer_python)
    with stack:
        boot["stack_ready_s"] = time.monotonic() - t0
        trainer_pids = descendants(stack.service("trainer").proc.pid)
        inference_pids = descendants(stack.service("inference").proc.pid)
        client = Client(stack.gateway_url, stack.redis_url)
        run = client.create_run(f"gpu-{args.mode}", base_model=str(model), lora=LoraConfig(r=16, alpha=32),
                                optimizer=OptimizerConfig(lr=lr), max_staleness_steps=0)
        digits = toy.digit_token_ids(model)
        for step in range(1, args.steps + 1):
            s0 = time.monotonic()
            rolled = toy.roll_out(run, digits, PROMPTS, group_size=args.group_size, max_tokens=args.max_tokens)
            s1 = time.monotonic()
            if step == kill_step:
                kill, result = gpu_rank_kill.kill_during_train(
                    stack.service("trainer").proc.pid, args.kill_rank, run, rolled.groups, [r["train_s"] for r in rows[1:]])
                kill["step"] = step
                print(f"[gpu_check] step {step}: rank {args.kill_rank} killed: {json.dumps(kill)}", flush=True)
                if result is None:
                    break
            else:
                result = run.train(rolled.groups)
            s2 = time.monotonic()
            served_at = result.metrics.get("served_at", 0.0)
            mem = memory.samples[-1] if memory.samples else None
            rows.append({
                "step": step, "reward": rolled.mean_reward, "served_by": sorted(set(rolled.versions)),
                "version": result.version, "rollout_s": s1 - s0, "train_s": result.train_s, "sync_s": s2 - s1,
                "publish_to_serving_ms": (served_at - result.published_at) * 1000,
                "gpu_wait_s": result.metrics.get("gpu_wait_s"), "ranks": result.metrics.get("ranks"),
                "gpu_mib": mem["gpu_mib"] if mem else None,
            })
            r = rows[-1]
            print(f"[gpu_check] step {step:>3} reward {r['reward']:.3f} v{r['version']} rollout {r['rollout_s']:.2f}s "
                  f"train {r['train_s']:.2f}s sync {r['sync_s']:.2f}s publish->serving {r['publish_to_serving_ms']:.0f}ms",
                  flush=True)
        loaded: dict[int | None, dict[str, object]] = {}
        for e in client.events.history(run=run.name, count=10_000):  # each version's first announcement
            if e.kind is EventKind.ADAPTER_LOADED:
                loaded.setdefault(e.version, e.data)
        for r in rows:
            r["engine_load_ms"] = loaded.get(r["version"], {}).get("load_ms")
        own_log = stack.state / "logs" / f"{args.engine}.log"  # the engine's own output (SGLang's, vLLM's)
        inference_log = (stack.logs / "inference.log").read_text(errors="replace")
        trainer_log = (stack.logs / "trainer.log").read_text(errors="replace")
        if kill is not None:
            kill = gpu_rank_kill.verdict(kill, client, run.name, trainer_log, len(json.loads(args.trainer_gpus)), rows)
        client.close()
        trainer_pids |= descendants(stack.service("trainer").proc.pid)
        inference_pids |= descendants(stack.service("inference").proc.pid)
    memory.stop_flag.set()
    memory.join(5)

    from_log = engine_log.record(inference_log)
    boot["engine_boot_s"] = from_log["engine_boot_s"]
    side_peak = {"inference": 0.0, "trainer": 0.0}
    for s in memory.samples:
        for pid, mib in s["pid_mib"].items():
            side = "trainer" if pid in trainer_pids else "inference" if pid in inference_pids else None
            if side is None:  # SGLang's children re-parented: count them as inference in split mode
                side = "inference"
            side_peak[side] = max(side_peak[side], mib)
    first = statistics.fmean(r["reward"] for r in rows[:5])
    last = statistics.fmean(r["reward"] for r in rows[-5:])

    def p(key: str, q: float) -> float | None:
        vals = sorted(r[key] for r in rows if r.get(key) is not None)
        return vals[min(len(vals) - 1, round(q * (len(vals) - 1)))] if vals else None

    growth = None
    if len(rows) > 6 and rows[3]["gpu_mib"] and rows[-1]["gpu_mib"]:
        growth = {str(g): rows[-1]["gpu_mib"][g] - rows[3]["gpu_mib"][g] for g in rows[-1]["gpu_mib"]}
    summary = {
        "mode": args.mode, "shape": args.shape, "engine": args.engine, "backend": args.backend, "steps": len(rows),
        "lr": lr, "reward_first5": first, "reward_last5": last, "reward_rise": last - first,
        "publish_to_serving_ms_p50": p("publish_to_serving_ms", 0.5),
        "publish_to_serving_ms_p95": p("publish_to_serving_ms", 0.95),
        "engine_load_ms_p50": p("engine_load_ms", 0.5), "engine_load_ms_p95": p("engine_load_ms", 0.95),
        "rollout_s_p50": p("rollout_s", 0.5), "train_s_p50": p("train_s", 0.5), "sync_s_p50": p("sync_s", 0.5),
        "boot": boot, "peak_gpu_mib_by_side": side_peak, "gpu_mib_growth_step4_to_last": growth,
        "engine_command": from_log["engine_command"],
        "handovers": from_log["handovers"][:10], "handover": from_log["handover"],
        "trainer_backend_line": next((ln for ln in trainer_log.splitlines() if "backend" in ln.lower()), None),
        "machine": platform.platform(), "python": platform.python_version(),
        "rank_kill": kill,
        "engine_log_tail": own_log.read_text(errors="replace").splitlines()[-5:] if own_log.exists() else [],
    }
    (out / "results.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    killed_ok = kill is None or all(kill["checks"].values())
    return 0 if last > first and killed_ok else 1


if __name__ == "__main__":
    sys.exit(main())
