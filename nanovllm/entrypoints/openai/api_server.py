"""The OpenAI-compatible HTTP server: FastAPI routes over an `EngineClient`, served by uvicorn.

Owns the routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
`/metrics`), the API-key check, turning prompts into token ids off the event loop (and refusing
what does not fit the context), turning engine outputs into OpenAI's responses and SSE chunks,
aborting requests whose client went away, and a graceful exit on SIGTERM/SIGINT. Request
shapes and error JSON come from `protocol.py`; connection and body limits, request ids and the
last-resort 500 from `http_guard.py`; the engine is reached only through the engine client held
in `app.state` (started and stopped by the app's lifespan).
"""
import asyncio
import hmac
import json
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from nanovllm import LLM
from nanovllm.engine.chat import BrokenChatTemplateError, ChatOptions, render_chat
from nanovllm.engine.outputs import RequestDelta, RequestOutput
from nanovllm.engine.request_builder import encode_text
from nanovllm.entrypoints.openai.engine_loop import EngineClient, EngineDeadError, QueueFullError, Submission
from nanovllm.entrypoints.openai.http_guard import (RequestGuard, connection_cap, guarded_protocol, install_log_limits,
                                             internal_error_message)
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.entrypoints.openai.protocol import (APIError, AssistantMessage, ChatCompletionChoice, ChatCompletionChunk,
                                           ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamChoice,
                                           ChatLogprobs, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                           CompletionResponse, DeltaMessage, ModelCard, ModelList, TokenLogprob,
                                           TopLogprob, UsageInfo, request_error, validation_error)
from nanovllm.entrypoints.openai.server_settings import (DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT,
                                                  RETRY_AFTER_SECONDS, ServerSettings)
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")

SSE_DONE = "data: [DONE]\n\n"  # OpenAI's end of a stream


# ---- app ----

