"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`k3_jax.serving.engine.Engine`.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``"stream": true`` server-sent events ending in ``data: [DONE]``).

Threading: the engine is single-threaded; :class:`AsyncEngine` owns it on one worker thread that admits
submitted requests, steps the engine while there is work, and hands each token event to the asyncio queue
of its request. Request validation happens before submission, so a bad request gets a 4xx and never
touches the engine. A client that disconnects mid-stream aborts its request.

Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with 400 (invalid request),
404 (unknown model) or 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from k3_jax.serving.chat import ChatFormatError, chat_prompt_ids, chat_stop_ids
from k3_jax.serving.engine import Engine, RequestError, TokenEvent
from k3_jax.serving.sampling import SamplingParams

__all__ = ["AsyncEngine", "create_app"]


# ---------------------------------------------------------------------------------------------- engine loop
class AsyncEngine:
    """Runs an :class:`Engine` on a worker thread; ``submit`` returns an asyncio queue of events."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Validate (raises :class:`RequestError`) and queue a request; events arrive on the queue."""
        if self.error is not None:
            raise RuntimeError(f"engine stopped after an error: {self.error!r}")
        self.engine.validate(prompt, params)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        self._inbox.put(("add", rid, prompt, params))
        self._wake.set()
        return rid, q

    def abort(self, rid: str) -> None:
        self._queues.pop(rid, None)
        self._inbox.put(("abort", rid, None, None))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _deliver(self, rid: str, item: Any) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _run(self) -> None:
        while not self._stop:
            while True:
                try:
                    op, rid, prompt, params = self._inbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    if op == "add":
                        self.engine.add_request(prompt, params, request_id=rid)
                    else:
                        self.engine.abort(rid)
                except RequestError as e:
                    self._deliver(rid, e)
            if not self.engine.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except BaseException as e:  # noqa: BLE001 - report to every waiting client, then stop
                self.error = e
                for rid in list(self._queues):
                    self._deliver(rid, e)
                return
            for ev in events:
                self._deliver(ev.request_id, ev)
                if ev.finished:
                    target = self._queues.get(ev.request_id)
                    if target is not None:
                        self._queues.pop(ev.request_id, None)


# ---------------------------------------------------------------------------------------------- schemas
class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None)
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    n: int = 1
    ignore_eos: bool = False


class CompletionRequest(_Base):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Base):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: Literal["invalid_request_error", "server_error"] = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, type_: str = "invalid_request_error"
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=body)


