"""The CPU container stack end to end: learning through the published gateway, then faults.

The tests share one stack (module scope) and run in file order: each fault test starts from
what the ones before it left (the run `digits` at version STEPS, ...).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import httpx
import pytest
from compose_stack import MODEL, ComposeStack, wait_for
from helpers.jobs import make_job
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem import Client, LoraConfig, OptimizerConfig
from tandem.dev import toy
from tandem.events import EventKind
from tandem.jobs import enqueue
from tandem.runs import LossConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# 20 steps gave a rise of +0.30..+0.49 over five runs (sampling is not seeded); 30 steps take
# ~12 s on 2 cores and leave margin above the +0.3 the test asks for.
STEPS = 30
# Where the trainer is SIGKILLed while writing a version (see write_killer.py), in order; more
# `staging` kills follow (up to MAX_KILLS in all) until one has landed before the rename.
KILL_POINTS = ("staging", "weights", "manifest")
MAX_KILLS = 5


def job_status(client: Client, job_id: str) -> JobStatus | None:
    return Job.fetch(job_id, connection=client.conn, serializer=JSONSerializer).get_status()


def serving(stack: ComposeStack, run: str) -> int:
    """The version the gateway routes `run` to, asked through the published port."""
    body = {"model": run, "messages": [{"role": "user", "content": "Count for me."}], "max_tokens": 2}
    resp = httpx.post(f"{stack.gateway_url}/v1/chat/completions", json=body, timeout=30)
    resp.raise_for_status()
    return int(resp.json()["tandem"]["version"])


def wait_finished(client: Client, job_id: str, timeout_s: float, what: str) -> None:
    """Wait until the job finished; fail at once, with rq's message, when it failed."""

    def finished() -> bool:
        job = Job.fetch(job_id, connection=client.conn, serializer=JSONSerializer)
        status = job.get_status()
        if status == JobStatus.FAILED and not job.retries_left:
            pytest.fail(f"{what} failed: {(job.exc_info or '').strip()[-2000:]}")
        return status == JobStatus.FINISHED

    wait_for(finished, timeout_s, what)


def test_reward_rises_through_the_published_gateway(stack: ComposeStack, client: Client, digits: frozenset[int]) -> None:
    run = client.create_run("digits", base_model=MODEL, lora=LoraConfig(r=8, alpha=16),
                            optimizer=OptimizerConfig(lr=5e-3), max_staleness_steps=0)
    rows = []
    t0 = time.monotonic()
    for step in range(1, STEPS + 1):
        rolled = toy.roll_out(run, digits, toy.prompts_for(step, 4))
        result = run.train(rolled.groups)
        rows.append({"step": step, "reward": rolled.mean_reward, "versions": sorted(set(rolled.versions)),
                     "version": result.version})
    wall = time.monotonic() - t0
    first = statistics.fmean(r["reward"] for r in rows[:5])
    last = statistics.fmean(r["reward"] for r in rows[-5:])
    print(f"\n{STEPS} steps in {wall:.0f} s; reward {first:.3f} -> {last:.3f}:",
          " ".join(f"{r['reward']:.2f}" for r in rows))
    assert last >= first + 0.3, [round(r["reward"], 3) for r in rows]
    for r in rows:  # synchronous: step k's rollouts were served by version k-1, the newest
        assert (r["versions"], r["version"]) == ([r["step"] - 1], r["step"])
    assert run.status()["serving_version"] == STEPS
    assert serving(stack, "digits") == STEPS


def test_killed_trainer_job_completes_once_after_start(stack: ComposeStack, client: Client) -> None:
    # 16 passes over 48 sequences of 400 tokens: ~8 s on 2 cores, long enough to kill it mid-job
    # (6 passes over 32 x 300 took 1.5 s and sometimes finished before the kill landed).
    run = client.create_run("crash", base_model=MODEL, lora=LoraConfig(r=4), loss=LossConfig(epochs=16))
    job = make_job(run="crash", step=1, seed=1, version=0, groups=6, size=8, prompt=100, completion=300)
    enqueue(client.conn, job)
    wait_for(lambda: job_status(client, job.job_id) == JobStatus.STARTED, 60, "the job to start", 0.1)
    trainer = stack.container("trainer")
    wait_for(lambda: "adapter.activate run=crash" in stack.docker("logs", trainer, stderr=True), 30,
             "training to begin", 0.1)
    time.sleep(0.5)
    stack.docker("kill", trainer)
    assert job_status(client, job.job_id) == JobStatus.STARTED
    assert client.registry.latest_version("crash") == 0
    assert stack.health("trainer").startswith("exited")  # `docker kill` is not restarted by policy

    stack.compose("start", "trainer")
    wait_finished(client, job.job_id, 180, "the killed job")
    assert [m.version for m in client.registry.manifests("crash")] == [1]
    assert client.registry.version_of_job("crash", job.job_id) == 1
    ready = [e for e in run.history() if e.kind is EventKind.ADAPTER_READY]
    assert [(e.version, e.job_id) for e in ready] == [(1, job.job_id)]
    on_disk = stack.exec("trainer", "ls", "/adapters/crash").split()
    assert on_disk == ["v000001"], on_disk  # one version, no staging directory left over
    assert "job.abandoned job_id=" + job.job_id in stack.logs_of("trainer")
    wait_for(lambda: serving(stack, "crash") == 1, 60, "inference to serve crash v1")
    stack.wait_healthy("trainer")


