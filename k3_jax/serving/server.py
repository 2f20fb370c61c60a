"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`k3_jax.serving.engine.Engine`.

Endpoints: ``GET /health``, ``GET /metrics`` (Prometheus text: :mod:`k3_jax.serving.prometheus`),
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true``
server-sent events ending in ``data: [DONE]``). With an engine built with a prefix cache, every request reuses
the longest cached prefix of its prompt, so the turns of a conversation (each resending the history) reuse
the previous turns' prefill automatically.

Threading: the engine is single-threaded; :class:`AsyncEngine` owns it on one worker thread that admits
submitted requests, steps the engine while there is work, and hands each token event to the asyncio queue
of its request. Tokenization and request validation run in the default executor (never on the event loop);
detokenization runs on the engine thread. A bad request gets a 4xx and never touches the engine.

Robustness contract:
  * request bodies larger than ``max_body_bytes`` get 413 before any parsing (the ``Content-Length`` header is
    checked, and the bytes of a chunked body are counted as they arrive);
  * every sampling field has an explicit range (the schemas below, then :meth:`SamplingParams.validate`);
  * a request that fails inside the engine fails alone (500 ``server_error``, its id in the message and in
    the log); the others keep streaming;
  * a client that disconnects, streaming or not, aborts its request: its slot is free at the next step;
  * ``/health`` answers 200 ``{"status": "ok", ...slot occupancy}``, or 503 with ``"status": "degraded"``
    only while the engine cannot step (its thread died, or its last decode call failed).

Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``: 400 (invalid request, invalid
JSON or UTF-8), 404 (unknown model or route), 405, 413, 500 / 503 (``server_error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3_jax.serving.chat import ChatFormatError, chat_stop_ids
from k3_jax.serving.engine import Engine, RequestError, TokenEvent
from k3_jax.serving.media import MediaServingConfig, RequestMedia, chat_request_ids, check_media_tokenizer
from k3_jax.serving.prometheus import CONTENT_TYPE_LATEST, render
from k3_jax.serving.sampling import (
    INT32_MAX,
    MAX_STOP_IDS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    SamplingParams,
)
from k3_jax.vision.processor import ImageError

__all__ = ["AsyncEngine", "create_app", "DEFAULT_MAX_BODY_BYTES"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a 1M-character prompt fits; serve.py --max-request-bytes raises it


# ---------------------------------------------------------------------------------------------- engine loop
class _Failure:
    """Queue item ending a request with an HTTP error (``status``, OpenAI error ``type``, message)."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None):
        self.status, self.message, self.type, self.code = status, message, type_, code


_DISCONNECTED = object()  # queue item: the client went away


class AsyncEngine:
    """Runs an :class:`Engine` on a worker thread; ``submit`` returns an asyncio queue of events.

    Queue items: :class:`TokenEvent` (the last one has ``finished``; ``finish_reason == "error"`` when the
    engine failed the request) or a :class:`_Failure`. The thread never dies of a request: an exception the
    engine did not isolate fails the requests it holds, is logged, and the loop goes on.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.loop_error: str | None = None  # last step failure the engine did not isolate (None after a success)
        self._thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def degraded_reason(self) -> str | None:
        """Why the engine cannot step now, or None when it can."""
        if not self.alive:
            return "the engine thread is not running"
        if self.engine.degraded:
            return f"the last decode step failed: {self.engine.last_step_error}"
        if self.loop_error is not None:
            return f"the last engine step failed: {self.loop_error}"
        return None

    def occupancy(self) -> dict[str, int]:
        """Slot occupancy (read without a lock: a snapshot, exact when the engine is idle)."""
        e = self.engine
        return {
            "running": e.num_running,
            "waiting": e.num_waiting,
            "max_batch": e.max_batch,
            "free_slots": e.max_batch - e.num_running,
            "tracked_requests": e.num_requests,
            "open_streams": len(self._queues),
        }

    def submit(self, prompt: list[int], params: SamplingParams,
               media: RequestMedia | None = None) -> tuple[str, asyncio.Queue]:
        """Queue an already validated request (see :meth:`Engine.validate`); events arrive on the queue."""
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        self._inbox.put(("add", rid, prompt, params, media))
        self._wake.set()
        return rid, q

    def abort(self, rid: str) -> None:
        """Forget ``rid``'s queue and free its slot before the engine's next step."""
        self._queues.pop(rid, None)
        self._inbox.put(("abort", rid, None, None, None))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _deliver(self, rid: str, item: Any) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, q = target
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, rid, prompt, params, media = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                if op == "add":
                    if rid in self._queues:  # else aborted while queued
                        self.engine.add_request(prompt, params, request_id=rid, media=media)
                else:
                    self.engine.abort(rid)
            except RequestError as e:
                self._deliver(rid, _Failure(400, str(e), "invalid_request_error"))
                self._queues.pop(rid, None)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                logger.error("request %s: %s failed", rid, op, exc_info=e)
                self._deliver(rid, _Failure(500, f"request {rid} failed: {type(e).__name__}: {e}", "server_error"))
                self._queues.pop(rid, None)

    def _fail_all(self, exc: BaseException) -> None:
        """After an error the engine did not isolate: drop everything it holds, telling each client."""
        for rid in list(self.engine._by_id):
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
        msg = f"engine step failed: {type(exc).__name__}: {exc}"
        for rid in list(self._queues):
            self._deliver(rid, _Failure(500, f"request {rid}: {msg}", "server_error", "engine_error"))
            self._queues.pop(rid, None)

    def _run(self) -> None:
        while not self._stop:
            try:
                self._drain_inbox()
                if not self.engine.has_work:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                events = self.engine.step()
                self.loop_error = None
            except Exception as e:  # noqa: BLE001 - keep the thread alive; health says degraded meanwhile
                logger.error("engine step failed outside any one request; failing what it held", exc_info=e)
                self.loop_error = f"{type(e).__name__}: {e}"
                self._fail_all(e)
                time.sleep(0.05)
                continue
            for ev in events:
                self._deliver(ev.request_id, ev)
                if ev.finished:
                    self._queues.pop(ev.request_id, None)


# ---------------------------------------------------------------------------------------------- body limit
class BodySizeLimit:
    """ASGI middleware: HTTP bodies over ``max_bytes`` get 413 before the app parses anything.

    A ``Content-Length`` over the limit is refused before reading; otherwise the body is read (counting the
    bytes, so a chunked body is refused as soon as it passes the limit) and handed to the app in one piece.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _error_response(400, f"invalid Content-Length {length[:40]!r}")(scope, receive, send)
                return
            if declared > self.max_bytes:
                await self._too_large(f"Content-Length {declared} is over the limit", scope, receive, send)
                return
        chunks: list[bytes] = []
        total, tail = 0, None
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                tail = msg  # the client left before the body was complete: pass that on
                break
            chunks.append(msg.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes:
                await self._too_large("the body passed the limit while being received", scope, receive, send)
                return
            if not msg.get("more_body", False):
                break
        pending = [tail or {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, why: str, scope: dict, receive: Callable, send: Callable) -> None:
        resp = _error_response(
            413, f"request body too large: {why} of {self.max_bytes} bytes", code="request_too_large"
        )
        resp.headers["connection"] = "close"
        await resp(scope, receive, send)


# ---------------------------------------------------------------------------------------------- schemas
_StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
_TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
_Count = Annotated[int, Field(ge=0, le=INT32_MAX)]

# OpenAI / vLLM fields this server does not implement, with the values that mean "off": any other is refused
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
}


class _Base(BaseModel):
    """Fields shared by both endpoints, each with an explicit range (a value outside answers 400)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)  # 0 or -1 (vLLM's convention): off
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    stop: _StopString | Annotated[list[_StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[_TokenId], Field(max_length=MAX_STOP_IDS)] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=INT32_MAX)
    ignore_eos: bool = False


class CompletionRequest(_Base):
    prompt: str | list[int] | list[str]
    logprobs: _Count | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Base):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: _Count | None = None


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