def build_app(settings: ServerSettings) -> FastAPI:
    """The FastAPI app; its lifespan builds the engine (in the engine loop's thread) and frees it."""

    settings.check()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = EngineClient(lambda: LLM(settings.model, **settings.engine_kwargs), settings.max_queue_len,
                              app.state.metrics)
        await client.start()
        app.state.engine_client = client
        # Prompts are tokenized (and chat templates rendered) in a thread of their own, so a long
        # one never stalls the event loop (other streams) or the engine thread (every step).
        app.state.prompt_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanovllm-tokenize")
        try:
            # Tokenizers of the server's own, one per thread that uses it (a fast tokenizer is not
            # to be shared across threads; the engine's stays with the engine thread): this one for
            # logprob strings on the event loop, `prompt_tokenizer` in the prompt thread.
            app.state.tokenizer, app.state.prompt_tokenizer = (
                AutoTokenizer.from_pretrained(settings.model, use_fast=True, trust_remote_code=False)
                for _ in range(2))
            logger.info("engine ready: serving %r as model %r", settings.model, settings.model_name)
            yield
        finally:
            app.state.prompt_pool.shutdown(wait=False, cancel_futures=True)
            await client.shutdown()
            logger.info("engine stopped")

    app = FastAPI(title="nanovllm OpenAI-compatible server", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = ServerMetrics()
    app.add_middleware(RequestGuard, max_request_bytes=settings.max_request_bytes, body_timeout=settings.body_timeout)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(EngineDeadError, _engine_dead_handler)
    app.add_exception_handler(Exception, _internal_error_handler)
    app.include_router(_plain_router)
    app.include_router(_v1_router)
    return app


async def _check_api_key(request: Request) -> None:
    """The /v1 routes' dependency: the Bearer token must equal the key (compared in constant time)."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key; send it as 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


_plain_router = APIRouter()
_v1_router = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await _api_error_handler(request, validation_error(list(exc.errors())))


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return await _api_error_handler(request, APIError(exc.status_code, str(exc.detail), headers=exc.headers))


async def _engine_dead_handler(request: Request, exc: EngineDeadError) -> JSONResponse:
    # The cause (an exception's text) is for the log, which has it; the client learns the state.
    return await _api_error_handler(request, APIError(503, "the engine is not running; retry later",
                                                      type="server_error", code="engine_not_running"))


async def _internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # A last resort (RequestGuard answers a route's own bugs, with their traceback in the log): the
    # client gets OpenAI's error shape and the request id, never the exception's text.
    request_id = getattr(request.state, "request_id", "unknown")
    return await _api_error_handler(request, APIError(500, internal_error_message(request_id), type="server_error",
                                                      code="internal_error"))


@_plain_router.get("/health")
async def health(request: Request) -> Response:
    """200 while a new request can be served; 503 once the engine loop has stopped or a shutdown
    has begun (a failed request leaves it healthy: the engine serves on)."""
    client: EngineClient = request.app.state.engine_client
    return Response(status_code=200 if client.is_serving else 503)


@_plain_router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@_v1_router.get("/models")
async def list_models(request: Request) -> ModelList:
    client: EngineClient = request.app.state.engine_client
    return ModelList(data=[ModelCard(id=request.app.state.settings.model_name,
                                     max_model_len=client.config.max_model_len)])


# ---- shared request plumbing ----

def _check_model(request: Request, model: str | None) -> None:
    name = request.app.state.settings.model_name
    if model is not None and model != name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r}", param="model",
                       code="model_not_found")


async def _in_prompt_thread(request: Request, work: Callable, *args):
    """Run work(prompt_tokenizer, *args) in the prompt thread (tokenizing and chat templates)."""
    state = request.app.state
    return await asyncio.get_running_loop().run_in_executor(state.prompt_pool, work, state.prompt_tokenizer, *args)


def _encode(tokenizer: PreTrainedTokenizerBase, prompts: list[str | list[int]]) -> list[list[int]]:
    return [encode_text(tokenizer, p, "prompt") if isinstance(p, str) else p for p in prompts]  # as the engine does


def _fit_context(request: Request, params: SamplingParams, prompts: list[list[int]], requested: int | None,
                 default: int, prompt_field: str, max_tokens_field: str) -> SamplingParams:
    """`params` with max_tokens for these prompts: the one `requested`, refused (400) when prompt
    and completion outgrow the context, as vLLM; else `default`, cut to what the context leaves."""
    max_len = request.app.state.engine_client.config.max_model_len
    noun = "prompt" if prompt_field == "prompt" else "messages"
    for i, prompt in enumerate(prompts):
        which = f" {i}" if len(prompts) > 1 else ""
        if len(prompt) >= max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, the {noun}{which} "
                                f"has {len(prompt)} tokens, which leaves no room for a completion. Please reduce the "
                                f"length of the {noun}.", param=prompt_field, code="context_length_exceeded")
        if requested is not None and len(prompt) + requested > max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                                f"{len(prompt) + requested} tokens ({len(prompt)} in the {noun}{which}, {requested} "
                                f"for the completion). Please reduce the length of the {noun} or completion.",
                           param=max_tokens_field, code="context_length_exceeded")
    max_tokens = requested if requested is not None else min(default, max_len - max(map(len, prompts)))
    return params if max_tokens == params.max_tokens else replace(params, max_tokens=max_tokens)


async def _submit(request: Request, prompts: list, params: SamplingParams, request_id: str, fields: set[str],
                  prompt_field: str) -> Submission:
    client: EngineClient = request.app.state.engine_client
    try:
        return await client.add(prompts, params, request_id)
    except ValueError as exc:
        raise request_error(exc, fields, prompt_field) from None
    except QueueFullError as exc:
        request.app.state.metrics.requests_rejected.inc()
        raise APIError(503, str(exc), type="server_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Response], submission: Submission) -> Response:
    """Await a non-streaming response, aborting the requests if the client goes away first (or
    the handler is cancelled, as at the end of a shutdown's grace period)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        logger.info("client went away; aborting %s", submission.request_ids)
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    finally:
        work_task.cancel()
        watch_task.cancel()
        request.app.state.engine_client.abort(list(submission.unfinished))


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _check_finals(state, finals: list[RequestOutput], request_id: str) -> None:
    """A non-streaming response's outcome when it is not a plain success: a request the engine
    failed is a 500 with the engine's message (its request id in it), one the shutdown aborted a
    503; both in OpenAI's error JSON."""
    error = next((final.error for final in finals if final.error is not None), None)
    if error is not None:
        raise APIError(500, error, type="server_error")
    aborted = any(s.finish_reason == "abort" for final in finals for s in final.outputs)
    if aborted and state.engine_client.shutting_down:
        raise APIError(503, f"the server is shutting down; request {request_id} was aborted before it finished",
                       type="server_error")


def _error_event(error: str) -> str:
    """The SSE event that ends a stream whose request the engine failed (after its "abort" chunk)."""
    return _sse(APIError(500, error, type="server_error").body())


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _completion_logprobs(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], entries: list[dict | None],
                         offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: per token its text, logprob, top alternatives (the chosen one
    included, as vLLM) and character offset. A None entry (an echoed prompt token) has no logprob."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(entry["logprob"])
        alternatives = {_token_text(tokenizer, t): lp for t, lp in entry["top_logprobs"].items()}
        alternatives.setdefault(text, entry["logprob"])
        top.append(alternatives)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)


def _chat_logprobs(tokenizer: PreTrainedTokenizerBase, entries: list[dict]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = _token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
    return ChatLogprobs(content=[
        TokenLogprob(**top(e["token_id"], e["logprob"]).model_dump(),
                     top_logprobs=[top(t, lp) for t, lp in e["top_logprobs"].items()])
        for e in entries])


# ---- /v1/completions ----

_COMPLETION_FIELDS = set(CompletionRequest.model_fields)


@_v1_router.post("/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    _check_model(request, body.model)
    prompts = body.prompts()
    requested = body.max_tokens if "max_tokens" in body.model_fields_set else None
    try:
        params = body.to_sampling_params()
        prompt_ids = await _in_prompt_thread(request, _encode, prompts)
        params = _fit_context(request, params, prompt_ids, requested, params.max_tokens, "prompt", "max_tokens")
    except ValueError as exc:
        raise request_error(exc, _COMPLETION_FIELDS) from None
    request_id = f"cmpl-{request.state.request_id}"
    submission = await _submit(request, prompt_ids, params, request_id, _COMPLETION_FIELDS, "prompt")
    state = request.app.state
    if body.stream:
        return _sse_response(_completion_events(state, body, params, prompts, submission, request_id))
    return await _unless_disconnected(
        request, _completion_response(state, body, params, prompts, submission, request_id), submission)


def _prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


async def _completion_response(state, body: CompletionRequest, params: SamplingParams, prompts: list,
                               submission: Submission, request_id: str) -> Response:
    finals: list[RequestOutput | None] = [None] * len(prompts)
    async for output in submission:
        if output.finished:
            finals[submission.index(output.request_id)] = output.final
    _check_finals(state, finals, request_id)
    tokenizer = state.tokenizer
    choices = []
    for i, final in enumerate(finals):
        prompt_text = _prompt_text(tokenizer, prompts[i]) if body.echo else ""
        for j, sample in enumerate(final.outputs):
            logprobs = None
            if params.logprobs is not None:
                ids, entries = sample.token_ids, list(sample.logprobs)
                if body.echo:
                    ids, entries = final.prompt_token_ids + ids, [None] * len(final.prompt_token_ids) + entries
                logprobs = _completion_logprobs(tokenizer, ids, entries, 0)
            choices.append(CompletionChoice(index=i * params.n + j, text=prompt_text + sample.text,
                                            logprobs=logprobs, finish_reason=sample.finish_reason,
                                            stop_reason=sample.stop_reason))
    usage = _usage(sum(len(f.prompt_token_ids) for f in finals),
                   sum(len(s.token_ids) for f in finals for s in f.outputs))
    response = CompletionResponse(id=request_id, model=state.settings.model_name, choices=choices, usage=usage)
    return JSONResponse(response.model_dump())


async def _completion_events(state, body: CompletionRequest, params: SamplingParams, prompts: list,
                             submission: Submission, request_id: str) -> AsyncIterator[str]:
    tokenizer, model = state.tokenizer, state.settings.model_name
    offsets: dict[int, int] = {}  # choice index -> characters sent so far (for logprobs' text_offset)
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    error = None  # the engine's message, if it failed one of the prompts
    try:
        async for output in submission:
            error = error or output.error
            i = submission.index(output.request_id)
            prompt_tokens[i] = len(output.prompt_token_ids)
            for sample in output.samples:
                choice = i * params.n + sample.index
                text, ids, entries = sample.text, sample.token_ids, list(sample.logprobs)
                completion_tokens += len(ids)
                if choice not in offsets:  # the first chunk of this choice
                    offsets[choice] = 0
                    if body.echo:
                        text = _prompt_text(tokenizer, prompts[i]) + text
                        ids = output.prompt_token_ids + ids
                        entries = [None] * len(output.prompt_token_ids) + entries
                logprobs = None
                if params.logprobs is not None and ids:
                    logprobs = _completion_logprobs(tokenizer, ids, entries, offsets[choice])
                offsets[choice] += len(text)
                if not (text or logprobs or sample.finished):
                    continue  # text held back (a partial character or a possible stop string)
                chunk = CompletionChoice(index=choice, text=text, logprobs=logprobs,
                                         finish_reason=sample.finish_reason if sample.finished else None,
                                         stop_reason=sample.stop_reason if sample.finished else None)
                yield _sse(CompletionResponse(id=request_id, model=model, choices=[chunk]))
        if error is not None:
            yield _error_event(error)
        elif body.include_usage:
            usage = _usage(sum(prompt_tokens.values()), completion_tokens)
            yield _sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
    except EngineDeadError as exc:
        yield _sse(APIError(503, str(exc), type="server_error").body())
    finally:  # normally nothing is left; after a disconnect (cancellation) everything is
        state.engine_client.abort(list(submission.unfinished))
    yield SSE_DONE


# ---- /v1/chat/completions ----

_CHAT_FIELDS = set(ChatCompletionRequest.model_fields)


def _chat_prompt(tokenizer: PreTrainedTokenizerBase, body: ChatCompletionRequest) -> list[int]:
    """The conversation rendered by the tokenizer's chat template, as token ids (as LLM.chat does)."""
    try:
        return render_chat(tokenizer, body.conversation(), ChatOptions(add_generation_prompt=body.add_generation_prompt))
    except BrokenChatTemplateError as exc:  # the model's template is broken: the server's fault, not the client's
        logger.error("%s", exc)
        raise APIError(500, "this model's chat template is broken; the server's log has the details",
                       type="server_error", code="chat_template_error") from None
    except ValueError as exc:  # no template, or the template's own refusal
        raise APIError(400, f"messages: {exc}", param="messages") from None


@_v1_router.post("/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    _check_model(request, body.model)
    state = request.app.state
    client: EngineClient = state.engine_client
    given = next((name for name in ("max_completion_tokens", "max_tokens") if getattr(body, name) is not None),
                 "max_tokens")
    try:
        params = body.to_sampling_params(default_max_tokens=client.config.max_model_len)  # checked before any work
        prompt = await _in_prompt_thread(request, _chat_prompt, body)
        # With no max_tokens, the answer may fill what the context (and the KV cache) has left.
        room = min(client.config.max_model_len, client.cache_capacity_tokens) - len(prompt)
        params = _fit_context(request, params, [prompt], getattr(body, given), max(room, 1), "messages", given)
    except ValueError as exc:
        raise request_error(exc, _CHAT_FIELDS, "messages") from None
    request_id = f"chatcmpl-{request.state.request_id}"
    submission = await _submit(request, [prompt], params, request_id, _CHAT_FIELDS, "messages")
    if body.stream:
        return _sse_response(_chat_events(state, body, params, submission, request_id))
    return await _unless_disconnected(request, _chat_response(state, params, submission, request_id), submission)


async def _final_output(submission: Submission) -> RequestOutput:
    async for output in submission:
        if output.finished:
            return output.final
    raise AssertionError("a submission ended without a final output")


async def _chat_response(state, params: SamplingParams, submission: Submission, request_id: str) -> Response:
    final = await _final_output(submission)
    _check_finals(state, [final], request_id)
    choices = []
    for j, sample in enumerate(final.outputs):
        logprobs = _chat_logprobs(state.tokenizer, sample.logprobs) if params.logprobs is not None else None
        choices.append(ChatCompletionChoice(index=j, message=AssistantMessage(content=sample.text),
                                            logprobs=logprobs, finish_reason=sample.finish_reason,
                                            stop_reason=sample.stop_reason))
    usage = _usage(len(final.prompt_token_ids), sum(len(s.token_ids) for s in final.outputs))
    response = ChatCompletionResponse(id=request_id, model=state.settings.model_name, choices=choices, usage=usage)
    return JSONResponse(response.model_dump())


async def _chat_events(state, body: ChatCompletionRequest, params: SamplingParams, submission: Submission,
                       request_id: str) -> AsyncIterator[str]:
    model = state.settings.model_name

    def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        return _sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    prompt_tokens = completion_tokens = 0
    error = None  # the engine's message, if it failed the request
    try:
        # OpenAI's first chunk of each choice carries the role and no text.
        yield chunk([ChatCompletionStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                     for j in range(params.n)])
        output: RequestDelta
        async for output in submission:
            error = error or output.error
            prompt_tokens = len(output.prompt_token_ids)
            for sample in output.samples:
                completion_tokens += len(sample.token_ids)
                logprobs = None
                if params.logprobs is not None and sample.logprobs:
                    logprobs = _chat_logprobs(state.tokenizer, sample.logprobs)
                if not (sample.text or logprobs or sample.finished):
                    continue
                yield chunk([ChatCompletionStreamChoice(
                    index=sample.index, delta=DeltaMessage(content=sample.text or None), logprobs=logprobs,
                    finish_reason=sample.finish_reason if sample.finished else None,
                    stop_reason=sample.stop_reason if sample.finished else None)])
        if error is not None:
            yield _error_event(error)
        elif body.include_usage:
            yield chunk([], _usage(prompt_tokens, completion_tokens))
    except EngineDeadError as exc:
        yield _sse(APIError(503, str(exc), type="server_error").body())
    finally:
        state.engine_client.abort(list(submission.unfinished))
    yield SSE_DONE


# ---- running it ----

def listening_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before the engine is built: the port is known (and can be 0 for any free
    one) and early clients wait in the backlog instead of being refused."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(socket.SOMAXCONN)
    return sock


def uvicorn_config(app: FastAPI, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, log_level: str = "info",
                   max_connections: int | None = None) -> uvicorn.Config:
    """uvicorn's settings for `app` (from build_app): its HTTP protocol guarded by the connection
    cap (`max_connections`, default the app's setting) and the header timeout."""
    settings: ServerSettings = app.state.settings
    install_log_limits()
    protocol = guarded_protocol(AutoHTTPProtocol, max_connections or settings.max_connections, settings.header_timeout)
    return uvicorn.Config(app, http=protocol, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout)


# Before the shutdown grace period ends, what still runs is aborted this many seconds early (at
# most half the period), so every response ends properly (a last "abort" chunk and [DONE], or a
# 503) instead of being cancelled mid-way by uvicorn.
SHUTDOWN_ABORT_MARGIN_S = 1.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown aborts the requests still running shortly before its
    grace period (timeout_graceful_shutdown) runs out: they end with finish_reason "abort" while
    their connections are still served, and nothing is left for uvicorn to cancel."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.config.timeout_graceful_shutdown
        timer = None
        if grace is not None:
            delay = grace - min(SHUTDOWN_ABORT_MARGIN_S, grace / 2)
            timer = asyncio.get_running_loop().call_later(delay, _abort_for_shutdown, self.config.app)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def _abort_for_shutdown(app: FastAPI) -> None:
    client: EngineClient | None = getattr(app.state, "engine_client", None)
    if client is not None and client.is_running:
        logger.info("shutdown grace period ending: aborting the requests still running")
        client.begin_shutdown()


def serve(settings: ServerSettings, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, log_level: str = "info") -> int:
    """Run the server until SIGTERM/SIGINT; then stop accepting, give in-flight requests
    `shutdown_timeout` seconds, abort the rest, free the engine and return 0."""
    sock = listening_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    logger.info("listening on http://%s:%d (requests wait until the engine is ready)", url_host, bound_port)
    server = GracefulServer(uvicorn_config(build_app(settings), shutdown_timeout, log_level,
                                           connection_cap(settings.max_connections)))
    # uvicorn handles the signal (graceful shutdown), then re-raises it to the handlers it found
    # in place. These take it quietly, so a requested shutdown ends with exit status 0.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, frame: received.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if not server.started:  # the lifespan (building the engine) failed; uvicorn has logged why
        return 1
    return 0
