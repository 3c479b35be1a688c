"""The public entry point: `LLM(path, **config)` is the engine under nano-vllm's name, with the
offline API on top: generate() and chat() return nano-vllm's output dicts, stream() yields each
sample's new text as it comes. They drive the engine with its one driver, `LLMEngine.run` (each
call pops only its own requests' news), so a generate() inside a stream() loop, or two streams
read in turn, each get exactly what they would get alone.

The engine hands out typed `RequestOutput`s; the dicts are made here, at this API's boundary
only, by `engine/outputs.to_nanovllm_dict`, so scripts written for nano-vllm keep working.
"""
from typing import Iterator, NamedTuple

from tqdm.auto import tqdm

from nanovllm.engine.chat import ChatOptions
from nanovllm.engine.outputs import to_nanovllm_dict
from nanovllm.engine.request import Request
from nanovllm.engine.request_builder import Prompt
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


class StreamOutput(NamedTuple):
    index: int  # which prompt of the call
    sample: int  # which of its n samples
    text: str  # text new since this sample's previous output
    token_ids: list[int]  # token ids new since then
    finished: bool
    finish_reason: str | None


class LLM(LLMEngine):

    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams],
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[dict]:
        """One output dict per prompt, in input order: "text", "token_ids", "finish_reason",
        "stop_reason", "prompt_token_ids", "num_cached_tokens", "logprobs" when asked, and for
        n > 1 every sample under "outputs" (the top-level fields are sample 0's). `priority`:
        one int per prompt, lower first (see add_requests); None gives all 0. A request the
        engine failed (a fault in its own work, see engine/llm_engine.py) is among them with
        finish_reason "abort" and "error", a message naming its request id; the others are
        exactly what they would be without it. Bad input raises ValueError before any work."""
        with self._entered():
            requests = self._builder.build_all(prompts, sampling_params, priority=priority)
            return self._run_to_end(requests, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **chat_options) -> list[dict]:
        """generate() over conversations rendered by the tokenizer's chat template; takes one
        conversation (a list of {"role", "content"} dicts) or a list of them. `chat_options` are
        the other ChatOptions fields (continue_final_message, chat_template, chat_template_kwargs,
        tools), as vLLM's LLM.chat takes them."""
        with self._entered():
            options = ChatOptions(add_generation_prompt=add_generation_prompt, **chat_options)
            prompts = self._builder.chat_prompts(messages, options)
            requests = self._builder.build_all(prompts, sampling_params or SamplingParams(), name="messages")
            return self._run_to_end(requests, use_tqdm)

    def stream(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
               priority: list[int] | None = None) -> Iterator[StreamOutput]:
        """Yield each sample's new text and token ids as they are produced; the concatenated
        text of a sample equals what generate() returns for it. The prompts are checked now and
        queued at the first next(); closing the generator aborts what is unfinished at once."""
        with self._entered():
            requests = self._builder.build_all(prompts, sampling_params, deltas=True, priority=priority)
        return self._stream(requests)

    def _stream(self, requests: list[Request]) -> Iterator[StreamOutput]:
        # The generator stream() returns. Its own finally releases its requests, so close() (or an
        # error) frees them at once; nothing here waits on another generator being finalised.
        try:
            with self._entered():
                self._table.submit(requests)
            index = {r.request_id: r.index for r in requests}
            unfinished = set(index)
            for outputs in self.run(unfinished):  # each step holds the engine; the caller may use it between
                for out in outputs:
                    if out.finished:
                        unfinished.discard(out.request_id)
                    for s in out.samples:
                        yield StreamOutput(index[out.request_id], s.index, s.text, s.token_ids, s.finished,
                                           s.finish_reason)
                if not unfinished:
                    return
                self._check_progress(outputs)
        finally:
            self._release(requests)

    def _run_to_end(self, requests: list[Request], use_tqdm: bool) -> list[dict]:
        """Submit a call's requests and step until all have finished (the caller is inside the
        engine); their outputs in order. If a step raises (Ctrl-C included), the call's
        unfinished requests are aborted."""
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            self._table.submit(requests)
            finals = {}
            unfinished = {r.request_id for r in requests}
            for outputs in self._drive(unfinished, max_step_failures=1):
                for out in outputs:
                    if out.finished:
                        finals[out.request_id] = out.final
                        unfinished.discard(out.request_id)
                        pbar.update(1)
                if not unfinished:
                    return [to_nanovllm_dict(finals[r.request_id]) for r in requests]
                self._check_progress(outputs)
                if use_tqdm:
                    pbar.set_postfix({"Prefill": f"{int(self.core.prefill_tps)}tok/s",
                                      "Decode": f"{int(self.core.decode_tps)}tok/s"})
        finally:
            pbar.close()
            self._forget(requests)

    def _check_progress(self, outputs: list) -> None:
        """A call's requests are unfinished: a step that brought them nothing must have left work queued."""
        if not outputs and self.scheduler.is_finished():
            raise RuntimeError("internal error: a call's requests are unfinished but nothing is scheduled; "
                               "please report it")
