"""The inference controller's sections: the controller that follows the event stream and loads
adapters (`TANDEM_CONTROLLER__*`), and this service as one replica among others, its name and
heartbeat (`TANDEM_REPLICA__*`)."""

from __future__ import annotations

import socket

from pydantic import BaseModel, Field

from tandem.settings.section import SECTION


class ControllerSettings(BaseModel):
    """The inference controller that follows the event stream and loads adapters."""

    model_config = SECTION

    consumer: str = "inference"
    """Name of the controller's cursor on the event stream; each replica keeps its own, `<consumer>:<replica.id>`."""
    keep_versions: int = Field(2, ge=1, le=64)
    """How many newest versions per run stay loaded (older ones are unloaded when idle)."""
    block_ms: int = Field(1000, ge=1, le=60000)
    """How long one blocking read of the event stream waits, in milliseconds."""
    slot_wait_s: float = Field(30.0, gt=0, le=3600)
    """How long a load waits for a free engine slot (`engine.max_loaded_adapters`) while every
    loaded adapter serves a request in flight (the least recently used one is drained for it: out
    of routing, unloaded when its requests end), in seconds; past it a request that needed the load
    is answered 429 (`adapter_slots`, with Retry-After) and a newest version is tried again later."""
    run_max_loaded_adapters: int = Field(4, ge=1, le=256)
    """Most engine slots (`engine.max_loaded_adapters`) one run's adapters may take at once: its quota
    of resident adapters. Loading one more of its versions first evicts the run's own least recently
    used adapter that no request holds, never another run's; while each of them serves a request in
    flight (or waits to serve) the load waits, as for a free slot, up to `slot_wait_s`. It should be
    at least `keep_versions`, or the run's newest versions take turns in its slots."""
    check_inline: bool | None = None
    """Whether the controller checks a new version's files (paths confined, no symlinks, the
    manifest's files; it reads the manifest and adapter_config.json: about 1-2 ms on a local disk) on
    its event loop, rather than in a thread. In a thread the checks' many small system calls each wait
    to take the interpreter's lock back from the event loop, which serves the gateway's requests
    meanwhile (5.7 ms against 1.8 on a GPU host, docs/benchmarks.md); on a filesystem that can hang
    (NFS, SMB, a FUSE mount) a thread keeps the gateway answering. Unset: on the loop where the adapter
    store lies on a local filesystem (ext4, xfs, btrfs, zfs, f2fs, tmpfs, overlay), in a thread anywhere
    else. Even on the loop, a version whose event path or files lead anywhere but plainly into the
    store (a symlink, a `..` or a path outside it, another mount inside it) is checked in a thread.
    The checksums, which read every byte, always run in a thread, beside the engine's load."""
    reconcile_s: float = Field(5.0, gt=0, le=3600)
    """How often the controller reconciles with the registry and the engine, in seconds: it loads
    a registered version that was never announced, loads again what the engine lost and unloads
    adapters the engine holds that nothing routes to."""


def _host_id() -> str:
    """The host name as a replica id: its first 63 characters of letters, digits, `.`, `_`, `-`."""
    name = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "-" for c in socket.gethostname())
    return name.lstrip("._-")[:63] or "replica"


class ReplicaSettings(BaseModel):
    """This inference service as one replica among others sharing the Redis (tandem.replicas)."""

    model_config = SECTION

    id: str = Field(default_factory=lambda: _host_id(), pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                    json_schema_extra={"shown_default": "the host name"})
    """The replica's name in Redis, events (`adapter_loaded`) and responses (`x-tandem-replica`);
    by default the host name (a container's or pod's name). Unique per replica."""
    url: str | None = None
    """Where this replica's gateway answers for a router; unset: http://<host name>:<gateway.port>."""
    heartbeat_s: float = Field(2.0, gt=0, le=60)
    """How often the replica writes its heartbeat (state and versions held), in seconds."""
    ttl_s: float = Field(10.0, gt=0, le=600)
    """How long a heartbeat lasts: a replica silent this long is gone, in seconds."""
    agree_s: float = Field(10.0, gt=0, le=3600)
    """Longest a replica holding a new version waits for the other ready replicas to hold it before it
    serves it anyway, in seconds; a replica still without it then leaves rotation until it catches up."""
