"""A prefill computes past the last layer's attention only the rows it samples from
(models/base.py `keep_rows`): every prompt token's K/V is still stored, the output equals HF's
greedy tokens, and prompt logprobs (which read every row) still get every row."""
import pytest
import torch

from helpers import greedy, hf_greedy, random_prompts
from nanovllm import LLM, SamplingParams

LENGTHS = [64, 40, 17, 16, 3, 1]  # longest first: with a budget of 24 the first chunks end inside a prompt
MAX_TOKENS = 12


def first_and_last_mlp(llm: LLM):
    model = llm.model_runner.model
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    return layers[0].mlp, layers[-1].mlp


def record_rows(module) -> list[int]:
    """The row count of each call's input to `module`."""
    rows: list[int] = []
    module.register_forward_hook(lambda mod, args, out: rows.append(args[0].size(0)))
    return rows


def record_sampling(llm: LLM) -> list[tuple[int, int]]:
    """(tokens computed, sequences sampled) of each prefill step."""
    steps: list[tuple[int, int]] = []
    run = llm.model_runner.run

    def recording_run(seqs, is_prefill, *copies):
        if is_prefill:
            done = sum(seq.num_computed_tokens + seq.num_scheduled_tokens == len(seq) for seq in seqs)
            steps.append((sum(seq.num_scheduled_tokens for seq in seqs), done))
        return run(seqs, is_prefill, *copies)

    llm.model_runner.run = recording_run
    return steps


@pytest.mark.parametrize("ckpt", ["qwen3_tiny", "gpt2_tiny", "qwen3_moe_tiny"])
@pytest.mark.parametrize("budget", [None, 24])
def test_prefill_computes_the_last_layer_for_its_sampling_rows_only(ckpt, budget, request):
    path = request.getfixturevalue(ckpt)
    prompts = random_prompts(100, LENGTHS, seed=11)
    extra = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=128, max_num_seqs=8, **extra)
    assert not llm.core.async_scheduling  # record_sampling wraps run(), what the CPU engine loop calls
    first, last = first_and_last_mlp(llm)
    first_rows, last_rows = record_rows(first), record_rows(last)
    steps = record_sampling(llm)
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == hf_greedy(path, prompts, MAX_TOKENS)
    prefills = len(steps)
    assert prefills >= 1 and (budget is None or prefills > 2)
    # The first layer's MLP sees every computed token, the last one's a row per sampling sequence
    # (one row where a chunk ends inside every prompt); decode steps come after, a row each.
    assert first_rows[:prefills] == [tokens for tokens, _ in steps]
    assert last_rows[:prefills] == [max(done, 1) for _, done in steps]
    assert sum(tokens for tokens, _ in steps) > sum(max(done, 1) for _, done in steps)
    if budget is not None:
        assert any(done == 0 for _, done in steps), "some chunk must end inside every prompt"
    assert first_rows[prefills:] == last_rows[prefills:]
    llm.exit()


def test_prompt_logprobs_steps_keep_every_row(qwen3_tiny):
    """The step that computes prompt logprobs runs every row to the end (their logits are read);
    its sampled token is the same as without them."""
    prompt = random_prompts(100, [20], seed=3)[0]
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, enable_prefix_caching=False)
    _, last = first_and_last_mlp(llm)
    rows = record_rows(last)
    with_lp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1),
                           use_tqdm=False)[0]
    assert rows[0] == len(prompt)
    rows.clear()
    plain = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    assert rows[0] == 1
    assert plain["token_ids"] == with_lp["token_ids"]
    llm.exit()


def test_pruned_logits_equal_the_full_forward_rows(qwen3_tiny, monkeypatch):
    """The logits of a pruned prefill are the full forward's sampling rows, in the same order
    (float32, to rounding: the last layer's products run on fewer rows)."""
    from nanovllm.runner import model_runner
    prompts = random_prompts(100, [30, 5, 17, 9], seed=4)
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, enable_prefix_caching=False)
    model = llm.model_runner.model
    logits: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]
    wants_logits = greedy(1, logprobs=1)  # plain greedy steps may take their tokens without logits (a greedy head)
    llm.generate(prompts, wants_logits, use_tqdm=False)
    full_inputs = model_runner.prefill_inputs
    monkeypatch.setattr(model_runner, "prefill_inputs", lambda *a, **k: full_inputs(*a, **k)._replace(keep_rows=None))
    llm.generate(prompts, wants_logits, use_tqdm=False)
    pruned, full = logits
    assert pruned.shape == full.shape == (len(prompts), model.lm_head.weight.size(0))
    torch.testing.assert_close(pruned, full, rtol=1e-5, atol=1e-5)
    assert not torch.equal(full[0], full[1])  # rows in order, not one row repeated
    llm.exit()
