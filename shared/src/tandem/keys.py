"""Every Redis key tandem uses, built in one place under one prefix.

Keeping the layout here means a reader can see the whole Redis schema at once and an
operator can `SCAN tandem:*` to find everything tandem owns.
"""

from __future__ import annotations

PREFIX = "tandem"

#: rq queue that carries train jobs (rq adds its own `rq:queue:` prefix).
TRAIN_QUEUE = "tandem-train"

#: Redis Stream with every event (`adapter_ready`, `adapter_loaded`, ...).
EVENTS = f"{PREFIX}:events"

#: Set of run names.
RUNS = f"{PREFIX}:runs"

#: Set of deleted runs whose directories the trainer has yet to remove from the adapter store
#: (tandem.deletion); a name in it cannot be created again until the trainer has.
DELETED_RUNS = f"{PREFIX}:runs:deleted"


def run(name: str) -> str:
    """JSON of the run's spec."""
    return f"{PREFIX}:run:{name}"


def run_versions(name: str) -> str:
    """Sorted set of published versions (score = version), member = manifest JSON."""
    return f"{PREFIX}:run:{name}:versions"


def run_jobs(name: str) -> str:
    """Hash job id -> version it published (the idempotency record)."""
    return f"{PREFIX}:run:{name}:jobs"


def run_steps(name: str) -> str:
    """Counter of submitted train steps."""
    return f"{PREFIX}:run:{name}:steps"


def run_serving(name: str) -> str:
    """Version the inference side serves for the run (written by the controller)."""
    return f"{PREFIX}:run:{name}:serving"


def run_loaded(name: str) -> str:
    """JSON list of the versions the engine holds for the run (written by the controller)."""
    return f"{PREFIX}:run:{name}:loaded"


def run_load_attempts(name: str) -> str:
    """Hash version -> load attempts the controller has made, so no adapter name is reused; and
    `floor:<version>` -> the attempts made before the run was last deleted (tandem.deletion): an
    engine's adapter of a lower attempt belongs to the deleted run, never to a run of the same
    name created since. Deleting the run keeps this key."""
    return f"{PREFIX}:run:{name}:load_attempts"


def run_lock(name: str) -> str:
    """Lock held by the trainer while it trains a run, so two workers never race."""
    return f"{PREFIX}:run:{name}:lock"


def run_state(name: str) -> list[str]:
    """Every key of one run but its lock and its load attempts: what deleting the run removes
    (tandem.deletion). The load attempts outlive it, so that a run created again under the same
    name never gets an adapter name an engine was given for the deleted one."""
    return [run(name), run_versions(name), run_jobs(name), run_steps(name), run_serving(name), run_loaded(name)]


def cursor(consumer: str) -> str:
    """Last event id a consumer has handled."""
    return f"{PREFIX}:cursor:{consumer}"


def gpu_lease() -> str:
    """Lease on the shared GPU (shared mode)."""
    return f"{PREFIX}:gpu:lease"


def gpu_lease_bell(side: str) -> str:
    """A list the other side pushes to when the GPU lease changes in a way `side` waits for."""
    return f"{PREFIX}:gpu:lease:bell:{side}"


def trainer_alive(worker_name: str) -> str:
    """Short-TTL key a live trainer worker keeps refreshing; value = its instance token."""
    return f"{PREFIX}:trainer:{worker_name}:alive"


#: Lock held while one trainer requeues the jobs of dead workers.
TRAINER_RECOVERY = f"{PREFIX}:trainer:recovery"


REPLICAS = f"{PREFIX}:replicas"
"""Set of the ids of inference replicas that announced themselves (see tandem.replicas)."""


def replica(replica_id: str) -> str:
    """One inference replica's heartbeat: its state as JSON, expiring unless renewed."""
    return f"{PREFIX}:replica:{replica_id}"


def episode(episode_id: str) -> str:
    """JSON of a multi-turn episode the gateway keeps: its messages and token ids (expires)."""
    return f"{PREFIX}:episode:{episode_id}"


def run_episodes(name: str) -> str:
    """Set of the ids of a run's episodes, so that deleting the run finds them (the gateway's; it
    expires with the newest of them). Apart from the run's keys: a client reads those, never an
    episode id."""
    return f"{PREFIX}:run-episodes:{name}"


# Tinker's API (tandem_inference.tinker) ----------------------------------------------------------

#: Every key of the Tinker service starts with this.
TINKER = f"{PREFIX}:tinker"


def tinker_session(session_id: str) -> str:
    """JSON of a Tinker session (its SDK version, when it was created)."""
    return f"{TINKER}:session:{session_id}"


def tinker_model(model_id: str) -> str:
    """JSON of a Tinker model: the run it is, its session, base model and LoRA rank."""
    return f"{TINKER}:model:{model_id}"


def tinker_order(model_id: str) -> str:
    """Hash of a model's request order: the next `seq_id` to enqueue, the seq_id -> future of every
    request seen, the requests parked until their turn, the forward_backward jobs since the last
    optim_step, the last job that publishes a version."""
    return f"{TINKER}:order:{model_id}"


def tinker_future(request_id: str) -> str:
    """JSON of a future: what it waits on (an rq job, a version to serve) or its stored result."""
    return f"{TINKER}:future:{request_id}"


def tinker_checkpoints(model_id: str) -> str:
    """Hash `weights/<name>` or `sampler_weights/<name>` -> JSON {version, ...} of a model's checkpoints."""
    return f"{TINKER}:checkpoints:{model_id}"


def tinker_sampling_session(sampling_session_id: str) -> str:
    """JSON of a sampling session: the run and version (or base model) it samples."""
    return f"{TINKER}:sampling:{sampling_session_id}"


def tinker_session_futures(session_id: str) -> str:
    """List of the sampling futures of a sampling session, in the order they were created."""
    return f"{TINKER}:sampling:{session_id}:futures"
