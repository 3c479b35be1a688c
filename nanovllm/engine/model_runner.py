"""Turns scheduled sequences into tensors, runs the model and samples the next tokens.

Owns the model, the attention backend, the KV cache (one tensor, sliced per layer) and the
per-step inputs: token ids, positions, slot mappings and block tables. It is the only part of
the engine that touches tensors; it knows nothing of queues or finishing rules.
"""
import logging

import torch
import torch.distributed as dist

from nanovllm.attention import create_backend
from nanovllm.config import Config
from nanovllm.engine.block_manager import token_slots
from nanovllm.engine.decode_inputs import DecodeInputs, bucket_for, graph_batch_sizes
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import Sampler, SamplerOutput, prepare_sampling
from nanovllm.models.qwen3 import MODELS
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils import cpu
from nanovllm.utils.context import AttentionMetadata, forward_context
from nanovllm.utils.loader import load_model
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


class ModelRunner:

    def __init__(self, config: Config):
        self.config = config
        hf_config = config.hf_config
        self.device = torch.device(config.device)
        self.block_size = config.kvcache_block_size
        self.num_layers = hf_config.num_hidden_layers
        # Built inside tensor_parallel_rank(...) for a rank of a tensor-parallel group, else rank 0 of 1.
        self.rank, self.world_size = tp_rank(), tp_size()
        self.num_kv_heads = hf_config.num_key_value_heads // self.world_size  # this rank's (Config checks it divides)
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        if self.device.type == "cpu":
            logger.info("CPU: %d torch threads per rank, malloc tuned: %s", cpu.set_num_threads(self.world_size),
                        cpu.keep_freed_memory())
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            with self.device:
                self.model = MODELS[config.architecture](hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(self.model, config.model)
        if self.device.type == "cpu" and not cpu.native_half_matmul(config.dtype):
            cpu.hold_matmul_weights_in_float32(self.model)
            dtype = str(config.dtype).removeprefix("torch.")
            logger.info("CPU: no native %s matmul here, so linear layers hold float32 weights and compute in "
                        "float32 (activations stay %s)", dtype, dtype)
        self.backend = create_backend(config.attention_backend, config.device, self.block_size)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self.max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        self.warmup_model()
        self.num_kvcache_blocks = self.allocate_kv_cache()
        with torch.inference_mode():  # like every step's other inputs, so compiled code sees one kind
            self.decode_inputs = DecodeInputs(config.max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                              self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_batch_sizes: list[int] = []
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        if use_graphs and self.backend.supports_cuda_graphs:
            self.capture_cudagraphs()
        elif use_graphs and self.rank == 0:
            logger.warning("CUDA graphs off: the %s attention backend cannot be captured", self.backend.name)
        if self.rank == 0:
            logger.info("device %s, dtype %s, attention %s, CUDA graphs %s, KV cache %d blocks x %d tokens = %d "
                        "tokens, tensor parallel %d", config.device, config.dtype, self.backend.name,
                        f"on ({len(self.graphs)} batch sizes)" if self.graphs else "off",
                        self.num_kvcache_blocks, self.block_size, self.num_kvcache_blocks * self.block_size,
                        self.world_size)

    def exit(self) -> None:
        self.graphs.clear()
        self.graph_pool = self.graph_hidden = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = None
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
        seqs = [Sequence(-1, [0] * seq_len, SamplingParams(), self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        self.run(seqs, True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _kv_block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.config.dtype.itemsize

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
                                    self.head_dim, dtype=self.config.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def _to_device(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        return self._to_device([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs], torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], torch.Tensor]:
        """Prefill inputs, plus which sequences finish their prompt in this step (they sample)
        and the rows of their last new token."""
        input_ids, positions, slot_mapping = [], [], []
        seqlens_q, seqlens_k = [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            seqlens_q.append(end - start)
            seqlens_k.append(end)
            if seq.block_table:  # the warm-up has no cache
                slot_mapping.extend(token_slots(seq.block_table, self.block_size, start, end))
        cu_q = [0]
        cu_k = [0]
        for lq, lk in zip(seqlens_q, seqlens_k):
            cu_q.append(cu_q[-1] + lq)
            cu_k.append(cu_k[-1] + lk)
        has_prefix = cu_k[-1] > cu_q[-1]
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._to_device(slot_mapping, torch.int64),
            cu_seqlens_q=self._to_device(cu_q, torch.int32),
            cu_seqlens_k=self._to_device(cu_k, torch.int32),
            max_seqlen_q=max(seqlens_q),
            max_seqlen_k=max(seqlens_k),
            block_tables=self._block_tables(seqs) if has_prefix else None,
            seqlens_q=seqlens_q,
            seqlens_k=seqlens_k,
        )
        completing = [i for i, (seq, lk) in enumerate(zip(seqs, seqlens_k)) if lk == len(seq)]
        last_rows = self._to_device([cu_q[i + 1] - 1 for i in completing], torch.int64)
        return (self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64), meta, completing,
                last_rows)

    def prepare_decode(self, seqs: list[Sequence], padded_batch: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Decode inputs in the persistent buffers; padded (full-width tables) for a CUDA graph."""
        graph = padded_batch is not None
        return self.decode_inputs.fill(seqs, padded_batch if graph else len(seqs), full_width=graph)

    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """One CUDA graph per decode batch bucket, largest first, sharing one memory pool. Each
        reads the persistent decode buffers and writes its hidden states to one output buffer."""
        config, hf_config = self.config, self.config.hf_config
        self.graph_batch_sizes = graph_batch_sizes(config.max_num_seqs)
        max_batch = self.graph_batch_sizes[-1]
        if hasattr(self.backend, "reserve_decode_scratch"):  # so that capture never allocates
            self.backend.reserve_decode_scratch(max_batch, hf_config.num_attention_heads // self.world_size,
                                                self.num_kv_heads, self.head_dim, self.max_blocks_per_seq,
                                                self.block_size, self.device)
        self.graph_hidden = torch.zeros(max_batch, hf_config.hidden_size, dtype=config.dtype, device=self.device)
        self.graph_pool = None
        for batch in reversed(self.graph_batch_sizes):
            # All rows are padding (slot -1, context 0): warm-up and capture write no KV.
            input_ids, positions, meta = self.decode_inputs.fill([], batch, full_width=True)
            with forward_context(meta):
                self.graph_hidden[:batch] = self.model(input_ids, positions)  # warm-up (and compile)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, self.graph_pool):
                    self.graph_hidden[:batch] = self.model(input_ids, positions)
            if self.graph_pool is None:
                self.graph_pool = graph.pool()
            self.graphs[batch] = graph
            torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        """One forward pass; samples a token for each sequence whose prompt (or decode) completes
        in it. A prefill chunk that leaves part of its prompt gets token -1 and no sampling, so
        a seeded generator never advances on it."""
        completing = None  # every sequence of a decode step samples
        if is_prefill:
            input_ids, positions, meta, completing, last_rows = self.prepare_prefill(seqs)
        elif self.graphs:
            batch = bucket_for(len(seqs), self.graph_batch_sizes)
            self.prepare_decode(seqs, batch)
            self.graphs[batch].replay()
            hidden_states, meta = self.graph_hidden[:len(seqs)], None
        else:
            input_ids, positions, meta = self.prepare_decode(seqs)
        if meta is not None:
            with forward_context(meta):
                hidden_states = self.model(input_ids, positions)  # [num_tokens, hidden]
        if completing is not None:
            if not completing:
                return SamplerOutput([-1] * len(seqs), [None] * len(seqs))
            hidden_states = hidden_states[last_rows]
        sampled = seqs if completing is None else [seqs[i] for i in completing]
        logits = self.model.compute_logits(hidden_states)  # [num_sampled, vocab] on rank 0, None elsewhere
        if self.rank != 0:  # only rank 0 samples; a worker never reads sampling fields
            return SamplerOutput([], [])
        out = self.sampler(logits, prepare_sampling(sampled, logits.size(-1), self.config.eos, self.device))
        if len(sampled) == len(seqs):
            return out
        token_ids, logprobs = [-1] * len(seqs), [None] * len(seqs)
        for j, i in enumerate(completing):
            token_ids[i], logprobs[i] = out.token_ids[j], out.logprobs[j]
        return SamplerOutput(token_ids, logprobs)
