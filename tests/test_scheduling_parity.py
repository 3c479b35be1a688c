"""Scheduling policies, priorities and swap preemption end to end: greedy float32 tokens must
equal HF transformers' under every policy and preemption mode, with the counters showing that
what a test is about (mixed steps, swaps, the recompute fallback) really happened.

One tiny checkpoint, short outputs and small caches keep this file to well under a minute of
CPU; tests/test_scheduling.py checks the scheduler's decisions themselves without a model.
"""
import importlib.util
import math
from dataclasses import asdict

import pytest
import torch

from helpers import AUTO_DEVICE, GPU_ONLY, greedy, hf_greedy, random_prompts
from nanovllm import LLM
from nanovllm.attention.torch_backend import TorchBackend, causal_attention, gather_kv
from nanovllm.scheduling.scheduler import MIXED, PREFILL_FIRST
from nanovllm.utils.context import AttentionMetadata

BLOCK = 16
MAX_TOKENS = 20
# Many short prompts and a few longer than the token budget, around block boundaries.
LENGTHS = [1, 3, 5, 9, 15, 16, 17, 33, 48, 70, 2, 7]
BUDGET = 24  # tokens per step: long prompts take several chunks, beside the decodes
# A cache of 10 blocks of 16 tokens for prompts of up to 90 tokens with their outputs, and a
# budget that lets many sequences in at once: sequences are preempted again and again.
SMALL_CACHE = dict(num_kvcache_blocks=10, max_num_batched_tokens=48)
POLICIES = [MIXED, PREFILL_FIRST]
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", kvcache_block_size=BLOCK, **{"max_num_seqs": 16, **kwargs})


def run_online(llm: LLM, prompts: list[list[int]], arrivals: list[int], priorities: list[int]) -> dict[int, list[int]]:
    """add_request() each prompt at its arrival step (a step count), step until all are done; the
    token ids of each prompt, by index."""
    ids: dict[str, int] = {}
    done: dict[int, list[int]] = {}
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    steps = 0
    while len(done) < len(prompts):
        while order and arrivals[order[0]] <= steps:
            i = order.pop(0)
            ids[llm.add_request(prompts[i], greedy(MAX_TOKENS), priority=priorities[i])] = i
        for request_id in llm.step().request_ids:
            out = llm.pop_output(request_id)
            if out.finished:
                done[ids[request_id]] = out.final.outputs[0].token_ids
        steps += 1
        assert steps < 2000, "not finished: livelock"
    return done


@pytest.fixture(scope="module")
def prompts_and_expected(qwen3_tiny):
    prompts = random_prompts(200, LENGTHS, seed=21)
    return prompts, hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)


@pytest.mark.parametrize("policy", POLICIES)
def test_parity_with_arrivals_priorities_and_a_small_budget(qwen3_tiny, prompts_and_expected, policy):
    prompts, expected = prompts_and_expected
    llm = engine(qwen3_tiny, num_kvcache_blocks=64, max_num_batched_tokens=BUDGET, scheduling_policy=policy)
    arrivals = [(3 * i) % 11 for i in range(len(prompts))]  # some at once, others while earlier ones decode
    priorities = [i % 3 for i in range(len(prompts))]
    done = run_online(llm, prompts, arrivals, priorities)
    assert [done[i] for i in range(len(prompts))] == expected
    stats = llm.stats()
    assert (stats.mixed_steps > 0) == (policy == MIXED)
    assert stats.prefill_steps > 0 and stats.decode_steps > 0 and stats.num_preemptions == 0
    assert stats.inter_token_latency_count == len(prompts) * (MAX_TOKENS - 1)
    assert 0 < stats.inter_token_latency_during_prefill_count < stats.inter_token_latency_count
    assert stats.mean_inter_token_latency_s > 0
    assert set(asdict(stats)) >= {"preemptions_swap", "preemptions_recompute", "mixed_steps", "blocks_swapped_out"}
    assert (stats.num_waiting, stats.num_running, stats.num_swapped) == (0, 0, 0)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks == 64
    llm.exit()


@pytest.mark.parametrize("policy", POLICIES)
def test_priorities_order_the_runs_and_keep_outputs(qwen3_tiny, prompts_and_expected, policy):
    """One sequence at a time: they finish in priority order (ties by position), each with the
    start of HF's tokens."""
    prompts, expected = (x[:8] for x in prompts_and_expected)
    priorities = [(7 * i) % 4 for i in range(len(prompts))]
    num_tokens = 4
    llm = engine(qwen3_tiny, num_kvcache_blocks=64, max_num_seqs=1, scheduling_policy=policy)
    tokens: list[list[int]] = [[] for _ in prompts]
    finished = []
    for out in llm.stream(prompts, greedy(num_tokens), priority=priorities):
        tokens[out.index] += out.token_ids
        if out.finished:
            finished.append(out.index)
    llm.exit()
    assert finished == sorted(range(len(prompts)), key=lambda i: (priorities[i], i))
    assert tokens == [e[:num_tokens] for e in expected]


@pytest.mark.parametrize("policy", POLICIES)
def test_swap_preemption_under_a_tiny_cache(qwen3_tiny, prompts_and_expected, policy):
    prompts, expected = prompts_and_expected
    llm = engine(qwen3_tiny, **SMALL_CACHE, scheduling_policy=policy, preemption_mode="swap", swap_space=0.01)
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    stats = llm.stats()
    assert stats.preemptions_swap > 1 and stats.swap_ins > 1 and stats.blocks_swapped_out > 1
    assert stats.swap_ins + stats.swapped_prefix_lost == stats.preemptions_swap and stats.swap_space_full == 0
    assert stats.num_free_swap_blocks == stats.num_swap_blocks > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    llm.exit()


def test_swap_space_too_small_falls_back_to_recompute(qwen3_tiny, prompts_and_expected):
    prompts, expected = prompts_and_expected
    probe = engine(qwen3_tiny, num_kvcache_blocks=10)
    block_bytes = probe.model_runner._kv_block_bytes()
    probe.exit()
    # Room for exactly one host block: a sequence with more computed blocks than that is recomputed.
    llm = engine(qwen3_tiny, **SMALL_CACHE, preemption_mode="swap", swap_space=1.5 * block_bytes / 2**30)
    assert llm.stats().num_swap_blocks == 1
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    stats = llm.stats()
    assert stats.swap_space_full > 0 and stats.preemptions_recompute >= stats.swap_space_full
    llm.exit()


def test_tensor_parallel_swaps_each_ranks_shard(qwen3_tiny, prompts_and_expected):
    """tensor_parallel_size=2: the swap copies travel in the step message and each rank copies
    its own heads' K/V; a rank that swapped wrongly would change the tokens."""
    prompts, expected = prompts_and_expected
    llm = LLM(qwen3_tiny, device="cpu", tensor_parallel_size=2, kvcache_block_size=BLOCK, **SMALL_CACHE,
              preemption_mode="swap", swap_space=0.01)
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    stats = llm.stats()
    llm.exit()
    assert [o["token_ids"] for o in outputs] == expected
    assert stats.preemptions_swap > 1 and stats.swap_ins > 1 and stats.mixed_steps > 0


def test_triton_backend_runs_mixed_batches(qwen3_tiny):
    """Decode rows are query length 1 over their cache in the varlen prefill kernel (under
    TRITON_INTERPRET=1 on CPU, compiled where there is a GPU): the same tokens as HF."""
    prompts = random_prompts(200, [3, 20], seed=22)
    llm = LLM(qwen3_tiny, device=AUTO_DEVICE, attention_backend="triton", kvcache_block_size=BLOCK, num_kvcache_blocks=16,
              max_num_batched_tokens=8, enforce_eager=True)
    outputs = llm.generate(prompts, greedy(3), use_tqdm=False)
    assert llm.stats().mixed_steps >= 2  # the short prompt decodes beside the long one's chunks
    llm.exit()
    assert [o["token_ids"] for o in outputs] == hf_greedy(qwen3_tiny, prompts, 3)


