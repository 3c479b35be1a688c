"""The CUDA path's logic, checked without CUDA: graph buckets, the padded persistent decode
inputs a graph reads, and the KV-cache sizing arithmetic against a fake device memory report."""
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from nanovllm.scheduling.sequence import Sequence
from nanovllm.runner.decode_inputs import DecodeInputs
from nanovllm.runner.graph import bucket_for, graph_batch_sizes
from nanovllm.platform.device import GIB, device_platform, gpu_kv_budget
from nanovllm.runner.model_runner import MemoryReserve, ModelRunner, blocks_in_budget
from nanovllm.runner.step_inputs import StepMessage, decode_slot
from nanovllm.sampling_params import SamplingParams


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 8, 9, 16, 17, 100, 256, 512, 1000])
def test_every_batch_size_has_a_bucket(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs and sizes[0] == 1
    for batch in range(1, max_num_seqs + 1):
        bucket = bucket_for(batch, sizes)
        assert bucket in sizes and bucket >= batch
        assert bucket - batch < 16, "padding stays under one bucket step"
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(max_num_seqs + 1, sizes)


def make_seq(seq_id: int, length: int, block_table: list[int], block_size: int) -> Sequence:
    seq = Sequence(seq_id, list(range(100 + seq_id, 100 + seq_id + length)), SamplingParams(), block_size)
    seq.block_table = block_table
    return seq


def fill(inputs: DecodeInputs, seqs: list[Sequence], padded_batch: int, full_width: bool) -> tuple:
    """A decode step of `seqs` written into the buffers: (input ids, positions, attention metadata)."""
    step = inputs.fill(StepMessage.of(seqs, is_prefill=False), padded_batch, full_width)
    assert step.sample_indices == list(range(len(seqs)))  # every decoding sequence samples
    return step.input_ids, step.positions, step.meta


def test_padded_rows_store_nothing_and_attend_to_nothing():
    bs = 16
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=4, block_size=bs, device=torch.device("cpu"))
    long = [make_seq(i, 40 + i, [7 - i, 3, 5], bs) for i in range(6)]
    fill(inputs, long, 8, full_width=True)  # leaves real values in rows 0..5
    seqs = [make_seq(0, 16, [2], bs), make_seq(1, 17, [4, 1], bs), make_seq(2, 33, [0, 6, 3], bs)]
    input_ids, positions, meta = fill(inputs, seqs, 8, full_width=True)
    assert input_ids.tolist()[:3] == [seq.last_token for seq in seqs]
    assert positions.tolist()[:3] == [15, 16, 32]
    assert meta.context_lens.tolist() == [16, 17, 33, 0, 0, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [decode_slot(s.block_table, bs, len(s)) for s in seqs] + [-1] * 5
    assert meta.slot_mapping.tolist()[:3] == [2 * bs + 15, 1 * bs + 0, 3 * bs + 0]
    assert meta.block_tables.shape == (8, 4)  # a graph's shape: full width
    for row, seq in enumerate(seqs):
        assert meta.block_tables[row, :len(seq.block_table)].tolist() == seq.block_table
    assert input_ids.tolist()[3:] == [0] * 5 and positions.tolist()[3:] == [0] * 5
    # Eager: exactly the batch, tables cut to the longest one.
    _, _, eager = fill(inputs, seqs[:2], 2, full_width=False)
    assert eager.block_tables.shape == (2, 2) and eager.context_lens.tolist() == [16, 17]


def test_gpu_budget_counts_weights_and_warmup_peak():
    total, free = 80 * GIB, 70 * GIB  # 10 GiB in use: weights and the CUDA context
    peak, current = 6 * GIB, 2 * GIB  # the warm-up's activations peaked 4 GiB above what stays
    budget = gpu_kv_budget(total, free, peak, current, 0.9)
    assert budget == int(72 * GIB) - 10 * GIB - 4 * GIB
    assert blocks_in_budget(budget, 64 * 1024 * 1024, max_num_seqs=10_000, blocks_per_seq=16) == budget // (64 << 20)
    # Capped at what max_num_seqs full-length sequences can use.
    assert blocks_in_budget(budget, 1024, max_num_seqs=4, blocks_per_seq=16) == 64
    assert blocks_in_budget(-5, 1024, 4, 16) == 0


def fake_runner(max_model_len: int, block_size: int = 256, utilization: float = 0.9,
                reserve: MemoryReserve = MemoryReserve()) -> SimpleNamespace:
    """Just what _num_blocks_from_memory reads, on a pretend CUDA device (Qwen3-0.6B-like KV);
    `reserve` is what a speculative draft model takes from the same budget."""
    config = SimpleNamespace(gpu_memory_utilization=utilization, max_num_seqs=1024, max_model_len=max_model_len,
                             cpu_kvcache_space_gib=4.0)
    runner = SimpleNamespace(config=config, device=torch.device("cuda"), device_platform=device_platform("cuda"),
                             block_size=block_size, world_size=1, max_blocks_per_seq=-(-max_model_len // block_size),
                             reserve=reserve)
    runner._kv_block_bytes = lambda: 2 * 28 * block_size * 8 * 128 * 2  # 28 MiB per 256-token block in bf16
    return runner


def test_block_count_from_a_fake_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (130 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"allocated_bytes.all.peak": 5 * GIB,
                                                              "allocated_bytes.all.current": 2 * GIB})
    runner = fake_runner(max_model_len=4096)
    blocks = ModelRunner._num_blocks_from_memory(runner)
    assert blocks == (int(140 * 0.9 * GIB) - 10 * GIB - 3 * GIB) // (28 << 20)
    # A draft model's weights come off the budget, and its KV bytes are added to every block.
    draft = MemoryReserve(fixed_bytes=GIB, per_block_bytes=4 << 20)
    blocks = ModelRunner._num_blocks_from_memory(fake_runner(max_model_len=4096, reserve=draft))
    assert blocks == (int(140 * 0.9 * GIB) - 10 * GIB - 3 * GIB - GIB) // (32 << 20)


def test_clear_error_when_one_full_length_sequence_does_not_fit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2 * GIB, 80 * GIB))  # nearly full already
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"allocated_bytes.all.peak": GIB,
                                                              "allocated_bytes.all.current": GIB})
    with pytest.raises(ValueError, match=r"fewer than one sequence of max_model_len=40960"):
        ModelRunner._num_blocks_from_memory(fake_runner(max_model_len=40960, utilization=0.99))


