"""The OpenAI-compatible HTTP server: a FastAPI app over an `EngineClient`, served by uvicorn.

Owns the app and its lifespan (the engine client, the prompt thread and its tokenizer, the
structured-outputs compiler and the request checker admission uses), the API-key check, the
error handlers (every error in OpenAI's JSON), the small routes (`/v1/models[/{id}]`, `/health`,
`/metrics`, `/version`), and running it: a listening socket bound before the engine is built and
a graceful exit on SIGTERM/SIGINT. The endpoints that read prompts have modules of their own:
`/v1/completions` in serving_completion.py, `/v1/chat/completions` in serving_chat.py (each
request admitted once, in the prompt thread, by admission.py), /tokenize and /detokenize in
serving_tokens.py. Request shapes and error JSON come from `protocol.py`; connection and body
limits, request ids and the last-resort 500 from `http_guard.py`.
"""
import asyncio
import hmac
import logging
import signal
import socket
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from nanovllm import LLM, __version__
from nanovllm.config import Config
from nanovllm.engine.chat import load_chat_template
from nanovllm.engine.request_builder import RequestBuilder
from nanovllm.entrypoints.openai.engine_loop import EngineClient, EngineDeadError
from nanovllm.entrypoints.openai.http_guard import (RequestGuard, connection_cap, guarded_protocol, install_log_limits,
                                             internal_error_message)
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.entrypoints.openai.protocol import APIError, ModelCard, ModelList, validation_error
from nanovllm.entrypoints.openai.serving_chat import router as chat_router
from nanovllm.entrypoints.openai.serving_common import check_model
from nanovllm.entrypoints.openai.serving_completion import router as completion_router
from nanovllm.entrypoints.openai.serving_tokens import router as tokens_router
from nanovllm.entrypoints.openai.server_settings import (DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT,
                                                  ServerSettings)
from nanovllm.structured_outputs import GrammarCompiler

logger = logging.getLogger("nanovllm")


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
            app.state.admission = _request_checker(app.state, client)
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
    for router in (completion_router, chat_router):
        app.include_router(router, prefix="/v1", dependencies=[Depends(_check_api_key)])
    # vLLM serves these outside /v1; here they take the same API key as /v1 (they do work for anyone).
    app.include_router(tokens_router, dependencies=[Depends(_check_api_key)])
    return app


async def _server_grammars(state, config: Config) -> GrammarCompiler:
    """A structured-outputs compiler of the server's own, beside an engine in its own process: the
    prompt thread compiles each request's constraint with it, so one that does not compile is a
    400 before the engine sees it (the engine compiles it again, for itself: a compiled grammar
    does not cross to its process)."""
    grammars = GrammarCompiler(state.prompt_tokenizer, config.hf_config.vocab_size, config.eos)
    try:
        await asyncio.get_running_loop().run_in_executor(state.prompt_pool, grammars.load)
    except Exception:  # as the engine: each constrained request is refused with why
        logger.warning("structured outputs are unavailable for this tokenizer", exc_info=True)
    return grammars


def _request_checker(state, client: EngineClient) -> RequestBuilder:
    """The engine's request checks, made in the prompt thread as a request is admitted (with the
    server's tokenizer and compiler, the engine's vocabulary, context and KV cache), so the
    engine builds what was admitted without checking it again."""
    config = client.config
    block_size = config.kvcache_block_size
    return RequestBuilder(state.prompt_tokenizer, config.hf_config.vocab_size, config.max_model_len, block_size,
                          client.cache_capacity_tokens // block_size, state.grammars)


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
    check_model(request, model_id)
    return _model_card(request)


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