# ---------------------------------------------------------------------------------------------- app
def create_app(engine: Engine, tokenizer: Any, model_name: str = "k3") -> FastAPI:
    """The FastAPI app serving ``engine`` under the model id ``model_name``.

    The engine should have been built with the same ``tokenizer`` (text deltas and stop strings).
    """
    runner = AsyncEngine(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        runner.shutdown()

    app = FastAPI(title="k3-jax", version="0.1.0", lifespan=lifespan)
    app.state.runner = runner
    created = int(time.time())
    stop_chat = chat_stop_ids(tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error_response(400, f"invalid request: {loc}: {first.get('msg', 'bad value')}", param=loc or None)

    @app.get("/health")
    async def health() -> JSONResponse:
        if runner.error is not None:
            return _error_response(500, f"engine failed: {runner.error!r}", type_="server_error")
        return JSONResponse({"status": "ok", "running": engine.num_running})

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "k3-jax",
                    "max_model_len": engine.max_len,
                }
            ],
        }

    def check_model(req: _Base) -> None:
        if req.model is not None and req.model != model_name:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")

    def sampling(req: _Base, extra_stop_ids: tuple[int, ...], logprobs: int | None) -> SamplingParams:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:
            max_tokens = 16 if isinstance(req, CompletionRequest) else engine.max_len
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed if req.seed is not None else int(uuid.uuid4().int % (2**32)),
                stop_token_ids=tuple(dict.fromkeys([*(req.stop_token_ids or ()), *extra_stop_ids])),
                stop=stop,
                logprobs=logprobs,
                ignore_eos=req.ignore_eos,
            ).validate(engine.cfg.vocab_size, engine.max_logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def submit(prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        try:
            return runner.submit(prompt, params)
        except RequestError as e:
            raise APIError(400, str(e), param="prompt" if "prompt" in str(e) else None) from e
        except RuntimeError as e:
            raise APIError(500, str(e), type_="server_error") from e

    async def events(rid: str, q: asyncio.Queue, request: Request) -> AsyncIterator[TokenEvent]:
        try:
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if isinstance(item, BaseException):
                    raise APIError(400 if isinstance(item, RequestError) else 500, str(item))
                yield item
                if item.finished:
                    return
        finally:
            if rid in runner._queues:  # not finished: client gone or error
                runner.abort(rid)

    def tok_str(t: int) -> str:
        return tokenizer.token_bytes(t).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
        params = sampling(req, () if req.ignore_eos else eos, req.logprobs)
        rid, q = submit(ids, params)
        echo = req.prompt if (req.echo and isinstance(req.prompt, str)) else ""

        def logprob_block(evs: list[TokenEvent]) -> dict | None:
            if req.logprobs is None:
                return None
            return {
                "tokens": [tok_str(e.token) for e in evs],
                "token_logprobs": [e.logprob for e in evs],
                "top_logprobs": [{tok_str(i): v for i, v in (e.top_logprobs or [])} for e in evs],
            }

        if req.stream:

            async def sse() -> AsyncIterator[str]:
                if echo:
                    yield _sse(_completion_chunk(rid, created, model_name, echo, None, None))
                async for ev in events(rid, q, request):
                    yield _sse(
                        _completion_chunk(rid, created, model_name, ev.text, ev.finish_reason, logprob_block([ev]))
                    )
                yield "data: [DONE]\n\n"

            return StreamingResponse(_guard(sse()), media_type="text/event-stream")

        evs = [ev async for ev in events(rid, q, request)]
        text = echo + "".join(e.text for e in evs)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": logprob_block(evs),
                    "finish_reason": evs[-1].finish_reason if evs else "abort",
                }
            ],
            "usage": _usage(len(ids), len(evs)),
        }

    # ------------------------------------------------------------------ /v1/chat/completions
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req)
        try:
            ids = chat_prompt_ids(tokenizer, [m.model_dump(exclude_none=True) for m in req.messages])
        except ChatFormatError as e:
            raise APIError(400, str(e), param="messages") from e
        n_top = req.top_logprobs or 0
        params = sampling(req, () if req.ignore_eos else stop_chat, n_top if req.logprobs else None)
        rid, q = submit(ids, params)

        def lp_content(evs: list[TokenEvent]) -> dict | None:
            if not req.logprobs:
                return None
            return {
                "content": [
                    {
                        "token": tok_str(e.token),
                        "logprob": e.logprob,
                        "top_logprobs": [{"token": tok_str(i), "logprob": v} for i, v in (e.top_logprobs or [])],
                    }
                    for e in evs
                ]
            }

        if req.stream:

            async def sse() -> AsyncIterator[str]:
                yield _sse(_chat_chunk(rid, created, model_name, {"role": "assistant", "content": ""}, None))
                async for ev in events(rid, q, request):
                    delta = {"content": ev.text} if ev.text else {}
                    yield _sse(_chat_chunk(rid, created, model_name, delta, ev.finish_reason, lp_content([ev])))
                yield "data: [DONE]\n\n"

            return StreamingResponse(_guard(sse()), media_type="text/event-stream")

        evs = [ev async for ev in events(rid, q, request)]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(e.text for e in evs)},
                    "logprobs": lp_content(evs),
                    "finish_reason": evs[-1].finish_reason if evs else "abort",
                }
            ],
            "usage": _usage(len(ids), len(evs)),
        }

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _guard(gen: AsyncIterator[str]) -> AsyncIterator[str]:
    """Turn an error in the middle of a stream into a final SSE error event."""
    try:
        async for chunk in gen:
            yield chunk
    except APIError as e:
        yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        yield "data: [DONE]\n\n"


def _completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None, logprobs: dict | None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }


def _chat_chunk(
    rid: str, created: int, model: str, delta: dict, finish: str | None, logprobs: dict | None = None
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }
