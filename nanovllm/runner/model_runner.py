"""Runs the model over one step and samples the next tokens.

Owns the model, the platform (platform/: chosen once, it gives the layers their kernels and
builds the attention backend and the sampler), the attention backend, the KV cache (one tensor,
sliced per layer; fp8 with per-layer scales when Config.kv_cache_dtype asks, see kv_scales.py),
the host swap space (the same layout in host memory, pinned on CUDA, for preemption_mode="swap"), the
sampler and the decode CUDA graphs. A step: the scheduled sequences become a StepMessage; its
swap copies move KV blocks between the cache and the swap space; the message becomes the forward
pass's tensors (step_inputs.py, decode_inputs.py), the model runs on them, eagerly or by
replaying a graph (graph.py), and rank 0 samples the rows that complete a sequence
(sampling_inputs.py). It knows nothing of queues or finishing rules, and changes no
sequence except to give a seeded one its random generator.
"""
import logging
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.scheduling.block_manager import NO_COPIES, BlockCopies
from nanovllm.scheduling.scheduler import SWAP
from nanovllm.scheduling.sequence import Sequence
from nanovllm.layers.attention import Attention
from nanovllm.layers.logits_processors import SamplingTensors
from nanovllm.models.registry import MODELS
from nanovllm.platform.choose import choose_platform
from nanovllm.platform.context import building_for
from nanovllm.platform.device import GIB, DevicePlatform, device_platform
from nanovllm.runner.decode_inputs import DecodeInputs
from nanovllm.runner.graph import DecodeGraphs, graph_batch_sizes
from nanovllm.runner.kernel_warmup import warm_up_kernels
from nanovllm.runner.memory_check import check_fits, kv_block_bytes
from nanovllm.runner.kv_scales import calibration_token_ids, checkpoint_kv_scales, describe, observing_kv
from nanovllm.runner.pending_tokens import PendingTokens, fill_placeholders
from nanovllm.runner.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from nanovllm.runner.protocol import RunnerOutput
from nanovllm.runner.sampling_inputs import prepare_sampling
from nanovllm.runner.step_inputs import HeadDraw, StepInputs, StepMessage, prefill_inputs
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.compile import compiling
from nanovllm.utils.context import forward_context
from nanovllm.utils.loader import load_model
from nanovllm.utils.math_utils import cdiv
from nanovllm.utils.parallel import tp_rank, tp_size

logger = logging.getLogger("nanovllm")



class StartupTimes(NamedTuple):
    """Seconds each part of a model runner's start-up took (logged at INFO, reported by bench.py)."""
    load_s: float  # building the model and loading its weights
    warmup_s: float  # the first forward pass, which measures peak activation memory
    kv_cache_s: float  # sizing and allocating the KV cache
    kernels_s: float  # launching every kernel variant a step may launch (kernel_warmup.py)
    capture_s: float  # capturing the decode CUDA graphs

    @property
    def total_s(self) -> float:
        return sum(self)


def lap_timer(platform: DevicePlatform) -> Callable[[], float]:
    """A function returning the seconds since its previous call (or its making), once the
    device's queued work is done: the parts of a start-up, timed one after another."""
    last = time.perf_counter()

    def lap() -> float:
        nonlocal last
        platform.synchronize()
        now = time.perf_counter()
        elapsed, last = now - last, now
        return elapsed

    return lap


