"""The transformers engine served on loopback, called over HTTP like tandem calls SGLang."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.loopback import serve_app

from tandem.settings import EngineSettings
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_trainer.tiny_model import build_random_adapter

pytestmark = pytest.mark.integration

KEY = "sesame"


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent-event stream; the last one must be [DONE]."""
    payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    build_random_adapter(tiny_model, root / "v1", seed=1)
    build_random_adapter(tiny_model, root / "v2", seed=2)
    build_random_adapter(tiny_model, root / "r32", rank=32)
    return root


@pytest.fixture(scope="module")
def url(tiny_model: Path) -> Iterator[str]:
    settings = EngineSettings(
        model=str(tiny_model),
        device="cpu",
        served_model_name="tiny",
        max_lora_rank=16,
        max_loaded_adapters=2,
        admin_api_key=KEY,
        unload_timeout_s=20,
    )
    with serve_app(create_engine_app(settings)) as base_url:
        yield base_url


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    """An admin client; every adapter is unloaded and memory resumed after each test."""
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c
        c.post("/resume_memory_occupation", json=None)
        for name in c.get("/server_info").json()["loaded_adapters"]:
            assert c.post("/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def load(client: httpx.Client, name: str, path: Path) -> httpx.Response:
    return client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def gen(client: httpx.Client, lora: str | None = None, **sampling) -> dict:
    body = {
        "text": "What is 2 plus 2?",
        "lora_path": lora,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "sampling_seed": 5, "ignore_eos": True, **sampling},
    }
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_shape_logprobs_and_adapter_effect(client: httpx.Client, adapters: Path) -> None:
    out = gen(client)
    meta = out["meta_info"]
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 12
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 12
    assert meta["prompt_tokens"] > 0 and meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"] and all(t[0] <= 0 and t[2] is None for t in triples)
    assert gen(client)["output_ids"] == out["output_ids"]  # same seed, same tokens

    assert load(client, "run-v1", adapters / "v1").json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"run-v1": str(adapters / "v1")},
    }
    tuned = gen(client, "run-v1", temperature=0)
    assert tuned["output_ids"] != gen(client, temperature=0)["output_ids"]
    assert gen(client, temperature=0)["output_ids"] == gen(client, None, temperature=0)["output_ids"]


def test_generate_batches_input_ids_and_n(client: httpx.Client) -> None:
    body = {
        "input_ids": [[5, 6, 7], [8, 9]],
        "sampling_params": {"max_new_tokens": 4, "n": 3},
        "rid": ["x", "y"],
    }
    outs = client.post("/generate", json=body).json()
    assert len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 3, 2, 2, 2]
    assert [o["meta_info"]["id"] for o in outs] == ["x-0", "x-1", "x-2", "y-0", "y-1", "y-2"]
    single = client.post(
        "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}, "rid": "r1"}
    ).json()
    assert (
        isinstance(single, dict)
        and single["meta_info"]["id"] == "r1"
        and "output_token_logprobs" not in single["meta_info"]
    )


def test_concurrent_fan_out_requests_all_succeed(client: httpx.Client) -> None:
    """A group fanned out as n identical unseeded requests, as the gateway does."""
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": {"max_new_tokens": 16}}
    outs: list[dict] = []

    def one() -> None:
        response = client.post("/generate", json=body)
        assert response.status_code == 200
        outs.append(response.json())

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(outs) == 8
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # independent samples
    assert all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in outs)