def _error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None
) -> JSONResponse:
    """An OpenAI-shaped error; ``type`` defaults to ``server_error`` for 5xx, else ``invalid_request_error``."""
    type_ = type_ or ("server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(status_code=status, content=_error_body(message, type_, param, code))


async def _watch_disconnect(request: Request, q: asyncio.Queue) -> None:
    """Put ``_DISCONNECTED`` on ``q`` when the client of ``request`` goes away."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            q.put_nowait(_DISCONNECTED)
            return


# ---------------------------------------------------------------------------------------------- app
def create_app(
    engine: Engine, tokenizer: Any, model_name: str = "k3", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    media: MediaServingConfig | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model id ``model_name``.

    The engine should have been built with the same ``tokenizer`` (text deltas and stop strings).
    ``max_body_bytes``: larger request bodies get 413 before parsing. With a vision model, chat messages may hold
    image parts (:mod:`k3_jax.serving.media`; ``media``: the limits, default :class:`MediaServingConfig`); a
    tokenizer without the media markers raises here.
    """
    if engine.cfg.vision is not None:
        check_media_tokenizer(tokenizer, engine.cfg)
    media_cfg = media or MediaServingConfig()
    runner = AsyncEngine(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        runner.shutdown()

    app = FastAPI(title="k3-jax", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
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
        if first.get("type") == "json_invalid":
            why = (first.get("ctx") or {}).get("error", "")
            return _error_response(400, f"request body is not valid JSON: {why}", code="invalid_json")
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error_response(400, f"invalid request: {loc}: {first.get('msg', 'bad value')}", param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 400 and "parsing the body" in message:
            message = "request body could not be parsed: it must be UTF-8 encoded JSON"
        codes = {404: "not_found", 405: "method_not_allowed"}
        resp = _error_response(e.status_code, message, code=codes.get(e.status_code))
        resp.headers.update(e.headers or {})
        return resp

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, e: Exception) -> JSONResponse:
        eid = uuid.uuid4().hex[:12]
        logger.error("unhandled error %s on %s %s", eid, request.method, request.url.path, exc_info=e)
        return _error_response(500, f"internal server error (error id {eid}): {type(e).__name__}")

    @app.get("/health")
    async def health() -> JSONResponse:
        occ = runner.occupancy()
        reason = runner.degraded_reason()
        if reason is not None:
            body = {"status": "degraded", **occ, **_error_body(f"engine degraded: {reason}", "server_error")}
            return JSONResponse(status_code=503, content=body)
        return JSONResponse({"status": "ok", **occ})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(content=render(engine), media_type=CONTENT_TYPE_LATEST)

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

    def check_request(req: _Base) -> None:
        if req.model is not None and req.model != model_name:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        for field, value in (req.model_extra or {}).items():
            if field in _UNSUPPORTED and value not in _UNSUPPORTED[field]:
                raise APIError(400, f"{field}={value!r:.80} is not supported by this server", param=field)

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
                top_k=max(req.top_k, 0),
                seed=req.seed if req.seed is not None else int(uuid.uuid4().int % (2**32)),
                stop_token_ids=tuple(dict.fromkeys([*(req.stop_token_ids or ()), *extra_stop_ids])),
                stop=stop,
                logprobs=logprobs,
                ignore_eos=req.ignore_eos,
            ).validate(engine.cfg.vocab_size, engine.max_logprobs)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ")[0]) from e

    async def submit(make_ids: Callable[[], list[int] | tuple[list[int], RequestMedia | None]],
                     params: SamplingParams) -> tuple[list[int], str, asyncio.Queue]:
        """Tokenize (``make_ids``: ids, or ids and the request's media) and validate in the executor, then
        queue: ``(ids, request id, queue)``."""

        def prepare() -> tuple[list[int], RequestMedia | None]:
            out = make_ids()
            ids, media = out if isinstance(out, tuple) else (out, None)
            engine.validate(ids, params, media)
            return ids, media

        try:
            ids, media = await asyncio.to_thread(prepare)
        except (ChatFormatError, ImageError) as e:
            raise APIError(400, str(e), param="messages") from e
        except RequestError as e:
            raise APIError(400, str(e), param="prompt" if "prompt" in str(e) else None) from e
        try:
            rid, q = runner.submit(ids, params, media)
        except RuntimeError as e:
            raise APIError(503, str(e), type_="server_error", code="engine_unavailable") from e
        return ids, rid, q

    async def events(rid: str, q: asyncio.Queue, request: Request) -> AsyncIterator[TokenEvent]:
        watcher = asyncio.create_task(_watch_disconnect(request, q))
        try:
            while True:
                item = await q.get()
                if item is _DISCONNECTED:
                    return
                if isinstance(item, _Failure):
                    raise APIError(item.status, item.message, code=item.code, type_=item.type)
                if item.finish_reason == "error":
                    raise APIError(500, f"request {rid} failed in the engine: {item.error}", code="engine_error",
                                   type_="server_error")
                yield item
                if item.finished:
                    return
        finally:
            watcher.cancel()
            if rid in runner._queues:  # not finished: client gone or error
                runner.abort(rid)

    def tok_str(t: int) -> str:
        return tokenizer.token_bytes(t).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
        params = sampling(req, () if req.ignore_eos else eos, req.logprobs)
        text_prompt = prompt if isinstance(prompt, str) else None
        ids, rid, q = await submit(
            (lambda: tokenizer.encode(text_prompt)) if text_prompt is not None else (lambda: list(prompt)), params
        )
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

            return StreamingResponse(_guard(sse(), rid), media_type="text/event-stream")

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
        check_request(req)
        n_top = req.top_logprobs or 0
        params = sampling(req, () if req.ignore_eos else stop_chat, n_top if req.logprobs else None)
        messages = req.messages
        ids, rid, q = await submit(
            lambda: chat_request_ids(tokenizer, [m.model_dump(exclude_none=True) for m in messages], engine.cfg,
                                     media_cfg),
            params,
        )

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

            return StreamingResponse(_guard(sse(), rid), media_type="text/event-stream")

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


async def _guard(gen: AsyncIterator[str], rid: str) -> AsyncIterator[str]:
    """Turn an error in the middle of a stream into a final SSE error event (OpenAI error shape)."""
    try:
        async for chunk in gen:
            yield chunk
    except APIError as e:
        yield _sse(_error_body(e.message, e.type, e.param, e.code))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - the headers are sent: the error can only travel as an event
        logger.error("stream of request %s failed", rid, exc_info=e)
        yield _sse(_error_body(f"request {rid} failed: {type(e).__name__}", "server_error"))
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
