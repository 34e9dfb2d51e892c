"""The `forward_backward` kind: Tinker's `forward_backward` (and `forward`) on a run's newest version.

Under the run's lock, with the GPU in shared mode, the run's newest intact version becomes the
training adapter (a fresh one at version 0, as the train kind starts a new run), with the
gradients the run already holds (tinker_common.py). The datums are packed into micro-batches of
`backend.micro_batch_tokens` padded tokens; each datum's tokens go through the model, position i
giving the log-probability of `target_tokens[i]`, and the loss (tinker_losses.py) is summed over
tokens and datums. Unless `forward_only`, each micro-batch's loss is back-propagated, adding to
the gradients the run holds, and the job's id is recorded with them, for the `optim_step` that
names it. Nothing is published.

A job whose id the run already holds gradients of (the same job sent twice) is answered with a
forward pass and adds nothing. A loss that is not finite fails the job (`TrainStepFailed`,
retried by the queue); as any failure that is not the input's, it drops every held gradient.

The result: per datum `{"logprobs": [N floats]}` in `loss_fn_outputs`, and `{"loss:sum": ...}`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch
from pydantic import BaseModel, JsonValue

from tandem.runs import RunSpec
from tandem.tinker_jobs import Datum, ForwardBackwardJob, ForwardBackwardResult
from tandem_trainer.errors import TrainStepFailed
from tandem_trainer.jobs.base import Attempt, JobKind
from tandem_trainer.jobs.context import JobContext
from tandem_trainer.jobs.tinker_common import activate_newest, parsed, single_process
from tandem_trainer.microbatch import MicroBatch, pack
from tandem_trainer.tinker_losses import check_datums, datum_loss, loss_config

log = logging.getLogger(__name__)


class ForwardBackwardKind(JobKind[ForwardBackwardJob, ForwardBackwardResult]):
    """A `tandem.tinker_jobs.ForwardBackwardJob`: the loss's outputs, and its gradients held with the run."""

    name = "forward_backward"

    def parse(self, payload: BaseModel | JsonValue) -> ForwardBackwardJob:
        return parsed(ForwardBackwardJob, payload, self.name)

    def run(self, ctx: JobContext, job: ForwardBackwardJob, attempt: Attempt) -> ForwardBackwardResult:
        single_process(ctx, self.name)
        config = loss_config(job.loss_fn, job.loss_fn_config)
        spec = ctx.run_spec(job.run)
        info = ctx.backend.model_info(spec.base_model)
        check_datums(job.datums, job.loss_fn, vocab_size=info.vocab_size, max_positions=info.max_positions)
        with ctx.locked(job.run, job.timeout_s), ctx.device():
            _, version = activate_newest(ctx, spec)
            backward = not job.forward_only and job.job_id not in ctx.backend.gradient_jobs()
            if not job.forward_only and not backward:
                log.warning("forward_backward.repeated run=%s job_id=%s: its gradients are already held; "
                            "answered with a forward pass, nothing added", job.run, job.job_id)
            logprobs, loss = _forward(ctx, job, config, info.pad_id, backward=backward)
            if backward:
                ctx.backend.hold_gradients(job.job_id)
            held = ctx.backend.gradient_jobs()
        log.info("forward_backward.held run=%s version=%d gradients_of=%s", job.run, version, held)
        return ForwardBackwardResult(job_id=job.job_id, run=job.run,
                                     loss_fn_outputs=[{"logprobs": lp} for lp in logprobs],
                                     metrics={"loss:sum": loss})

    def log_end(self, result: ForwardBackwardResult, attempt: Attempt) -> None:
        log.info("forward_backward.end run=%s job_id=%s datums=%d duration_s=%.3f loss_sum=%.5f",
                 result.run, result.job_id, len(result.loss_fn_outputs), time.perf_counter() - attempt.started,
                 result.metrics.get("loss:sum", 0.0))


def accumulate(ctx: JobContext, job: ForwardBackwardJob, spec: RunSpec) -> None:
    """Add `job`'s gradients to those the active adapter holds, and hold its id with them: an
    optim_step's recompute of a forward_backward whose gradients the trainer lost (optim_step.py)."""
    config = loss_config(job.loss_fn, job.loss_fn_config)
    _forward(ctx, job, config, ctx.backend.model_info(spec.base_model).pad_id, backward=True)
    ctx.backend.hold_gradients(job.job_id)


def _forward(ctx: JobContext, job: ForwardBackwardJob, config: dict[str, float], pad_id: int, *,
             backward: bool) -> tuple[list[list[float]], float]:
    """Each datum's target log-probabilities and the job's summed loss; with `backward`, its
    gradient added to the parameters' (one backward pass per micro-batch)."""
    lengths = [len(d.tokens) for d in job.datums]
    logprobs: list[list[float]] = [[] for _ in job.datums]
    total = 0.0
    for indices in pack([n + 1 for n in lengths], ctx.settings.backend.micro_batch_tokens):
        mb = tinker_batch(job.datums, indices, pad_id).to(ctx.backend.device)
        with torch.set_grad_enabled(backward):
            rows = ctx.backend.forward(mb).logprobs
            losses = []
            for row, i in enumerate(indices):
                inputs = {name: torch.tensor(values, dtype=torch.float32, device=rows.device)
                          for name, values in job.datums[i].inputs.items() if name != "target_tokens"}
                losses.append(datum_loss(job.loss_fn, rows[row, : lengths[i]], inputs, config))
            loss = torch.stack(losses).sum()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise TrainStepFailed(f"the {job.loss_fn} loss is {value} on datums {list(indices)}; "
                                  "nothing of the job is kept")
        if backward:
            loss.backward()  # type: ignore[no-untyped-call]
        total += value
        for row, i in enumerate(indices):
            logprobs[i] = rows[row, : lengths[i]].detach().float().cpu().tolist()
    return logprobs, total


def tinker_batch(datums: Sequence[Datum], indices: Sequence[int], pad_id: int) -> MicroBatch:
    """The datums `indices` as one right-padded micro-batch whose column i predicts `target_tokens[i]`.

    The backend's forward drops the last position's logits (it predicts past a completion's end),
    so each row carries one padding token past its tokens: the logits of every real position are
    kept, and the causal model's outputs there do not depend on what follows.
    """
    chosen = [datums[i] for i in indices]
    width = max(len(d.tokens) for d in chosen) + 1
    rows = len(chosen)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    targets = torch.zeros((rows, width - 1), dtype=torch.long)
    mask = torch.zeros((rows, width - 1), dtype=torch.float32)
    for row, d in enumerate(chosen):
        n = len(d.tokens)
        input_ids[row, :n] = torch.tensor(d.tokens, dtype=torch.long)
        attention_mask[row, :n] = 1
        targets[row, :n] = torch.tensor([int(t) for t in d.inputs["target_tokens"]], dtype=torch.long)
        mask[row, :n] = 1.0
    return MicroBatch(
        input_ids=input_ids, attention_mask=attention_mask, start=0, targets=targets, mask=mask,
        rollout_logprobs=torch.zeros((rows, width - 1), dtype=torch.float32),
        advantages=torch.zeros(rows, dtype=torch.float32), temperatures=torch.ones(rows, dtype=torch.float32),
        indices=tuple(indices),
    )
