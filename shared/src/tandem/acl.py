"""Redis's users: one per role, each allowed only what its service does there (Redis ACL, 7.0 or newer).

    role       user              may
    client     tandem-client     read runs, versions, replicas and the event stream; create a run and
                                 count its steps; put train jobs on the rq queue and follow them
    inference  tandem-inference  follow and append to the event stream (its cursors), read the registry
                                 and write what serves, its heartbeat, episodes, the GPU lease; delete
                                 a run (its keys, its jobs still queued, its episodes: tandem.deletion)
    trainer    tandem-trainer    run the rq worker, read and write the registry, append to and read the
                                 event stream, its liveness keys and locks, the GPU lease; read the
                                 replicas' heartbeats, take a deleted run off the deleted runs
    tinker     tandem-tinker     what the client may, and its own keys (sessions, models, futures,
                                 checkpoint names: tandem:tinker:*)
    admin      default           everything: the operator and its tools (redis-cli, rq-dashboard)

No role but admin may run a command of the `@dangerous` category (FLUSHALL, CONFIG, SHUTDOWN, DEBUG,
MODULE, KEYS, CLIENT KILL, ...) or SCRIPT FLUSH, touch a key outside its patterns, or run a command
outside its lists: the client cannot append an event (a forged `adapter_ready`) nor read an
episode (the gateway serves those), and the engine gets no Redis user at all.

Each role's rules are selectors (`(~pattern +command ...)`): a command passes when one selector
allows both it and every key it names. The key patterns are built from tandem.keys, so a key that
moves takes its rule along; rq's keys are its own `rq:` ones. `tandem up` writes `user_lines()` into
its redis.conf; compose.yaml and deploy/k8s/base/redis.yaml carry the same rules (a unit test holds
them equal), with each password from the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from urllib.parse import quote, urlsplit, urlunsplit

from tandem import keys


class Role(StrEnum):
    CLIENT = "client"
    INFERENCE = "inference"
    TRAINER = "trainer"
    TINKER = "tinker"


#: The Redis user of each role.
USERS = {role: f"tandem-{role.value}" for role in Role}

#: The user of operators and their tools: Redis's own, with every permission, whose password is
#: `requirepass` (REDIS_PASSWORD).
ADMIN = "default"

#: Redis before 7.0 has no selectors: the roles' rules need 7.0 or newer.
MIN_REDIS_VERSION = (7, 0)

#: The settings that carry a Redis credential. A process of no role (an engine) starts without them,
#: and each service is given its own role's URL rather than inheriting one.
CREDENTIAL_VARIABLES = ("TANDEM_REDIS__URL", "TANDEM_REDIS__PASSWORD")

_RUN = keys.run("*")
_REPLICAS = f"~{keys.REPLICAS} ~{keys.replica('*')}"
_LEASE = f"~{keys.gpu_lease()} ~{keys.gpu_lease_bell('*')}"

#: Every role: connect, authenticate, name the connection, transactions (WATCH is per key, below).
_BASE = "+@connection -@dangerous +multi +exec +discard +unwatch"

#: rq's key of the train queue.
_RQ_QUEUE = f"rq:queue:{keys.TRAIN_QUEUE}"

#: Reading the registry: run specs, versions, what serves, the deleted runs (and watching them).
_READ_REGISTRY = (f"(%R~{keys.RUNS} %R~{keys.DELETED_RUNS} %R~{_RUN} +get +smembers +sismember +zrange +zrevrange"
                  " +zrangebyscore +hget +watch)")

#: Reading the event stream.
_READ_EVENTS = f"(%R~{keys.EVENTS} +xread +xrange +xrevrange)"

#: The GPU lease of shared mode and its bells, taken in turns by inference and the trainer.
_GPU_LEASE = f"({_LEASE} +hsetnx +hget +hset +pexpire +exists +del +lpush +ltrim +blpop)"

#: The client's rules (the Tinker service has them too).
_CLIENT = [
    _BASE,
    "+info",  # rq's check of the server's version
    _READ_REGISTRY,
    _READ_EVENTS,
    f"(%R~{keys.REPLICAS} %R~{keys.replica('*')} +smembers +mget)",
    f"(~{keys.RUNS} +sadd)",
    # SETNX, not SET: a client creates a run spec and never overwrites a key
    f"(~{_RUN} +setnx)",
    f"(~{keys.run_steps('*')} +incrby)",  # redis-py's INCR
    # rq: enqueue a job on the train queue, read its state, cancel it (to the canceled registry); read
    # the queue (a run's quota of queued jobs, tandem.job_quota)
    f"(~rq:queues ~rq:job:* ~{_RQ_QUEUE} ~rq:canceled:{keys.TRAIN_QUEUE} ~rq:deferred:{keys.TRAIN_QUEUE}"
    f" ~rq:scheduled:{keys.TRAIN_QUEUE} +hset +hget +hgetall +hmget +hexists +exists +rpush +lpush +lrem +lrange"
    " +sadd +zadd +zrem +watch)",
    "(~rq:job:* +hsetnx)",  # claim a job it gives up on before a worker starts it (tandem.jobs.claim)
    "(%R~rq:results:* +xrevrange +xrange)",  # a job's result, which the trainer writes
]

_RULES = {
    Role.CLIENT: _CLIENT,
    Role.TINKER: [
        # the client's rules (create a run, enqueue its jobs, follow them, read registry, events, replicas)
        *_CLIENT,
        f"(~{keys.TINKER}:* +get +set +del +expire +hset +hget +hgetall +hdel +hsetnx +hincrby +rpush +lrange"
        " +exists +watch)",
    ],
    Role.INFERENCE: [
        _BASE,
        _READ_REGISTRY,
        f"(~{keys.EVENTS} +xadd +xread +xrange +xrevrange)",
        f"(~{keys.cursor('*')} +get +set)",
        f"(~{keys.run_serving('*')} ~{keys.run_loaded('*')} +set)",
        # counted per load; deleting a run sets its floors (tandem.deletion)
        f"(~{keys.run_load_attempts('*')} +hincrby +hgetall +hset)",
        f"({_REPLICAS} +set +mget +del +sadd +srem +smembers)",
        f"(~{keys.episode('*')} +get +set +del +watch)",
        f"(~{keys.run_episodes('*')} +sadd +pexpire +smembers +del)",
        _GPU_LEASE,
        # deleting a run (tandem.deletion): its keys and name, whether a live trainer holds its lock,
        # its jobs on the queue (and whether one is started); never a job put on it
        f"(~{_RUN} +del)",
        f"(~{keys.RUNS} +srem)",
        f"(~{keys.DELETED_RUNS} +sadd)",
        f"(%R~{keys.trainer_alive('*')} +get)",
        f"(%R~{_RQ_QUEUE} %R~{_RQ_QUEUE}:intermediate %R~rq:wip:{keys.TRAIN_QUEUE} %R~rq:job:* +lrange +zrange"
        " +hgetall +watch)",
        f"(~{_RQ_QUEUE} +lrem)",
        f"(~rq:fair:{keys.TRAIN_QUEUE} +hdel)",  # its entry in the queue's fair turns
        "(~rq:job:* +del)",
    ],
    Role.TRAINER: [
        _BASE,
        # rq's check of the server's version and its scripts; SCAN finds the live workers' keys
        "+info +script|load +scan",
        # rq's worker: its hashes, queues, registries, results and the channel it takes commands on
        "(~rq:* &rq:pubsub:* +@hash +@list +@set +@sortedset +@string +@stream +del +unlink +exists +expire"
        " +pexpire +persist +ttl +pttl +type +watch +evalsha +eval +subscribe +unsubscribe +psubscribe"
        " +punsubscribe +publish)",
        _READ_REGISTRY,
        # a published version, the job that published it; the lock of the run it trains (its scripts)
        f"(~{keys.run_versions('*')} +zadd +zremrangebyscore)",
        f"(~{keys.run_jobs('*')} +hset)",
        f"(~{keys.run_lock('*')} +set +get +del +eval +evalsha)",
        f"(~{keys.EVENTS} +xadd +xread +xrange +xrevrange)",
        # its liveness key and the others', and the lock of the recovery of dead workers
        f"(~{keys.trainer_alive('*')} ~{keys.TRAINER_RECOVERY} +set +get +del +exists +watch)",
        _GPU_LEASE,
        # the store's upkeep (tandem_trainer.store_cleanup): what the replicas hold, the deleted runs done
        f"(%R~{keys.REPLICAS} %R~{keys.replica('*')} +smembers +mget)",
        f"(~{keys.DELETED_RUNS} +srem)",
    ],
}


def rules(role: Role) -> str:
    """The ACL rules of `role`'s user, after its password."""
    return " ".join(_RULES[role])


def user_line(role: Role, password: str) -> str:
    """One `user` line of redis.conf: `role`'s user, on, with `password` and its rules."""
    return f"user {USERS[role]} reset on >{password} {rules(role)}"


def user_lines(passwords: Mapping[Role, str]) -> list[str]:
    """The `user` lines of redis.conf for every role, each with its password from `passwords`."""
    return [user_line(role, passwords[role]) for role in Role]


def without_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the Redis credential (CREDENTIAL_VARIABLES)."""
    return {k: v for k, v in env.items() if k not in CREDENTIAL_VARIABLES}


def role_url(url: str, role: Role | None, password: str) -> str:
    """`url` (redis://host:port/db) with `role`'s user and `password`; role None: the admin's (`default`)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    user = USERS[role] if role is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))