@dataclass
class Kill:
    """One SIGKILL of the trainer while it wrote `version`, and what it left behind."""

    version: int
    point: str
    seen: str
    ms_after_staging: float | None
    staging_left: list[str]
    """Files of the staging directory (`.tmp-v<version>-*/...`) still there after the kill."""
    published: bool
    registered: bool
    recovered_s: float = 0.0

    @property
    def landed(self) -> str:
        if self.staging_left and not self.published:
            return "mid-write"
        if self.published and not self.registered:
            return "after rename"
        return "after register"


def store_listing(stack: ComposeStack, run: str) -> list[str]:
    """Every path under the run's directory of the adapter volume, read by the inference side."""
    out = stack.exec("inference", "find", f"/adapters/{run}", "-mindepth", "1", "-printf", "%P\\n")
    return sorted(out.split())


def kill_while_writing(stack: ComposeStack, client: Client, run: str, version: int, point: str) -> Kill:
    """Train `version`, SIGKILL the trainer at `point` of its write, then let it recover."""
    restarts = stack.restart_count("trainer")
    killer = stack.probe("trainer", "write_killer.py", "/adapters", run, str(version), point)
    try:
        assert killer.line(60) == "ready"
        job = make_job(run=run, step=version, seed=version, version=version - 1)
        enqueue(client.conn, job)
        report = killer.json_line(120)
        killer.proc.wait(60)  # the container exits with the trainer, ending the killer too
    finally:
        killer.stop()
    t0 = time.monotonic()
    # Seen before the trainer is back: it waits for its dead predecessor's liveness key (8 s)
    # before it recovers anything, so what the kill left is still there.
    listing = store_listing(stack, run)
    staged = f".tmp-v{version:06d}-"
    kill = Kill(version=version, point=point, seen=report["seen"], ms_after_staging=report["ms_after_staging"],
                staging_left=[p for p in listing if p.startswith(staged)],
                published=f"v{version:06d}" in listing,
                registered=client.registry.latest_version(run) == version)
    assert not (kill.staging_left and kill.published), listing
    if kill.landed == "mid-write":
        assert job_status(client, job.job_id) == JobStatus.STARTED
        assert client.registry.latest_version(run) == version - 1

    wait_for(lambda: stack.restart_count("trainer") > restarts, 60, "the restart policy to start the trainer again")
    wait_finished(client, job.job_id, 180, f"the job of {run} v{version} after the kill")
    kill.recovered_s = time.monotonic() - t0
    # Exactly one new version, made by this job, announced once; nothing left in staging.
    assert [m.version for m in client.registry.manifests(run)] == list(range(1, version + 1))
    assert client.registry.version_of_job(run, job.job_id) == version
    ready = [e for e in client.events.history(run=run, count=10_000)
             if e.kind is EventKind.ADAPTER_READY and e.version == version]
    assert [e.job_id for e in ready] == [job.job_id]
    top = sorted({p.split("/")[0] for p in store_listing(stack, run)})
    assert top == [f"v{v:06d}" for v in range(1, version + 1)], top
    return kill


