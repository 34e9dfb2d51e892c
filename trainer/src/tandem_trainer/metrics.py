"""The trainer's Prometheus metrics, and the `/metrics` endpoint that serves them.

The worker is an rq `SimpleWorker` (worker.py): every job runs in the process that started it,
so one registry, filled by the jobs and served from a thread of the same process, sees every
job; no multiprocess mode is needed. With data-parallel ranks only rank 0 serves the queue,
and only it serves `/metrics`: what it records is the whole group's step.

Per run, the last step's numbers are gauges (loss, KL, entropy, clip fraction, gradient norm,
reward, tokens/s, micro-batches, staleness of the rollouts, the version published); durations
are histograms; outcomes are counters. Queue depth, the GPU's memory and the resident runs
(backends/resident.py: how each switch of run found its state, evictions, what is kept where)
are read at each scrape. `tandem_trainer_last_step_timestamp_seconds` is what a "trainer stuck"
alert compares with `time()`; `tandem_trainer_start_time_seconds` changes at each restart, which
a "trainer crash-looping" alert counts (each restart also resets the last step's time to the start).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem_trainer.errors import TrainerConfigError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tandem.settings import TrainerMetricsSettings
    from tandem_trainer.backends.resident import ResidentStats

log = logging.getLogger(__name__)

#: Buckets of the stage histograms, in seconds: a tiny model's step on the CPU to a large one's on GPUs.
STAGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)

#: The manifest's metric (jobs/train.py) behind each per-run gauge.
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "loss": ("tandem_trainer_loss", "GRPO loss of the run's last step (per trained token)."),
    "entropy": ("tandem_trainer_entropy", "Mean entropy of the policy on the trained tokens of the last step, in nats."),
    "clip_frac": ("tandem_trainer_clip_fraction", "Share of the last step's trained tokens whose ratio was clipped."),
    "grad_norm": ("tandem_trainer_grad_norm", "Gradient norm of the last step, before clipping."),
    "reward_mean": ("tandem_trainer_reward_mean", "Mean reward of the last step's trajectories."),
    "reward_std": ("tandem_trainer_reward_std", "Standard deviation of the last step's rewards."),
    "microbatches": ("tandem_trainer_microbatches", "Micro-batches of the last step."),
    "staleness_max": ("tandem_trainer_rollout_staleness_steps",
                      "Versions between the oldest rollout of the last step and the version it trained from."),
}


class TrainerMetrics:
    """Prometheus metrics of the trainer, in a registry the caller owns (one per process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.step = {key: Gauge(name, doc, ["run"], registry=r) for key, (name, doc) in STEP_GAUGES.items()}
        self.kl = Gauge("tandem_trainer_kl", "KL estimate (k3) of the last step, per trained token: to the "
                        "rollout policy (`against=rollout`) and to the reference model (`against=reference`, "
                        "when the run has a KL penalty).", ["run", "against"], registry=r)
        self.tokens_per_second = Gauge("tandem_trainer_tokens_per_second",
                                       "Trained tokens per second of the last step's training stage.", ["run"],
                                       registry=r)
        self.tokens = Counter("tandem_trainer_tokens", "Trained (unmasked completion) tokens.", ["run"], registry=r)
        self.version = Gauge("tandem_trainer_published_version", "Newest version the trainer published per run.",
                             ["run"], registry=r)
        self.steps = Counter("tandem_trainer_steps", "Optimizer steps published (one per job that trained).",
                             ["run"], registry=r)
        self.last_step = Gauge("tandem_trainer_last_step_timestamp_seconds",
                               "Unix time the last job of this trainer published its version (the trainer's "
                               "start until then).", registry=r)
        self.started = Gauge("tandem_trainer_start_time_seconds",
                             "Unix time this trainer process started (set up its metrics): a new value is a "
                             "restart.", registry=r)
        self.started.set(time.time())
        self.last_step.set(time.time())  # "no step for 15 min" counts from the start, not from 1970
        self.stage_seconds = Histogram("tandem_trainer_stage_seconds",
                                       "Time of one stage of a job: `train` (the step on the device), `publish` "
                                       "(write, register, announce, fsync), `state` (the optimizer state).",
                                       ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.job_seconds = Histogram("tandem_trainer_job_seconds", "Time of one train job, start to result.",
                                     buckets=STAGE_BUCKETS, registry=r)
        self.lease_wait_seconds = Histogram("tandem_trainer_gpu_lease_wait_seconds",
                                            "Time a job waited for the GPU lease (shared mode).",
                                            buckets=STAGE_BUCKETS, registry=r)
        self.jobs = Counter("tandem_trainer_jobs", "Train jobs by outcome: `finished`, `retried` (failed, to be "
                            "run again), `failed` (failed for good).", ["outcome"], registry=r)
        for outcome in ("finished", "retried", "failed"):
            self.jobs.labels(outcome)
        self.in_progress = Gauge("tandem_trainer_job_in_progress", "1 while a train job runs.", registry=r)
        self.tracker_errors = Counter("tandem_trainer_tracker_errors",
                                      "Steps the experiment tracker could not record.", registry=r)
        self.tracker_dropped = Counter("tandem_trainer_tracker_dropped",
                                       "Steps never handed to the experiment tracker: its queue was full (the "
                                       "tracker is behind or hangs), or the trainer stopped before it emptied.",
                                       registry=r)
        self.store_removals = Counter("tandem_trainer_store_removals",
                                      "Directories the trainer removed from the adapter store: `version` (retired "
                                      "by retention.keep_versions), `run` (a deleted run's).", ["what"], registry=r)
        for what in ("version", "run"):
            self.store_removals.labels(what)
        self.queue_depth = Gauge("tandem_trainer_queue_depth", "Train jobs waiting in the queue.", registry=r)
        self.queue_depth.set_function(lambda: math.nan)
        r.register(CudaMemory())
        self._resident = ResidentRuns()
        r.register(self._resident)

    def watch_queue(self, depth: Callable[[], int]) -> None:
        """Read the queue's depth with `depth` at every scrape (NaN while Redis does not answer)."""
        def read() -> float:
            try:
                return float(depth())
            except Exception:  # noqa: BLE001 - a scrape must answer while Redis is away
                return math.nan
        self.queue_depth.set_function(read)

    def watch_resident(self, read: Callable[[], ResidentStats | None]) -> None:
        """Read the backend's resident runs with `read` at every scrape (None: it keeps none)."""
        self._resident.read = read

    def record_step(self, run: str, version: int, metrics: Mapping[str, float]) -> None:
        """The numbers of a step that published `version` of `run` (the manifest's metrics)."""
        for key, gauge in self.step.items():
            if key in metrics:
                gauge.labels(run).set(metrics[key])
        if "approx_kl" in metrics:
            self.kl.labels(run, "rollout").set(metrics["approx_kl"])
        if "ref_kl" in metrics:
            self.kl.labels(run, "reference").set(metrics["ref_kl"])
        tokens, train_s = metrics.get("tokens", 0.0), metrics.get("train_s", 0.0)
        self.tokens.labels(run).inc(tokens)
        if train_s > 0:
            self.tokens_per_second.labels(run).set(tokens / train_s)
            self.stage_seconds.labels("train").observe(train_s)
        if "gpu_wait_s" in metrics:
            self.lease_wait_seconds.observe(metrics["gpu_wait_s"])
        self.version.labels(run).set(version)
        self.steps.labels(run).inc()
        self.last_step.set(time.time())


class CudaMemory(Collector):
    """`tandem_trainer_gpu_memory_bytes`, read from torch at each scrape; absent until CUDA is in use."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        torch = sys.modules.get("torch")  # never imported (nor CUDA started) for a scrape's sake
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return []
        family = GaugeMetricFamily("tandem_trainer_gpu_memory_bytes",
                                   "GPU memory of the trainer's device (rank 0's with several ranks): `allocated` "
                                   "by tensors, `reserved` by torch's caching allocator, `peak` allocated since start.",
                                   labels=["device", "kind"])
        index = torch.cuda.current_device()
        device = str(index)
        family.add_metric([device, "allocated"], float(torch.cuda.memory_allocated(index)))
        family.add_metric([device, "reserved"], float(torch.cuda.memory_reserved(index)))
        family.add_metric([device, "peak"], float(torch.cuda.max_memory_allocated(index)))
        return [family]


class ResidentRuns(Collector):
    """`tandem_trainer_resident_*`, read from the backend at each scrape; absent until watched."""

    def __init__(self) -> None:
        self.read: Callable[[], ResidentStats | None] = lambda: None

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.read()
        if stats is None:
            return []
        switches = CounterMetricFamily(
            "tandem_trainer_resident_switches", "Switches of the training run by how its state was found: `hit` "
            "(kept on the device), `spill` (kept in host memory, copied back), `miss` (read from the store), "
            "`fresh` (version 0, nothing to find).", labels=["outcome"])
        for outcome, count in stats.switches.items():
            switches.add_metric([outcome], float(count))
        evictions = CounterMetricFamily("tandem_trainer_resident_evictions",
                                        "Runs forgotten to stay within the resident bounds (their state is in the "
                                        "store).", value=float(stats.evicted))
        spills = CounterMetricFamily("tandem_trainer_resident_spills",
                                     "Runs moved from the GPU to pinned host memory.", value=float(stats.spilled))
        runs = GaugeMetricFamily("tandem_trainer_resident_runs",
                                 "Runs kept in memory besides the training one, by place (`device`, `host`).",
                                 labels=["place"])
        nbytes = GaugeMetricFamily("tandem_trainer_resident_bytes",
                                   "Bytes of the runs kept in memory besides the training one, by place.",
                                   labels=["place"])
        for place in ("device", "host"):
            runs.add_metric([place], float(stats.runs.get(place, 0)))
            nbytes.add_metric([place], float(stats.nbytes.get(place, 0)))
        return [switches, evictions, spills, runs, nbytes]


def serve_metrics(metrics: TrainerMetrics, settings: TrainerMetricsSettings) -> WSGIServer | None:
    """Serve `/metrics` on `settings.host:port` from a daemon thread; None when turned off."""
    if not settings.enabled:
        return None
    try:
        server, _thread = start_http_server(settings.port, addr=settings.host, registry=metrics.registry)
    except OSError as exc:
        raise TrainerConfigError(
            f"cannot serve the trainer's /metrics on {settings.host}:{settings.port} ({exc}); set "
            "TANDEM_METRICS__PORT to a free port, or TANDEM_METRICS__ENABLED=false"
        ) from exc
    log.info("metrics.listening url=http://%s:%d/metrics", settings.host, server.server_port)
    return server