def test_decode_inputs_reuse_the_same_memory_every_step():
    """Pitfall: per-step tensor allocations in the decode loop. Every step writes the same
    persistent buffers (what a captured CUDA graph reads)."""
    bs = 16
    inputs = DecodeInputs(max_batch=4, max_blocks_per_seq=3, block_size=bs, device=torch.device("cpu"))
    pointers = set()
    for step in range(5):
        seqs = [make_seq(i, 20 + step + i, [i, 4 + i], bs) for i in range(1 + step % 3)]
        input_ids, positions, meta = fill(inputs, seqs, 4, full_width=True)
        pointers.add((input_ids.data_ptr(), positions.data_ptr(), meta.slot_mapping.data_ptr(),
                      meta.context_lens.data_ptr(), meta.block_tables.data_ptr()))
        assert meta.context_lens.tolist()[:len(seqs)] == [len(s) for s in seqs]
    assert len(pointers) == 1


# torch.compile's CPU code generation (inductor) builds C++ with this compiler.
CXX = os.environ.get("CXX", "g++")


@pytest.mark.skipif(shutil.which(CXX) is None, reason=f"torch.compile on CPU needs a C++ compiler ({CXX}); none found")
def test_compiled_layers_keep_greedy_parity(qwen3_tiny):
    """The torch.compile branch CUDA takes, exercised on CPU: still HF's greedy tokens.

    Pinned to CPU on every machine: the compiled functions are compiled once per process and
    kept, so on a GPU machine earlier CUDA tests have compiled them already; compiled code is
    specialised per device, though, and only this test compiles for CPU (compile_mode="auto"
    leaves CPU eager; tests/test_cpu_compile_once.py also does, and resets dynamo after), so new
    graphs show that the CPU run took the compiled branch.
    """
    from torch._dynamo.utils import counters

    from helpers import hf_greedy, random_prompts
    from nanovllm import LLM

    before = counters["stats"]["unique_graphs"]
    # fused_kernels="torch": the layers' compilable functions, as CUDA without Triton kernels (the CPU's
    # own kernels and sampler race would leave nothing to compile)
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, compile_mode="on",
              fused_kernels="torch")
    prompts = random_prompts(200, [5, 17, 33], seed=50)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.exit()
    assert counters["stats"]["unique_graphs"] > before, "nothing was compiled"
    assert [o["token_ids"] for o in outputs] == hf_greedy(qwen3_tiny, prompts, 12)
