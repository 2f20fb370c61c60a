"""Hardening of the engine, the model's token-id inputs and the HTTP server (issue #25, serving half).

Engine tests first (they step the shared tiny engine directly), then the real HTTP server (uvicorn on
127.0.0.1, a free port, one server for the module) answering bad, oversized, abandoned and fault-injected
requests, and a bounded load-and-fault run after which /health is ok, no slot is leaked and a reference greedy
request answers exactly what it answered before.
"""

import concurrent.futures
import json
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.model import K3ForCausalLM, check_token_ids
from k3_jax.serving.engine import RequestError, RequestFailed
from k3_jax.serving.sampling import SamplingParams
from tests.serving_common import MAX_LEN, reference_greedy_check, running_server, tiny_setup

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from k3_jax.serving.server import create_app  # noqa: E402

MODEL = "k3-tiny-hardening"
BODY_LIMIT = 16 * 1024  # small: an oversized body is read by the server in one go (no RST on close)
FAULT_PROMPT = [11, 12, 13, 14, 15]  # requests starting with these ids hit an injected engine fault


@pytest.fixture(scope="module")
def setup():
    return tiny_setup()


def _run(engine, steps_limit=400):
    """Step until idle; events by request id."""
    out: dict[str, list] = {}
    for _ in range(steps_limit):
        if not engine.has_work:
            return out
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev)
    raise AssertionError("engine did not finish")


def _assert_no_leak(engine):
    assert not engine.has_work and engine.num_running == 0 and not engine._by_id
    assert engine._slots == [None] * engine.max_batch


