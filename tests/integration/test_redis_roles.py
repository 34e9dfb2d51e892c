"""The Redis user of each role (tandem.acl) against a real redis-server: what each is refused.

Every role is refused the commands that take a server over or read its secrets, and the keys and
commands of the others: the client cannot append a forged `adapter_ready`, read an episode, or
touch what inference and the trainer write; inference cannot enqueue a job or publish a version;
the trainer cannot read an episode or write what serves. That each role may do what its service
does is proven by the tests that run the services as their roles (the stack of `tandem up`, the
fixtures `workers`, `servers` and `client_conn`), which fail on any refusal in Redis's ACL log.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers.redis_server import RedisServer
from redis.exceptions import NoPermissionError

from tandem import keys
from tandem.acl import USERS, Role
from tandem.connection import translated
from tandem.errors import BackendUnavailable
from tandem.events import Event, EventKind, EventStream

pytestmark = pytest.mark.integration

#: Refused to every role: commands that take the server over, read its secrets or list its keys.
EVERY_ROLE_REFUSED = [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "requirepass"), ("CONFIG", "SET", "requirepass", "x"),
    ("SHUTDOWN", "NOSAVE"), ("DEBUG", "SLEEP", "0"), ("MODULE", "LIST"), ("MODULE", "LOAD", "/tmp/x.so"),
    ("SCRIPT", "FLUSH"), ("FUNCTION", "FLUSH"), ("KEYS", "*"), ("ACL", "LIST"), ("ACL", "SETUSER", "x", "on"),
    ("CLIENT", "LIST"), ("CLIENT", "KILL", "TYPE", "normal"), ("MONITOR",), ("SAVE",), ("BGREWRITEAOF",),
    ("REPLICAOF", "127.0.0.1", "1"), ("SWAPDB", "0", "1"), ("SLOWLOG", "GET"), ("LATENCY", "RESET"),
    ("RANDOMKEY",), ("DBSIZE",), ("MIGRATE", "127.0.0.1", "1", "k", "0", "1000"),
]

#: Writes no role makes: a run spec is created once (by a client), never overwritten.
RUN_SPEC = [("SET", keys.run("victim"), "{}"), ("GET", "elsewhere")]
#: Deleting a run: inference's alone (DELETE /v1/runs/<run> on the gateway, tandem.deletion).
RUN_DELETION = [("DEL", keys.run("victim")), ("DEL", keys.run_versions("victim")), ("SREM", keys.RUNS, "victim"),
                ("SADD", keys.DELETED_RUNS, "victim")]
#: What only the trainer writes: versions, the job -> version record, run locks, its liveness keys.
TRAINERS = [("ZADD", keys.run_versions("victim"), "9", "{}"),
            ("HSET", keys.run_jobs("victim"), "job", "9"), ("SET", keys.run_lock("victim"), "x"),
            ("SET", keys.trainer_alive("trainer"), "x"), ("SUBSCRIBE", "rq:pubsub:trainer")]
#: What only inference writes: what serves, heartbeats, cursors.
INFERENCES = [("SET", keys.run_serving("victim"), "9"), ("SET", keys.replica("forged"), "{}"),
              ("SET", keys.cursor("inference"), "0-0")]
#: Episodes: the gateway's alone (clients read theirs through it).
EPISODES = [("GET", keys.episode("someone-elses")), ("SET", keys.episode("someone-elses"), "{}"),
            ("SMEMBERS", keys.run_episodes("victim"))]

#: What each role is refused besides: the others' keys and writes.
REFUSED = {
    Role.CLIENT: RUN_SPEC + RUN_DELETION + TRAINERS + INFERENCES + EPISODES + [
        ("XADD", keys.EVENTS, "*", "kind", "adapter_ready", "run", "victim", "version", "9", "ts", "1"),
        ("XTRIM", keys.EVENTS, "MAXLEN", "0"), ("DEL", keys.EVENTS), ("SCAN", "0"),
        ("INCRBY", keys.run_serving("victim"), "1"), ("SREM", keys.REPLICAS, "replica-1"),
        ("HSET", keys.gpu_lease(), "holder", "x"), ("PUBLISH", "rq:pubsub:trainer", "{}"),
        ("XADD", "rq:results:someone-elses", "*", "type", "1", "return_value", "{}"),
        ("DEL", "rq:job:someone-elses"), ("DEL", "rq:queue:tandem-train"), ("HSET", "rq:worker:trainer", "state", "busy"),
    ],
    Role.INFERENCE: RUN_SPEC + TRAINERS + [
        ("HSET", "rq:job:forged", "func_name", "os.system"), ("RPUSH", "rq:queue:tandem-train", "forged"), ("SCAN", "0"),
        ("LPUSH", "rq:queue:tandem-train", "forged"), ("DEL", "rq:queue:tandem-train"), ("SREM", keys.DELETED_RUNS, "r"),
    ],
    Role.TRAINER: RUN_SPEC + RUN_DELETION + INFERENCES + EPISODES + [("SUBSCRIBE", "elsewhere")],
}
#: The Tinker service has the client's rights and its own keys: refused what a client is.
REFUSED[Role.TINKER] = list(REFUSED[Role.CLIENT])
#: A client cannot read or forge the Tinker service's futures and sessions.
REFUSED[Role.CLIENT] = REFUSED[Role.CLIENT] + [("GET", f"{keys.TINKER}:future:someone-elses"),
                                               ("HSET", f"{keys.TINKER}:session:forged", "owner", "x")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis of its own (some refusals are asked of Redis's ACL alone, with DEBUG on), its admin's
    password set as every stack sets one."""
    server = RedisServer(tmp_path_factory.mktemp("roles"), password="admin-secret", durable=False, roles=True)
    if not server.roles:
        pytest.skip("Redis older than 7.0 has no ACL selectors, which the roles need")
    server.start()
    yield server
    server.stop()