def test_torch_backend_batches_a_mixed_steps_decode_rows_exactly():
    """The torch backend sends a mixed batch's one-token rows through its batched decode path:
    the same outputs as attending each sequence on its own."""
    gen = torch.Generator().manual_seed(5)
    block_size, num_heads, num_kv_heads, head_dim = 16, 6, 2, 16
    lens = [(0, 20), (33, 1), (15, 1), (16, 9), (47, 1), (5, 1)]  # (cached, new) per sequence
    num_blocks = sum(-(-(p + n) // block_size) for p, n in lens)
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for p, n in lens:
        need = -(-(p + n) // block_size)
        tables.append(order[:need])
        order = order[need:]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    seqlens_q, seqlens_k = [n for _, n in lens], [p + n for p, n in lens]
    cu = lambda xs: torch.tensor([0] + xs).cumsum(0).to(torch.int32)  # noqa: E731
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0), cu_seqlens_q=cu(seqlens_q),
                             cu_seqlens_k=cu(seqlens_k), max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
                             block_tables=block_tables, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    q = torch.randn(sum(seqlens_q), num_heads, head_dim, generator=gen)
    out = TorchBackend().prefill(q, None, None, k_cache, v_cache, meta, head_dim ** -0.5)
    start = 0
    for i, (p, n) in enumerate(lens):
        k, v = (gather_kv(cache, block_tables[i], p + n) for cache in (k_cache, v_cache))
        expected = causal_attention(q[start:start + n], k, v, head_dim ** -0.5)
        torch.testing.assert_close(out[start:start + n], expected)
        start += n


@pytest.mark.parametrize("backend", [
    pytest.param("triton", marks=GPU_ONLY),
    pytest.param("flash_attn", marks=[*GPU_ONLY, pytest.mark.skipif(not HAS_FLASH_ATTN,
                                                                    reason="flash-attn is not installed")]),
])
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_mixed_batches_and_decode_graphs(qwen3_tiny, backend, policy):
    """On CUDA: mixed batches through the backend's varlen path (flash-attn's with a block table
    too), and pure decode steps still replaying CUDA graphs."""
    block = 256 if backend == "flash_attn" else BLOCK
    prompts = random_prompts(200, [300, 20, 257, 5, 90], seed=23)
    llm = LLM(qwen3_tiny, device="cuda", dtype="float32", attention_backend=backend, kvcache_block_size=block,
              num_kvcache_blocks=8 if block == 256 else 128, max_num_batched_tokens=128, max_num_seqs=8,
              scheduling_policy=policy)
    replays = []
    replay = llm.model_runner.graphs.replay

    def counting_replay(inputs):
        replays.append(inputs.input_ids.size(0))
        return replay(inputs)
    llm.model_runner.graphs.replay = counting_replay
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    stats = llm.stats()
    llm.exit()
    assert [o["token_ids"] for o in outputs] == hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)
    assert replays, "pure decode steps must replay CUDA graphs"
    assert (stats.mixed_steps > 0) == (policy == MIXED)


@pytest.mark.parametrize("kwargs, field", [
    (dict(scheduling_policy="fifo"), "scheduling_policy='fifo'"),
    (dict(scheduling_policy=None), "scheduling_policy=None"),
    (dict(preemption_mode="drop"), "preemption_mode='drop'"),
    (dict(swap_space=-1), "swap_space=-1"),
    (dict(swap_space=math.inf), "swap_space=inf"),
    (dict(swap_space="4"), "swap_space='4'"),
    (dict(swap_space=True), "swap_space=True"),
])
def test_bad_scheduling_settings_are_refused(qwen3_tiny, kwargs, field):
    with pytest.raises(ValueError, match=f"{field} is not allowed"):
        LLM(qwen3_tiny, device="cpu", **kwargs)


def test_bad_priorities_are_refused_before_anything_is_queued(qwen3_tiny):
    llm = engine(qwen3_tiny, num_kvcache_blocks=16)
    prompts = [[1, 2, 3], [4, 5]]
    for priority, message in [("high", "priority='high'"), ([0], "priority=\\[0\\]"), (0, "priority=0"),
                              ([0, 1.5], "priority=1.5"), ([0, True], "priority=True"), ([None, 0], "priority=None")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, greedy(2), use_tqdm=False, priority=priority)
        with pytest.raises(ValueError, match=message):
            llm.stream(prompts, greedy(2), priority=priority)
    for priority in ("1", 2.0, False):
        with pytest.raises(ValueError, match=f"priority={priority!r}"):
            llm.add_request([1, 2], greedy(2), priority=priority)
    assert llm.is_finished() and llm.stats().num_waiting == 0
    assert len(llm.generate(prompts, greedy(2), use_tqdm=False, priority=[-5, 10**12])) == 2  # any int
    llm.exit()
