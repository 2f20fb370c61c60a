"""OpenAI-compatible server on localhost (uvicorn in a thread) answering a real HTTP client (httpx):
models/health, completions and chat completions (plain and SSE-streamed), concurrent streams, and 4xx errors
for bad requests after which the server keeps serving."""

import json
import threading

import pytest

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from k3_jax.serving.server import create_app  # noqa: E402
from tests.serving_common import running_server, tiny_setup  # noqa: E402

MODEL = "k3-tiny-test"


@pytest.fixture(scope="module")
def client():
    _, _, engine, _ = tiny_setup()
    app = create_app(engine, engine.tokenizer, model_name=MODEL)
    with running_server(app) as (c, _):
        yield c
    assert not engine.has_work


def _sse(resp):
    """Parse an SSE body into JSON chunks; asserts it ends with [DONE]."""
    datas = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def test_models_and_health(client):
    r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    assert client.get("/health").json()["status"] == "ok"


def test_completion_plain_and_streamed_agree(client):
    body = {
        "model": MODEL,
        "prompt": "def main():",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 8
    assert len(choice["logprobs"]["token_logprobs"]) == 8
    assert all(1 <= len(t) <= 2 for t in choice["logprobs"]["top_logprobs"])  # dict: equal strings merge
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(s)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # token-id prompts and seeded sampling are reproducible
    body = {"prompt": [5, 300, 41], "max_tokens": 6, "temperature": 0.9, "seed": 7}
    a, b = client.post("/v1/completions", json=body).json(), client.post("/v1/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_chat_plain_streamed_and_concurrent(client):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert r.json()["usage"]["prompt_tokens"] > 5

    results = {}

    def stream(i):
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            results[i] = _sse(s)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for chunks in results.values():
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/completions", {"prompt": ""}, 400, "empty"),
        ("/v1/completions", {"prompt": [7] * 500}, 400, "max_len"),
        ("/v1/completions", {"prompt": [5, 10**6]}, 400, "outside"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n=1"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "non-empty"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ],
)
def test_bad_requests_get_4xx_and_server_keeps_serving(client, path, body, status, words):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    ok = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
