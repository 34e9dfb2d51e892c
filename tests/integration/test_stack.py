"""`tandem up`'s stack of local processes: private Redis, URLs for clients, restarts, the CLI's errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tandem import Client, keys
from tandem.dev.cli import main as tandem
from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack
from tandem.dev.supervisor import Service
from tandem.errors import ConfigError, StackError
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import RedisSettings

pytestmark = pytest.mark.integration


class RedisOnly(Stack):
    """The stack's own Redis, as `tandem up` starts it, and nothing else."""

    def plan(self) -> list[Service]:
        return [s for s in super().plan() if s.name == "redis"]


class Sleepers(Stack):
    """Two services that run until killed, standing in for the real ones."""

    def plan(self) -> list[Service]:
        argv = [sys.executable, "-c", "import time; time.sleep(600)"]
        return [Service("one", argv, ready=lambda: True), Service("two", argv, ready=lambda: True)]


@pytest.fixture
def no_tandem_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A working directory of its own, and no TANDEM_* settings from the environment."""
    import os

    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_stacks_redis_has_a_password_that_stays_private(tmp_path: Path) -> None:
    state = tmp_path / "stack"
    with RedisOnly(StackConfig(state_dir=state, gateway_port=0)) as stack:
        password = stack.secrets["redis_client_password"]
        assert f"tandem-client:{password}@" in stack.redis_url  # client.env's: the client's user
        assert f":{stack.secrets['redis_password']}@" in stack.admin_redis_url
        for url in (stack.redis_url, stack.admin_redis_url, *stack.redis_urls.values()):
            assert redis.Redis.from_url(url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=stack.redis_port).ping()
        proc = stack.service("redis").proc
        assert proc is not None
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        for name, secret in stack.secrets.items():
            assert secret not in cmdline, f"{name} is on redis-server's command line"
        for private in ("secrets.json", "redis/redis.conf", "client.env"):
            assert (state / private).stat().st_mode & 0o777 == 0o600, private
        # Redis's data (every run, job and episode) and the logs: the directory is the user's alone,
        # and what the services write in it is theirs (it was 0755, the AOF and logs 0644)
        redis.Redis.from_url(stack.admin_redis_url).set("x", "y")
        assert state.stat().st_mode & 0o777 == 0o700
        written = [p for p in (state / "redis").rglob("*") if p.is_file() and p.name != "redis.conf"]
        written += list((state / "logs").glob("*.log"))
        assert written and all(p.stat().st_mode & 0o077 == 0 for p in written), [
            (str(p), oct(p.stat().st_mode)) for p in written]
        assert f"TANDEM_REDIS__URL={stack.redis_url}" in (state / "client.env").read_text()
        assert f"TANDEM_GATEWAY_URL={stack.gateway_url}" in (state / "client.env").read_text()
        assert "TANDEM_API_KEY" not in (state / "client.env").read_text()  # the gateway has no key
    again = RedisOnly(StackConfig(state_dir=state, gateway_port=0))
    assert again.secrets == stack.secrets  # kept across runs: the URL only changes with the port


@pytest.mark.parametrize("credentials", [":wrong-secret@", ""])
def test_a_wrong_or_missing_redis_password_is_config_error_not_redis_is_down(tmp_path: Path, credentials: str) -> None:
    with RedisOnly(StackConfig(state_dir=tmp_path / "stack", gateway_port=0)) as stack:
        url = f"redis://{credentials}127.0.0.1:{stack.redis_port}/0"
        with pytest.raises(ConfigError) as info:
            RedisSettings(url=url).connect()
    message = str(info.value)
    assert "answers but refuses these credentials" in message and "TANDEM_REDIS__PASSWORD" in message
    assert "wrong-secret" not in message and "does not answer" not in message


class RedisUp(RedisOnly):
    """`tandem up` with only its Redis, which stops once it has said where everything is."""

    def supervise(self, should_stop: Callable[[], bool], poll_s: float = 0.2) -> None:
        return None


def test_tandem_up_does_not_print_the_redis_password(
    no_tandem_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tandem.dev.stack.Stack", RedisUp)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert tandem(["up", "--model", "unused", "--gateway-port", "0"]) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out = capsys.readouterr().out
    for password in json.loads((no_tandem_env / ".tandem" / "stack" / "secrets.json").read_text()).values():
        assert password not in out
    assert "redis://tandem-client:***@127.0.0.1:" in out and ".tandem/stack/client.env" in out


def test_every_service_gets_the_engine_admin_key(tmp_path: Path) -> None:
    stack = RedisOnly(StackConfig(state_dir=tmp_path))
    key = stack.secrets["engine_admin_key"]
    assert len(key) >= 32 and stack.env()["TANDEM_ENGINE__ADMIN_API_KEY"] == key


@pytest.mark.parametrize("what", ["gateway", "redis", "tinker"])
def test_a_port_in_use_is_named_before_anything_starts(tmp_path: Path, what: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        stack = RedisOnly(StackConfig(state_dir=tmp_path, **{"gateway_port": 0, f"{what}_port": port}))
        with pytest.raises(ConfigError, match=f"{what} port {port} is in use.*--{what}-port 0"):
            stack.start()
        assert stack.services == []


def test_a_second_stack_on_a_state_directory_in_use_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    """Two stacks on one directory would share its Redis config and client.env: the second rewrote
    them, and the first's Redis, restarted, came back on the second's port."""
    with RedisOnly(StackConfig(state_dir=tmp_path, gateway_port=0)) as first:
        conf, env = (tmp_path / "redis" / "redis.conf").read_text(), (tmp_path / "client.env").read_text()
        second = RedisOnly(StackConfig(state_dir=tmp_path, gateway_port=0))
        with pytest.raises(ConfigError) as info:
            second.start()
        message = str(info.value)
        assert str(tmp_path) in message and f"pid {os.getpid()}" in message and "--state-dir" in message
        assert second.services == []
        assert (tmp_path / "redis" / "redis.conf").read_text() == conf and (tmp_path / "client.env").read_text() == env
        assert redis.Redis.from_url(first.redis_url).ping()
    with RedisOnly(StackConfig(state_dir=tmp_path, gateway_port=0)) as again:  # stopped: the directory is free
        assert redis.Redis.from_url(again.redis_url).ping()


def test_client_env_carries_the_gateways_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tandem delete --state-dir` of a stack whose gateway has a key got a 401: client.env had the
    URLs only (test_run_deletion: the CLI reads it)."""
    monkeypatch.setenv("TANDEM_GATEWAY__API_KEY", "k-0123456789")
    with RedisOnly(StackConfig(state_dir=tmp_path, gateway_port=0)):
        env = (tmp_path / "client.env").read_text()
        assert "TANDEM_API_KEY=k-0123456789\n" in env and (tmp_path / "client.env").stat().st_mode & 0o777 == 0o600