def test_generate_stream_is_cumulative_and_ends_with_done(client: httpx.Client) -> None:
    body = {
        "text": "Count: 1 2 3",
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 1},
    }
    with client.stream("POST", "/generate", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert len(events) == 8
    assert [len(e["output_ids"]) for e in events] == list(range(1, 9))
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    plain = client.post("/generate", json={**body, "stream": False}).json()
    assert events[-1]["output_ids"] == plain["output_ids"] and events[-1]["text"] == plain["text"]
    assert events[-1]["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]


def test_stream_error_is_an_event_then_done(client: httpx.Client, adapters: Path) -> None:
    """The second prompt's adapter is unloaded while the first prompt streams: its error is an event."""
    load(client, "run-v1", adapters / "v1")
    body = {
        "text": ["long", "short"],
        "stream": True,
        "lora_path": [None, "run-v1"],
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert client.post("/unload_lora_adapter", json={"lora_name": "run-v1"}).status_code == 200
        payloads = [line[6:] for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert "Got LoRA adapter that has never been loaded" in error["message"] and "run-v1" in error["message"]
    done = json.loads(payloads[-3])
    assert done["index"] == 0 and done["meta_info"]["completion_tokens"] == 400


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"text": "hi", "lora_path": "ghost"}, 400, "Got LoRA adapter that has never been loaded"),
        ({"input_ids": [1, 99999]}, 400, "outside the vocabulary"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1024}}, 400, "context length 1024"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}, 400, "exceeds the server limit"),
        ({"text": ""}, 400, "empty input"),
        ({"input_ids": []}, 400, "empty input"),
        ({}, 400, "empty input"),
        ({"text": "hi", "sampling_params": {"n": 0}}, 400, "n=0 must be >= 1"),
        ({"text": "hi", "sampling_params": {"top_p": 1.5}}, 400, "top_p=1.5"),
        ({"text": "hi", "stream": True, "lora_path": "ghost"}, 400, "never been loaded"),
        ({"text": 5}, 422, "text"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, 422, "max_new_tokens"),
    ],
)
def test_bad_generate_input_is_a_4xx_naming_it(
    client: httpx.Client, body: dict, status: int, message: str
) -> None:
    response = client.post("/generate", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


def test_openai_chat_with_served_adapter_logprobs_and_n(
    client: httpx.Client, adapters: Path, tiny_model: Path
) -> None:
    load(client, "run-v1", adapters / "v1")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say a number"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "ignore_eos": True,
    }
    base = client.post("/v1/chat/completions", json=body).json()
    tuned = client.post("/v1/chat/completions", json={**body, "model": "tiny:run-v1", "n": 2}).json()
    assert base["object"] == "chat.completion" and tuned["model"] == "tiny:run-v1"
    assert len(tuned["choices"]) == 2 and tuned["choices"][0]["message"]["role"] == "assistant"
    content = base["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(c["logprob"] <= 0 and isinstance(c["token"], str) for c in content)
    assert base["choices"][0]["finish_reason"] == "length"
    assert base["usage"]["completion_tokens"] == 6
    assert base["usage"]["total_tokens"] == base["usage"]["prompt_tokens"] + 6
    tuned_lps = [c["logprob"] for c in tuned["choices"][0]["logprobs"]["content"]]
    assert max(abs(a - c["logprob"]) for a, c in zip(tuned_lps, content, strict=False)) > 0.01  # the adapter served it
    # the prompt is the chat template with a generation prompt; token ids come back on request
    ids = client.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()
    from transformers import AutoTokenizer

    template = "<|im_start|>user\nSay a number<|im_end|>\n<|im_start|>assistant\n"
    assert ids["prompt_token_ids"] == AutoTokenizer.from_pretrained(tiny_model).encode(template)
    assert len(ids["prompt_token_ids"]) == base["usage"]["prompt_tokens"]
    assert [
        client.post(
            "/generate",
            json={
                "input_ids": ids["prompt_token_ids"],
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            },
        ).json()["output_ids"]
    ] == [ids["choices"][0]["token_ids"]]

    unknown = client.post("/v1/chat/completions", json={**body, "model": "tiny:ghost"})
    assert unknown.status_code == 400 and "never been loaded" in unknown.json()["error"]["message"]


def test_openai_chat_and_completions_stream(client: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "seed": 3,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = sse_events(response)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    plain = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert streamed == plain["choices"][0]["message"]["content"]

    cbody = {
        "model": "tiny",
        "prompt": "Numbers:",
        "max_tokens": 5,
        "ignore_eos": True,
        "seed": 3,
        "logprobs": 1,
    }
    with client.stream("POST", "/v1/completions", json={**cbody, "stream": True}) as response:
        chunks = sse_events(response)
    plain = client.post("/v1/completions", json=cbody).json()
    assert plain["object"] == "text_completion" and plain["choices"][0]["finish_reason"] == "length"
    assert len(plain["choices"][0]["logprobs"]["token_logprobs"]) == 5
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert plain["usage"]["completion_tokens"] == 5


def test_models_lists_the_base_and_every_adapter(client: httpx.Client, adapters: Path) -> None:
    load(client, "run-v1", adapters / "v1")
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("run-v1", "tiny")]
    assert data[1]["root"] == str(adapters / "v1")


def test_load_errors_leave_the_serving_adapter_alone(
    client: httpx.Client, adapters: Path, tmp_path: Path
) -> None:
    assert load(client, "run-v1", adapters / "v1").status_code == 200
    before = gen(client, "run-v1")["output_ids"]
    no_config = shutil.copytree(adapters / "v1", tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    no_weights = shutil.copytree(adapters / "v1", tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    bad_target = shutil.copytree(adapters / "v1", tmp_path / "bad_target")
    config = json.loads((bad_target / "adapter_config.json").read_text())
    (bad_target / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": ["q_proj", "wqkv"]})
    )
    cases = [
        ("run-v1", adapters / "v1", "Failed to load LoRA adapter run-v1 because it is already loaded"),
        ("x", tmp_path / "nowhere", "is not a local directory"),
        ("x", no_config, "no adapter_config.json"),
        ("x", no_weights, "no adapter_model.safetensors"),
        ("x", adapters / "r32", "exceeds max_lora_rank=16"),
        ("x", bad_target, "['wqkv'] do not exist in the base model"),
        ("run:v2", adapters / "v2", "contain no ':'"),
    ]
    for name, path, message in cases:
        response = load(client, name, path)
        assert response.status_code == 400, name
        body = response.json()
        assert body["success"] is False and message in body["error_message"], body
        assert body["loaded_adapters"] == {"run-v1": str(adapters / "v1")}
        assert gen(client, "run-v1")["output_ids"] == before
    assert load(client, "run-v2", adapters / "v2").status_code == 200
    full = load(client, "run-v3", adapters / "v1")
    assert full.status_code == 400 and "max_loaded_adapters" in full.json()["error_message"]
    assert gen(client, "run-v1")["output_ids"] == before


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("[1, 2]", "adapter_config.json is not a JSON object"),
        ({"r": "eight"}, "adapter_config.json has no valid LoRA rank 'r'"),
        ({"rank_pattern": ["q_proj"]}, "adapter_config.json: rank_pattern is not a mapping"),
        ({"target_modules": 5}, "target_modules 5 is not a list of module names"),
    ],
)
def test_malformed_adapter_configs_are_a_400_naming_the_problem(
    client: httpx.Client, adapters: Path, tmp_path: Path, change: str | dict, expected: str
) -> None:
    bad = shutil.copytree(adapters / "v1", tmp_path / "bad")
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(change if isinstance(change, str) else json.dumps({**config, **change}))
    response = load(client, "x", bad)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["success"] is False and expected in body["error_message"], body
    assert body["loaded_adapters"] == {}


def test_unload(client: httpx.Client, adapters: Path) -> None:
    unknown = client.post("/unload_lora_adapter", json={"lora_name": "ghost"})
    assert unknown.status_code == 400 and "not loaded" in unknown.json()["error_message"]
    load(client, "run-v1", adapters / "v1")
    load(client, "run-v2", adapters / "v2")
    response = client.post("/unload_lora_adapter", json={"lora_name": "run-v1"})
    assert response.json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"run-v2": str(adapters / "v2")},
    }
    assert client.post("/generate", json={"text": "hi", "lora_path": "run-v1"}).status_code == 400


