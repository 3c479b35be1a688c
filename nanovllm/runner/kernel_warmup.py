"""Start-up launches of every kernel variant a step can launch, so that nothing compiles inside generate().

Triton compiles a kernel at its first launch with a new specialisation (dtypes, constexprs, and
which integer arguments equal 1 or divide by 16), torch.compile at a call that fails its guards.
The model runner's first forward pass runs before the KV cache exists, and the CUDA-graph capture
covers only decode with graphs on; with the cache allocated, this launches what they miss:
1. prefill steps over a cached prefix (paged attention, the variants that store K/V), of one and
   of two sequences: one new token over a cached one is also how a mixed step's decode rows reach
   the varlen kernels (the default scheduling policy's steps), and a handful of (token, expert)
   pairs is the fused MoE kernel's small-tile variant (its large tiles are the first forward
   pass's full-size prefill);
2. sampling from their logits on both sampler paths: the common one (the race over the logits in
   the model's dtype) and the general one (filters, penalties and logprobs over float32 logits);
3. without CUDA graphs, eager decode steps of padding rows at every (batch, block-table width)
   where the attention backend's launches change (decode_warmup_shapes), and with torch.compile
   on at batch 1 and 2 too (dynamo specialises size 1; Triton kernels take batch sizes as the grid
   or as arguments excluded from specialisation).
The prefills write K/V for one token into block 0, which no sequence owns yet (every block is
written before anything reads it). An fp8 cache's scales are set before this runs, so the
quantised variants of the store and attention kernels are the ones launched (and the paged
prefill, which an fp8 cache takes for every prompt, is among them). Swaps copy blocks with torch indexing and compile nothing. It
knows the runner's parts and nothing of scheduling.
"""
import dataclasses

import torch

from nanovllm.scheduling.sequence import Sequence
from nanovllm.runner.step_inputs import StepMessage
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.compile import compiling
from nanovllm.utils.context import forward_context

# Batch sizes 1 and 2: torch.compile specialises size 1.
WARMUP_BATCHES = (1, 2)
# The general sampler path with every filter, a penalty and logprobs: all its operations run once.
GENERAL_SAMPLING = SamplingParams(top_k=2, top_p=0.9, min_p=0.01, repetition_penalty=1.1, logprobs=1)


def _prefix_sequence(params: SamplingParams, block_size: int) -> Sequence:
    """Two tokens in block 0, the first one cached: a one-token prefill after a one-token prefix."""
    seq = Sequence(-1, [0, 0], params, block_size)
    seq.block_table = [0]
    seq.num_computed_tokens = seq.num_scheduled_tokens = 1
    return seq


@torch.inference_mode()
def warm_up_kernels(runner, eager_decode: bool) -> None:
    """`runner` is a ModelRunner whose KV cache is allocated; `eager_decode`: decode steps will run
    eagerly (no CUDA graphs), so their variants are launched here."""
    batches = [b for b in WARMUP_BATCHES if b <= runner.config.max_num_seqs]
    # 1-2. Prefills after a prefix, and both sampler paths on their logits.
    for batch in batches:
        seqs = [_prefix_sequence(SamplingParams(), runner.block_size) for _ in range(batch)]
        logits = runner.forward(StepMessage.of(seqs, is_prefill=True))
        runner.sample(seqs, logits)
        runner.sample([_prefix_sequence(GENERAL_SAMPLING, runner.block_size) for _ in range(batch)], logits)
    if not eager_decode:
        return
    # 3. Eager decode of padding rows (slot -1, context 0: they store and read nothing).
    full = runner.max_blocks_per_seq
    shapes = {(batch, full) for batch in batches} if runner.compile else set()
    shapes |= set(runner.backend.decode_warmup_shapes(runner.config.max_num_seqs, runner.num_kv_heads, full,
                                                      runner.block_size, runner.device))
    empty = StepMessage.of([], is_prefill=False)
    for batch, width in sorted(shapes):
        inputs = runner.decode_inputs.fill(empty, batch, full_width=True)
        meta = dataclasses.replace(inputs.meta, block_tables=inputs.meta.block_tables[:, :width])
        with forward_context(meta), compiling(runner.compile):
            runner.model(inputs.input_ids, inputs.positions)