def test_tandem_up_on_a_state_directory_in_use_is_refused_before_it_builds_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny model's build took its time (imports, weights) before the second `tandem up` was told
    that the directory is taken."""
    monkeypatch.chdir(tmp_path)  # the tiny model's default path is relative: .tandem/models/tiny
    state = tmp_path / "state"
    with RedisOnly(StackConfig(state_dir=state, gateway_port=0)):
        assert tandem(["up", "--state-dir", str(state), "--gateway-port", "0"]) == 1
        assert f"the state directory {state} is in use by another stack (pid {os.getpid()})" in capsys.readouterr().err
        assert not (tmp_path / ".tandem" / "models").exists()


def test_a_stack_that_fails_to_start_frees_its_state_directory(tmp_path: Path) -> None:
    class Failing(Stack):
        def plan(self) -> list[Service]:
            return [Service("dies", [sys.executable, "-c", "raise SystemExit(3)"], ready=lambda: False)]

    with pytest.raises(StackError, match="dies exited with code 3"):
        Failing(StackConfig(state_dir=tmp_path, gateway_port=0)).start()
    with Sleepers(StackConfig(state_dir=tmp_path, gateway_port=0)) as stack:
        assert len(stack.services) == 2


def test_a_probe_that_finds_another_stacks_process_stops_the_stack(tmp_path: Path) -> None:
    """The engine's and the gateway's probes raise StackError when another stack's process answers in
    this one's place: waiting on would not help, so every service stops and the directory is free."""
    def foreign() -> bool:
        raise StackError("another stack's process answers here")

    with Sleepers(StackConfig(state_dir=tmp_path, gateway_port=0)) as stack:
        one, two = stack.service("one"), stack.service("two")
        two.ready = foreign
        with pytest.raises(StackError, match="another stack's process"):
            stack.restart("two")
        assert stack.services == []
        assert one.proc is not None and one.proc.poll() is not None
    with Sleepers(StackConfig(state_dir=tmp_path, gateway_port=0)) as again:
        assert len(again.services) == 2


