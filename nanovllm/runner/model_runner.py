"""Runs the model over one step and samples the next tokens.

Owns the model, the attention backend, the KV cache (one tensor, sliced per layer; fp8 with
per-layer scales when Config.kv_cache_dtype asks, see kv_scales.py), the host
swap space (the same layout in host memory, pinned on CUDA, for preemption_mode="swap"), the
sampler and the decode CUDA graphs. A step: the scheduled sequences become a StepMessage; its
swap copies move KV blocks between the cache and the swap space; the message becomes the forward
pass's tensors (step_inputs.py, decode_inputs.py), the model runs on them, eagerly or by
replaying a graph (graph.py), and rank 0 samples the rows that complete a sequence
(sampling_inputs.py). It knows nothing of queues or finishing rules, and changes no
sequence except to give a seeded one its random generator.
"""
import logging
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanovllm.attention import create_backend
from nanovllm.config import Config
from nanovllm.engine.block_manager import NO_COPIES, BlockCopies
from nanovllm.engine.scheduler import SWAP
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import Sampler, SamplerOutput
from nanovllm.models.registry import MODELS
from nanovllm.runner.decode_inputs import DecodeInputs
from nanovllm.runner.graph import DecodeGraphs, graph_batch_sizes
from nanovllm.runner.kv_scales import calibration_token_ids, checkpoint_kv_scales, describe, observing_kv
from nanovllm.runner.sampling_inputs import prepare_sampling
from nanovllm.runner.step_inputs import StepInputs, StepMessage, prefill_inputs
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.compile import compiling
from nanovllm.utils.context import forward_context
from nanovllm.utils.loader import load_model
from nanovllm.utils.math_utils import cdiv
from nanovllm.utils.parallel import tp_rank, tp_size

logger = logging.getLogger("nanovllm")

GIB = 1 << 30
# On CPU the warm-up only checks the forward pass runs; a full max_num_batched_tokens prefill
# (done on CUDA to measure peak memory) would take minutes on a few cores.
CPU_WARMUP_TOKENS = 64


def gpu_kv_budget(total: int, free: int, peak: int, current: int, utilization: float) -> int:
    """Bytes the KV cache may take: `utilization` of the device, less what is in use now (this
    process's weights and anything else on the device) and less the warm-up's activation peak
    above what stays allocated."""
    used = total - free
    return int(total * utilization) - used - (peak - current)


