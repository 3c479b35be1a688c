"""The OpenAI-compatible HTTP server: FastAPI routes over an `EngineClient`, served by uvicorn.

Owns the routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models[/{id}]`, `/health`,
`/metrics`, `/version`), the API-key check, turning prompts into token ids off the event loop
(and refusing what does not fit the context), turning engine outputs into OpenAI's responses and
SSE chunks (a chat answer split by the --reasoning-parser, from `reasoning.py`), aborting
requests whose client went away, and a graceful exit on SIGTERM/SIGINT. A request's
structured-outputs constraint is compiled in the prompt thread before it is queued (a 400 if it
does not compile); tools and tool_choice are planned and their calls parsed by
`serving_tools.py`. Request shapes and error JSON come from `protocol.py`; connection and body
limits, request ids and the last-resort 500 from `http_guard.py`; /tokenize and /detokenize from
`serving_tokens.py`; the engine is reached only through the engine client held in `app.state`
(started and stopped by the app's lifespan).
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
from functools import partial

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from nanovllm import LLM, __version__
from nanovllm.config import Config
from nanovllm.engine.chat import load_chat_template
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
                                           TopLogprob, UsageInfo, constraint_error, request_error,
                                           validation_error)
from nanovllm.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningDelta, TagReasoningParser
from nanovllm.entrypoints.openai.serving_common import check_model as _check_model
from nanovllm.entrypoints.openai.serving_common import check_request_template, render_request_chat
from nanovllm.entrypoints.openai.serving_common import in_prompt_thread as _in_prompt_thread
from nanovllm.entrypoints.openai.serving_tokens import router as tokens_router
from nanovllm.entrypoints.openai.serving_tools import ToolDeltas, ToolOutput, ToolPlan, finish_reason, plan_tools
from nanovllm.entrypoints.openai.server_settings import (DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT,
                                                  RETRY_AFTER_SECONDS, ServerSettings)
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs import GrammarCompiler

logger = logging.getLogger("nanovllm")

SSE_DONE = "data: [DONE]\n\n"  # OpenAI's end of a stream


# ---- app ----

def build_app(settings: ServerSettings) -> FastAPI:
    """The FastAPI app; its lifespan builds the engine (in the engine loop's thread) and frees it."""

    settings.check()
    chat_template = None if settings.chat_template is None else load_chat_template(settings.chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = EngineClient(partial(LLM, settings.model, **settings.engine_kwargs), settings.max_queue_len,
                              app.state.metrics, engine_process=settings.engine_process)
        await client.start()
        app.state.engine_client = client
        # Prompts are tokenized (and chat templates rendered) in a thread of their own, so a long
        # one never stalls the event loop (other streams) or, in-process, the engine's thread.
        app.state.prompt_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanovllm-tokenize")
        try:
            # Tokenizers of the server's own, one per thread that uses it (a fast tokenizer is not
            # to be shared across threads; the engine's stays with the engine): this one for
            # logprob strings on the event loop, `prompt_tokenizer` in the prompt thread.
            app.state.tokenizer, app.state.prompt_tokenizer = (
                AutoTokenizer.from_pretrained(settings.model, use_fast=True, trust_remote_code=False)
                for _ in range(2))
            app.state.grammars = (client.grammars if client.grammars is not None
                                  else await _server_grammars(app.state, client.config))
            logger.info("engine ready: serving %r as model %r", settings.model, settings.model_name)
            yield
        finally:
            app.state.prompt_pool.shutdown(wait=False, cancel_futures=True)
            await client.shutdown()
            logger.info("engine stopped")

    app = FastAPI(title="nanovllm OpenAI-compatible server", lifespan=lifespan)
    app.state.settings = settings
    app.state.chat_template = chat_template  # --chat-template's text (None: the checkpoint's own)
    app.state.metrics = ServerMetrics()
    app.add_middleware(RequestGuard, max_request_bytes=settings.max_request_bytes, body_timeout=settings.body_timeout)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(EngineDeadError, _engine_dead_handler)
    app.add_exception_handler(Exception, _internal_error_handler)
    app.include_router(_plain_router)
    app.include_router(_v1_router)
    # vLLM serves these outside /v1; here they take the same API key as /v1 (they do work for anyone).
    app.include_router(tokens_router, dependencies=[Depends(_check_api_key)])
    return app


async def _server_grammars(state, config: Config) -> GrammarCompiler:
    """A structured-outputs compiler of the server's own, beside an engine in its own process: the
    prompt thread compiles each request's constraint with it, so one that does not compile is a
    400 before the engine sees it (the engine compiles it again, for itself)."""
    grammars = GrammarCompiler(state.prompt_tokenizer, config.hf_config.vocab_size, config.eos)
    try:
        await asyncio.get_running_loop().run_in_executor(state.prompt_pool, grammars.load)
    except Exception:  # as the engine: each constrained request is refused with why
        logger.warning("structured outputs are unavailable for this tokenizer", exc_info=True)
    return grammars


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


@_plain_router.get("/version")
async def version() -> dict:
    return {"version": __version__}


def _model_card(request: Request) -> ModelCard:
    return ModelCard(id=request.app.state.settings.model_name,
                     max_model_len=request.app.state.engine_client.config.max_model_len)


@_v1_router.get("/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_model_card(request)])


@_v1_router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    _check_model(request, model_id)
    return _model_card(request)


# ---- shared request plumbing ----

def _encode(tokenizer: PreTrainedTokenizerBase, prompts: list[str | list[int]],
            add_special_tokens: bool = True) -> list[list[int]]:
    # as the engine does (with the tokenizer's special tokens, unless asked not to)
    return [encode_text(tokenizer, p, "prompt", add_special_tokens=add_special_tokens) if isinstance(p, str) else p
            for p in prompts]


def _truncate(request: Request, prompts: list[list[int]], keep: int | None) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: the last max_model_len)."""
    if keep is None:
        return prompts
    max_len = request.app.state.engine_client.config.max_model_len
    if keep == 0 or keep > max_len:
        raise APIError(400, f"truncate_prompt_tokens={keep} is not allowed; it must be in [1, max_model_len={max_len}]"
                            " or -1 (keep the last max_model_len tokens)", param="truncate_prompt_tokens")
    keep = max_len if keep == -1 else keep
    return [prompt[-keep:] for prompt in prompts]


async def _compile_constraint(request: Request, params: SamplingParams, source: str | None) -> None:
    """Compile the request's structured-outputs constraint in the prompt thread, off the event loop
    and the engine's (xgrammar caches it, so the engine's own compile as it builds the request is a
    lookup); one that does not compile is a 400 naming the request field that gave it."""
    if params.structured_outputs is None:
        return
    state = request.app.state
    try:
        await asyncio.get_running_loop().run_in_executor(state.prompt_pool, state.grammars.compile,
                                                         params.structured_outputs)
    except ValueError as exc:
        raise APIError(400, constraint_error(str(exc), source), param=source) from None


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
                  prompt_field: str, priority: int = 0) -> Submission:
    client: EngineClient = request.app.state.engine_client
    try:
        return await client.add(prompts, params, request_id, priority)
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


def _sse(payload: BaseModel | dict, with_usage: bool = True) -> str:
    """One SSE event. A stream chunk carries "usage" only when the client asked for it
    (stream_options.include_usage), as OpenAI's."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude=None if with_usage else {"usage"})
    else:
        data = json.dumps(payload)
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
        alternatives: dict[str, float] = {}
        for t, lp in entry["top_logprobs"].items():  # most likely first: of tokens with one text, it stays
            alternatives.setdefault(_token_text(tokenizer, t), lp)
        alternatives.setdefault(text, entry["logprob"])
        top.append(alternatives)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)


