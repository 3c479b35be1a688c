"""The engine loop: validates and queues requests, steps the scheduler and the model runner,
and hands back finished outputs in the order they were asked for.

Every request is checked in full before any of a call's requests is queued, so a bad one
raises a clear error and leaves the engine as it was.
"""
import atexit
import logging
from itertools import count
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")


class LLMEngine:

    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, kwargs)
        self.config = config
        # A local directory and no trust_remote_code: no code from the checkpoint runs.
        self.tokenizer = AutoTokenizer.from_pretrained(config.model, use_fast=True, trust_remote_code=False)
        eos = self.tokenizer.eos_token_id
        config.eos = eos if eos is not None else getattr(config.hf_config, "eos_token_id", None) or -1
        self.model_runner = ModelRunner(config)
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

    def _make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        """Validate one request and build its sequence; nothing is queued here."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params={sampling_params!r} is not allowed; it must be a SamplingParams")
        if isinstance(prompt, str):
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
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"prompt length {len(token_ids)} is longer than max_model_len={max_len}")
        # The longest this sequence can grow must fit in the whole cache, or it could never run.
        bs = self.config.kvcache_block_size
        longest = min(len(token_ids) + sampling_params.max_tokens, max_len)
        needed = (longest + bs - 1) // bs
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"a request of {len(token_ids)} prompt tokens and max_tokens={sampling_params.max_tokens} "
                             f"needs {needed} KV blocks of {bs} tokens, more than the whole cache "
                             f"({self.block_manager.num_blocks} blocks); shorten it or enlarge the cache")
        return Sequence(next(self._seq_ids), token_ids, sampling_params, bs)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Queue one request; returns its id (the seq_id step() reports)."""
        seq = self._make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> tuple[list[Sequence], int, bool]:
        """Run one scheduled batch. Returns (sequences finished in it, tokens computed, is_prefill)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:  # everything was preempted; the next step prefills again
            return [], 0, True
        token_ids = self.model_runner.run(batch.seqs, batch.is_prefill)
        finished = self.scheduler.postprocess(batch, token_ids)
        return finished, batch.num_tokens, batch.is_prefill

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def _output(self, seq: Sequence) -> dict:
        return {
            "text": self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True),
            "token_ids": seq.completion_token_ids,
            "finish_reason": seq.finish_reason,
            "num_cached_tokens": seq.num_cached_tokens,
        }

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams],
        use_tqdm: bool = True,
    ) -> list[dict]:
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts={prompts!r:.80} is not allowed; prompts must be a list of str or of token-id lists")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts; "
                                 "give one per prompt or a single SamplingParams")
        else:
            sampling_params = [sampling_params] * len(prompts)
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            self.scheduler.add(seq)
        ours = {seq.seq_id for seq in seqs}
        outputs: dict[int, dict] = {}
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while not self.is_finished():
            t = perf_counter()
            finished, num_tokens, is_prefill = self.step()
            tps = num_tokens / max(perf_counter() - t, 1e-9)
            if is_prefill:
                prefill_tps = tps
            else:
                decode_tps = tps
            pbar.set_postfix({"Prefill": f"{int(prefill_tps)}tok/s", "Decode": f"{int(decode_tps)}tok/s"})
            for seq in finished:
                if seq.seq_id in ours:
                    outputs[seq.seq_id] = self._output(seq)
                    pbar.update(1)
        pbar.close()
        return [outputs[seq.seq_id] for seq in seqs]
