"""Host time per decode step: scheduling, input preparation and postprocessing, model excluded.

256 running sequences with contexts of about 1,000 tokens decode step after step through the
real engine loop (`LLMEngine.step`: Scheduler, BlockManager, the runner's persistent decode
inputs and sampling preparation, stop checks); only the forward pass and the device-side
sampling are replaced by a stand-in that returns fixed tokens at once. Prints the
microseconds per step (median and p90 over the timed steps), then a final JSON line.

Usage: python benchmarks/host_overhead.py [--seqs 256] [--context 1000] [--steps 200]
"""
import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.engine.block_manager import BlockManager  # noqa: E402
from nanovllm.engine.decode_inputs import DecodeInputs  # noqa: E402
from nanovllm.engine.llm_engine import LLMEngine  # noqa: E402
from nanovllm.engine.scheduler import Scheduler  # noqa: E402
from nanovllm.engine.sequence import Sequence  # noqa: E402
from nanovllm.layers.sampler import SamplerOutput, prepare_sampling  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 256  # nano-vllm's default
VOCAB = 151936  # Qwen3's
EOS = VOCAB - 1  # never produced by the stand-in
PROMPT_JITTER = 50  # contexts vary by up to this many tokens, so blocks fill at different steps


class StandInRunner:
    """What ModelRunner.run does on the host for a decode step, with no model behind it."""

    def __init__(self, max_seqs: int, max_blocks: int):
        self.inputs = DecodeInputs(max_seqs, max_blocks, BLOCK_SIZE, torch.device("cpu"))
        self.rng = random.Random(0)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        if not is_prefill:
            self.inputs.fill(seqs, len(seqs), full_width=False)
            prepare_sampling(seqs, VOCAB, EOS, torch.device("cpu"))
        return SamplerOutput([self.rng.randrange(1000) for _ in seqs], [None] * len(seqs))


def build_engine(num_seqs: int, context: int, steps: int) -> LLMEngine:
    max_len = context + PROMPT_JITTER + steps + 8
    max_blocks = -(-max_len // BLOCK_SIZE)
    engine = object.__new__(LLMEngine)  # the real step(), without loading a model
    engine._init_routing()
    engine.block_manager = BlockManager(num_seqs * max_blocks, BLOCK_SIZE)
    engine.scheduler = Scheduler(num_seqs, num_seqs * max_len, max_len, EOS, engine.block_manager)
    engine.model_runner = StandInRunner(num_seqs, max_blocks)
    rng = random.Random(1)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 4, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(context + rng.randrange(-PROMPT_JITTER, PROMPT_JITTER))]
        engine.scheduler.add(Sequence(i, prompt, params, BLOCK_SIZE))
    while engine.scheduler.waiting:  # prefill everything (the stand-in makes it instant)
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    engine = build_engine(args.seqs, args.context, args.warmup + args.steps)
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
          f"block {BLOCK_SIZE}, {args.steps} steps, {torch.get_num_threads()} threads, {cpu}")
    print(f"{'median us':>12}{'p90 us':>12}{'per seq us':>12}")
    print(f"{median:>12.0f}{p90:>12.0f}{median / args.seqs:>12.2f}")
    print(json.dumps({"benchmark": "host_overhead", "device": cpu, "seqs": args.seqs, "context": args.context,
                      "block_size": BLOCK_SIZE, "steps": args.steps, "median_us": round(median),
                      "p90_us": round(p90), "date": date.today().isoformat()}))


if __name__ == "__main__":
    main()
