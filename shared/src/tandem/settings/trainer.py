"""The trainer's sections: how it runs the model (`backend`), its `/metrics` endpoint, the tracker
it logs learning curves to, and data-parallel training over ranks and nodes (`parallel`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from tandem.settings.gpus import GpuSettings
from tandem.settings.section import SECTION


class TrainerBackendSettings(BaseModel):
    """How the trainer runs the model."""

    model_config = SECTION

    kind: Literal["auto", "peft", "unsloth"] = "auto"
    """`auto` picks Unsloth when it imports and CUDA is there, else peft."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one micro-batch (padded tokens); larger batches accumulate gradients."""
    gradient_checkpointing: bool = True
    """Recompute activations in backward on CUDA (less memory, ~30% more compute); ignored on CPU."""
    step_breakdown: bool = False
    """Time each stage of a training step (the order to the other ranks, packing, forward and
    backward of each micro-batch, the ranks' settle, the gradient all-reduce, the optimizer, staging
    the adapter) with a device synchronise around each, into each version's metrics as
    `stage_<name>_s`. The synchronises cost time of their own: for measuring, not for training."""
    adapter_dtype: Literal["float32", "auto", "bfloat16", "float16"] = "auto"
    """Dtype of the published adapter weights, the bytes on the path to serving. `auto` is the
    trainer's compute dtype: bfloat16 on GPUs that have it (engines serve in it anyway), float32
    on the CPU. A narrower adapter halves the bytes to copy, write, check and load; the float32
    master weights then go into the version's trainer state, so resuming loses no precision."""
    gather_adapter_copy: bool = True
    """Copy the adapter to host memory in one transfer where it is cast: its matrices concatenated
    and cast on the device first, instead of one cast and one copy a matrix (matrices already in
    the adapter's dtype are copied one a tensor either way). With plain PyTorch tensors on an H200
    it took 0.62-0.80 x the time of the copy (float32 matrices, 0.5B and 8B shapes); in the Unsloth
    trainer at 0.5B the suite's copy stage read 4.5 ms p50 against 5.4 without it, and optimizer
    step -> first response 95.0 against 99.2 (2 x H200, 2026-11-30; docs/benchmarks.md)."""
    blank_adapter_file: bool = True
    """Write each version's weights over a blank: a file of zeros (no name, never seen in the store)
    that the trainer writes after a publish, off the path, while the next step trains. Writing
    over pages that already exist skips the page cache's and the filesystem's allocation: the
    suite's write of an 8B rank-16 adapter went from 38.7 to 29.4 ms p50 (2 x H200, 2026-11-30;
    no gain at 0.5B there; docs/benchmarks.md). Where the store's filesystem cannot make unnamed
    files (`O_TMPFILE`), versions go into new files as before."""
    resident_runs: int | None = Field(None, ge=1, le=4096)
    """Runs whose LoRA weights (in the dtype they train in) and optimizer state the trainer keeps in
    memory, the run training now included, so that a job of one of them starts without reading its
    version from the store; past the bound the least recently trained run is forgotten (its state
    is in the store). 1: only the run training now (every switch of run reads the store). Unset:
    4 on the CPU; on CUDA no count of its own (`resident_device_bytes` and `resident_host_bytes`
    bound it)."""
    resident_device_bytes: int | None = Field(None, ge=0)
    """Bytes of GPU memory that resident runs other than the training one may hold; past it the
    least recent are spilled to pinned host memory. Unset: a fifth of the GPU's free memory
    (`torch.cuda.mem_get_info`, what neither torch's allocator nor another process holds) when the
    first run is set aside; 0 in shared mode when the engine frees memory for each job
    (`gpus.release_tags` not empty: the free memory is inference's, lent for the job). Ignored on
    the CPU."""
    resident_host_bytes: int | None = Field(None, ge=0)
    """Bytes of host memory (pinned on CUDA) that resident runs may hold: those spilled from the
    GPU, or every one on the CPU; past it the least recent are forgotten. Unset: a fifth of the
    host's available memory (MemAvailable, or the cgroup's limit less its usage when lower) when
    the first run is set aside."""


class TrainerMetricsSettings(BaseModel):
    """The trainer's Prometheus endpoint (`GET /metrics`), served by the process that runs the jobs."""

    model_config = SECTION

    enabled: bool = True
    """Serve `/metrics`; off: the trainer listens on no port at all."""
    host: str = "127.0.0.1"
    """Address `/metrics` binds to: loopback by default; the container stacks set `0.0.0.0`, their
    private network, and never publish the port."""
    port: int = Field(9310, ge=1, le=65535)
    """Port of `/metrics`."""