def _echoed_entries(prompt_token_ids: list[int], prompt_logprobs: list[dict | None] | None) -> list[dict | None]:
    """An echoed prompt's entries for _completion_logprobs: None for the first token (and for every
    token when the prompt has no logprobs), else the token's logprob and its top alternatives."""
    if prompt_logprobs is None:
        return [None] * len(prompt_token_ids)
    entries: list[dict | None] = [None]
    for token_id, position in zip(prompt_token_ids[1:], prompt_logprobs[1:]):
        top = sorted(position.items(), key=lambda item: -item[1]["logprob"])  # most likely first
        entries.append({"logprob": position[token_id]["logprob"], "top_logprobs": {t: info["logprob"] for t, info in top}})
    return entries


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
    if requested == 0:  # echo alone (to_sampling_params refuses it otherwise): one token is run, then dropped
        requested = 1
    try:
        params = body.to_sampling_params()
        await _compile_constraint(request, params, (body.constraint() or (None,))[0])
        prompt_ids = await _in_prompt_thread(request, _encode, prompts, body.add_special_tokens)
        if body.truncate_prompt_tokens is not None:  # echo shows the prompt the model saw
            prompts = prompt_ids = _truncate(request, prompt_ids, body.truncate_prompt_tokens)
        params = _fit_context(request, params, prompt_ids, requested, params.max_tokens, "prompt", "max_tokens")
    except ValueError as exc:
        raise request_error(exc, _COMPLETION_FIELDS) from None
    request_id = f"cmpl-{request.state.request_id}"
    submission = await _submit(request, prompt_ids, params, request_id, _COMPLETION_FIELDS, "prompt", body.priority)
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
    echo_only = body.echo_only  # the one token sampled is dropped: the prompt alone
    for i, final in enumerate(finals):
        prompt_text = _prompt_text(tokenizer, prompts[i]) if body.echo else ""
        for j, sample in enumerate(final.outputs):
            logprobs = None
            ids, text = ([], "") if echo_only else (sample.token_ids, sample.text)
            if params.logprobs is not None:
                entries = [] if echo_only else list(sample.logprobs)
                if body.echo:
                    prompt_ids = final.prompt_token_ids
                    ids, entries = prompt_ids + ids, _echoed_entries(prompt_ids, final.prompt_logprobs) + entries
                logprobs = _completion_logprobs(tokenizer, ids, entries, 0)
            choices.append(CompletionChoice(
                index=i * params.n + j, text=prompt_text + text, logprobs=logprobs,
                finish_reason="length" if echo_only else sample.finish_reason,
                stop_reason=None if echo_only else sample.stop_reason,
                prompt_logprobs=final.prompt_logprobs if body.prompt_logprobs is not None else None))
    usage = _usage(sum(len(f.prompt_token_ids) for f in finals),
                   0 if echo_only else sum(len(s.token_ids) for f in finals for s in f.outputs))
    response = CompletionResponse(id=request_id, model=state.settings.model_name, choices=choices, usage=usage)
    return JSONResponse(response.model_dump())


