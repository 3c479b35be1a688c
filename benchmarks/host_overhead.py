"""Host time per decode step: scheduling, input preparation and postprocessing, model excluded.

256 running sequences with contexts of about 1,000 tokens decode step after step through the
real engine loop (`LLMEngine.step`: Scheduler, BlockManager, the runner's persistent decode
inputs and sampling preparation, stop checks); only the forward pass and the device-side
sampling are replaced by a stand-in that returns fixed tokens at once. Prints the
microseconds per step (median and p90 over the timed steps), then a final JSON line.

With `--async-scheduling` the engine runs its overlapped loop (Config.async_scheduling): the
same host work per step, in another order (launch step N+1, then resolve step N). On a GPU that
work runs while the device computes, so what it costs the throughput is what exceeds the
device's step time; this measures the host side, which is the same either way.

Usage: python benchmarks/host_overhead.py [--seqs 256] [--context 1000] [--steps 200] [--async-scheduling]
"""
import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.engine import llm_engine  # noqa: E402
from nanovllm.config import Config  # noqa: E402
from nanovllm.scheduling.sequence import Sequence  # noqa: E402
from nanovllm.engine.llm_engine import LLMEngine  # noqa: E402
from nanovllm.runner.decode_inputs import DecodeInputs  # noqa: E402
from nanovllm.runner.protocol import RunnerOutput  # noqa: E402
from nanovllm.runner.sampling_inputs import prepare_sampling  # noqa: E402
from nanovllm.runner.step_inputs import StepMessage  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402
from nanovllm.testing.synthetic import build_checkpoint  # noqa: E402
from nanovllm.utils.math_utils import cdiv  # noqa: E402

BLOCK_SIZE = 256  # nano-vllm's default
VOCAB = 151936  # Qwen3's: prompt ids and the sampler's width (the stand-in never reads the model's)
PROMPT_JITTER = 50  # contexts vary by up to this many tokens, so blocks fill at different steps


class ReadyTokens(NamedTuple):
    """What PendingTokens gives the engine, with the tokens on the host already."""
    sample_indices: list[int]
    token_ids: list[int]

    def result(self) -> RunnerOutput:
        return RunnerOutput(self.token_ids, [None] * len(self.token_ids))


class StandInRunner:
    """What ModelRunner.run does on the host for a decode step (its StepMessage, the persistent
    decode inputs, the sampling inputs), with no model behind it."""
    attention_backend = "none (stand-in)"

    def __init__(self, config: Config):
        max_blocks = cdiv(config.max_model_len, BLOCK_SIZE)
        self.num_kvcache_blocks = config.max_num_seqs * max_blocks
        self.num_swap_blocks = 0
        self.eos = config.eos
        self.inputs = DecodeInputs(config.max_num_seqs, max_blocks, BLOCK_SIZE, torch.device("cpu"))
        self.rng = random.Random(0)

    def run(self, seqs: list[Sequence], is_prefill: bool, *copies) -> RunnerOutput:
        return self.launch(seqs, is_prefill).result()

    def launch(self, seqs: list[Sequence], is_prefill: bool, *copies) -> ReadyTokens:
        if not is_prefill:
            self.inputs.fill(StepMessage.of(seqs, is_prefill=False), len(seqs), full_width=False)
            prepare_sampling(seqs, VOCAB, self.eos, torch.device("cpu"))
        # Every sequence samples (the prefill is one step). Tokens ready at once, as a list: the
        # real runner's .tolist() of the sampled tokens is device-side work here.
        return ReadyTokens(list(range(len(seqs))), [self.rng.randrange(1000) for _ in seqs])

    def exit(self) -> None:
        pass


def build_engine(num_seqs: int, context: int, steps: int, checkpoint: str, async_scheduling: bool) -> LLMEngine:
    """The real engine (its step(), scheduler, block manager and stop checker) over a stand-in
    runner; the tiny checkpoint gives it a config and a tokenizer, and its model is never built."""
    max_len = context + PROMPT_JITTER + steps + 8
    build_checkpoint(checkpoint, max_position_embeddings=max_len)
    real = llm_engine.create_model_runner
    llm_engine.create_model_runner = StandInRunner
    try:
        engine = LLMEngine(checkpoint, device="cpu", kvcache_block_size=BLOCK_SIZE, max_num_seqs=num_seqs,
                           max_num_batched_tokens=num_seqs * max_len, max_model_len=max_len,
                           async_scheduling="on" if async_scheduling else "off")
    finally:
        llm_engine.create_model_runner = real
    rng = random.Random(1)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 4, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(VOCAB) for _ in range(context + rng.randrange(-PROMPT_JITTER, PROMPT_JITTER))]
        engine.scheduler.add(Sequence(i, prompt, params, BLOCK_SIZE))
    while engine.scheduler.waiting:  # prefill everything (the stand-in makes it instant)
        engine.step()
    if async_scheduling:  # resolve the prefill: from here on each step reports the decode before it
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--async-scheduling", action="store_true", help="the engine's overlapped loop")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as checkpoint:
        engine = build_engine(args.seqs, args.context, args.warmup + args.steps, checkpoint, args.async_scheduling)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        out = engine.step()
        elapsed = time.perf_counter() - start
        assert not out.is_prefill and len(out.advanced) == args.seqs
        if i >= args.warmup:
            times.append(elapsed * 1e6)
    median, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
    cpu = platform.processor() or platform.machine()
    print(f"host overhead per decode step: {args.seqs} sequences, contexts ~{args.context} tokens, "
          f"block {BLOCK_SIZE}, {args.steps} steps, {torch.get_num_threads()} threads, {cpu}, "
          f"{'overlapped' if args.async_scheduling else 'plain'} loop")
    print(f"{'median us':>12}{'p90 us':>12}{'per seq us':>12}")
    print(f"{median:>12.0f}{p90:>12.0f}{median / args.seqs:>12.2f}")
    print(json.dumps({"benchmark": "host_overhead", "device": cpu, "seqs": args.seqs, "context": args.context,
                      "block_size": BLOCK_SIZE, "steps": args.steps, "async_scheduling": args.async_scheduling, "median_us": round(median),
                      "p90_us": round(p90), "date": date.today().isoformat()}))


if __name__ == "__main__":
    main()