class TrackerSettings(BaseModel):
    """Where the trainer logs each run's learning curve, one tracker run per tandem run."""

    model_config = SECTION

    kind: Literal["none", "mlflow", "wandb"] = "none"
    """`mlflow` (needs `tandem-trainer[mlflow]`), `wandb` (needs `tandem-trainer[wandb]`) or `none`."""
    experiment: str = Field("tandem", min_length=1, max_length=128)
    """MLflow experiment, or Weights & Biases project, that the runs go into."""
    mlflow_uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI: a tracking server (`http://127.0.0.1:5000`; what `tandem-trainer[mlflow]`
    talks to), or, with the full `mlflow` package installed, a database (`sqlite:///mlflow.db`,
    relative to the trainer's working directory) or a file store (`file:./mlruns`)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """Weights & Biases mode: `offline` writes the runs under `wandb_dir` only (`wandb sync` uploads
    them later); `online` sends them (needs `WANDB_API_KEY`)."""
    wandb_dir: Path = Path(".")
    """Directory Weights & Biases writes its `wandb/` folder of runs into."""


class ParallelSettings(BaseModel):
    """Data-parallel training: several trainer processes (ranks) train each job together."""

    model_config = SECTION

    ranks: int | None = Field(None, ge=1, le=64)
    """Trainer processes on this machine, started by torchrun. Unset: one per GPU of `gpus.trainer`
    in split mode, else 1. Rank 0 takes jobs from the queue and publishes; every rank trains a
    share of each job's micro-batches and the gradients are summed across ranks before the
    optimizer step (NCCL on GPUs, gloo on the CPU). Every rank needs the model in its own memory."""
    max_restarts: int = Field(100, ge=0, le=100000)
    """How often torchrun starts the ranks again after one of them failed (a job in flight fails
    with a message naming the rank); past it the trainer exits and its container's restart policy
    takes over."""
    nodes: int = Field(1, ge=1, le=256)
    """Machines (containers, pods) whose ranks train as one group: each runs `tandem-trainer` with
    the same settings and `ranks` ranks, so the group has `nodes x ranks` ranks. Above 1 the nodes
    meet at `rendezvous_endpoint` (torchrun's c10d rendezvous) instead of on loopback."""
    rendezvous_endpoint: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9.\-]*:[0-9]{1,5}$")
    """`host:port` where the nodes meet (torchrun `--rdzv-endpoint`): the node whose address this
    is hosts the rendezvous store on that port, listening on that address only; the others connect
    to it. Required when `nodes` is above 1; unset, the ranks of one machine meet on loopback."""
    rendezvous_id: str = Field("tandem-trainer", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
    """Name of the group at the rendezvous (torchrun `--rdzv-id`): the same on every node of one
    trainer, another for a second trainer that meets at the same endpoint."""
    node_address: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9.\-:]*$")
    """Host name or address by which the other nodes reach this one (torchrun `--local-addr`), and
    the address the ranks' store listens on when rank 0 is here; unset: this machine's fully
    qualified host name, which must resolve to that address here and on the other nodes."""
    rendezvous_timeout_s: int = Field(900, ge=10, le=86400)
    """How long a node waits at the rendezvous for the others, in seconds, at start, after a
    restart and after the nodes lost each other there (and, before, for the node that hosts it to
    answer); past it the node's trainer exits."""
    rendezvous_read_timeout_s: int = Field(60, ge=5, le=3600)
    """How long a node waits, in seconds, for what another node must write to the rendezvous store
    (torchrun's c10d `read_timeout`): after a round closes, for the part of a node that joined the
    round and stopped before writing it; past it this node goes back to the rendezvous. Above the
    time a node takes to write its part once the round closes (well under a second on one network)."""

    def world(self, gpus: GpuSettings) -> int:
        """How many ranks train on this machine: `ranks`, or one per trainer GPU in split mode."""
        if self.ranks is not None:
            return self.ranks
        return len(gpus.trainer) if gpus.mode == "split" else 1

    def total(self, gpus: GpuSettings) -> int:
        """How many ranks the group has, on every node together."""
        return self.world(gpus) * self.nodes

    @model_validator(mode="after")
    def _nodes_meet_somewhere(self) -> ParallelSettings:
        if self.nodes > 1 and self.rendezvous_endpoint is None:
            raise ValueError(
                f"parallel.nodes={self.nodes} but parallel.rendezvous_endpoint is unset; the nodes "
                "need a host:port to meet at (TANDEM_PARALLEL__RENDEZVOUS_ENDPOINT, e.g. trainer-0:29400)"
            )
        return self