async def _completion_events(state, body: CompletionRequest, params: SamplingParams, prompts: list,
                             submission: Submission, request_id: str) -> AsyncIterator[str]:
    tokenizer, model = state.tokenizer, state.settings.model_name
    offsets: dict[int, int] = {}  # choice index -> characters sent so far (for logprobs' text_offset)
    prompt_tokens: dict[int, int] = {}
    prompt_logprobs: dict[int, list] = {}  # prompt index -> its prompt logprobs, once they came
    completion_tokens = 0
    echo_only = body.echo_only  # the one token sampled is dropped: the prompt alone
    error = None  # the engine's message, if it failed one of the prompts
    try:
        async for output in submission:
            error = error or output.error
            i = submission.index(output.request_id)
            prompt_tokens[i] = len(output.prompt_token_ids)
            if output.prompt_logprobs is not None:  # with the first token (sample 0's is never behind)
                prompt_logprobs[i] = output.prompt_logprobs
            for sample in output.samples:
                choice = i * params.n + sample.index
                text, ids, entries = sample.text, sample.token_ids, list(sample.logprobs)
                if echo_only:
                    text, ids, entries = "", [], []
                completion_tokens += len(ids)
                first_chunk = choice not in offsets
                if first_chunk:
                    offsets[choice] = 0
                    if body.echo:
                        text = _prompt_text(tokenizer, prompts[i]) + text
                        ids = output.prompt_token_ids + ids
                        entries = _echoed_entries(output.prompt_token_ids, prompt_logprobs.get(i)) + entries
                logprobs = None
                if params.logprobs is not None and ids:
                    logprobs = _completion_logprobs(tokenizer, ids, entries, offsets[choice])
                offsets[choice] += len(text)
                if not (text or ids or sample.finished):
                    continue  # no new token (echo_only's empty chunk)
                # A new token whose text is held back (a partial character, a possible stop string)
                # still sends a chunk, with empty text, as vLLM does: one chunk per token per step.
                finish_reason = ("length" if echo_only else sample.finish_reason) if sample.finished else None
                chunk = CompletionChoice(index=choice, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                         stop_reason=sample.stop_reason if sample.finished and not echo_only else None,
                                         prompt_logprobs=prompt_logprobs.get(i) if first_chunk and
                                         body.prompt_logprobs is not None else None)
                yield _sse(CompletionResponse(id=request_id, model=model, choices=[chunk]),
                           with_usage=body.include_usage)
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


