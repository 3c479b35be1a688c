"""What every route that reads a prompt shares: the model-name check, the prompt thread, and
chat rendering with its errors as the client should see them.

Its own module so route modules (api_server.py's generation routes, serving_tokens.py's
tokenizer routes) use one copy without importing each other. It knows the app's state
(settings, prompt pool, prompt tokenizer) but no route.
"""
import asyncio
import logging
from collections.abc import Callable

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.chat import BrokenChatTemplateError, ChatOptions, render_chat
from nanovllm.entrypoints.openai.protocol import APIError

logger = logging.getLogger("nanovllm")


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
