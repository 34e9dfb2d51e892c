"""Deleting a run through the gateway, with its controller, the real engine, redis and real adapters:
what goes, what is refused, and that nothing of another run is touched.

Versions are published the way the trainer does it (tests/helpers/adapters.py); jobs sit on the
real rq queue (no worker takes them); episodes are made by the gateway itself. The engine and
the gateway are conftest.py's `engine_url`, `settings` and `url`; every service, and the client,
talks to Redis as its own role's user (tandem.acl), and the admin only sets the scene and looks.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.adapters import announce, publish, publish_reseeded
from helpers.jobs import make_job
from helpers.servers import gateway, inference_settings
from helpers.waiting import wait_until

from tandem import keys
from tandem.acl import Role
from tandem.adapters import AdapterStore
from tandem.client import Client
from tandem.deletion import delete_run
from tandem.dev import cli
from tandem.errors import RunBusy, RunNotFound, ValidationFailed
from tandem.events import EventKind, EventStream
from tandem.jobs import TrainJob, check_incarnation, enqueue, train_queue
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import InferenceSettings
from tandem_trainer.errors import JobRejected
from tandem_trainer.jobs.train_checks import check_origins
from tandem_trainer.store_cleanup import remove_deleted_runs

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Count to three."}]


def serve_versions(settings: InferenceSettings, conns: dict[Role, redis.Redis], tiny_model: Path, url: str, run: str,
                   versions: int) -> None:
    """Create `run` (as the client) and publish `versions` versions (as the trainer); wait until the
    newest serves."""
    registry, store = Registry(conns[Role.TRAINER]), AdapterStore(settings.store.root)
    Registry(conns[Role.CLIENT]).create_run(RunSpec(name=run, base_model=str(tiny_model)))
    for version in range(1, versions + 1):
        announce(EventStream(conns[Role.TRAINER]), store, publish(store, registry, tiny_model, run, version))
    wait_until(lambda: httpx.get(f"{url}/v1/runs/{run}").json()["serving_version"] == versions,
               what=f"{run} v{versions} serving")


def engine_adapters(engine_url: str) -> list[str]:
    cards = httpx.get(f"{engine_url}/v1/models").json()["data"]
    return sorted(str(card["id"]) for card in cards if card.get("parent"))


def episode(url: str, run: str, episode_id: str) -> None:
    body = {"model": run, "messages": CHAT, "episode": episode_id, "max_tokens": 3}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def snapshot(conn: redis.Redis, run: str, jobs: list[str], episodes: list[str]) -> dict[str, bytes | None]:
    """Every key of `run`, its jobs and its episodes, as Redis serializes them (DUMP)."""
    names = [*keys.run_state(run), keys.run_episodes(run), *(f"rq:job:{j}" for j in jobs),
             *(keys.episode(e) for e in episodes)]
    return {name: conn.dump(name) for name in names}


def queued(conn: redis.Redis) -> list[str]:
    return [i.decode() for i in conn.lrange(train_queue(conn).key, 0, -1)]


def test_deleting_a_run_removes_it_and_touches_nothing_of_another(
    url: str, settings: InferenceSettings, redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis],
    tiny_model: Path, engine_url: str,
) -> None:
    serve_versions(settings, role_conns, tiny_model, url, "gone", 2)
    serve_versions(settings, role_conns, tiny_model, url, "kept", 2)
    for run, ep in (("gone", "ep-gone"), ("kept", "ep-kept")):
        episode(url, run, ep)
    for job_id, run in (("k1", "kept"), ("g1", "gone"), ("k2", "kept"), ("g2", "gone")):
        enqueue(role_conns[Role.CLIENT], make_job(job_id, run=run))
    Registry(role_conns[Role.CLIENT]).next_step("kept")
    assert engine_adapters(engine_url) == ["gone-v1", "gone-v2", "kept-v1", "kept-v2"]
    before = snapshot(redis_conn, "kept", ["k1", "k2"], ["ep-kept"])
    assert all(before[k] is not None for k in (keys.run("kept"), keys.run_versions("kept"), keys.run_steps("kept"),
                                               keys.run_episodes("kept"), keys.episode("ep-kept")))

    resp = httpx.delete(f"{url}/v1/runs/gone")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"run": "gone", "versions": [1, 2], "jobs": ["g1", "g2"], "episodes": 1}

    # the run resolves no more, here at once: a 404 naming it
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "gone", "messages": CHAT, "max_tokens": 2})
    assert chat.status_code == 404 and "'gone'" in chat.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json={"model": "gone@v2", "prompt": "x"}).status_code == 404
    assert httpx.get(f"{url}/v1/runs/gone").status_code == 404
    assert "gone" not in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    # its adapters leave the engine; the other run's stay and serve
    wait_until(lambda: engine_adapters(engine_url) == ["kept-v1", "kept-v2"], what="gone's adapters unloaded")
    served = httpx.post(f"{url}/v1/chat/completions", json={"model": "kept", "messages": CHAT, "max_tokens": 2})
    assert served.status_code == 200 and served.headers["x-tandem-version"] == "2"

    # Redis: the run's keys, queued jobs and episode are gone; the store's directory waits for the trainer
    assert not any(redis_conn.exists(k) for k in keys.run_state("gone"))
    assert Registry(redis_conn).list_runs() == ["kept"] and Registry(redis_conn).deleted_runs() == ["gone"]
    assert queued(redis_conn) == ["k1", "k2"]
    assert not redis_conn.exists("rq:job:g1", "rq:job:g2", keys.episode("ep-gone"), keys.run_episodes("gone"))
    events = EventStream(redis_conn).history(run="gone")
    failed = [e for e in events if e.kind is EventKind.TRAIN_FAILED]
    assert [(e.job_id, e.data["retries_left"]) for e in failed] == [("g1", 0), ("g2", 0)]
    assert "deleted" in failed[0].data["message"]
    assert events[-1].kind is EventKind.RUN_DELETED and events[-1].data == {"versions": [1, 2], "jobs": ["g1", "g2"]}
    assert any(e.kind is EventKind.ADAPTER_READY for e in events)  # the stream is a log: its entries stay
    assert AdapterStore(settings.store.root).versions("gone") == [1, 2]

    # the other run: byte for byte
    assert snapshot(redis_conn, "kept", ["k1", "k2"], ["ep-kept"]) == before
    wait_until(lambda: redis_conn.get(keys.run_serving("gone")) is None and not redis_conn.exists(
        keys.run_loaded("gone")), what="no status of the deleted run written back")

    # deleting it again is a 404 naming it
    again = httpx.delete(f"{url}/v1/runs/gone")
    assert again.status_code == 404 and "'gone'" in again.json()["error"]["message"]


def test_deleting_is_refused_while_a_job_of_the_run_runs(
    url: str, settings: InferenceSettings, redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis],
    tiny_model: Path,
) -> None:
    serve_versions(settings, role_conns, tiny_model, url, "busy", 1)
    enqueue(role_conns[Role.CLIENT], make_job("running-job", run="busy"))
    queue = train_queue(redis_conn)
    redis_conn.lmove(queue.key, queue.intermediate_queue_key)  # what a worker does as it takes the job
    before = snapshot(redis_conn, "busy", ["running-job"], [])

    resp = httpx.delete(f"{url}/v1/runs/busy")
    assert resp.status_code == 409
    error = resp.json()["error"]
    assert error["type"] == "conflict" and error["job_id"] == "running-job" and "running-job" in error["message"]
    assert snapshot(redis_conn, "busy", ["running-job"], []) == before  # nothing deleted
    assert httpx.post(f"{url}/v1/completions", json={"model": "busy", "prompt": "x", "max_tokens": 2}).status_code == 200

    # the run's lock, held by a live trainer (its liveness key holds its token), refuses it too
    redis_conn.delete(queue.intermediate_queue_key, "rq:job:running-job")
    redis_conn.set(keys.trainer_alive("w1"), "w1#abc")
    redis_conn.set(keys.run_lock("busy"), "w1#abc|n0nce")
    resp = httpx.delete(f"{url}/v1/runs/busy")
    assert resp.status_code == 409 and "w1#abc" in resp.json()["error"]["message"]
    assert resp.json()["error"]["job_id"] is None

    # a lock whose holder is dead is no job: it goes with the run
    redis_conn.delete(keys.trainer_alive("w1"))
    assert httpx.delete(f"{url}/v1/runs/busy").status_code == 200
    assert not redis_conn.exists(keys.run_lock("busy"))


def test_the_client_and_the_cli_delete_through_the_gateway_with_its_key(
    role_urls: dict[Role, str], tmp_path: Path, engine_url: str, tiny_model: Path, tokenizer: Any,
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    settings = inference_settings(role_urls[Role.INFERENCE], tmp_path / "store", engine_url, tiny_model, api_key="s3cret")
    registry = Registry(redis_conn)
    for run in ("one", "two"):
        registry.create_run(RunSpec(name=run, base_model=str(tiny_model)))
    with gateway(settings, tokenizer) as url:
        assert httpx.delete(f"{url}/v1/runs/one").status_code == 401
        assert registry.has_run("one")
        with Client(url, role_urls[Role.CLIENT], api_key="s3cret") as client:
            assert client.delete_run("one").model_dump() == {"run": "one", "versions": [], "jobs": [], "episodes": 0}
            with pytest.raises(RunNotFound, match="'one'"):
                client.delete_run("one")
            enqueue(client.conn, make_job("j-two", run="two"))
            queue = train_queue(redis_conn)
            redis_conn.lmove(queue.key, queue.intermediate_queue_key)
            with pytest.raises(RunBusy) as busy:
                client.delete_run("two")
            assert busy.value.job_id == "j-two"
            redis_conn.delete(queue.intermediate_queue_key)

        monkeypatch.setenv("TANDEM_GATEWAY_URL", url)
        monkeypatch.setenv("TANDEM_REDIS__URL", role_urls[Role.CLIENT])
        monkeypatch.setenv("TANDEM_API_KEY", "s3cret")
        assert cli.main(["delete", "two"]) == 0
        assert "deleted run two: 0 versions" in capsys.readouterr().out
        assert cli.main(["delete", "two"]) == 1
        assert "unknown run 'two'" in capsys.readouterr().err

        # --state-dir: the stack's client.env, as `tandem up` writes it, with the gateway's key
        registry.create_run(RunSpec(name="three", base_model=str(tiny_model)))
        for name in ("TANDEM_GATEWAY_URL", "TANDEM_REDIS__URL", "TANDEM_API_KEY"):
            monkeypatch.delenv(name)
        state = tmp_path / "state"
        state.mkdir()
        (state / "client.env").write_text(f"TANDEM_GATEWAY_URL={url}\nTANDEM_REDIS__URL={role_urls[Role.CLIENT]}\n"
                                          "TANDEM_API_KEY=s3cret\n")
        monkeypatch.chdir(tmp_path)  # no .env but the one named
        assert cli.main(["delete", "three", "--state-dir", str(state)]) == 0, capsys.readouterr().err
    assert registry.list_runs() == []


def test_every_replica_forgets_a_run_deleted_elsewhere_and_a_missed_deletion_at_its_start(
    settings: InferenceSettings, tokenizer: Any, role_conns: dict[Role, redis.Redis], tiny_model: Path,
    engine_url: str,
) -> None:
    inference = role_conns[Role.INFERENCE]
    with gateway(settings, tokenizer) as url:
        for run in ("elsewhere", "missed", "stays"):
            serve_versions(settings, role_conns, tiny_model, url, run, 1)
        delete_run(inference, "elsewhere")  # another replica's DELETE: this one hears `run_deleted`
        wait_until(lambda: httpx.get(f"{url}/v1/runs/elsewhere").status_code == 404, what="elsewhere forgotten")
        wait_until(lambda: engine_adapters(engine_url) == ["missed-v1", "stays-v1"], what="elsewhere unloaded")
    delete_run(inference, "missed")  # while this replica's controller is down: the engine still holds it
    assert engine_adapters(engine_url) == ["missed-v1", "stays-v1"]
    with gateway(settings, tokenizer) as url:
        wait_until(lambda: engine_adapters(engine_url) == ["stays-v1"], what="missed unloaded at start-up")
        assert httpx.post(f"{url}/v1/completions", json={"model": "missed", "prompt": "x"}).status_code == 404
        assert httpx.get(f"{url}/v1/runs/stays").json()["serving_version"] == 1


def greedy(url: str, model: str) -> list[tuple[str, float]]:
    """Tokens and logprobs of a short greedy answer by `model` (the gateway's run, or an engine's adapter)."""
    body = {"model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [(t["token"], round(t["logprob"], 4)) for t in response.json()["choices"][0]["logprobs"]["content"]]


def test_a_run_created_again_under_a_deleted_runs_name_never_serves_the_deleted_runs_adapter(
    settings: InferenceSettings, tokenizer: Any, redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis],
    tiny_model: Path, engine_url: str, tmp_path: Path,
) -> None:
    """The deleted run's v1 is still in the engine when a run of the same name publishes its own v1
    from the same directory (here its controller was down; a request still generating holds it
    the same way). The new run's v1 loads under a name no engine was given for the deleted run, and
    the old adapter is unloaded, not taken for the new run's."""
    trainer = role_conns[Role.TRAINER]
    store = AdapterStore(settings.store.root)
    with gateway(settings, tokenizer) as url:
        serve_versions(settings, role_conns, tiny_model, url, "again", 1)
    base = settings.engine.served_model_name  # the engine picks an adapter by `<base>:<adapter>`
    deleted = greedy(engine_url, f"{base}:again-v1")
    template = tmp_path / "template"
    shutil.copytree(store.adapter_dir("again", 1), template)
    delete_run(role_conns[Role.INFERENCE], "again")
    assert remove_deleted_runs(trainer, store, "test-owner", lambda owner: True) == ["again"]
    Registry(role_conns[Role.CLIENT]).create_run(RunSpec(name="again", base_model=str(tiny_model)))
    announce(EventStream(trainer), store,
             publish_reseeded(store, Registry(trainer), template, tiny_model, "again", 1, seed=1234))
    assert engine_adapters(engine_url) == ["again-v1"]  # the deleted run's, from the directory the new v1 is in now

    with gateway(settings, tokenizer) as url:
        wait_until(lambda: engine_adapters(engine_url) == ["again-v1-a1"],
                   what="the new run's v1 loaded under a name of its own and the deleted run's unloaded")
        assert httpx.get(f"{url}/v1/runs/again").json()["serving_version"] == 1
        assert greedy(url, "again")  # answered, by the one adapter of the run the engine holds
    assert greedy(engine_url, f"{base}:again-v1-a1") != deleted  # the new run's weights, not the deleted run's
    assert redis_conn.hget(keys.run_load_attempts("again"), "floor:1") == b"1"

    # a rollout the deleted run's v1 sampled is no rollout of the new run's v1: the client and the
    # trainer refuse it (the same run name and version number used to train on it as on-policy)
    def sampled_by(adapter: str) -> TrainJob:
        job = make_job(run="again", version=1).model_dump()
        job["groups"][0]["trajectories"][2]["origin"] = {"run": "again", "adapter": adapter}
        return TrainJob.model_validate(job)

    registry = Registry(role_conns[Role.CLIENT])
    with pytest.raises(ValidationFailed) as refused:
        check_incarnation(sampled_by("again-v1"), registry.load_attempt_floor)
    assert refused.value.field == "groups.0.trajectories.2.origin.adapter"
    assert "adapter 'again-v1': version 1 of a deleted run that was also named 'again'" in str(refused.value)
    with pytest.raises(JobRejected) as rejected:
        check_origins(sampled_by("again-v1"), Registry(trainer))
    assert rejected.value.field == "groups.0.trajectories.2.origin.adapter"
    check_incarnation(sampled_by("again-v1-a1"), registry.load_attempt_floor)  # the new run's own v1
    check_origins(sampled_by("again-v1-a1"), Registry(trainer))