def as_role(server: RedisServer, role: Role) -> redis.Redis:
    return redis.Redis.from_url(server.role_urls[role])


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("command", EVERY_ROLE_REFUSED, ids=lambda c: " ".join(c[:2]))
def test_no_role_may_take_the_server_over_or_read_its_secrets(server: RedisServer, role: Role,
                                                              command: tuple[str, ...]) -> None:
    with as_role(server, role) as conn:
        with pytest.raises(NoPermissionError):
            conn.execute_command(*command)
    assert server.connect().ping()  # still up: the SHUTDOWN, FLUSHALL and DEBUG above never ran
    assert server.connect().execute_command("ACL", "DRYRUN", USERS[role], *command) != b"OK"


@pytest.mark.parametrize("role", list(Role))
def test_each_role_is_refused_what_the_others_do(server: RedisServer, role: Role) -> None:
    admin = server.connect()
    admin.set(keys.episode("someone-elses"), '{"messages": ["private"]}')
    with as_role(server, role) as conn:
        for command in REFUSED[role]:
            with pytest.raises(NoPermissionError):
                conn.execute_command(*command)
            assert admin.execute_command("ACL", "DRYRUN", USERS[role], *command) != b"OK", command
    assert admin.get(keys.episode("someone-elses")) == b'{"messages": ["private"]}'


@pytest.mark.parametrize("role", list(Role))
def test_a_script_runs_with_its_callers_rights(server: RedisServer, role: Role) -> None:
    admin = server.connect()
    admin.set("kept", "1")
    with as_role(server, role) as conn, pytest.raises(redis.ResponseError, match="can't run this command|no permissions"):
        conn.eval("return redis.call('flushall')", 0)
    assert admin.get("kept") == b"1"


def test_the_client_reads_the_stream_but_cannot_forge_an_adapter_ready(server: RedisServer) -> None:
    with as_role(server, Role.TRAINER) as trainer, as_role(server, Role.CLIENT) as client:
        EventStream(trainer).append(Event(kind=EventKind.ADAPTER_READY, run="r", version=1, job_id="j"))
        assert [e.version for e in EventStream(client).history(run="r")] == [1]
        with pytest.raises(BackendUnavailable) as info:
            EventStream(client).append(Event(kind=EventKind.ADAPTER_READY, run="victim", version=9, job_id="j"))
    message = str(info.value)
    assert "refused" in message and "TANDEM_REDIS__URL" in message and "Redis roles" in message
    assert "start Redis" not in message  # it answers: starting it would not help
    assert "client-secret" not in message and server.role_passwords[Role.CLIENT] not in message


def test_the_admin_may_do_anything(server: RedisServer) -> None:
    admin = server.connect()
    assert admin.config_get("appendonly") and admin.execute_command("ACL", "DRYRUN", "default", "FLUSHALL") == b"OK"


def test_the_default_user_needs_the_admins_password(server: RedisServer, tmp_path: Path) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port, username=USERS[Role.CLIENT], password="wrong").ping()


def test_a_refused_command_names_the_roles_and_what_to_do(server: RedisServer) -> None:
    with as_role(server, Role.INFERENCE) as conn, pytest.raises(BackendUnavailable) as info:
        with translated(conn, "enqueue a job"):
            conn.rpush("rq:queue:tandem-train", "forged")
    assert "cannot enqueue a job" in str(info.value) and "its own role's URL" in str(info.value)