def test_a_dead_service_is_started_again_after_a_growing_pause(tmp_path: Path) -> None:
    config = StackConfig(state_dir=tmp_path, gateway_port=0, restart_backoff_s=0.2, restart_backoff_max_s=0.3)
    stop = threading.Event()
    with Sleepers(config) as stack:
        watcher = threading.Thread(target=stack.supervise, args=(stop.is_set,), kwargs={"poll_s": 0.05})
        watcher.start()
        try:
            one, two = stack.service("one"), stack.service("two")
            assert two.proc is not None
            untouched = two.proc.pid
            for round_ in range(1, 4):
                assert one.proc is not None
                before = one.proc.pid
                stack.kill("one")
                wait = threading.Event()
                for _ in range(200):
                    if one.proc.pid != before and one.proc.poll() is None:
                        break
                    wait.wait(0.05)
                assert one.proc.pid != before, f"not started again after death {round_}"
            assert one.backoffs_s == [0.2, 0.3, 0.3]  # doubled, then capped
            assert two.proc.pid == untouched and two.backoffs_s == []
        finally:
            stop.set()
            watcher.join(10)


def test_status_without_a_stack_is_one_line_that_says_what_to_do(
    no_tandem_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("TANDEM_REDIS__URL", f"redis://:sekrit@127.0.0.1:{closed}/0")
    assert tandem(["status"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "does not answer" in err and "tandem up" in err and "sekrit" not in err
    monkeypatch.setenv("TANDEM_GATEWAY_URL", f"http://127.0.0.1:{closed}")
    assert tandem(["delete", "r"]) == 1  # as status says it
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "does not answer" in err and "`tandem up` writes its URLs to .tandem/stack/client.env" in err, err


@pytest.mark.parametrize("args", [["--gateway-port", "99999"], ["--gateway-port", "-1"], ["--redis-port", "70000"],
                                  ["--redis-port", "x"]])
def test_a_port_out_of_range_is_one_line_naming_it(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        tandem(["up", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert args[0] in err and repr(args[1]) in err and "0 for a free one" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["", "a/b", "run name"])
def test_status_of_an_invalid_run_name_is_a_usage_error_naming_it(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        tandem(["status", name])
    assert info.value.code == 2  # before Redis is asked: '' is not "every run"
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"run name {name!r} is invalid" in err


def test_a_model_directory_that_is_not_there_is_one_line_before_anything_starts(
    no_tandem_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = no_tandem_env / "state"
    assert tandem(["up", "--model", str(no_tandem_env / "no-such-model"), "--state-dir", str(state)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "no-such-model: no such directory" in err and "hub id" in err
    assert not state.exists()  # nothing started, nothing written


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_state_dir_that_is_a_file_is_one_line_before_anything_starts(
    no_tandem_env: Path, capsys: pytest.CaptureFixture[str], under: str
) -> None:
    afile = no_tandem_env / "afile"
    afile.write_text("not a directory")
    assert tandem(["up", "--model", "unused", "--state-dir", str(afile / under)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and f"{afile} is a file, not a directory" in err


def test_status_and_client_find_the_stack_that_tandem_up_started(
    no_tandem_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with RedisOnly(StackConfig(state_dir=no_tandem_env / ".tandem" / "stack", gateway_port=0)) as stack:
        assert tandem(["status"]) == 0
        assert "no runs yet" in capsys.readouterr().out
        client = Client()
        try:
            assert client.settings.gateway_url == stack.gateway_url
            assert client.conn.ping() and client.runs() == []
        finally:
            client.close()
        assert tandem(["status", "ghost"]) == 1
        assert capsys.readouterr().err.strip() == "tandem status: unknown run 'ghost'; known runs: []"

        # a run spec that no longer reads back (written by hand, or by an older tandem) is named
        # on its own line, and the other runs are still listed
        registry = Registry(redis.Redis.from_url(stack.redis_url))
        for name in ("good", "broken"):
            registry.create_run(RunSpec(name=name, base_model="tiny"))
        admin = redis.Redis.from_url(stack.admin_redis_url)  # by hand: the operator's user
        admin.set(keys.run("broken"), '{"name": "broken", "base_model": "tiny", "loss": {"kl_coef": null}}')
        assert tandem(["status"]) == 0
        out = capsys.readouterr().out
        assert "good: base tiny, latest v0, serving v0" in out
        assert "broken: run 'broken' in Redis" in out and "kl_coef" in out


def test_status_finds_a_stack_started_elsewhere_by_its_state_dir(
    no_tandem_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = no_tandem_env / "elsewhere"
    with RedisOnly(StackConfig(state_dir=state, gateway_port=0)) as stack:
        Registry(redis.Redis.from_url(stack.redis_url)).create_run(RunSpec(name="mine", base_model="tiny"))
        assert tandem(["status"]) == 1  # the default state directory has no stack
        assert "does not answer" in capsys.readouterr().err
        assert tandem(["status", "--state-dir", str(state)]) == 0
        assert "mine: base tiny, latest v0, serving v0" in capsys.readouterr().out
        assert tandem(["status", "mine", "--state-dir", str(state)]) == 0
        # a shell that exported another stack's URLs: the flag still names this one
        monkeypatch.setenv("TANDEM_REDIS__URL", "redis://127.0.0.1:9/0")
        monkeypatch.setenv("TANDEM_GATEWAY_URL", "http://127.0.0.1:9")
        capsys.readouterr()
        assert tandem(["status", "--state-dir", str(state)]) == 0
        assert "mine: base tiny" in capsys.readouterr().out
        assert tandem(["delete", "ghost", "--state-dir", str(no_tandem_env / "nothing")]) == 1
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and "nothing: no client.env there" in err and "tandem up --state-dir" in err


@pytest.mark.parametrize("blocked", ["logs", "redis", "secrets.json/x"])
def test_a_state_directory_that_cannot_be_written_is_one_line_naming_it(
    no_tandem_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, blocked: str
) -> None:
    state = no_tandem_env / "state"
    (state / blocked).parent.mkdir(parents=True, exist_ok=True)
    (state / blocked).write_text("a file where the stack wants a directory")
    monkeypatch.setattr("tandem.dev.stack.Stack", RedisUp)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert tandem(["up", "--model", "unused", "--gateway-port", "0", "--state-dir", str(state)]) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(state / blocked.split("/")[0]) in err, err


def test_a_gateway_port_answered_by_another_process_is_a_stack_error_naming_it(tmp_path: Path) -> None:
    """Two `tandem up` started in the same moment on one port: both pass the port check, one binds,
    and the other's readiness probe got the winner's /ready. It must not take that for its own."""
    from fastapi import FastAPI
    from helpers.loopback import serve_app

    other = FastAPI()
    other.get("/ready")(lambda: {"status": "ready"})
    with serve_app(other) as url:
        port = int(url.rsplit(":", 1)[1])
        stack = Stack(StackConfig(state_dir=tmp_path, gateway_port=port))
        inference = next(svc for svc in stack.plan() if svc.name == "inference")  # its probe, as the stack waits on it
        inference.proc = subprocess.Popen(["sleep", "60"])  # ours, which could not bind the port
        try:
            with pytest.raises(StackError, match=f"gateway port {port} is held by another process") as info:
                inference.ready()
            assert "--gateway-port 0" in str(info.value)
        finally:
            inference.proc.kill()
            inference.proc.wait()


def _gone(pid: int) -> bool:
    """Whether `pid` no longer runs (a zombie nobody reaps counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard is Linux's PR_SET_PDEATHSIG")
def test_services_die_with_a_supervisor_killed_outright(tmp_path: Path) -> None:
    """`tandem up` SIGKILLed left every service running (each in a session of its own), and a new
    `tandem up` on the directory started a second Redis over the same files."""
    script = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from tandem.dev.supervisor import Service, Supervisor\n"
        f"sup = Supervisor(Path({str(tmp_path)!r}), ready_timeout_s=30, restart_backoff_s=1, "
        "restart_backoff_max_s=1, restart_reset_s=1)\n"
        "sup.open()\n"
        "svc = Service('sleeper', [sys.executable, '-c', 'import time; time.sleep(600)'], ready=lambda: True)\n"
        "sup.start(svc, dict(os.environ))\n"
        "print(svc.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert supervisor.stdout is not None
        child = int(supervisor.stdout.readline())
        assert not _gone(child)
        supervisor.kill()
        supervisor.wait(10)
        deadline = threading.Event()
        for _ in range(200):
            if _gone(child):
                break
            deadline.wait(0.05)
        assert _gone(child), "the service outlived its supervisor"
    finally:
        supervisor.kill()
        supervisor.wait(10)
        if supervisor.stdout is not None:
            supervisor.stdout.close()