# ---------------------------------------------------------------------------------------------- engine
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=1.0, top_k=2**31), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(seed=2**32), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(max_tokens=2**31), "max_tokens"),
        (dict(temperature=1e9), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(logprobs=True), "logprobs"),
        (dict(stop_token_ids=(2**31,)), "stop token id"),
        (dict(stop=("x",) * 17), "stop"),
        (dict(stop=("x" * 300,)), "stop"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_engine_rechecks_every_sampling_range(setup, kwargs, field):
    engine = setup[2]
    with pytest.raises(RequestError, match=field):
        engine.add_request([5, 6], SamplingParams(**kwargs))
    _assert_no_leak(engine)


@pytest.mark.parametrize("prompt", [[5, 1.5], [5, -1], [5, 10**30], [True]], ids=["float", "negative", "huge", "bool"])
def test_engine_rejects_prompt_ids_that_are_not_vocabulary_integers(setup, prompt):
    engine = setup[2]
    with pytest.raises(RequestError, match="prompt"):
        engine.add_request(prompt, SamplingParams())
    _assert_no_leak(engine)


class _BrokenDetok:
    """Detokenizer that raises on its third token (an unexpected per-request engine error)."""

    def __init__(self):
        self.n = 0

    def push(self, token):
        self.n += 1
        if self.n == 3:
            raise RuntimeError("injected detokenizer fault")
        return ""

    def flush(self):
        return ""


def test_one_request_failing_in_the_engine_fails_alone(setup):
    """A request whose values overflow the engine's host arrays at admission (as ``top_k >= 2**31`` did before
    validation caught it), and one whose detokenizer raises mid-generation, each end with an error event; the
    greedy request beside them is exact and the engine keeps serving."""
    cfg, variables, engine, fwd = setup
    good = engine.add_request([5, 300, 41, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    bad_admit = engine.add_request([5, 9], SamplingParams(max_tokens=10, ignore_eos=True))
    bad_emit = engine.add_request([5, 10], SamplingParams(max_tokens=10, ignore_eos=True))
    by_id = engine._by_id
    by_id[bad_admit].params = SamplingParams(max_tokens=10, temperature=1.0, seed=2**40)  # past validation
    by_id[bad_emit].detok = _BrokenDetok()
    evs = _run(engine)
    assert [e.finish_reason for e in evs[bad_admit]] == ["error"] and "Overflow" in evs[bad_admit][0].error
    assert evs[bad_emit][-1].finish_reason == "error" and len(evs[bad_emit]) == 3
    assert "injected detokenizer fault" in evs[bad_emit][-1].error
    toks = [e.token for e in evs[good]]
    assert len(toks) == 10 and evs[good][-1].finish_reason == "length"
    reference_greedy_check(fwd, variables, [5, 300, 41, 7], toks)
    assert engine.stats["failed_requests"] >= 2 and not engine.degraded
    _assert_no_leak(engine)


def test_failed_decode_call_fails_its_batch_then_engine_recovers(setup, monkeypatch):
    cfg, variables, engine, fwd = setup
    real = engine._decode
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            if calls.pop("consume", False):  # as a call that failed on the device: its donated cache is gone
                jax.tree.leaves(args[1])[0].delete()
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode", flaky)
    calls["consume"] = True
    a = engine.add_request([5, 300], SamplingParams(max_tokens=8, ignore_eos=True))
    b = engine.add_request([5, 301], SamplingParams(max_tokens=8, ignore_eos=True))
    evs = _run(engine)
    assert evs[a][-1].finish_reason == evs[b][-1].finish_reason == "error"
    assert engine.degraded and "injected device failure" in engine.last_step_error
    _assert_no_leak(engine)
    with pytest.raises(RequestFailed, match="injected"):  # the Python API raises, naming the cause
        calls["n"] = 1
        engine.generate([[5, 302]], max_new_tokens=4, stop_token_ids=())
    _assert_no_leak(engine)
    out = engine.generate([[5, 300]], max_new_tokens=6, stop_token_ids=())[0]
    reference_greedy_check(fwd, variables, [5, 300], out)
    assert not engine.degraded and engine.last_step_error is None


def test_held_back_stop_prefix_is_flushed_when_a_stop_token_ends_generation(setup):
    """Text held back as a possible stop-string prefix is emitted when a stop token id (or eos) ends the
    request; the stop token's own text is not."""
    engine = setup[2]
    tok = engine.tokenizer
    prompt = [5, 300, 41, 7]
    full = list(engine.generate_stream([prompt], max_new_tokens=24, stop_token_ids=()))
    toks = [e.token for e in full]
    ends = [k for k in range(2, len(toks)) if toks[k] not in toks[:k] and tok.decode(toks[:k]).strip()]
    assert ends, f"no usable stop position in {toks}"
    k = ends[0]
    want = tok.decode(toks[:k], skip_special=True)
    stop = want[-1] + "\x00never"  # the last character is a proper prefix of the stop string: held back
    evs = list(engine.generate_stream([prompt], max_new_tokens=24, stop_token_ids=(toks[k],), stop=(stop,)))
    assert evs[-1].finish_reason == "stop" and len(evs) == k + 1
    assert "".join(e.text for e in evs) == want
    _assert_no_leak(engine)
    STOP_CASE.update(prompt=prompt, stop_id=toks[k], stop=stop, want=want)  # the HTTP test below reuses it


STOP_CASE: dict = {}


def test_out_of_range_token_ids_raise_eagerly_and_are_nan_under_jit(setup):
    cfg, variables, _, fwd = setup
    v = cfg.vocab_size
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {v}\).*{v}"):
        check_token_ids(np.array([[1, 2, v]]), v)
    with pytest.raises(ValueError, match=r"\(0, 1\): -1"):
        check_token_ids([[3, -1]], v)
    with pytest.raises(ValueError, match="outside"):
        check_token_ids([[10**30]], v)
    with pytest.raises(ValueError, match="integer"):
        check_token_ids(np.array([[1.0]]), v)
    check_token_ids(np.array([[0, v - 1]]), v)
    model = K3ForCausalLM(cfg)
    with pytest.raises(ValueError, match="tokens has 1 token id"):
        model.apply(variables, jnp.array([[5, v]], jnp.int32))  # raises before any compute
    # under jit (the [1, MAX_LEN] reference forward): the row's logits are NaN (attention multiplies the NaN
    # values of masked positions by zero, so the positions before the bad id are NaN too), never a wrapped row
    base = np.zeros((1, MAX_LEN), np.int32)
    base[0, :6] = [5, 300, 41, 7, 9, 10]
    clean = np.asarray(fwd(variables, jnp.asarray(base)))
    for bad in (v, -1, -v):
        ids = base.copy()
        ids[0, 3] = bad
        got = np.asarray(fwd(variables, jnp.asarray(ids)))
        assert np.isnan(got[0]).all(), f"id {bad}: logits not NaN"
    assert np.isfinite(clean).all()


# ---------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(setup):
    engine = setup[2]
    _assert_no_leak(engine)  # the engine tests above left it clean; from here on the server owns it
    app = create_app(engine, engine.tokenizer, model_name=MODEL, max_body_bytes=BODY_LIMIT)
    with running_server(app, log_level="critical", timeout=120) as (c, port):
        yield c, port, engine, app.state.runner
    _assert_no_leak(engine)


def _assert_openai_error(r, status, type_="invalid_request_error", words=""):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) >= {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == type_ and words in body["error"]["message"], body


def _raw(port, payload: bytes, read=False):
    """Send raw bytes on a fresh connection; return the response (``read``) or the open socket."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(payload)
    if not read:
        return s
    chunks = []
    while True:
        b = s.recv(65536)
        if not b:
            break
        chunks.append(b)
    s.close()
    return b"".join(chunks)


def _post_bytes(path, data: bytes, extra_headers=""):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(data)}\r\n{extra_headers}\r\n").encode() + data


def _idle(client, engine, runner, timeout=30.0):
    """Wait until the engine holds no request and the server no stream; assert /health is ok and shows it."""
    deadline = time.time() + timeout
    while engine.has_work or engine._by_id or runner._queues:
        assert time.time() < deadline, f"not idle: {engine.num_requests} requests, {len(runner._queues)} streams"
        time.sleep(0.05)
    h = client.get("/health")
    assert h.status_code == 200, h.text
    body = h.json()
    assert body["status"] == "ok" and body["running"] == body["waiting"] == body["tracked_requests"] == 0, body
    assert body["free_slots"] == body["max_batch"] == engine.max_batch and body["open_streams"] == 0, body
    return body


REF = {"model": MODEL, "prompt": "def main():", "max_tokens": 6, "temperature": 0, "ignore_eos": True}

BAD_FIELDS = [
    {"temperature": 1, "top_k": 2**31},
    {"top_k": -2},
    {"seed": -1},
    {"seed": 2**32},
    {"max_tokens": 2**31},
    {"max_tokens": 0},
    {"max_completion_tokens": -3},
    {"temperature": 1e9},
    {"temperature": "hot"},
    {"top_p": 0},
    {"top_p": 1.5},
    {"n": 0},
    {"logprobs": 2**31},
    {"logprobs": 6},
    {"stop_token_ids": [2**31]},
    {"stop_token_ids": [5000]},
    {"stop_token_ids": list(range(3, 12))},
    {"stop": ["x"] * 17},
    {"stop": "x" * 300},
    {"stop": ""},
    {"presence_penalty": 0.5},
    {"logit_bias": {"5": 10}},
    {"prompt": [5, -1]},
    {"prompt": [5, 2**40]},
]


@pytest.mark.parametrize("extra", BAD_FIELDS, ids=lambda d: ",".join(f"{k}={str(v)[:12]}" for k, v in d.items()))
def test_out_of_range_fields_get_400_and_the_engine_is_untouched(server, extra):
    client, _, engine, runner = server
    r = client.post("/v1/completions", json={**REF, **extra})
    _assert_openai_error(r, 400)
    assert client.get("/health").json()["status"] == "ok"


def test_chat_fields_and_non_finite_json_numbers_get_400(server):
    client, port, _, _ = server
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra in ({"top_logprobs": 10**12, "logprobs": True}, {"top_logprobs": 9, "logprobs": True},
                  {"temperature": 1, "top_k": 2**63}):
        _assert_openai_error(client.post("/v1/chat/completions", json={**chat, **extra}), 400)
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        raw = b'{"prompt": "x", "max_tokens": 1, "temperature": ' + literal + b"}"
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        _assert_openai_error(r, 400, words="temperature")


def test_every_error_body_is_openai_shaped(server):
    client, port, _, _ = server
    _assert_openai_error(client.get("/v1/nothing"), 404)
    r = client.get("/v1/completions")
    _assert_openai_error(r, 405)
    assert "POST" in r.headers.get("allow", "")
    headers = {"content-type": "application/json"}
    _assert_openai_error(client.post("/v1/completions", content=b'{"prompt": ', headers=headers), 400, words="JSON")
    _assert_openai_error(client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=headers), 400,
                         words="UTF-8")
    _assert_openai_error(client.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)


def test_oversized_bodies_get_413_before_parsing(server):
    client, port, engine, runner = server
    big = json.dumps({"prompt": "a" * (BODY_LIMIT + 10), "max_tokens": 1}).encode()
    headers = {"content-type": "application/json"}
    _assert_openai_error(client.post("/v1/completions", content=big, headers=headers), 413, words="too large")

    def chunks():  # no Content-Length: transfer-encoding chunked
        for i in range(0, len(big), 10000):
            yield big[i : i + 10000]

    r = client.post("/v1/completions", content=chunks(), headers=headers)
    _assert_openai_error(r, 413, words="while being received")
    # a body just under the limit is served
    ok = {"prompt": [5] * 8, "max_tokens": 1, "pad": "b" * (BODY_LIMIT - 200)}
    r = client.post("/v1/completions", json=ok)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    _idle(client, engine, runner)


def test_tokenization_runs_off_the_event_loop(server, monkeypatch):
    """A slow tokenization (2 s here) must not stall /health."""
    client, port, engine, runner = server
    tok = engine.tokenizer
    real = tok.encode

    def slow_encode(text, **kw):
        time.sleep(2.0)
        return real(text, **kw)

    monkeypatch.setattr(tok, "encode", slow_encode)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.post, "/v1/completions", json={"prompt": "slow", "max_tokens": 1})
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        waited = time.perf_counter() - t0
        r = fut.result()
    assert r.status_code == 200, r.text
    assert waited < 1.0, f"/health waited {waited:.2f} s behind a tokenization"


def _wait_running(engine, n, timeout=30.0):
    deadline = time.time() + timeout
    while engine.num_running < n:
        assert time.time() < deadline, "requests were not admitted"
        time.sleep(0.01)


def test_disconnects_free_their_slots(server):
    """Clients that go away, non-streaming and streaming, free their slots at the next engine step: the
    engine stops generating for them long before their max_tokens."""
    client, port, engine, runner = server
    before = engine.stats["decode_tokens"]
    body = {"prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    socks = [_raw(port, _post_bytes("/v1/completions", json.dumps(body).encode())) for _ in range(2)]
    stream = _raw(port, _post_bytes("/v1/completions", json.dumps({**body, "stream": True}).encode()))
    got = b""
    while b"data: " not in got:  # streaming has started
        got += stream.recv(4096)
    _wait_running(engine, 3)
    for s in [*socks, stream]:
        s.close()
    deadline = time.time() + 20
    while engine.has_work and time.time() < deadline:
        time.sleep(0.02)
    generated = engine.stats["decode_tokens"] - before
    assert generated < 3 * 120 // 2, f"{generated} tokens generated for abandoned requests"
    _idle(client, engine, runner)


def test_held_back_stop_prefix_is_flushed_over_http(server):
    client, _, _, _ = server
    if not STOP_CASE:
        pytest.skip("needs test_held_back_stop_prefix_is_flushed_when_a_stop_token_ends_generation")
    body = {"prompt": STOP_CASE["prompt"], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [STOP_CASE["stop_id"]], "stop": STOP_CASE["stop"]}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == STOP_CASE["want"], r.text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = _sse_events(s)
    assert "".join(c["choices"][0]["text"] for c in chunks) == STOP_CASE["want"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_health_is_degraded_only_while_the_engine_cannot_step(server, monkeypatch):
    """A failed decode call fails the requests in it (500 server_error) and /health answers 503 "degraded"
    until a decode step succeeds again; the process keeps serving."""
    client, _, engine, runner = server
    real, calls = engine._decode, {"n": 0}

    def fails_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode", fails_once)
    body = {"prompt": [5, 6, 9], "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    _assert_openai_error(client.post("/v1/completions", json=body), 500, type_="server_error", words="injected")
    h = client.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "degraded", h.text
    _assert_openai_error(h, 503, type_="server_error", words="decode step failed")
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    _idle(client, engine, runner)


def _sse_events(resp):
    datas = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", datas[-3:]
    return [json.loads(d) for d in datas[:-1]]


def test_load_and_fault(server, monkeypatch):
    """Concurrent streams with abusive requests mixed in; afterwards /health is ok, no slot or queue is
    leaked and the reference greedy request answers exactly what it answered before."""
    client, port, engine, runner = server
    ref = client.post("/v1/completions", json=REF)
    assert ref.status_code == 200, ref.text
    ref_text = ref.json()["choices"][0]["text"]

    real_emit = engine._emit

    def faulty_emit(req, token, out, row):
        if req.prompt[: len(FAULT_PROMPT)] == FAULT_PROMPT and req.output:
            raise RuntimeError("injected engine fault")
        return real_emit(req, token, out, row)

    monkeypatch.setattr(engine, "_emit", faulty_emit)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}

    def ref_stream():
        with client.stream("POST", "/v1/completions", json={**REF, "stream": True}) as s:
            assert s.status_code == 200
            return "".join(c["choices"][0]["text"] for c in _sse_events(s)) == ref_text

    def chat_stream(i):
        body = {**chat, "stream": True, "temperature": 0.8, "seed": i, "stop": ["zz"]}
        with client.stream("POST", "/v1/chat/completions", json=body) as s:
            chunks = _sse_events(s)
        return s.status_code == 200 and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    def plain_chat():
        r = client.post("/v1/chat/completions", json=chat)
        return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")

    def bad_field(extra):
        r = client.post("/v1/completions", json={**REF, **extra})
        return r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

    def oversized():  # the declared length alone is refused: the body is never sent
        head = _post_bytes("/v1/completions", b"")
        r = _raw(port, head.replace(b"Content-Length: 0", f"Content-Length: {10 * BODY_LIMIT}".encode()), read=True)
        return r.startswith(b"HTTP/1.1 413") and b"too large" in r

    def invalid_bytes(data):
        r = _raw(port, _post_bytes("/v1/chat/completions", data), read=True)
        return r.startswith(b"HTTP/1.1 400") and b'"invalid_request_error"' in r

    def drop(stream):
        body = {"prompt": [5, 6, 8], "max_tokens": 100, "ignore_eos": True, "stream": stream}
        s = _raw(port, _post_bytes("/v1/completions", json.dumps(body).encode()))
        if stream:
            s.recv(1024)
        else:
            time.sleep(0.2)
        s.close()
        return True

    def fault(stream):
        body = {"prompt": FAULT_PROMPT, "max_tokens": 6, "ignore_eos": True, "stream": stream}
        if not stream:
            r = client.post("/v1/completions", json=body)
            err = r.json()["error"]
            return r.status_code == 500 and err["type"] == "server_error" and "cmpl-" in err["message"]
        with client.stream("POST", "/v1/completions", json=body) as s:
            datas = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        last = json.loads(datas[-2])
        return datas[-1] == "[DONE]" and last["error"]["type"] == "server_error"

    jobs = [ref_stream] * 4 + [lambda i=i: chat_stream(i) for i in range(4)] + [plain_chat] * 2
    jobs += [lambda e=e: bad_field(e) for e in BAD_FIELDS]
    jobs += [oversized, lambda: invalid_bytes(b'{"messages": [\xff]}'), lambda: invalid_bytes(b"{nope")]
    jobs += [lambda: drop(True), lambda: drop(False), lambda: drop(False), lambda: fault(True), lambda: fault(False)]
    order = np.random.RandomState(0).permutation(len(jobs))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(jobs[i]) for i in order]
        results = [f.result(timeout=120) for f in futs]
    assert all(results), [i for i, ok in zip(order, results, strict=True) if not ok]

    monkeypatch.setattr(engine, "_emit", real_emit)
    _idle(client, engine, runner)
    again = client.post("/v1/completions", json=REF)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == ref_text
    assert engine.stats["failed_requests"] >= 2