def test_unload_waits_for_a_running_stream(client: httpx.Client, adapters: Path) -> None:
    load(client, "run-v1", adapters / "v1")
    body = {
        "text": "go",
        "stream": True,
        "lora_path": "run-v1",
        "sampling_params": {"max_new_tokens": 800, "ignore_eos": True},
    }
    events: list[str] = []
    ended = [0.0]

    def consume() -> None:
        with client.stream("POST", "/generate", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        ended[0] = time.perf_counter()

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.005)
    sent_at = len(events)
    unload = client.post("/unload_lora_adapter", json={"lora_name": "run-v1"})
    answered = time.perf_counter()
    reader.join(30)
    assert 0 < sent_at < 400, "the unload must be sent while the stream runs"
    assert unload.status_code == 200 and unload.json()["loaded_adapters"] == {}
    assert events[-1] == "[DONE]" and json.loads(events[-2])["meta_info"]["completion_tokens"] == 800
    assert answered > ended[0] - 0.5  # the unload answered only once the stream had (nearly) ended


def test_admin_routes_need_the_key(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as anon:
        for path, body in [
            ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
            ("/unload_lora_adapter", {"lora_name": "a"}),
            ("/update_weights_from_disk", {"model_path": "/x"}),
            ("/flush_cache", None),
            ("/release_memory_occupation", None),
            ("/resume_memory_occupation", None),
        ]:
            response = anon.post(path, json=body)
            assert response.status_code == 401 and "admin key" in response.json()["error"]["message"], path
        wrong = anon.post("/flush_cache", headers={"x-api-key": "nope"})
        assert wrong.status_code == 401
        assert anon.post("/flush_cache", headers={"x-api-key": KEY}).status_code == 200
        assert anon.get("/v1/models").status_code == 200  # reading and generating need no admin key


def test_every_admin_route_refuses_without_the_key_before_reading_the_body(url: str) -> None:
    from tandem_inference.engines.transformers import routes_admin

    paths = {route.path for route in routes_admin.router.routes}
    assert paths == {"/load_lora_adapter", "/unload_lora_adapter", "/update_weights_from_disk", "/flush_cache",
                     "/release_memory_occupation", "/resume_memory_occupation"}
    with httpx.Client(base_url=url, timeout=30) as anon:
        for path in sorted(paths):
            response = anon.post(path, json={"unexpected": [1]})  # a body none of them accepts whole
            assert response.status_code == 401, (path, response.text)


def test_release_and_resume(client: httpx.Client) -> None:
    assert (
        client.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
    )
    info = client.get("/server_info").json()
    assert info["memory_released"] is True
    refused = client.post("/generate", json={"text": "hi"})
    assert refused.status_code == 503 and "resume" in refused.json()["error"]["message"]
    assert client.get("/health_generate").status_code == 503
    assert client.post("/release_memory_occupation", json={"tags": ["gpu"]}).status_code == 400
    assert client.post("/resume_memory_occupation").status_code == 200
    assert client.get("/server_info").json()["memory_released"] is False
    assert client.get("/health_generate").status_code == 200


def test_info_routes_and_metrics(client: httpx.Client, adapters: Path, tiny_model: Path) -> None:
    info = client.get("/server_info").json()
    assert info["model_path"] == str(tiny_model) and info["served_model_name"] == "tiny"
    assert info["max_lora_rank"] == 16 and info["max_loaded_adapters"] == info["max_loaded_loras"] == 2
    assert info["enable_lora"] is True and info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["version"]
    assert client.get("/model_info").json() == {
        "model_path": str(tiny_model),
        "tokenizer_path": str(tiny_model),
        "is_generation": True,
    }
    assert client.post("/flush_cache").status_code == 200
    load(client, "run-v1", adapters / "v1")
    gen(client)
    text = client.get("/metrics").text
    assert 'tandem_engine_requests_total{route="/generate",status="200"}' in text
    assert "tandem_engine_generated_tokens_total" in text
    assert "tandem_engine_adapter_load_seconds_count" in text
    generated = [
        line for line in text.splitlines() if line.startswith("tandem_engine_generated_tokens_total")
    ]
    assert float(generated[0].split()[-1]) >= 12


def test_health_is_503_until_the_model_is_loaded(tiny_model: Path) -> None:
    from fastapi.testclient import TestClient

    app = create_engine_app(EngineSettings(model=str(tiny_model), device="cpu"))
    unstarted = TestClient(app)  # used outside `with`, it runs no lifespan: the model never loads
    assert unstarted.get("/health").status_code == 503
    response = unstarted.post("/generate", json={"text": "hi"})
    assert response.status_code == 503 and "not loaded" in response.json()["error"]["message"]
    with serve_app(app) as base_url:
        assert httpx.get(f"{base_url}/health").status_code == 200
        start = time.perf_counter()
        assert httpx.get(f"{base_url}/health_generate", timeout=30).status_code == 200
        assert time.perf_counter() - start < 5
