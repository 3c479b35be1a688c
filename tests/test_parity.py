"""End to end against HF transformers: greedy float32 tokens must be identical, for every batch
mix, with prefix-cache hits, under preemption and with chunked prefill.

HF runs on CPU, the reference. The engine runs on CPU, and the tests parametrized with
EVERY_DEVICE run on CUDA too where there is a GPU (the same float32 tokens are expected there).
"""
import pytest

from helpers import EVERY_DEVICE, greedy, hf_greedy, random_prompts
from nanovllm import LLM, SamplingParams

CHECKPOINTS = ["qwen3_tiny", "qwen3_tiny_tied", "qwen2_tiny"]
# Around block boundaries for block size 16, plus a few longer ones.
MIXED_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 50, 64]
MAX_TOKENS = 24
BLOCK = 16
# More than any test's batch; on CUDA it means 5 decode graphs to capture instead of nano-vllm's 36.
MAX_NUM_SEQS = 16


def engine(path: str, device: str, **kwargs) -> LLM:
    return LLM(path, device=device, kvcache_block_size=kwargs.pop("kvcache_block_size", BLOCK),
               max_num_seqs=MAX_NUM_SEQS, **kwargs)


def record_prefill_chunks(llm: LLM) -> list[list[int]]:
    """Wrap the runner to record, per step that computes prompt tokens, the tokens scheduled for
    each sequence in its prompt (a mixed step's decode rows are left out)."""
    chunks: list[list[int]] = []
    name = "launch" if llm.core.async_scheduling else "run"  # what the engine loop calls (on by default on CUDA)
    run = getattr(llm.model_runner, name)

    def recording_run(seqs, is_prefill, *copies):
        prompt_rows = [seq.num_scheduled_tokens for seq in seqs if seq.num_computed_tokens < seq.num_prompt_tokens]
        if prompt_rows:
            chunks.append(prompt_rows)
        return run(seqs, is_prefill, *copies)

    setattr(llm.model_runner, name, recording_run)
    return chunks


@pytest.mark.parametrize("device", EVERY_DEVICE)
@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_greedy_parity_mixed_batch(ckpt, device, request):
    path = request.getfixturevalue(ckpt)
    prompts = random_prompts(200, MIXED_LENGTHS, seed=1)
    # Different max_tokens per request, so sequences leave the batch at different steps.
    max_tokens = [MAX_TOKENS - 2 * (i % 4) for i in range(len(prompts))]
    llm = engine(path, device, num_kvcache_blocks=256)
    outputs = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert [o["token_ids"] for o in outputs] == [e[:m] for e, m in zip(expected, max_tokens)]
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert all(len(set(e)) > 4 for e in expected), "the random model should not repeat one token"
    llm.exit()


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_prefix_cache_hits_keep_outputs(ckpt, request):
    path = request.getfixturevalue(ckpt)
    shared = random_prompts(200, [40], seed=2)[0]
    tails = random_prompts(200, [1, 9, 16, 23], seed=3)
    prompts = [shared + tail for tail in tails] + [shared[:32], shared[:32]]  # 32 = 2 full blocks
    llm = engine(path, "cpu", num_kvcache_blocks=256)
    first = llm.generate([shared], greedy(MAX_TOKENS), use_tqdm=False)
    assert first[0]["num_cached_tokens"] == 0
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert [o["token_ids"] for o in outputs] == expected
    # The 40-token prefix holds 2 full blocks; a fully cached prompt still computes its last block.
    assert [o["num_cached_tokens"] for o in outputs] == [32, 32, 32, 32, 16, 16]
    # A third call hits blocks published by the second (prefix + generated-free tails).
    again = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in again] == expected
    assert all(a["num_cached_tokens"] >= o["num_cached_tokens"] for a, o in zip(again, outputs))
    llm.exit()


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_parity_under_preemption(ckpt, request):
    path = request.getfixturevalue(ckpt)
    prompts = random_prompts(200, MIXED_LENGTHS, seed=4)
    # 12 blocks of 16 hold 192 tokens: far less than the batch needs at once.
    llm = engine(path, "cpu", num_kvcache_blocks=12)
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outputs] == hf_greedy(path, prompts, MAX_TOKENS)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    llm.exit()


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_parity_with_chunked_prefill(ckpt, request):
    path = request.getfixturevalue(ckpt)
    prompts = random_prompts(200, MIXED_LENGTHS, seed=5)
    budget = 24  # smaller than the longer prompts, and not a multiple of the block size
    llm = engine(path, "cpu", num_kvcache_blocks=256, max_num_batched_tokens=budget)
    chunks = record_prefill_chunks(llm)
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == hf_greedy(path, prompts, MAX_TOKENS)
    assert all(sum(step) <= budget for step in chunks)
    assert sum(sum(step) for step in chunks) == sum(map(len, prompts))  # no preemption: each token once
    assert len(chunks) > len(prompts) // 2, "long prompts must have been split over several steps"
    llm.exit()


@pytest.mark.parametrize("device", EVERY_DEVICE)
def test_parity_with_everything_at_once(qwen3_tiny, device):
    """Prefix hits, chunked prefill and preemption in one run, over two generate() calls."""
    shared = random_prompts(200, [48], seed=6)[0]
    prompts = [shared + tail for tail in random_prompts(200, [3, 17, 30, 1, 12], seed=7)]
    prompts += random_prompts(200, [5, 40, 64], seed=8)
    llm = engine(qwen3_tiny, device, num_kvcache_blocks=14, max_num_batched_tokens=40)
    expected = hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)
    first = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    second = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in first] == expected
    assert [o["token_ids"] for o in second] == expected
    assert llm.scheduler.num_preemptions > 0
    assert sum(o["num_cached_tokens"] for o in first + second) > 0
    llm.exit()


@pytest.mark.parametrize("device", EVERY_DEVICE)
def test_block_size_32_and_sampling_rows_beside_greedy(qwen3_tiny, device):
    """Another power-of-two block size; greedy rows stay argmax next to sampled rows."""
    prompts = random_prompts(200, [3, 31, 32, 33, 70], seed=9)
    llm = engine(qwen3_tiny, device, kvcache_block_size=32, num_kvcache_blocks=64)
    params = [greedy(MAX_TOKENS) if i % 2 == 0
              else SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)
    for i, (o, e) in enumerate(zip(outputs, expected)):
        if i % 2 == 0:
            assert o["token_ids"] == e
        else:
            assert len(o["token_ids"]) == MAX_TOKENS
    llm.exit()
