"""What every route that reads a prompt shares: the model-name check, the prompt thread, chat
rendering with its errors as the client should see them; and what the generation routes share:
queueing a request, aborting it when its client goes away, and the pieces of their responses
(SSE events, the engine's failures as errors, usage, a token's text).

Its own module so route modules (serving_completion.py, serving_chat.py, serving_tokens.py) use
one copy without importing each other. It knows the app's state (settings, prompt pool, prompt
tokenizer, engine client) but no route.
"""
import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.chat import BrokenChatTemplateError, ChatOptions, render_chat
from nanovllm.engine.outputs import RequestOutput
from nanovllm.engine.request_builder import AdmittedPrompt
from nanovllm.entrypoints.openai.engine_loop import EngineClient, QueueFullError, Submission
from nanovllm.entrypoints.openai.protocol import APIError, UsageInfo, request_error
from nanovllm.entrypoints.openai.server_settings import RETRY_AFTER_SECONDS

logger = logging.getLogger("nanovllm")

SSE_DONE = "data: [DONE]\n\n"  # OpenAI's end of a stream


def check_model(request: Request, model: str | None) -> None:
    """404 (OpenAI's model_not_found) unless `model` is left out or is the served model's name."""
    name = request.app.state.settings.model_name
    if model is not None and model != name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r}", param="model",
                       code="model_not_found")


async def in_prompt_thread(request: Request, work: Callable, *args):
    """Run work(prompt_tokenizer, *args) in the prompt thread (tokenizing and chat templates)."""
    state = request.app.state
    return await asyncio.get_running_loop().run_in_executor(state.prompt_pool, work, state.prompt_tokenizer, *args)


def render_request_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], options: ChatOptions,
                        from_request: bool) -> list[int]:
    """render_chat with its errors as the client should see them (`from_request`: the template
    came with the request, so a broken one is the client's fault)."""
    try:
        return render_chat(tokenizer, messages, options)
    except BrokenChatTemplateError as exc:
        if from_request:
            raise APIError(400, f"chat_template: {exc}", param="chat_template") from None
        logger.error("%s", exc)  # the model's (or --chat-template's) template: the server's fault
        raise APIError(500, "this model's chat template is broken; the server's log has the details",
                       type="server_error", code="chat_template_error") from None
    except ValueError as exc:  # no template, or the template's own refusal
        raise APIError(400, f"messages: {exc}", param="messages") from None


def check_request_template(request: Request, template: str | None) -> None:
    """A request's own chat_template is refused unless the server trusts them (vLLM's rule)."""
    if template is not None and not request.app.state.settings.trust_request_chat_template:
        raise APIError(400, "chat_template in a request is not allowed by this server (it was started without "
                            "--trust-request-chat-template); leave it out", param="chat_template",
                       code="unsupported_parameter")


# ---- queueing and waiting ----

async def submit(request: Request, prompts: list[AdmittedPrompt], request_id: str, fields: set[str],
                 prompt_field: str, priority: int = 0) -> Submission:
    """Queue the admitted prompts; the engine's refusal is a 400, a full queue a 503."""
    client: EngineClient = request.app.state.engine_client
    try:
        return await client.add(prompts, prompts[0].params, request_id, priority)
    except ValueError as exc:
        raise request_error(exc, fields, prompt_field) from None
    except QueueFullError as exc:
        request.app.state.metrics.requests_rejected.inc()
        raise APIError(503, str(exc), type="server_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Response], submission: Submission) -> Response:
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


# ---- pieces of responses ----

def sse(payload: BaseModel | dict, with_usage: bool = True) -> str:
    """One SSE event. A stream chunk carries "usage" only when the client asked for it
    (stream_options.include_usage), as OpenAI's."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude=None if with_usage else {"usage"})
    else:
        data = json.dumps(payload)
    return f"data: {data}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def check_finals(state, finals: list[RequestOutput], request_id: str) -> None:
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


def error_event(error: str) -> str:
    """The SSE event that ends a stream whose request the engine failed (after its "abort" chunk)."""
    return sse(APIError(500, error, type="server_error").body())


def dead_engine_event(exc: Exception) -> str:
    """The SSE event that ends a stream whose engine stopped."""
    return sse(APIError(503, str(exc), type="server_error").body())


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return tokenizer.decode([token_id])
