"""One job's optimizer step on the device, by one process or by every rank of a data-parallel group.

`train_step` is what a job does on the device: make the run's adapter at the parent version
the one that trains, pack the job's samples into micro-batches, accumulate the gradient of
the GRPO loss over them, clip and step, once per epoch. Rank 0 (or the only process) calls it
from the `train` kind (jobs/train.py) with a `StepOrder` it built; in a data-parallel group it first sends the
order to the other ranks, which run `follow`. Each rank then trains only its share of the
micro-batches, with the weights of the whole job, so that the summed gradient is the one a
single process would have: the number of ranks changes how fast a step is, not what it learns.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel

from tandem.runs import RunSpec
from tandem.settings import TrainerSettings
from tandem_trainer import failpoints
from tandem_trainer.backends.base import Backend
from tandem_trainer.backends.select import select_backend
from tandem_trainer.errors import RanksLost, TrainStepFailed
from tandem_trainer.grpo import LossStats, grpo_loss
from tandem_trainer.microbatch import MicroBatch, Sample, accumulation_weights, build_microbatches, split_budget
from tandem_trainer.parallel import Group
from tandem_trainer.stage_clock import StageClock

log = logging.getLogger(__name__)


class StepOrder(BaseModel):
    """Everything a rank needs to train one job's step (rank 0 sends it to the others as JSON)."""

    spec: RunSpec
    parent: int
    """The version the step trains from (0: a fresh adapter)."""
    version_dir: str | None
    """The parent's directory in the store (None for version 0)."""
    samples: list[Sample]
    pad_id: int
    budget: int
    """`backend.micro_batch_tokens` of rank 0."""
    entropy: bool


@dataclass(frozen=True)
class StepOutcome:
    stats: LossStats
    grad_norm: float
    tokens: int
    microbatches: int
    activate_s: float
    """Wall time of making the parent the training adapter: next to nothing when it already was, a
    swap in memory when the run was resident, a read of the store otherwise (backends/resident.py)."""


def train_step(backend: Backend, order: StepOrder, group: Group | None = None,
               clock: StageClock | None = None) -> StepOutcome:
    """Train `order` on `backend`; with a group, this rank's share, then the group's sum.

    In a group every rank raises the same `RankFailed` when any rank's share failed, and the
    group is marked broken when this rank fails anywhere else, since the ranks may then no
    longer agree on what comes next. (The optimizer step's own failure, a non-finite gradient
    norm, is alike on every rank: they all hold the same summed gradient.) `clock` times the
    stages (stage_clock.py).
    """
    try:
        return _train_step(backend, order, group, clock or StageClock())
    except TrainStepFailed:  # RankFailed, RanksLost, or the optimizer's step: alike on every rank
        raise
    except Exception:
        if group is not None:
            group.broken = True
        raise


def _train_step(backend: Backend, order: StepOrder, group: Group | None, clock: StageClock) -> StepOutcome:
    spec = order.spec
    world = group.world if group is not None else 1
    with clock.stage("pack"):
        lengths = [s.length for s in order.samples]
        budget = split_budget(lengths, order.budget, world)
        batches = build_microbatches(order.samples, budget, pad_id=order.pad_id)
        weights = accumulation_weights([mb.tokens for mb in batches])
        mine = group.share([mb.padded_tokens for mb in batches]) if group is not None else range(len(batches))
    error: str | None = None
    activating = time.perf_counter()
    try:
        with clock.stage("activate"):
            backend.activate(spec, order.parent, Path(order.version_dir) if order.version_dir else None)
    except Exception as exc:
        if group is None:
            raise
        error = _describe(exc)
    activate_s = time.perf_counter() - activating
    # gradients a run holds from Tinker's forward_backward are not this job's: a GRPO step never applies them
    backend.drop_gradients(f"a train job of run {spec.name} steps it")
    stats, grad_norms = LossStats(), []
    for _ in range(spec.loss.epochs):
        local = LossStats()
        if error is None:
            try:
                totals: list[tuple[MicroBatch, dict[str, torch.Tensor]]] = []
                for i in mine:
                    if weights[i] > 0:
                        with clock.stage("forward_backward"):
                            mb = batches[i].to(backend.device)
                            totals.append((mb, _accumulate(backend, spec, mb, weights[i], order.entropy)))
                with clock.stage("read_sums"):
                    local.add(_read(totals))  # one wait for the device per epoch, not per micro-batch
            except Exception as exc:
                if group is None:
                    raise
                error = _describe(exc)
        if group is not None:
            with clock.stage("settle"):
                local.sums = group.settle(error, local.sums)
            with clock.stage("all_reduce"):
                group.all_reduce(backend.trainable_parameters())
        stats.add(local.sums)
        with clock.stage("optimizer"):
            try:
                grad_norms.append(backend.step(spec.optimizer.max_grad_norm))
            except TrainStepFailed as exc:  # a gradient that overflowed: what of the run's spec to look at
                raise TrainStepFailed(
                    f"{exc}: the gradient overflowed (the adapter's scale lora.alpha / lora.r is "
                    f"{spec.lora.alpha / spec.lora.r:g}, optimizer.lr {spec.optimizer.lr:g}); where every step "
                    "does this, the run's spec is at fault: delete the run (`tandem delete`) and create it again "
                    "with a smaller lora.alpha or lr") from exc
    backend.synchronize()  # the step is done when the device is, not when it was queued
    return StepOutcome(stats=stats, grad_norm=grad_norms[-1], tokens=sum(mb.tokens for mb in batches),
                       microbatches=len(batches), activate_s=activate_s)


