"""What the engine hands its callers, under vLLM's names.

A finished request is a `RequestOutput` holding one `CompletionOutput` per sample; the server,
the batch writer and the offline API read these typed fields. While a request runs, each pop
(`LLMEngine.pop_output`) returns a `RequestDelta`: the `SampleDelta` of every sample with news
since the previous pop, and once the request has finished, its `RequestOutput` as `final`.

`to_nanovllm_dict` is the one adapter to nano-vllm's dict shape; only `LLM.generate()` and
`LLM.chat()` use it, at their boundary, so scripts written for nano-vllm run unchanged. Plain
data: built by engine/request.py, knowing nothing of scheduling or tensors.
"""
from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One sample of a finished request."""
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of its tokens' logprobs; None unless logprobs were asked
    logprobs: list[dict] | None  # per token {"token_id", "logprob", "top_logprobs"}; None unless asked
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    # Ours: the prompt tokens this sample found in the prefix cache (a later sample may find more).
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """A finished request: its prompt and its samples. A request the engine failed (see
    LLMEngine's fault rules) carries `error`, a message for its client, and its samples end
    with finish_reason "abort"."""
    request_id: str
    prompt: str | None  # the prompt's text when it was given as text; None for token ids
    prompt_token_ids: list[int]
    # vLLM's, with SamplingParams.prompt_logprobs (engine/request.py, prompt_logprobs_output): None
    # first, then per prompt token a dict token id -> {"logprob", "rank", "decoded_token"}; else None
    prompt_logprobs: list[dict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # ours: set when the engine failed this request (no exception text)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (the first sample's, as vLLM counts them)."""
        return self.outputs[0].num_cached_tokens


@dataclass
class SampleDelta:
    """What is new in one sample since its request was last popped."""
    index: int  # which of the request's n samples
    token_ids: list[int]  # token ids new since then
    text: str  # text new since then; a sample's texts concatenate to its final text
    logprobs: list[dict]  # one per new token, when the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None  # the stop token id or stop string that ended it


@dataclass
class RequestDelta:
    """A request's news since its last pop: only samples with news are listed. `final` is set
    once every sample has finished."""
    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleDelta]
    finished: bool
    final: RequestOutput | None
    # The request's prompt_logprobs, on the first pop once its prompt is computed (when asked)
    prompt_logprobs: list[dict | None] | None = None

    @property
    def error(self) -> str | None:
        """The failed request's message, on its final pop; None otherwise."""
        return None if self.final is None else self.final.error


def failed_output(request_id: str, n: int, error: str) -> RequestDelta:
    """A failed request's final output made without its samples (the engine could not even
    abort it): n aborted samples, no tokens."""
    samples = [SampleDelta(j, [], "", [], True, "abort", None) for j in range(n)]
    final = RequestOutput(request_id, None, [], None, [CompletionOutput(j, "", [], None, None, "abort", None)
                                                        for j in range(n)], True, error)
    return RequestDelta(request_id, [], samples, True, final)


def to_nanovllm_dict(output: RequestOutput) -> dict:
    """nano-vllm's output dict for a finished request, what LLM.generate() returns: sample 0's
    "text", "token_ids", "finish_reason", "stop_reason", "num_cached_tokens" (and "logprobs"
    when asked) at the top with "prompt_token_ids" (and "prompt_logprobs" when asked); every sample's under "outputs" when n > 1;
    "error" only for a request the engine failed."""
    samples = [_sample_dict(sample) for sample in output.outputs]
    out = {**samples[0], "prompt_token_ids": output.prompt_token_ids}
    if output.prompt_logprobs is not None:
        out["prompt_logprobs"] = output.prompt_logprobs
    if len(samples) > 1:
        out["outputs"] = samples
    if output.error is not None:
        out["error"] = output.error
    return out


def _sample_dict(sample: CompletionOutput) -> dict:
    out = {"text": sample.text, "token_ids": sample.token_ids, "finish_reason": sample.finish_reason,
           "stop_reason": sample.stop_reason, "num_cached_tokens": sample.num_cached_tokens}
    if sample.logprobs is not None:
        out["logprobs"] = sample.logprobs
    return out