def test_crash_while_writing_an_adapter_never_shows_a_partial_version(stack: ComposeStack, client: Client) -> None:
    """SIGKILL the trainer during the write of a version, at several points, while a watcher in
    the inference container verifies every version the store, the registry or the gateway shows."""
    client.create_run("torn", base_model=MODEL, lora=LoraConfig(r=16))
    watcher = stack.probe("inference", "store_watcher.py", "/adapters", "http://127.0.0.1:8000")
    kills: list[Kill] = []
    try:
        assert watcher.line(60) == "ready"
        # A canary that the watcher must flag: a version directory whose manifest names a file
        # that is not there (what a partial version would look like).
        canary = '{"run": "canary", "version": 1, "parent": 0, "step": 1, "job_id": "x", "base_model": "m", ' \
                 '"lora_rank": 1, "files": {"adapter/adapter_config.json": "00"}}'
        stack.exec("trainer", "sh", "-c", f"mkdir -p /adapters/canary/v000001 && echo '{canary}' > "
                   "/adapters/canary/v000001/manifest.json")
        points = list(KILL_POINTS)
        while points or (len(kills) < MAX_KILLS and not any(k.landed == "mid-write" for k in kills)):
            kills.append(kill_while_writing(stack, client, "torn", len(kills) + 1, points.pop(0) if points else "staging"))
        wait_for(lambda: serving(stack, "torn") == len(kills), 60, f"the gateway to serve torn v{len(kills)}")
        summary = watcher.close()
    finally:
        watcher.stop()
        stack.exec("trainer", "rm", "-rf", "/adapters/canary")
    print("\nkill point  seen       ms after staging  landed          left in staging            recovered s")
    for k in kills:
        ms = f"{k.ms_after_staging:.2f}" if k.ms_after_staging is not None else "-"
        print(f"{k.point:<11} {k.seen:<10} {ms:>16}  {k.landed:<15} {','.join(k.staging_left) or '-':<26} "
              f"{k.recovered_s:.1f}")
    print(f"watcher: {summary['passes']} passes, checks {summary['checks']}, {summary['verified']} versions verified, "
          f"staging seen {sorted(summary['staging_seen'])}")
    flagged = [(v["where"], v["run"], v["version"]) for v in summary["violations"]]
    assert flagged == [("disk", "canary", 1)], summary["violations"]  # the canary, and nothing else
    assert any(k.landed == "mid-write" for k in kills), "no kill landed while the version was being written"
    for k in kills:
        if k.landed == "mid-write":  # the watcher saw the leftover too, and never a partial v<N>
            assert any(name.startswith(f"torn/.tmp-v{k.version:06d}-") for name in summary["staging_seen"])
    assert all(summary["checks"][where] > 0 for where in ("disk", "registry", "gateway")), summary["checks"]
    assert "store.staging.cleaned run=torn" in stack.logs_of("trainer")
    stack.wait_healthy("trainer")


def test_restarted_inference_reconciles_and_serves_the_newest_version(stack: ComposeStack, client: Client) -> None:
    stack.compose("stop", "inference")
    # Published while the controller is down: it learns of v{STEPS+1} only from the stream and the registry.
    job = make_job(run="digits", step=STEPS + 1, seed=STEPS + 1, version=STEPS)
    enqueue(client.conn, job)
    wait_finished(client, job.job_id, 120, f"the job of v{STEPS + 1}")
    assert client.registry.latest_version("digits") == STEPS + 1
    stack.compose("start", "inference")
    stack.wait_healthy("inference", timeout_s=180)
    wait_for(lambda: serving(stack, "digits") == STEPS + 1, 60, f"the gateway to serve digits v{STEPS + 1}")
    assert serving(stack, "crash") == 1
    assert client.registry.serving("digits") == STEPS + 1


def test_restarted_redis_keeps_the_registry_and_queued_jobs(stack: ComposeStack, client: Client) -> None:
    stack.compose("stop", "trainer")  # warm shutdown: nobody takes the job before Redis restarts
    job = make_job(run="digits", step=STEPS + 2, seed=STEPS + 2, version=STEPS + 1)
    enqueue(client.conn, job)
    assert job_status(client, job.job_id) == JobStatus.QUEUED
    runs_before = sorted(client.runs())
    manifests_before = [m.version for m in client.registry.manifests("digits")]

    stack.compose("restart", "redis")
    stack.wait_healthy("redis", timeout_s=60)
    wait_for(lambda: client.conn.ping(), 30, "Redis to answer the client")
    assert sorted(client.runs()) == runs_before
    assert [m.version for m in client.registry.manifests("digits")] == manifests_before
    assert job_status(client, job.job_id) == JobStatus.QUEUED
    assert client.run("digits").spec.base_model == MODEL

    stack.compose("start", "trainer")
    wait_finished(client, job.job_id, 180, "the queued job")
    assert client.registry.latest_version("digits") == STEPS + 2
    # The inference side survived the Redis restart too: it follows the stream and loads v{STEPS+2}.
    wait_for(lambda: serving(stack, "digits") == STEPS + 2, 90, f"the gateway to serve digits v{STEPS + 2}")
    stack.wait_healthy()