def _accumulate(backend: Backend, spec: RunSpec, mb: MicroBatch, weight: float,
                entropy: bool) -> dict[str, torch.Tensor]:
    """Forward and backward of one micro-batch, its share of the job's loss added to the gradient;
    returns its masked sums on the device (read once per epoch by `_read`)."""
    fwd = backend.forward(mb, entropy=entropy)
    ref = backend.reference_logprobs(mb) if spec.loss.kl_coef > 0 else None
    terms = grpo_loss(
        fwd.logprobs, mb.rollout_logprobs, mb.advantages, mb.mask,
        clip_low=spec.loss.clip_low, clip_high=spec.loss.clip_high,
        ref_logprobs=ref, kl_coef=spec.loss.kl_coef,
    )
    torch.autograd.backward(terms.loss * weight)
    failpoints.hit("mid_training")
    totals = dict(terms.totals)
    if fwd.entropy is not None:
        totals["entropy"] = (fwd.entropy.detach() * mb.mask).sum()
    return totals


def _read(totals: list[tuple[MicroBatch, dict[str, torch.Tensor]]]) -> dict[str, float]:
    """The micro-batches' sums as numbers, read from the device at once; a non-finite loss fails
    the step naming the first micro-batch that had one (its gradient is already in the sum)."""
    if not totals:
        return {}
    keys = sorted({key for _, t in totals for key in t})
    table = torch.stack([torch.stack([t[key].float() if key in t else t["loss"].new_zeros(()) for key in keys])
                         for _, t in totals]).cpu()
    losses = table[:, keys.index("loss")]
    for (mb, _), value in zip(totals, losses.tolist(), strict=True):
        if not math.isfinite(value):
            raise TrainStepFailed(f"the loss is {value} on micro-batch {mb.indices}")
    return dict(zip(keys, table.double().sum(dim=0).tolist(), strict=True))


def _describe(exc: Exception) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of memory while training ({exc}); lower TANDEM_BACKEND__MICRO_BATCH_TOKENS"
    return f"{type(exc).__name__}: {exc}"


# the other ranks ------------------------------------------------------------------
def follow(settings: TrainerSettings, group: Group) -> None:
    """Ranks > 0: train each step rank 0 orders until it says stop.

    A step that failed on some rank (`RankFailed`, raised by every rank alike) or in its
    optimizer step leaves this rank waiting for the next order; anything else ends the rank,
    and with it the group, which torchrun then starts again.
    """
    backend = select_backend(settings.backend, device_index=group.device_index,
                             shared_gpu=settings.gpus.lends_memory)
    log.info("rank.follow rank=%d world=%d backend=%s", group.rank, group.world, backend.name)
    while True:
        message = group.receive()
        kind = message["kind"]
        if kind == "stop":
            log.info("rank.stop rank=%d: rank 0 stopped", group.rank)
            return
        if kind == "step":
            order = StepOrder.model_validate(message["order"])
            try:
                train_step(backend, order, group)
            except TrainStepFailed as exc:
                if isinstance(exc, RanksLost) or group.broken:
                    raise
                log.warning("rank.step_failed rank=%d run=%s: %s", group.rank, order.spec.name, exc)
                backend.invalidate()
        elif kind == "published":
            backend.mark_active(message["run"], message["version"], Path(message["version_dir"]))
        elif kind == "invalidate":
            backend.invalidate()
        elif kind == "forget_run":
            backend.forget_run(message["run"])
        else:
            raise RanksLost(f"rank {group.rank}: unknown order {kind!r} from rank 0")
