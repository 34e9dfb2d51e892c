"""A run switch in the trainer: one step of run A between steps of run B, against B's steps alone.

Many runs on one base need one step of run A between steps of run B to cost no more than a step
of B alone plus the swap. This script measures it on one peft backend (the trainer's, not the
stack: no Redis, no engine), with real forward, backward and optimizer steps through
`tandem_trainer.step.train_step`, the function a train job calls:

    (1) alone        N steps of run B in a row: B's adapter stays the training one (no switch)
    (2) interleaved  A, B, A, B, ... N pairs, both runs resident (backends/resident.py): each
                     step switches runs, a swap in memory
                     (after warm-up steps; (1), (2) and (3) alternate in --rounds rounds of N/rounds
                     steps each, so that drift of a shared machine's load falls on all alike)
    (3) from store   the same pairs on a second backend that keeps no run resident (`runs` 1), so
                     each switch reads the parent version from the store: two other runs of the
                     same work, taken in the same rounds (for context; --no-store-phase leaves it out)

After each step the trained version is published into an adapter store under --out as a train
job publishes it (the adapter's files, the manifest, then the optimizer state beside it) and
marked as the backend's active version, so a switch back finds the run resident at exactly that
version. Publishing is outside the timed step; the step is `train_step`'s wall time: activating
the run's parent version (the swap: `activate`), packing, forward and backward, the optimizer.
The swap is the step's `activate` stage; on CUDA every stage edge and every clock read waits for
the device (torch.cuda.synchronize), on the CPU the waits do nothing.

The verdict compares medians: B's step right after an A step against B's step alone plus the swap
of those B steps (p50 each), with the margin (positive: met); p95 is reported beside it. Each
phase records the load average at its start and end, since a shared machine's other work moves
these numbers.

    python bench/run_switch.py --out /tmp/run-switch                        # tiny model, CPU
    python bench/run_switch.py --shape 0.5b --device cuda --out /tmp/sw     # one GPU, 0.5B shape
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `bench` when run as a script

from bench.benchlib import SHAPES, machine, md_table, package_versions, pct

__all__ = ["Config", "main", "measure", "report"]

RUNS = ("a", "b")


@dataclass(frozen=True)
class Config:
    """What one measurement trains (the command line's options)."""

    model: str
    out: Path
    device: str = "cpu"
    shape: str = "tiny"
    steps: int = 20
    """N: B's steps alone, and A/B pairs interleaved (and from the store)."""
    warmup: int = 3
    rank: int = 8
    samples: int = 8
    prompt: int = 32
    completion: int = 96
    micro_batch_tokens: int = 4096
    lr: float = 1e-3
    rounds: int = 4
    """The alone and interleaved steps are taken in this many rounds of both, alternating, so that the
    drift of a shared machine's load falls on both alike."""
    store_phase: bool = True


@dataclass(frozen=True)
class StepRecord:
    """One timed step."""

    phase: str
    round: int
    run: str
    parent: int
    step_s: float
    """`train_step`'s wall time, the device waited for at both ends."""
    swap_s: float
    """Its `activate` stage: making the parent version the training adapter."""
    outcome: str
    """How the backend found the run (resident.py's hit, spill, miss, fresh), or "active" (no switch)."""
    loss: float
    grad_norm: float
    stages_s: dict[str, float] = field(default_factory=dict)


class TwoRuns:
    """Runs A and B of one base model on one backend, published into one store step by step.

    Runs are named by their role ("a", "b") and `suffix` (the store phase's are other runs, so that
    neither backend finds the other's newer versions in place of what it holds); both pairs train
    the same samples."""

    def __init__(self, config: Config, backend: Any, store: Any, suffix: str = "") -> None:
        from tandem.runs import LoraConfig, OptimizerConfig, RunSpec
        from tandem_trainer.microbatch import Sample

        self.config, self.backend, self.store = config, backend, store
        self.names = {role: f"{role}{suffix}" for role in RUNS}
        self.versions = dict.fromkeys(RUNS, 0)
        self.specs = {role: RunSpec(name=self.names[role], base_model=config.model, seed=seed,
                                    lora=LoraConfig(r=config.rank, alpha=2.0 * config.rank),
                                    optimizer=OptimizerConfig(lr=config.lr))
                      for seed, role in enumerate(RUNS)}
        info = backend.model_info(config.model)
        self.pad_id = info.pad_id
        rng = random.Random(1234)
        self.samples = {role: [Sample([rng.randrange(3, info.vocab_size) for _ in range(config.prompt)],
                                      [rng.randrange(3, info.vocab_size) for _ in range(config.completion)],
                                      [-6.2] * config.completion, [1] * config.completion,
                                      1.0 if i % 2 else -1.0)
                               for i in range(config.samples)]
                        for role in RUNS}

    def now(self) -> float:
        self.backend.synchronize()  # torch.cuda.synchronize on CUDA: a clock read waits for the device
        return time.perf_counter()

    def step(self, run: str, phase: str, round_: int = 0) -> StepRecord:
        """One timed `train_step` of `run` from its newest version, then that step published."""
        from tandem_trainer.stage_clock import StageClock
        from tandem_trainer.step import StepOrder, train_step

        parent, name = self.versions[run], self.names[run]
        order = StepOrder(spec=self.specs[run], parent=parent, samples=self.samples[run], pad_id=self.pad_id,
                          version_dir=str(self.store.version_dir(name, parent)) if parent else None,
                          budget=self.config.micro_batch_tokens, entropy=False)
        clock = StageClock(self.backend.synchronize)
        switches = Counter(self.backend.resident_stats().switches)
        started = self.now()
        outcome = train_step(self.backend, order, clock=clock)
        step_s = self.now() - started
        changed = Counter(self.backend.resident_stats().switches) - switches
        self.publish(run, parent + 1)
        return StepRecord(phase=phase, round=round_, run=run, parent=parent, step_s=step_s,
                          swap_s=clock.totals.get("activate", 0.0), outcome=next(iter(changed), "active"),
                          loss=outcome.stats.sums.get("loss", float("nan")), grad_norm=outcome.grad_norm,
                          stages_s=dict(clock.totals))

    def publish(self, role: str, version: int) -> None:
        """The trained adapter as version `version` of the run, as a train job publishes it (the
        files, then the backend told it holds that version, then the optimizer state beside it)."""
        from tandem.adapters import ADAPTER_DIR, Manifest

        run = self.names[role]
        adapter = self.backend.stage_adapter()
        with self.store.staging(run, version) as staged:
            checksums = adapter.write(staged / ADAPTER_DIR)
            self.store.publish(staged, Manifest(run=run, version=version, parent=version - 1, step=version,
                                                job_id=f"{run}-{version}", base_model=self.config.model,
                                                lora_rank=self.config.rank), checksums=checksums, durable=False)
        self.backend.mark_active(run, version, self.store.version_dir(run, version))
        with self.store.trainer_state(run, version) as state_dir:
            self.backend.save_state(state_dir, trainer_state={"run": run, "version": version})
        self.versions[role] = version


def split(steps: int, rounds: int) -> list[int]:
    """`steps` in `rounds` nearly equal parts (none empty)."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (i < steps % rounds) for i in range(rounds)]


def make_backend(config: Config, *, resident: bool) -> Any:
    from tandem_trainer.backends.peft import PeftBackend
    from tandem_trainer.backends.resident import ResidentBudget

    return PeftBackend(config.device, resident=ResidentBudget() if resident else ResidentBudget(runs=1))


def measure(config: Config, progress: Callable[[str], None] = print,
            phase: Callable[[str], AbstractContextManager[Any]] = lambda name: nullcontext(),
            store: Any = None) -> dict[str, Any]:
    """Every phase's steps (`StepRecord`s as dicts) and the load average around each phase.

    `phase(name)` is entered around each phase (the tests count the store's reads in it); `store`
    is an `AdapterStore` (default: a new one under `config.out`).
    """
    if store is None:
        from tandem.adapters import AdapterStore

        (config.out / "store").mkdir(parents=True, exist_ok=True)
        store = AdapterStore(config.out / "store")
    records: list[StepRecord] = []
    loads: dict[str, list[float]] = {}
    resident = TwoRuns(config, make_backend(config, resident=True), store)
    through = TwoRuns(config, make_backend(config, resident=False), store, "-store") if config.store_phase else None

    def timed(runs: TwoRuns, name: str, order: list[str], round_: int = 0) -> None:
        where = f"{name} {round_}"
        loads[f"{where} start"] = list(os.getloadavg())
        with phase(name):
            for i, run in enumerate(order, 1):
                records.append(runs.step(run, name, round_))
                if i % 10 == 0 or i == len(order):
                    progress(f"{where}: {i}/{len(order)} steps, last {run} {records[-1].step_s * 1000:.1f} ms "
                             f"(swap {records[-1].swap_s * 1000:.1f} ms, {records[-1].outcome})")
        loads[f"{where} end"] = list(os.getloadavg())

    warm = config.warmup
    timed(resident, "warmup", list(RUNS) * (warm + 1) + ["b"] * warm)
    if through is not None:
        timed(through, "store-warmup", list(RUNS) * (warm + 1))
    for round_, n in enumerate(split(config.steps, config.rounds)):
        timed(resident, "alone", ["b"] * n, round_)  # B was the last trained: none of these switches
        timed(resident, "interleaved", list(RUNS) * n, round_)
        if through is not None:
            timed(through, "store", list(RUNS) * n, round_)
    return {"records": [asdict(r) for r in records], "loadavg": loads}


# the report -------------------------------------------------------------------
def _ms(values: list[float], q: float) -> float:
    return pct(values, q) * 1000 if values else float("nan")


def _row(name: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    step = [s["step_s"] for s in steps]
    swap = [s["swap_s"] for s in steps]
    rest = [s["step_s"] - s["swap_s"] for s in steps]
    return {"case": name, "n": len(steps), "step_p50_ms": _ms(step, 50), "step_p95_ms": _ms(step, 95),
            "swap_p50_ms": _ms(swap, 50), "swap_p95_ms": _ms(swap, 95),
            "rest_p50_ms": _ms(rest, 50), "rest_p95_ms": _ms(rest, 95),
            "outcomes": dict(Counter(s["outcome"] for s in steps))}


def report(measured: dict[str, Any], config: Config) -> dict[str, Any]:
    """The cases' rows, the verdict and a markdown table from `measure`'s records."""
    records = measured["records"]

    def of(phase: str, run: str) -> list[dict[str, Any]]:
        return [r for r in records if r["phase"] == phase and r["run"] == run]

    rows = [_row("B alone", of("alone", "b")), _row("B after A, resident", of("interleaved", "b")),
            _row("A after B, resident", of("interleaved", "a"))]
    if config.store_phase:
        rows.append(_row("B after A, from the store", of("store", "b")))
    alone, after = rows[0], rows[1]
    verdict = {}
    for q in ("p50", "p95"):
        bound = alone[f"step_{q}_ms"] + after[f"swap_{q}_ms"]
        verdict[q] = {"b_after_a_ms": after[f"step_{q}_ms"], "b_alone_ms": alone[f"step_{q}_ms"],
                      "swap_ms": after[f"swap_{q}_ms"], "bound_ms": bound,
                      "margin_ms": bound - after[f"step_{q}_ms"], "met": after[f"step_{q}_ms"] <= bound}
    table = md_table(
        ["case", "n", "step p50 ms", "step p95 ms", "swap p50 ms", "swap p95 ms", "step − swap p50 ms", "switches"],
        [[r["case"], r["n"], r["step_p50_ms"], r["step_p95_ms"], r["swap_p50_ms"], r["swap_p95_ms"],
          r["rest_p50_ms"], ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))] for r in rows])
    lines = [f"{q}: B after A {v['b_after_a_ms']:.2f} ms {'<=' if v['met'] else '>'} B alone "
             f"{v['b_alone_ms']:.2f} + swap {v['swap_ms']:.2f} = {v['bound_ms']:.2f} ms: "
             f"{'met' if v['met'] else 'MISSED'}, margin {v['margin_ms']:+.2f} ms" for q, v in verdict.items()]
    return {"rows": rows, "verdict": verdict, "table": table, "verdict_lines": lines}


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from tandem_trainer.tiny_model import build_tiny_model

    shape = SHAPES[args.shape]
    where = Path(".tandem/models") / ("tiny" if args.shape == "tiny" else f"shape-{args.shape}")
    return str(build_tiny_model(where, **shape).resolve())


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="default: bench/results/run-switch-<timestamp>")
    parser.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when present)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="the model's shape (bench.benchlib.SHAPES); larger than tiny wants a GPU")
    parser.add_argument("--model", default=None, help="a model directory instead of --shape's random one")
    parser.add_argument("--steps", type=int, default=20, help="N: B's steps alone and A/B pairs (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of both runs")
    parser.add_argument("--samples", type=int, default=8, help="sequences a step")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens a sequence")
    parser.add_argument("--completion", type=int, default=96, help="completion tokens a sequence")
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternate the alone and interleaved steps in this many rounds (default 4)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on the CPU (default 1, as the suite gives each service; 0: torch's)")
    parser.add_argument("--no-store-phase", action="store_true", help="leave out the switches through the store")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error(f"--steps {args.steps}, --warmup {args.warmup}, --rounds {args.rounds}: give at least 1 step, "
                     "0 warm-ups and 1 round")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads and device == "cpu":
        torch.set_num_threads(args.threads)
    out = Path(args.out or f"bench/results/run-switch-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = Config(model=_model(args), out=out, device=device, shape=args.shape, steps=args.steps,
                    warmup=args.warmup, rank=args.rank, samples=args.samples, prompt=args.prompt,
                    completion=args.completion, micro_batch_tokens=args.micro_batch_tokens,
                    rounds=args.rounds, store_phase=not args.no_store_phase)
    print(f"run switch: {config.shape} model on {device} ({torch.get_num_threads()} threads), {config.steps} steps, "
          f"rank {config.rank}, {config.samples} x {config.prompt}+{config.completion} tokens a step", flush=True)
    t0 = time.monotonic()
    measured = measure(config, progress=lambda msg: print(f"  {msg}", flush=True))
    result = {"config": {**asdict(config), "out": str(out), "threads": torch.get_num_threads()},
              "machine": machine(), "versions": package_versions(("torch", "transformers", "peft", "safetensors")),
              "wall_s": time.monotonic() - t0,
              **report(measured, config), **measured}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(result["table"] + "\n\n" + "\n".join(f"- {line}" for line in result["verdict_lines"])
                                   + "\n")
    print(result["table"])
    for line in result["verdict_lines"]:
        print(line)
    print(f"load average (1 min) from {measured['loadavg']['warmup 0 start'][0]:.2f} to "
          f"{measured['loadavg'][list(measured['loadavg'])[-1]][0]:.2f}; {result['wall_s']:.1f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
