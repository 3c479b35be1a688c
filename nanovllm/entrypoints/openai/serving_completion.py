"""`POST /v1/completions`: OpenAI's legacy completions, one or several prompts (text or token
ids) of n samples each, with echo, logprobs (OpenAI's legacy shape) and prompt logprobs, as
one JSON response or an SSE stream.

A request is admitted in the prompt thread (admission.py) and queued through the engine client;
this module turns its outputs into the response.
"""
from collections.abc import AsyncIterator
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.outputs import RequestOutput
from nanovllm.engine.request_builder import encode_text
from nanovllm.entrypoints.openai.admission import admit
from nanovllm.entrypoints.openai.engine_loop import EngineDeadError, Submission
from nanovllm.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                                  CompletionResponse, request_error)
from nanovllm.entrypoints.openai.serving_common import (SSE_DONE, check_finals, check_model, dead_engine_event,
                                                        error_event, in_prompt_thread, sse, sse_response, submit,
                                                        token_text, unless_disconnected, usage)
from nanovllm.sampling_params import SamplingParams

router = APIRouter()

_COMPLETION_FIELDS = set(CompletionRequest.model_fields)


def _encode(tokenizer: PreTrainedTokenizerBase, prompts: list[str | list[int]],
            add_special_tokens: bool = True) -> list[list[int]]:
    # as the engine does (with the tokenizer's special tokens, unless asked not to)
    return [encode_text(tokenizer, p, "prompt", add_special_tokens=add_special_tokens) if isinstance(p, str) else p
            for p in prompts]


@router.post("/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    check_model(request, body.model)
    state = request.app.state
    prompts = body.prompts()
    requested = body.max_tokens if "max_tokens" in body.model_fields_set else None
    if requested == 0:  # echo alone (to_sampling_params refuses it otherwise): one token is run, then dropped
        requested = 1
    try:
        params = body.to_sampling_params()
        admitted = await in_prompt_thread(request, partial(
            admit, state=state, tokenize=lambda tokenizer: _encode(tokenizer, prompts, body.add_special_tokens),
            params=params, constraint_source=(body.constraint() or (None,))[0], keep=body.truncate_prompt_tokens,
            requested=requested, default=params.max_tokens, prompt_field="prompt", max_tokens_field="max_tokens"))
    except ValueError as exc:
        raise request_error(exc, _COMPLETION_FIELDS) from None
    if body.truncate_prompt_tokens is not None:  # echo shows the prompt the model saw
        prompts = [prompt.token_ids for prompt in admitted]
    params = admitted[0].params
    request_id = f"cmpl-{request.state.request_id}"
    submission = await submit(request, admitted, request_id, _COMPLETION_FIELDS, "prompt", body.priority)
    if body.stream:
        return sse_response(_completion_events(state, body, params, prompts, submission, request_id))
    return await unless_disconnected(
        request, _completion_response(state, body, params, prompts, submission, request_id), submission)


def _prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def _completion_logprobs(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], entries: list[dict | None],
                         offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: per token its text, logprob, top alternatives (the chosen one
    included, as vLLM) and character offset. A None entry (an echoed prompt token) has no logprob."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
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
            alternatives.setdefault(token_text(tokenizer, t), lp)
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


async def _completion_response(state, body: CompletionRequest, params: SamplingParams, prompts: list,
                               submission: Submission, request_id: str) -> Response:
    finals: list[RequestOutput | None] = [None] * len(prompts)
    async for output in submission:
        if output.finished:
            finals[submission.index(output.request_id)] = output.final
    check_finals(state, finals, request_id)
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
    total = usage(sum(len(f.prompt_token_ids) for f in finals),
                  0 if echo_only else sum(len(s.token_ids) for f in finals for s in f.outputs))
    response = CompletionResponse(id=request_id, model=state.settings.model_name, choices=choices, usage=total)
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
                yield sse(CompletionResponse(id=request_id, model=model, choices=[chunk]),
                          with_usage=body.include_usage)
        if error is not None:
            yield error_event(error)
        elif body.include_usage:
            total = usage(sum(prompt_tokens.values()), completion_tokens)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=total))
    except EngineDeadError as exc:
        yield dead_engine_event(exc)
    finally:  # normally nothing is left; after a disconnect (cancellation) everything is
        state.engine_client.abort(list(submission.unfinished))
    yield SSE_DONE
