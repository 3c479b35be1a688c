"""Admitting a generation request, once, in the server's prompt thread: its prompts tokenized
(or its chat rendered), truncated (`truncate_prompt_tokens`), max_tokens fitted to the context,
its structured-outputs constraint compiled and checked to be satisfiable, and every check the
engine makes (the server's own `RequestBuilder.admit`). What comes out is `AdmittedPrompt`s,
which the engine builds without checking, tokenizing or compiling again.

The order of the checks is the order a client sees refusals in: the constraint (a 400 naming
the field that gave it), the prompt (tokenizing, rendering), truncation, the context (OpenAI's
context_length_exceeded), then the engine's checks (a ValueError; the route names its field).
"""
from collections.abc import Callable
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from nanovllm.engine.request_builder import AdmittedPrompt
from nanovllm.entrypoints.openai.protocol import APIError, constraint_error
from nanovllm.sampling_params import SamplingParams

Tokenize = Callable[[PreTrainedTokenizerBase], list[list[int]]]


def admit(tokenizer: PreTrainedTokenizerBase, *, state, tokenize: Tokenize, params: SamplingParams,
          constraint_source: str | None, keep: int | None, requested: int | None, default: int | None,
          prompt_field: str, max_tokens_field: str) -> list[AdmittedPrompt]:
    """The request's prompts admitted (run in the prompt thread, with its tokenizer). `keep`: its
    truncate_prompt_tokens; `requested`: the max_tokens it gave (refused when it outgrows the
    context), else `default` (None: what the context and the KV cache leave), cut to the context.
    Raises APIError for what the server refuses itself, ValueError for the engine's checks."""
    grammar = _compile(state, params, constraint_source)
    prompts = _truncate(state, tokenize(tokenizer), keep)
    params = _fit_context(state, params, prompts, requested, default, prompt_field, max_tokens_field)
    return state.admission.admit_all(prompts, params, grammar)


def _compile(state, params: SamplingParams, source: str | None) -> object | None:
    """The request's constraint compiled; one that does not compile, or that no output can
    follow, is a 400 naming the request field that gave it."""
    constraint = params.structured_outputs
    if constraint is None:
        return None
    try:
        grammar = state.grammars.compile(constraint)
        state.grammars.check_satisfiable(grammar, constraint)
    except ValueError as exc:
        raise APIError(400, constraint_error(str(exc), source), param=source) from None
    return grammar


def _truncate(state, prompts: list[list[int]], keep: int | None) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: the last max_model_len)."""
    if keep is None:
        return prompts
    max_len = state.engine_client.config.max_model_len
    if keep == 0 or keep > max_len:
        raise APIError(400, f"truncate_prompt_tokens={keep} is not allowed; it must be in [1, max_model_len={max_len}]"
                            " or -1 (keep the last max_model_len tokens)", param="truncate_prompt_tokens")
    keep = max_len if keep == -1 else keep
    return [prompt[-keep:] for prompt in prompts]


def _fit_context(state, params: SamplingParams, prompts: list[list[int]], requested: int | None,
                 default: int | None, prompt_field: str, max_tokens_field: str) -> SamplingParams:
    """`params` with max_tokens for these prompts: the one `requested`, refused (400) when prompt
    and completion outgrow the context, as vLLM; else `default`, cut to what the context leaves."""
    client = state.engine_client
    max_len = client.config.max_model_len
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
    longest = max(map(len, prompts))
    if default is None:  # the answer may fill what the context (and the KV cache) has left
        default = max(min(max_len, client.cache_capacity_tokens) - longest, 1)
    max_tokens = requested if requested is not None else min(default, max_len - longest)
    return params if max_tokens == params.max_tokens else replace(params, max_tokens=max_tokens)