ADMIN_PROBE = """
import json, sys, urllib.error, urllib.request
def post(path, body, key=None):
    headers = {"Content-Type": "application/json", **({"Authorization": "Bearer " + key} if key else {})}
    req = urllib.request.Request("http://engine:30000" + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
key = sys.argv[1]
print(json.dumps([post("/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
                  post("/release_memory_occupation", {}),
                  post("/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, key),
                  post("/update_weights_from_disk", {"model_path": "/adapters"}, key)]))
"""


def process_of(stack: ComposeStack, container: str) -> tuple[str, str]:
    """The uid and command line of a container's main process (PID 1)."""
    out = stack.docker("exec", container, "sh", "-c", "awk '/^Uid:/ {print $2}' /proc/1/status; tr '\\0' ' ' < /proc/1/cmdline")
    uid, cmdline = out.split("\n", 1)
    return uid.strip(), cmdline


def test_nothing_is_open_by_default(stack: ComposeStack) -> None:
    # Redis runs as the redis user, its passwords on no command line (`ps` on the host shows those).
    uid, cmdline = process_of(stack, stack.container("redis"))
    assert uid != "0" and "redis-server" in cmdline and stack.redis_password not in cmdline, (uid, cmdline)
    assert not [name for name, password in stack.role_passwords.items() if password in cmdline], cmdline
    # each role's user has its rules, and the client's may not read what Redis keeps secret
    assert "+@connection" in stack.docker("exec", stack.container("redis"), "redis-cli", "ACL", "GETUSER", "tandem-client")
    refused = stack.docker("exec", "-e", f"REDISCLI_AUTH={stack.role_passwords['REDIS_CLIENT_PASSWORD']}",
                           stack.container("redis"), "sh", "-c",
                           "redis-cli --user tandem-client CONFIG GET requirepass 2>&1 || true")
    assert "NOPERM" in refused and stack.redis_password not in refused, refused
    # the engine holds no Redis credential at all
    assert "TANDEM_REDIS__" not in stack.docker("exec", stack.container("engine"), "env")
    # An image that starts as root, as the official one does, drops to redis the same way.
    root_run = stack.compose("run", "-d", "--no-deps", "-u", "0", "redis", "--dir", "/tmp", "--appendonly", "no")
    one_off = root_run.stdout.strip().splitlines()[-1]
    try:
        wait_for(lambda: "PONG" in stack.docker("exec", one_off, "redis-cli", "ping"), 30, "the root-started Redis")
        uid, cmdline = process_of(stack, one_off)
        assert uid != "0" and stack.redis_password not in cmdline, (uid, cmdline)
        assert "NOAUTH" in stack.docker("exec", "-e", "REDISCLI_AUTH=", one_off, "redis-cli", "ping")
    finally:
        stack.docker("rm", "-f", one_off)

    # The engine's admin routes need the admin key, also from inside the compose network, and
    # even with it read only from the adapter volume (adapters) and /models (weights).
    replies = [tuple(r) for r in json.loads(stack.exec("trainer", "python", "-c", ADMIN_PROBE, stack.engine_admin_key))]
    assert [code for code, _ in replies] == [401, 401, 400, 400], replies
    assert "'/etc' is outside" in replies[2][1] and "/adapters" in replies[2][1]
    assert "'/adapters' is outside" in replies[3][1] and "/models" in replies[3][1]

    # Published beyond loopback without GATEWAY_API_KEY, the inference service refuses to start.
    refused = stack.compose("run", "--rm", "--no-deps", "-e", "TANDEM_GATEWAY__PUBLISHED_HOST=0.0.0.0",
                            "inference", check=False, timeout_s=120)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "TANDEM_GATEWAY__ALLOW_UNAUTHENTICATED" in refused.stdout + refused.stderr

    # rq-dashboard: an image built once, an unprivileged user, the Redis URL not on its command line.
    stack.compose("--profile", "monitoring", "up", "-d", "rq-dashboard", timeout_s=300)
    wait_for(lambda: httpx.get(stack.dashboard_url, timeout=3).status_code == 200, 60, "rq-dashboard to answer")
    uid, cmdline = process_of(stack, stack.container("rq-dashboard"))
    assert uid != "0" and "rq-dashboard" in cmdline and stack.redis_password not in cmdline, (uid, cmdline)
    assert "trainer" in httpx.get(f"{stack.dashboard_url}/0/data/workers.json", timeout=10).text
