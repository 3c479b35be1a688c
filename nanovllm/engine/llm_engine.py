"""The engine loop: validates and queues requests, steps the scheduler and the model runner,
and hands back finished outputs in the order they were asked for.

Every request is checked in full before any of a call's requests is queued, so a bad one
raises a clear error and leaves the engine as it was.
"""
import atexit
import logging
from dataclasses import dataclass
from itertools import count
from time import perf_counter
from typing import Iterator, NamedTuple

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.tensor_parallel import create_model_runner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import end_of_text_id, load_tokenizer

logger = logging.getLogger("nanovllm")

Prompt = str | list[int]


class StreamOutput(NamedTuple):
    index: int  # which prompt of the call
    sample: int  # which of its n samples
    text: str  # text new since this sample's previous output
    token_ids: list[int]  # token ids new since then
    finished: bool
    finish_reason: str | None


class StepOutput(NamedTuple):
    advanced: list[Sequence]  # sequences that got a new token in this step
    finished: list[Sequence]  # those among them that finished
    num_tokens: int  # tokens the model computed
    is_prefill: bool


@dataclass
class Request:
    """One prompt of a call and its n samples (sample i is seqs[i])."""
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]


class LLMEngine:

    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, kwargs)
        self.config = config
        # None with skip_tokenizer_init: token-id prompts only, and outputs have empty text.
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model)
        config.eos = end_of_text_id(self.tokenizer, config.hf_config)
        self.model_runner = create_model_runner(config)  # tensor_parallel_size > 1 spawns the other ranks
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                                   config.eos, self.block_manager)
        self._seq_ids = count()
        self._exited = False
        atexit.register(self.exit)

    def exit(self) -> None:
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        self.model_runner.exit()

    def _make_request(self, index: int, prompt: Prompt, params: SamplingParams, stream: bool = False) -> Request:
        """Validate one prompt and build its sequences; nothing is queued here."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r} is not allowed; it must be a SamplingParams")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt={prompt!r:.80} is a string, but this engine has no tokenizer "
                                 "(skip_tokenizer_init=True); give each prompt as a list of token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt={prompt!r:.80} is not allowed; a prompt must be a str or a list of int token ids")
        if not token_ids:
            raise ValueError(f"prompt={prompt!r} is empty; a prompt needs at least one token")
        vocab_size = self.config.hf_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary; token ids must be in [0, {vocab_size})")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"stop={list(params.stop_strings)!r} needs a tokenizer to find the strings in the text, "
                             "but this engine has none (skip_tokenizer_init=True); use stop_token_ids instead")
        bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids has {bad}, outside the vocabulary; ids must be in [0, {vocab_size})")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"prompt length {len(token_ids)} is longer than max_model_len={max_len}")
        # The longest this sequence can grow must fit in the whole cache, or it could never run.
        bs = self.config.kvcache_block_size
        longest = min(len(token_ids) + params.max_tokens, max_len)
        needed = (longest + bs - 1) // bs
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"a request of {len(token_ids)} prompt tokens and max_tokens={params.max_tokens} "
                             f"needs {needed} KV blocks of {bs} tokens, more than the whole cache "
                             f"({self.block_manager.num_blocks} blocks); shorten it or enlarge the cache")
        seqs = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), token_ids, params, bs)
            seq.seed = None if params.seed is None else params.seed + i
            if stream or params.stop_strings:
                seq.detokenizer = Detokenizer(self.tokenizer, params)
            seqs.append(seq)
        return Request(index, token_ids, params, seqs)

    def _make_requests(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                       stream: bool = False) -> list[Request]:
        """Validate a whole call before any of it is queued."""
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts={prompts!r:.80} is not allowed; prompts must be a list of str or of token-id lists")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts; "
                                 "give one per prompt or a single SamplingParams")
        else:
            sampling_params = [sampling_params] * len(prompts)
        return [self._make_request(i, p, sp, stream) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]

    def _queue(self, request: Request) -> None:
        first, *others = request.seqs
        self.scheduler.add(first)
        if self.config.enable_prefix_caching:  # the other samples follow once the prompt is cached
            first.pending_siblings = others
        else:
            for seq in others:
                self.scheduler.add(seq)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> list[int]:
        """Queue one prompt; returns the seq_ids of its samples (as step() reports them)."""
        request = self._make_request(0, prompt, sampling_params)
        self._queue(request)
        return [seq.seq_id for seq in request.seqs]

    def step(self) -> StepOutput:
        """Run one scheduled batch and apply the stopping rules to its new tokens."""
        batch = self.scheduler.schedule()
        if not batch.seqs:  # everything was preempted; the next step prefills again
            return StepOutput([], [], 0, True)
        num_tokens = batch.num_tokens  # before postprocess clears the scheduled counts
        out = self.model_runner.run(batch.seqs, batch.is_prefill)
        advanced = self.scheduler.postprocess(batch, out.token_ids)
        # The runner returns logprobs exactly for the rows that sampled, which are the advanced ones.
        for seq, lp in zip(batch.seqs, out.logprobs):
            n = seq.sampling_params.logprobs
            if lp is not None and n is not None:
                seq.logprobs.append(lp._replace(top_logprobs=dict(list(lp.top_logprobs.items())[:n])))
        for seq in advanced:
            params = seq.sampling_params
            if seq.detokenizer is None:
                continue
            # A stop token ends a sequence before any stop string; min_tokens delays both.
            check = seq.finish_reason != "stop" and seq.num_completion_tokens >= params.min_tokens
            stop = seq.detokenizer.add_token(seq.last_token, check)
            if stop is not None and seq.is_finished:  # the last allowed token completed a stop string
                seq.finish_reason, seq.stop_reason = "stop", stop
            elif stop is not None:
                self.scheduler.finish(seq, "stop", stop)
        self.scheduler.drop_finished()
        return StepOutput(advanced, [seq for seq in advanced if seq.is_finished], num_tokens, batch.is_prefill)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def _drive(self, requests: list[Request], use_tqdm: bool) -> Iterator[StepOutput]:
        """Queue the requests and step until all of them finish, yielding each step. If the
        caller stops early (or a step raises), the unfinished ones are dropped, freeing their blocks."""
        seqs = [seq for r in requests for seq in r.seqs]
        ours = {seq.seq_id for seq in seqs}
        for request in requests:
            self._queue(request)
        remaining = len(seqs)
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            while remaining:
                t = perf_counter()
                step = self.step()
                tps = step.num_tokens / max(perf_counter() - t, 1e-9)
                if step.is_prefill:
                    prefill_tps = tps
                else:
                    decode_tps = tps
                pbar.set_postfix({"Prefill": f"{int(prefill_tps)}tok/s", "Decode": f"{int(decode_tps)}tok/s"})
                done = sum(seq.seq_id in ours for seq in step.finished)
                remaining -= done
                pbar.update(done)
                yield step
        finally:
            pbar.close()
            self.scheduler.abort([seq for seq in seqs if not seq.is_finished])

    def _sample_output(self, seq: Sequence) -> dict:
        params = seq.sampling_params
        if seq.detokenizer is not None:
            text = seq.detokenizer.final_text()
        elif self.tokenizer is None:  # skip_tokenizer_init: token ids only
            text = ""
        else:
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=params.skip_special_tokens)
        out = {
            "text": text,
            "token_ids": seq.completion_token_ids,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "num_cached_tokens": seq.num_cached_tokens,
        }
        if params.logprobs is not None:
            out["logprobs"] = [lp._asdict() for lp in seq.logprobs]
        return out

    def _output(self, request: Request) -> dict:
        samples = [self._sample_output(seq) for seq in request.seqs]
        out = {**samples[0], "prompt_token_ids": request.prompt_token_ids}
        if len(samples) > 1:
            out["outputs"] = samples
        return out

    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams],
        use_tqdm: bool = True,
    ) -> list[dict]:
        """One output dict per prompt, in input order: "text", "token_ids", "finish_reason",
        "stop_reason", "prompt_token_ids", "num_cached_tokens", "logprobs" when asked, and for
        n > 1 every sample under "outputs" (the top-level fields are sample 0's)."""
        requests = self._make_requests(prompts, sampling_params)
        for _ in self._drive(requests, use_tqdm):
            pass
        return [self._output(r) for r in requests]

    def stream(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams]
               ) -> Iterator[StreamOutput]:
        """Yield each sample's new text and token ids as they are produced; the concatenated
        text of a sample equals what generate() returns for it."""
        requests = self._make_requests(prompts, sampling_params, stream=True)
        where = {seq.seq_id: (r.index, i) for r in requests for i, seq in enumerate(r.seqs)}
        for step in self._drive(requests, use_tqdm=False):
            for seq in step.advanced:
                if seq.seq_id in where:
                    index, sample = where[seq.seq_id]
                    yield StreamOutput(index, sample, seq.detokenizer.stream_delta(seq.is_finished), [seq.last_token],
                                       seq.is_finished, seq.finish_reason)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **template_kwargs) -> list[dict]:
        """generate() over conversations rendered by the tokenizer's chat template; takes one
        conversation (a list of {"role", "content"} dicts) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("chat() needs the tokenizer's chat template, but this engine has no tokenizer "
                             "(skip_tokenizer_init=True); render the conversation yourself and call generate() "
                             "with token ids")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for conversation in conversations:
            if not isinstance(conversation, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in conversation):
                raise ValueError(f"conversation {conversation!r:.80} is not allowed; "
                                 "it must be a list of {'role': str, 'content': str} dicts")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.config.model!r} has no chat_template; use generate()")
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                    **template_kwargs) for c in conversations]
        # The template already holds any special tokens, so none are added again.
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        return self.generate(prompts, sampling_params or SamplingParams(), use_tqdm=use_tqdm)