def blocks_in_budget(budget: int, block_bytes: int, max_num_seqs: int, blocks_per_seq: int) -> int:
    """KV blocks that fit in `budget` bytes, no more than max_num_seqs full-length sequences use."""
    return min(max(budget, 0) // block_bytes, max_num_seqs * blocks_per_seq)


class MemoryReserve(NamedTuple):
    """Room another model sharing this runner's memory budget takes (a speculative draft model):
    its weights, made after this runner measures the device, and the bytes it keeps per KV block
    (it gets as many blocks as this runner)."""
    fixed_bytes: int = 0
    per_block_bytes: int = 0


class StepLogits(NamedTuple):
    """What a step's forward pass leaves for sampling."""
    logits: torch.Tensor | None  # [num sampled, vocab] on rank 0; None on other ranks and when none samples
    sample_indices: list[int]  # the sequences the rows belong to (index into the step's sequences)
    # Per sequence of the step, the prompt logprobs its rows scored (rank 0); None when none asked.
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    # The sampled rows' tokens already chosen (the LM head's, StepMessage.head_draw): no logits.
    tokens: torch.Tensor | None = None


class ModelRunner:

    def __init__(self, config: Config, reserve: MemoryReserve = MemoryReserve()):
        self.config = config
        self.reserve = reserve
        hf_config = config.hf_config
        self.device = torch.device(config.device)
        self.device_platform = device_platform(self.device)
        self.block_size = config.kvcache_block_size
        # Built inside tensor_parallel_rank(...) for a rank of a tensor-parallel group, else rank 0 of 1.
        self.rank, self.world_size = tp_rank(), tp_size()
        self.compile = config.compile_mode == "on"  # the hot layer functions run compiled in every step
        self.device_platform.prepare_process(config.cpu_threads, config.cpu_malloc_tuning)
        lap = lap_timer(self.device_platform)
        # Weights and the smallest KV cache against the memory there is, before any is allocated.
        check_fits(config, self.device, reserve.fixed_bytes, reserve.per_block_bytes)
        self.platform = choose_platform(config)  # the layers' kernels, linear methods and sampler
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            with self.device, building_for(self.platform):
                self.model = MODELS[config.architecture](hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        checkpoint_scales = load_model(self.model, config.model)
        self.backend = self.platform.attention_backend(config.attention_backend, self.block_size,
                                                       config.kv_cache_dtype)
        self.attention_backend = self.backend.name
        named_layers = {name: m for name, m in self.model.named_modules() if isinstance(m, Attention)}
        self.attention_layers = list(named_layers.values())
        for layer in self.attention_layers:
            layer.backend = self.backend
        weights = self.platform.prepare_model(self.model)  # after loading, with the backend set
        self.sampler = self.platform.sampler(self.model)
        # The KV cache's shape comes from the attention layers as the model built them (this rank's heads).
        self.num_layers = len(self.attention_layers)
        self.num_heads = self.attention_layers[0].num_heads
        self.num_kv_heads = self.attention_layers[0].num_kv_heads
        self.head_dim = self.attention_layers[0].head_dim
        self.last_sampled: PendingTokens | None = None  # the latest step's tokens, for placeholders
        self.max_blocks_per_seq = cdiv(config.max_model_len, self.block_size)
        self.cache_dtype = config.kv_cache_torch_dtype
        self.kv_quantized = self.cache_dtype != config.dtype
        # Every prefill reads its keys from the paged cache with a quantised cache (each query then
        # sees the same fp8 K/V) or a backend whose paged prefill is its fastest (the CPU kernel).
        self.prefill_from_cache = self.kv_quantized or self.backend.prefill_from_cache
        kv_scales = checkpoint_kv_scales(checkpoint_scales, named_layers, self.rank, self.world_size,
                                         self.device) if self.kv_quantized else None
        self.kv_scales_source = "checkpoint" if kv_scales is not None else "calibrated on the warm-up"
        load_s = lap()
        if self.kv_quantized and kv_scales is None:
            with observing_kv(self.attention_layers, self.device) as observers:
                self.warmup_model()
            kv_scales = [observer.scales(self.cache_dtype) for observer in observers]
        else:
            self.warmup_model()
        for layer, scales in zip(self.attention_layers, kv_scales or []):
            layer.kv_scales = scales
        warmup_s = lap()
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.num_swap_blocks = self.allocate_swap_space()
        with torch.inference_mode():  # like every step's other inputs, so compiled code sees one kind
            self.decode_inputs = DecodeInputs(config.max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                              self.device)
        kv_cache_s = lap()
        self.graphs = DecodeGraphs()
        use_graphs = self.device_platform.supports_cuda_graphs and not config.enforce_eager
        captures = use_graphs and self.backend.supports_cuda_graphs
        if use_graphs and not captures and self.rank == 0:
            logger.warning("CUDA graphs off: the %s attention backend cannot be captured", self.backend.name)
        if self.compile or self.platform.compiles_kernels or self.backend.compiles_kernels:
            warm_up_kernels(self, eager_decode=not captures)  # so that nothing compiles after start-up
        kernels_s = lap()
        if captures:
            self.capture_cudagraphs()
        self.startup = StartupTimes(load_s, warmup_s, kv_cache_s, kernels_s, lap())
        if self.rank == 0:
            logger.info("device %s, dtype %s, attention %s, compile %s, fused kernels %s, CUDA graphs %s, KV cache %d "
                        "blocks x %d tokens = %d tokens (%s), tensor parallel %d", config.device, config.dtype,
                        self.backend.name, config.compile_mode, config.fused_kernels,
                        f"on ({len(self.graphs)} batch sizes)" if self.graphs else "off",
                        self.num_kvcache_blocks, self.block_size, self.num_kvcache_blocks * self.block_size,
                        self.describe_cache_dtype(), self.world_size)
            if self.kv_quantized:
                logger.info("KV-cache scales %s: %s", self.kv_scales_source, describe(kv_scales))
            self.device_platform.log_startup(weights, self.backend, (self.cache_dtype, self.head_dim, self.block_size))
            if config.preemption_mode == SWAP:
                logger.info("swap space %d host blocks (swap_space=%s GiB per rank, %s)", self.num_swap_blocks,
                            config.swap_space, "pinned" if self.swap_cache.is_pinned() else "not pinned")
            t = self.startup
            logger.info("start-up %.1f s: load %.1f s, warm-up %.1f s, KV cache %.1f s, kernel warm-up %.1f s, "
                        "graph capture %.1f s", t.total_s, *t)

    def exit(self) -> None:
        self.graphs.clear()
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = self.swap_cache = None
        self.device_platform.free_cached_memory()

    @torch.inference_mode()
    def warmup_model(self) -> None:
        config = self.config
        seq_len, num_seqs = self.device_platform.warmup_shape(config.max_num_batched_tokens,
                                                              config.max_model_len, config.max_num_seqs)
        # Varied tokens: this forward is also what calibrates an fp8 cache's scales (kv_scales.py).
        prompt = calibration_token_ids(config.hf_config.vocab_size, seq_len)
        seqs = [Sequence(-1, prompt, SamplingParams(), self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        with self.device_platform.measuring_peak():  # the activations' peak: the KV cache leaves room for it
            self.run(seqs, True)

    def _kv_block_bytes(self) -> int:
        return kv_block_bytes(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.cache_dtype)

    def describe_cache_dtype(self) -> str:
        """The cache's element type for the start-up log, with what it buys over the model's."""
        name = str(self.cache_dtype).removeprefix("torch.")
        if not self.kv_quantized:
            return name
        ratio = self.config.dtype.itemsize // self.cache_dtype.itemsize
        return f"{name}: {ratio}x the tokens of a {str(self.config.dtype).removeprefix('torch.')} cache"

    def _num_blocks_from_memory(self) -> int:
        config = self.config
        budget, where = self.device_platform.kv_cache_budget(config.gpu_memory_utilization,
                                                             config.cpu_kvcache_space_gib, self.reserve.fixed_bytes)
        num_blocks = blocks_in_budget(budget, self._kv_block_bytes() + self.reserve.per_block_bytes,
                                      config.max_num_seqs, self.max_blocks_per_seq)
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

    def allocate_swap_space(self, num_blocks: int | None = None) -> int:
        """Host blocks for swapped-out K/V, laid out as the KV cache: swap_space GiB on this rank
        (none unless preemption_mode="swap"), capped by what max_num_seqs full-length sequences
        use, or exactly num_blocks (a draft model mirrors its target's). Pinned on CUDA, so the
        copies run at full bandwidth; left unwritten until used."""
        config = self.config
        if num_blocks is None:
            num_blocks = 0 if config.preemption_mode != SWAP else blocks_in_budget(
                int(config.swap_space * GIB), self._kv_block_bytes(), config.max_num_seqs, self.max_blocks_per_seq)
        shape = list(self.kv_cache.shape)
        shape[2] = num_blocks
        self.swap_cache = torch.empty(shape, dtype=self.kv_cache.dtype,
                                      pin_memory=self.device_platform.pin_memory and num_blocks > 0)
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
            swap_in: BlockCopies = NO_COPIES) -> RunnerOutput:
        """One step on this rank alone (one process, or each rank's own warm-up)."""
        return self.launch(seqs, is_prefill, swap_out, swap_in).result()

    def launch(self, seqs: list[Sequence], is_prefill: bool, swap_out: BlockCopies = NO_COPIES,
               swap_in: BlockCopies = NO_COPIES) -> PendingTokens:
        """One step on this rank alone, returning before its tokens reach the host (async
        scheduling): placeholder tokens among its inputs are read from the previous launch's."""
        head_draw = None  # only where the sampler takes tokens at the LM head (platform/cpu/sampling.py)
        if self.rank == 0 and self.sampler.takes_head_draw(seqs):
            head_draw = HeadDraw.of(seqs)
        return self.sample_pending(seqs, self.forward(StepMessage.of(seqs, is_prefill, swap_out, swap_in,
                                                                     head_draw=head_draw)))

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
            prompt = None
            if step.prompt_targets:  # only requests with prompt_logprobs: every other step skips this
                prompt = compute_prompt_logprobs(self.model, hidden_states, step.starts, step.ends,
                                                 step.prompt_targets)
            if not inputs.sample_indices:
                return StepLogits(None, [], prompt)
            if inputs.keep_rows is None:
                hidden_states = hidden_states[inputs.sample_rows]
            if step.head_draw is not None:  # the tokens without the logits where the model's head can (else None)
                draw = step.head_draw
                if len(inputs.sample_indices) != step.num_seqs:
                    draw = draw.rows(inputs.sample_indices)
                tokens = self.sampler.head_tokens(hidden_states, draw)
                if tokens is not None:
                    return StepLogits(None, inputs.sample_indices, prompt, tokens)
            logits = self.model.compute_logits(hidden_states)  # None on ranks > 0
        return StepLogits(logits, inputs.sample_indices, prompt)

    def _forward(self, step: StepMessage) -> tuple[StepInputs, torch.Tensor]:
        if step.is_prefill:
            inputs = prefill_inputs(step, self.block_size, self.device, attend_from_cache=self.prefill_from_cache)
        else:
            padded = self.graphs.padded_batch(step.num_seqs) if self.graphs else step.num_seqs
            inputs = self.decode_inputs.fill(step, padded, full_width=bool(self.graphs))
        fill_placeholders(inputs.input_ids, step.token_ids, self.last_sampled)
        if not step.is_prefill and self.graphs:
            return inputs, self.graphs.replay(inputs)
        with forward_context(inputs.meta):
            return inputs, self.model(inputs.input_ids, inputs.positions, inputs.keep_rows)

    def sample(self, seqs: list[Sequence], step: StepLogits) -> RunnerOutput:
        """Rank 0: the next token (and logprobs) of each sequence that samples; a prefill chunk
        that leaves part of its prompt gets token -1 and no sampling, so a seeded generator never
        advances on it. Other ranks never sample (nor read a sampling field): nothing."""
        return self.sample_pending(seqs, step).result()

    @torch.inference_mode()
    def sample_pending(self, seqs: list[Sequence], step: StepLogits) -> PendingTokens:
        """sample() without waiting for the tokens: they stay on the device (the next step's
        placeholders read them there) and travel to the host behind an event."""
        if self.rank != 0:
            return PendingTokens(0, [], None, [])
        sampled = seqs if len(step.sample_indices) == len(seqs) else [seqs[i] for i in step.sample_indices]
        tokens, logprobs, failed = None, [], {}
        if sampled and step.tokens is not None:  # chosen by the forward pass already (greedy, nothing else)
            tokens, logprobs = step.tokens, [None] * len(sampled)
        elif sampled:
            logits = step.logits
            try:
                inputs = self._sampling_inputs(sampled, logits)
            except Exception as exc:  # one row's parameters? find which, and sample the others
                inputs, failed = self._without_failing_rows(sampled, logits, exc)
            with compiling(self.compile):
                if not failed:
                    tokens, logprobs = self.sampler.draw(logits, inputs)
                else:
                    tokens, logprobs = self._draw_rows(logits, inputs, len(sampled), failed)
            failed = {step.sample_indices[row]: error for row, error in failed.items()}
        self.last_sampled = PendingTokens(len(seqs), step.sample_indices, tokens, logprobs, failed,
                                          step.prompt_logprobs)
        return self.last_sampled

    def _sampling_inputs(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplingTensors:
        return prepare_sampling(seqs, logits.size(-1), self.config.eos, self.device, philox=self.sampler.uses_philox)

    def _without_failing_rows(self, sampled: list[Sequence], logits: torch.Tensor, error: Exception
                              ) -> tuple[SamplingTensors | None, dict[int, Exception]]:
        """After building the sampling inputs raised: the rows whose inputs raise alone (each
        tried by itself; only on this failure path), and the inputs of the other rows. A fault
        no single row reproduces is the step's (it raises)."""
        failed = {}
        for row, seq in enumerate(sampled):
            try:
                self._sampling_inputs([seq], logits)
            except Exception as exc:
                failed[row] = exc
        if not failed:
            raise error
        keep = [seq for row, seq in enumerate(sampled) if row not in failed]
        return (self._sampling_inputs(keep, logits) if keep else None), failed

    def _draw_rows(self, logits: torch.Tensor, inputs: SamplingTensors | None, num_rows: int,
                   failed: dict[int, Exception]) -> tuple[torch.Tensor, list]:
        """Sample the rows not in `failed`; a failed row gets token 0 (never used: the engine
        aborts its sequence before any step reads it) and no logprobs."""
        tokens = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
        logprobs: list = [None] * num_rows
        keep = [row for row in range(num_rows) if row not in failed]
        if keep:
            index = torch.tensor(keep, device=logits.device)
            kept_tokens, kept_logprobs = self.sampler.draw(logits[index], inputs)
            tokens[index] = kept_tokens
            for row, lp in zip(keep, kept_logprobs):
                logprobs[row] = lp
        return tokens, logprobs
