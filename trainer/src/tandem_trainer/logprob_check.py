"""Rollout/trainer agreement: the trainer's logprobs of the very tokens an engine sampled.

The importance ratio of the first epoch compares the trainer's logprob of each sampled token
with the engine's (`rollout_logprobs`) on the same weights, so it is 1 only when both compute
the same distribution: same adapter version, same temperature convention (`tandem.logprobs`),
kernels that agree. `recompute` runs the trainer's own forward pass (the backend's,
micro-batched as in training) over samples; `tandem.logprobs.Mismatch` says how far apart the
two are per token, where a wrong kernel or convention shows up as a huge outlier.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.runs import RunSpec
from tandem.trajectories import Sample as Trajectory
from tandem_trainer.backends.base import Backend
from tandem_trainer.microbatch import Sample, build_microbatches


def recompute(
    backend: Backend,
    spec: RunSpec,
    version: int,
    version_dir: Path | None,
    samples: Sequence[Trajectory],
    *,
    budget: int = 4096,
    pad_id: int = 0,
    temperature: float | None = None,
) -> list[list[float]]:
    """The trainer's logprob of every completion token of `samples` under `spec` at `version`
    (its directory in the store; None for the fresh adapter of version 0), each at its sample's
    temperature, or at `temperature` where given (to show what another convention would read)."""
    backend.activate(spec, version, version_dir)
    rows = [
        Sample(s.prompt_ids, s.completion_ids, s.rollout_logprobs, [1] * len(s.completion_ids), 0.0,
               s.temperature if temperature is None else temperature)
        for s in samples
    ]
    out: list[list[float]] = [[] for _ in rows]
    with torch.no_grad():
        for mb in build_microbatches(rows, budget, pad_id=pad_id):
            logprobs = backend.forward(mb.to(backend.device)).logprobs.float().cpu()
            for row, i in enumerate(mb.indices):
                first = len(rows[i].prompt_ids) - 1 - mb.start
                out[i] = logprobs[row, first : first + len(rows[i].completion_ids)].tolist()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tandem_trainer.logprob_check`: recompute a JSON file of samples with the trainer's
    backend (`TANDEM_BACKEND__*` as the trainer reads them), for a driver that runs in another
    environment (bench/scenarios/agreement.py). Writes {"trainer": [[logprob, ...], ...]} to --out."""
    import argparse
    import json

    from tandem.settings import TrainerSettings
    from tandem_trainer.backends.select import select_backend

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--spec", required=True, help="the run's RunSpec as JSON (a file)")
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--version-dir", default=None, help="the version's directory in the store")
    p.add_argument("--samples", required=True, help="a JSON list of samples (prompt_ids, completion_ids, ...)")
    p.add_argument("--temperature", type=float, default=None,
                   help="read every sample at this temperature instead of its own (another convention)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    spec = RunSpec.model_validate_json(Path(args.spec).read_text())
    samples = [Trajectory.model_validate(s) for s in json.loads(Path(args.samples).read_text())]
    backend = select_backend(TrainerSettings().backend)
    info = backend.model_info(spec.base_model)
    version_dir = Path(args.version_dir) if args.version_dir else None
    out = recompute(backend, spec, args.version, version_dir, samples, pad_id=info.pad_id, temperature=args.temperature)
    Path(args.out).write_text(json.dumps({"trainer": out, "backend": type(backend).__name__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