def _chat_prompt(tokenizer: PreTrainedTokenizerBase, body: ChatCompletionRequest, server_template: str | None,
                 tools: list[dict] | None) -> list[int]:
    """The conversation rendered by the chat template (the request's, the server's --chat-template
    or the tokenizer's), with the tools the plan hands it, as token ids (as LLM.chat does)."""
    return render_request_chat(tokenizer, body.conversation(), body.chat_options(server_template, tools),
                               from_request=body.chat_template is not None)


@_v1_router.post("/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    _check_model(request, body.model)
    state = request.app.state
    client: EngineClient = state.engine_client
    given = next((name for name in ("max_completion_tokens", "max_tokens") if getattr(body, name) is not None),
                 "max_tokens")
    check_request_template(request, body.chat_template)
    try:
        plan = plan_tools(body, state.settings.tool_call_parser)
        structured = plan.structured if plan is not None else None
        # checked before any work
        params = body.to_sampling_params(default_max_tokens=client.config.max_model_len, structured=structured)
        await _compile_constraint(request, params, "tools" if structured is not None else (body.constraint() or
                                                                                            (None,))[0])
        prompt = await _in_prompt_thread(request, _chat_prompt, body, state.chat_template,
                                         plan.tools if plan is not None else None)
        prompt = _truncate(request, [prompt], body.truncate_prompt_tokens)[0]
        # With no max_tokens, the answer may fill what the context (and the KV cache) has left.
        room = min(client.config.max_model_len, client.cache_capacity_tokens) - len(prompt)
        params = _fit_context(request, params, [prompt], getattr(body, given), max(room, 1), "messages", given)
    except ValueError as exc:
        raise request_error(exc, _CHAT_FIELDS, "messages") from None
    request_id = f"chatcmpl-{request.state.request_id}"
    reasoning = _reasoning_parser_factory(state, body, prompt)
    submission = await _submit(request, [prompt], params, request_id, _CHAT_FIELDS, "messages", body.priority)
    if body.stream:
        return _sse_response(_chat_events(state, body, params, submission, request_id, reasoning, plan))
    return await _unless_disconnected(
        request, _chat_response(state, body, params, submission, request_id, reasoning, plan), submission)


# Prompt tokens decoded to see whether the template opened the reasoning itself: a start tag
# (and the whitespace after it) is a few tokens.
REASONING_PROMPT_TAIL_TOKENS = 8
ReasoningParserFactory = Callable[[], TagReasoningParser]


def _reasoning_parser_factory(state, body: ChatCompletionRequest, prompt: list[int]) -> ReasoningParserFactory | None:
    """A new reasoning parser per sample, with --reasoning-parser; None without one."""
    if state.settings.reasoning_parser is None:
        return None
    parser_class = REASONING_PARSERS[state.settings.reasoning_parser]
    tail = state.tokenizer.decode(prompt[-REASONING_PROMPT_TAIL_TOKENS:])
    return lambda: parser_class(tail)


def _assistant_message(text: str, body: ChatCompletionRequest, reasoning: ReasoningParserFactory | None
                       ) -> AssistantMessage:
    if reasoning is None:
        return AssistantMessage(content=body.echoed() + text)
    parts = reasoning().split(text)
    return AssistantMessage(content=(body.echoed() + parts.content) or None,
                            reasoning_content=(parts.reasoning or None) if body.include_reasoning else None)


def _stream_deltas(text: str, finished: bool, parser: TagReasoningParser | None, include_reasoning: bool
                   ) -> list[DeltaMessage]:
    """One sample's news as delta messages: its reasoning first, then its content."""
    if parser is None:
        return [DeltaMessage(content=text or None)]
    parts = parser.feed(text)
    if finished:
        held = parser.finish()
        parts = ReasoningDelta(parts.reasoning + held.reasoning, parts.content + held.content)
    deltas = [DeltaMessage(reasoning_content=parts.reasoning)] if parts.reasoning and include_reasoning else []
    if parts.content or not deltas:
        deltas.append(DeltaMessage(content=parts.content or None))
    return deltas


async def _final_output(submission: Submission) -> RequestOutput:
    async for output in submission:
        if output.finished:
            return output.final
    raise AssertionError("a submission ended without a final output")


async def _chat_response(state, body: ChatCompletionRequest, params: SamplingParams, submission: Submission,
                         request_id: str, reasoning: ReasoningParserFactory | None, plan: ToolPlan | None) -> Response:
    final = await _final_output(submission)
    _check_finals(state, [final], request_id)
    choices = []
    for j, sample in enumerate(final.outputs):
        logprobs = _chat_logprobs(state.tokenizer, sample.logprobs) if params.logprobs is not None else None
        message, reason = _assistant_message(sample.text, body, reasoning), sample.finish_reason
        if plan is not None:  # the tool calls are parsed out of the answer (after any reasoning)
            out = ToolOutput(plan, message.content or "")
            message = AssistantMessage(content=out.content, reasoning_content=message.reasoning_content,
                                       tool_calls=out.tool_calls)
            reason = finish_reason(reason, bool(out.tool_calls))
        choices.append(ChatCompletionChoice(index=j, message=message, logprobs=logprobs, finish_reason=reason,
                                            stop_reason=sample.stop_reason))
    usage = _usage(len(final.prompt_token_ids), sum(len(s.token_ids) for s in final.outputs))
    response = ChatCompletionResponse(id=request_id, model=state.settings.model_name, choices=choices, usage=usage,
                                      prompt_logprobs=final.prompt_logprobs)
    return JSONResponse(response.model_dump())


async def _chat_events(state, body: ChatCompletionRequest, params: SamplingParams, submission: Submission,
                       request_id: str, reasoning: ReasoningParserFactory | None,
                       plan: ToolPlan | None) -> AsyncIterator[str]:
    model = state.settings.model_name
    parsers = [reasoning() if reasoning is not None else None for _ in range(params.n)]  # one per sample
    tool_deltas = [ToolDeltas(plan) for _ in range(params.n)] if plan is not None else None

    def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        return _sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage),
                    with_usage=body.include_usage)

    prompt_tokens = completion_tokens = 0
    error = None  # the engine's message, if it failed the request
    try:
        # OpenAI's first chunk of each choice carries the role and no text.
        yield chunk([ChatCompletionStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                     for j in range(params.n)])
        if echoed := body.echoed():
            yield chunk([ChatCompletionStreamChoice(index=j, delta=DeltaMessage(content=echoed))
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
                deltas = _stream_deltas(sample.text, sample.finished, parsers[sample.index], body.include_reasoning)
                reason = sample.finish_reason
                if tool_deltas is not None:  # the content goes through the tool parser, in pieces
                    tools = tool_deltas[sample.index]
                    content = "".join(delta.content or "" for delta in deltas)
                    deltas = ([delta for delta in deltas if delta.reasoning_content] + tools.feed(content)
                              + (tools.finish() if sample.finished else []))
                    if not deltas and sample.finished:
                        deltas = [DeltaMessage()]
                    reason = finish_reason(sample.finish_reason, tools.called)
                # Plain content sends a chunk for every step with new tokens, "" while text is held
                # back (a partial character, a stop string), as vLLM does; the parsers' held-back
                # text (a reasoning tag, a tool call being written) sends none.
                plain = tool_deltas is None and parsers[sample.index] is None
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    if plain and sample.token_ids and delta.content is None:
                        delta = DeltaMessage(content="")
                    if last and not (delta.content is not None or delta.reasoning_content or delta.tool_calls
                                     or logprobs or sample.finished):
                        continue
                    yield chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=delta, logprobs=logprobs if k == 0 else None,
                        finish_reason=reason if sample.finished and last else None,
                        stop_reason=sample.stop_reason if sample.finished and last else None)])
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
