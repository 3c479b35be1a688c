"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt, or chat messages rendered as a chat
request would be) and `POST /detokenize`, with vLLM's request and response shapes.

The ids /tokenize returns are the ones a completion or chat request with the same fields would
hand the engine (same tokenizer, same chat rendering). Work runs in the prompt thread, as for
the generation routes. It knows nothing of the engine beyond its max_model_len.
"""
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, model_validator
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.chat import ChatOptions
from nanovllm.entrypoints.openai.protocol import (APIError, ChatMessage, Strict, Text, TokenId, request_error)
from nanovllm.entrypoints.openai.request_fields import screen_fields
from nanovllm.entrypoints.openai.serving_common import (check_model, check_request_template, in_prompt_thread,
                                                        render_request_chat)

router = APIRouter()


class TokenizeRequest(Strict):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`) in one shape."""
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[Text, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data: Any) -> Any:
        return screen_fields(set(cls.model_fields), data)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (a string) and messages (a chat conversation)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[TokenId]

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data: Any) -> Any:
        return screen_fields(set(cls.model_fields), data)


class DetokenizeResponse(BaseModel):
    prompt: str


_TOKENIZE_FIELDS = set(TokenizeRequest.model_fields)


def _tokenize(tokenizer: PreTrainedTokenizerBase, body: TokenizeRequest, server_template: str | None) -> list[int]:
    if body.prompt is not None:
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=add_special_tokens)
    options = ChatOptions(add_generation_prompt=body.add_generation_prompt,
                          continue_final_message=body.continue_final_message,
                          chat_template=body.chat_template or server_template,
                          chat_template_kwargs=dict(body.chat_template_kwargs or {}),
                          add_special_tokens=bool(body.add_special_tokens))
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return render_request_chat(tokenizer, messages, options, from_request=body.chat_template is not None)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    check_model(request, body.model)
    check_request_template(request, body.chat_template)
    state = request.app.state
    try:
        tokens = await in_prompt_thread(request, _tokenize, body, state.chat_template)
    except ValueError as exc:  # ChatOptions' refusals (they name the field)
        raise request_error(exc, _TOKENIZE_FIELDS, "messages") from None
    strs = state.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=state.engine_client.config.max_model_len, tokens=tokens,
                            token_strs=strs)


def _detokenize(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> str:
    vocab = len(tokenizer)
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens has the id {bad}, past this tokenizer's vocabulary of {vocab} ids",
                       param="tokens")
    return tokenizer.decode(tokens)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    check_model(request, body.model)
    return DetokenizeResponse(prompt=await in_prompt_thread(request, _detokenize, body.tokens))
