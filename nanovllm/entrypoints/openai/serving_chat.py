"""`POST /v1/chat/completions`: a conversation rendered by the chat template (the request's,
the server's --chat-template or the tokenizer's) with the tools the plan hands it, n samples of
an assistant answer, as one JSON response or an SSE stream.

An answer is split by the --reasoning-parser (reasoning.py) into reasoning and content, and its
content by the tool plan (serving_tools.py) into content and tool calls; logprobs take OpenAI's
chat shape. A request is admitted in the prompt thread (admission.py) and queued through the
engine client.
"""
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.outputs import RequestDelta, RequestOutput
from nanovllm.entrypoints.openai.admission import admit
from nanovllm.entrypoints.openai.engine_loop import EngineClient, EngineDeadError, Submission
from nanovllm.entrypoints.openai.protocol import (AssistantMessage, ChatCompletionChoice, ChatCompletionChunk,
                                                  ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatCompletionStreamChoice, ChatLogprobs, DeltaMessage,
                                                  TokenLogprob, TopLogprob, UsageInfo, request_error)
from nanovllm.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningDelta, TagReasoningParser
from nanovllm.entrypoints.openai.serving_common import (SSE_DONE, check_finals, check_model, check_request_template,
                                                        dead_engine_event, error_event, in_prompt_thread,
                                                        render_request_chat, sse, sse_response, submit, token_text,
                                                        unless_disconnected, usage)
from nanovllm.entrypoints.openai.serving_tools import ToolDeltas, ToolOutput, ToolPlan, finish_reason, plan_tools
from nanovllm.sampling_params import SamplingParams

router = APIRouter()

_CHAT_FIELDS = set(ChatCompletionRequest.model_fields)
# Prompt tokens decoded to see whether the template opened the reasoning itself: a start tag
# (and the whitespace after it) is a few tokens.
REASONING_PROMPT_TAIL_TOKENS = 8
ReasoningParserFactory = Callable[[], TagReasoningParser]


def _chat_prompt(tokenizer: PreTrainedTokenizerBase, body: ChatCompletionRequest, server_template: str | None,
                 tools: list[dict] | None) -> list[list[int]]:
    """The conversation rendered by the chat template, with the tools the plan hands it, as the
    token ids of the request's one prompt (as LLM.chat does)."""
    return [render_request_chat(tokenizer, body.conversation(), body.chat_options(server_template, tools),
                                from_request=body.chat_template is not None)]


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    check_model(request, body.model)
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
        source = "tools" if structured is not None else (body.constraint() or (None,))[0]
        tools = plan.tools if plan is not None else None
        admitted = await in_prompt_thread(request, partial(
            admit, state=state, tokenize=lambda tokenizer: _chat_prompt(tokenizer, body, state.chat_template, tools),
            params=params, constraint_source=source, keep=body.truncate_prompt_tokens, requested=getattr(body, given),
            default=None, prompt_field="messages", max_tokens_field=given))
    except ValueError as exc:
        raise request_error(exc, _CHAT_FIELDS, "messages") from None
    params = admitted[0].params
    request_id = f"chatcmpl-{request.state.request_id}"
    reasoning = _reasoning_parser_factory(state, admitted[0].token_ids)
    submission = await submit(request, admitted, request_id, _CHAT_FIELDS, "messages", body.priority)
    if body.stream:
        return sse_response(_chat_events(state, body, params, submission, request_id, reasoning, plan))
    return await unless_disconnected(
        request, _chat_response(state, body, params, submission, request_id, reasoning, plan), submission)


def _reasoning_parser_factory(state, prompt: list[int]) -> ReasoningParserFactory | None:
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


def _chat_logprobs(tokenizer: PreTrainedTokenizerBase, entries: list[dict]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
    return ChatLogprobs(content=[
        TokenLogprob(**top(e["token_id"], e["logprob"]).model_dump(),
                     top_logprobs=[top(t, lp) for t, lp in e["top_logprobs"].items()])
        for e in entries])


async def _final_output(submission: Submission) -> RequestOutput:
    async for output in submission:
        if output.finished:
            return output.final
    raise AssertionError("a submission ended without a final output")


async def _chat_response(state, body: ChatCompletionRequest, params: SamplingParams, submission: Submission,
                         request_id: str, reasoning: ReasoningParserFactory | None, plan: ToolPlan | None) -> Response:
    final = await _final_output(submission)
    check_finals(state, [final], request_id)
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
    total = usage(len(final.prompt_token_ids), sum(len(s.token_ids) for s in final.outputs))
    response = ChatCompletionResponse(id=request_id, model=state.settings.model_name, choices=choices, usage=total,
                                      prompt_logprobs=final.prompt_logprobs)
    return JSONResponse(response.model_dump())


async def _chat_events(state, body: ChatCompletionRequest, params: SamplingParams, submission: Submission,
                       request_id: str, reasoning: ReasoningParserFactory | None,
                       plan: ToolPlan | None) -> AsyncIterator[str]:
    model = state.settings.model_name
    parsers = [reasoning() if reasoning is not None else None for _ in range(params.n)]  # one per sample
    tool_deltas = [ToolDeltas(plan) for _ in range(params.n)] if plan is not None else None

    def chunk(choices: list[ChatCompletionStreamChoice], chunk_usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=chunk_usage),
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
            yield error_event(error)
        elif body.include_usage:
            yield chunk([], usage(prompt_tokens, completion_tokens))
    except EngineDeadError as exc:
        yield dead_engine_event(exc)
    finally:
        state.engine_client.abort(list(submission.unfinished))
    yield SSE_DONE