def blocks_in_budget(budget: int, block_bytes: int, max_num_seqs: int, blocks_per_seq: int) -> int:
    """KV blocks that fit in `budget` bytes, no more than max_num_seqs full-length sequences use."""
    return min(max(budget, 0) // block_bytes, max_num_seqs * blocks_per_seq)


class StepLogits(NamedTuple):
    """What a step's forward pass leaves for sampling."""
    logits: torch.Tensor | None  # [num sampled, vocab] on rank 0; None on other ranks and when none samples
    sample_indices: list[int]  # the sequences the rows belong to (index into the step's sequences)


class ModelRunner:

    def __init__(self, config: Config):
        self.config = config
        hf_config = config.hf_config
        self.device = torch.device(config.device)
        self.block_size = config.kvcache_block_size
        # Built inside tensor_parallel_rank(...) for a rank of a tensor-parallel group, else rank 0 of 1.
        self.rank, self.world_size = tp_rank(), tp_size()
        self.compile = config.compile_mode == "on"  # the hot layer functions run compiled in every step
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            with self.device:
                self.model = MODELS[config.architecture](hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        checkpoint_scales = load_model(self.model, config.model)
        self.backend = create_backend(config.attention_backend, config.device, self.block_size, config.kv_cache_dtype)
        self.attention_backend = self.backend.name
        named_layers = {name: m for name, m in self.model.named_modules() if isinstance(m, Attention)}
        self.attention_layers = list(named_layers.values())
        for layer in self.attention_layers:
            layer.backend = self.backend
        # The KV cache's shape comes from the attention layers as the model built them (this rank's heads).
        self.num_layers = len(self.attention_layers)
        self.num_heads = self.attention_layers[0].num_heads
        self.num_kv_heads = self.attention_layers[0].num_kv_heads
        self.head_dim = self.attention_layers[0].head_dim
        self.sampler = Sampler()
        self.max_blocks_per_seq = cdiv(config.max_model_len, self.block_size)
        self.cache_dtype = config.kv_cache_torch_dtype
        self.kv_quantized = self.cache_dtype != config.dtype
        kv_scales = checkpoint_kv_scales(checkpoint_scales, named_layers, self.rank, self.world_size,
                                         self.device) if self.kv_quantized else None
        self.kv_scales_source = "checkpoint" if kv_scales is not None else "calibrated on the warm-up"
        if self.kv_quantized and kv_scales is None:
            with observing_kv(self.attention_layers, self.device) as observers:
                self.warmup_model()
            kv_scales = [observer.scales(self.cache_dtype) for observer in observers]
        else:
            self.warmup_model()
        for layer, scales in zip(self.attention_layers, kv_scales or []):
            layer.kv_scales = scales
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.num_swap_blocks = self.allocate_swap_space()
        with torch.inference_mode():  # like every step's other inputs, so compiled code sees one kind
            self.decode_inputs = DecodeInputs(config.max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                              self.device)
        self.graphs = DecodeGraphs()
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        if use_graphs and self.backend.supports_cuda_graphs:
            self.capture_cudagraphs()
        elif use_graphs and self.rank == 0:
            logger.warning("CUDA graphs off: the %s attention backend cannot be captured", self.backend.name)
        if self.rank == 0:
            logger.info("device %s, dtype %s, attention %s, compile %s, CUDA graphs %s, KV cache %d blocks x %d tokens "
                        "= %d tokens (%s), tensor parallel %d", config.device, config.dtype, self.backend.name,
                        config.compile_mode, f"on ({len(self.graphs)} batch sizes)" if self.graphs else "off",
                        self.num_kvcache_blocks, self.block_size, self.num_kvcache_blocks * self.block_size,
                        self.describe_cache_dtype(), self.world_size)
            if self.kv_quantized:
                logger.info("KV-cache scales %s: %s", self.kv_scales_source, describe(kv_scales))
            if config.preemption_mode == SWAP:
                logger.info("swap space %d host blocks (swap_space=%s GiB per rank, %s)", self.num_swap_blocks,
                            config.swap_space, "pinned" if self.swap_cache.is_pinned() else "not pinned")

    def exit(self) -> None:
        self.graphs.clear()
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = self.swap_cache = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def warmup_model(self) -> None:
        config = self.config
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            seq_len = min(config.max_num_batched_tokens, config.max_model_len)
            num_seqs = max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
        else:
            seq_len, num_seqs = min(CPU_WARMUP_TOKENS, config.max_model_len), 1
        # Varied tokens: this forward is also what calibrates an fp8 cache's scales (kv_scales.py).
        prompt = calibration_token_ids(config.hf_config.vocab_size, seq_len)
        seqs = [Sequence(-1, prompt, SamplingParams(), self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        self.run(seqs, True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _kv_block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.cache_dtype.itemsize

    def describe_cache_dtype(self) -> str:
        """The cache's element type for the start-up log, with what it buys over the model's."""
        name = str(self.cache_dtype).removeprefix("torch.")
        if not self.kv_quantized:
            return name
        ratio = self.config.dtype.itemsize // self.cache_dtype.itemsize
        return f"{name}: {ratio}x the tokens of a {str(self.config.dtype).removeprefix('torch.')} cache"

    def _num_blocks_from_memory(self) -> int:
        config = self.config
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            stats = torch.cuda.memory_stats()
            budget = gpu_kv_budget(total, free, stats["allocated_bytes.all.peak"],
                                   stats["allocated_bytes.all.current"], config.gpu_memory_utilization)
            where = f"gpu_memory_utilization={config.gpu_memory_utilization} of {total / GIB:.1f} GiB"
        else:
            budget = int(config.cpu_kvcache_space_gib * GIB)
            where = f"cpu_kvcache_space_gib={config.cpu_kvcache_space_gib}"
        num_blocks = blocks_in_budget(budget, self._kv_block_bytes(), config.max_num_seqs, self.max_blocks_per_seq)
        if self.world_size > 1:  # block ids mean the same on every rank, so all take the smallest cache
            smallest = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
            num_blocks = int(smallest.item())
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(f"the KV cache fits {num_blocks} blocks of {self.block_size} tokens under {where}, "
                             f"fewer than one sequence of max_model_len={config.max_model_len} needs "
                             f"({self.max_blocks_per_seq}); lower max_model_len or give the cache more memory")
        return num_blocks

    def allocate_kv_cache(self) -> int:
        n = self.config.num_kvcache_blocks
        num_blocks = n if n > 0 else self._num_blocks_from_memory()
        # [k|v, layer, block, slot in block, kv head, head_dim]: one tensor, a slice per layer
        self.kv_cache = torch.zeros(2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, dtype=self.cache_dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def allocate_swap_space(self) -> int:
        """Host blocks for swapped-out K/V, laid out as the KV cache: swap_space GiB on this rank
        (none unless preemption_mode="swap"), capped by what max_num_seqs full-length sequences
        use. Pinned on CUDA, so the copies run at full bandwidth; left unwritten until used."""
        config = self.config
        num_blocks = 0
        if config.preemption_mode == SWAP:
            num_blocks = blocks_in_budget(int(config.swap_space * GIB), self._kv_block_bytes(), config.max_num_seqs,
                                          self.max_blocks_per_seq)
        shape = list(self.kv_cache.shape)
        shape[2] = num_blocks
        self.swap_cache = torch.empty(shape, dtype=self.kv_cache.dtype, pin_memory=self.device.type == "cuda" and
                                      num_blocks > 0)
        return num_blocks

    @torch.inference_mode()
    def swap(self, swap_out: BlockCopies, swap_in: BlockCopies) -> None:
        """Make a step's block copies: swap-outs (cache -> host) first, then swap-ins (host ->
        cache), each one gather and one scatter over block ids for every layer, K and V at once.
        An fp8 cache's blocks are copied as bytes (index_copy_ has no fp8 kernel on CPU)."""
        if not (swap_out.src or swap_in.src):
            return
        kv_cache, swap_cache = self.kv_cache, self.swap_cache
        if self.kv_quantized:
            kv_cache, swap_cache = kv_cache.view(torch.uint8), swap_cache.view(torch.uint8)
        if swap_out.src:
            src = torch.tensor(swap_out.src, dtype=torch.int64, device=self.device)
            dst = torch.tensor(swap_out.dst, dtype=torch.int64)
            # [2, layers, n, block_size, kv heads, head_dim], gathered on the device, copied once
            swap_cache.index_copy_(2, dst, kv_cache.index_select(2, src).cpu())
        if swap_in.src:
            src = torch.tensor(swap_in.src, dtype=torch.int64)
            dst = torch.tensor(swap_in.dst, dtype=torch.int64, device=self.device)
            kv_cache.index_copy_(2, dst, swap_cache.index_select(2, src).to(self.device))

    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """Capture a decode graph per batch bucket, after the attention backend has made
        whatever it keeps across steps for the largest of them (so capture never allocates)."""
        config = self.config
        batch_sizes = graph_batch_sizes(config.max_num_seqs)
        self.backend.prepare_cuda_graphs(batch_sizes[-1], self.num_heads, self.num_kv_heads, self.head_dim,
                                         self.max_blocks_per_seq, self.block_size, self.device)
        with compiling(self.compile):
            self.graphs.capture(self.model, self.decode_inputs, batch_sizes, config.hf_config.hidden_size,
                                config.dtype, self.device)

    def run(self, seqs: list[Sequence], is_prefill: bool, swap_out: BlockCopies = NO_COPIES,
            swap_in: BlockCopies = NO_COPIES) -> SamplerOutput:
        """One step on this rank alone (one process, or each rank's own warm-up)."""
        return self.sample(seqs, self.forward(StepMessage.of(seqs, is_prefill, swap_out, swap_in)))

    @torch.inference_mode()
    def forward(self, step: StepMessage) -> StepLogits:
        """The step's block copies, then its forward pass, on every rank: K/V written for every
        new token, and logits for the rows that sample (none when a prefill chunk leaves part of
        every prompt, or when the step is copies alone)."""
        self.swap(step.swap_out, step.swap_in)
        if not step.num_seqs:
            return StepLogits(None, [])
        with compiling(self.compile):
            inputs, hidden_states = self._forward(step)  # hidden_states: [rows, hidden]
            if not inputs.sample_indices:
                return StepLogits(None, [])
            logits = self.model.compute_logits(hidden_states[inputs.sample_rows])  # None on ranks > 0
        return StepLogits(logits, inputs.sample_indices)

    def _forward(self, step: StepMessage) -> tuple[StepInputs, torch.Tensor]:
        if step.is_prefill:
            inputs = prefill_inputs(step, self.block_size, self.device, attend_from_cache=self.kv_quantized)
        elif self.graphs:
            inputs = self.decode_inputs.fill(step, self.graphs.padded_batch(step.num_seqs), full_width=True)
            return inputs, self.graphs.replay(inputs)
        else:
            inputs = self.decode_inputs.fill(step, step.num_seqs, full_width=False)
        with forward_context(inputs.meta):
            return inputs, self.model(inputs.input_ids, inputs.positions)

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], step: StepLogits) -> SamplerOutput:
        """Rank 0: the next token (and logprobs) of each sequence that samples; a prefill chunk
        that leaves part of its prompt gets token -1 and no sampling, so a seeded generator never
        advances on it. Other ranks never sample (nor read a sampling field): nothing."""
        if self.rank != 0:
            return SamplerOutput([], [])
        n = len(seqs)
        if not step.sample_indices:
            return SamplerOutput([-1] * n, [None] * n)
        sampled = seqs if len(step.sample_indices) == n else [seqs[i] for i in step.sample_indices]
        logits = step.logits
        with compiling(self.compile):
            out = self.sampler(logits, prepare_sampling(sampled, logits.size(-1), self.config.eos, self.device))
        if len(sampled) == n:
            return out
        token_ids, logprobs = [-1] * n, [None] * n
        for j, i in enumerate(step.sample_indices):
            token_ids[i], logprobs[i] = out.token_ids[j], out.logprobs[j]
        return SamplerOutput(token_ids, logprobs)
