"""Sampling and outputs as vLLM users expect them: masks and penalties against reference
implementations, seeds, stop rules, logprobs against HF transformers, n > 1, streaming, chat."""
import gc
import inspect
import math
import random

import pytest
import torch

from helpers import _hf_model, greedy, hf_greedy, random_prompts, spanning_stop_string
from nanovllm import LLM, SamplingParams
from nanovllm.layers.logits_processors import (SamplingTensors, TopKTopP, apply_min_p, apply_penalties,
                                               apply_top_k_top_p)
from nanovllm.layers.sampler import Sampler, inverse_transform_from_logits

BLOCK = 16
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    engine = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=128, max_model_len=256)
    yield engine
    engine.exit()


def tensors(batch: int, temperature: float, **kwargs) -> SamplingTensors:
    return SamplingTensors(torch.full((batch,), temperature), all_greedy=temperature == 0, **kwargs)


# --- 1. masks against a plain-Python reference, and the sampled distribution ---

def reference_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: -row[i])
    kept = order[:k]
    kth = row[kept[-1]]
    kept = [i for i in order if row[i] >= kth]  # ties with the k-th value stay
    z = sum(math.exp(row[i]) for i in kept)
    result, mass = [], 0.0
    for i in kept:
        if p < 1 and mass >= p:
            break
        result.append(i)
        mass += math.exp(row[i]) / z
    return set(result)


def reference_min_p(row: list[float], min_p: float) -> set[int]:
    z = sum(math.exp(x) for x in row)
    probs = [math.exp(x) / z for x in row]
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def test_top_k_top_p_masks_match_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 3
    rng = random.Random(0)
    ks = [rng.choice([1, 2, 5, 17, 50]) for _ in range(64)]
    ps = [rng.choice([0.05, 0.3, 0.75, 0.9, 1.0]) for _ in range(64)]
    out = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    assert kept(out) == [reference_top_k_top_p(r, k, p) for r, k, p in zip(logits.tolist(), ks, ps)]
    kept_values = torch.isfinite(out)
    assert torch.equal(out[kept_values], logits[kept_values])  # kept logits are untouched


def test_min_p_mask_matches_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 40, generator=gen) * 2
    min_ps = torch.tensor([random.Random(i).choice([0.0, 0.01, 0.1, 0.5, 1.0]) for i in range(32)])
    out = apply_min_p(logits, min_ps)
    assert kept(out) == [reference_min_p(r, m) for r, m in zip(logits.tolist(), min_ps.tolist())]


def test_temperature_sampling_matches_softmax():
    """20,000 draws from an 8-token distribution: every frequency within 0.015 of softmax(l / T)
    (more than 4 standard deviations of a frequency at this count)."""
    torch.manual_seed(1234)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature, draws = 0.7, 20_000
    out = Sampler(inverse_transform_from_logits)(logits.repeat(draws, 1), tensors(draws, temperature))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=8).float() / draws
    expected = torch.softmax(logits / temperature, dim=0)
    assert (freq - expected).abs().max().item() < 0.015


def test_the_cpu_draw_follows_the_weights_and_never_takes_a_zero():
    """layers/sampler.py inverse_transform_draw (the CPU platform's draw): 20,000 rows of unnormalised weights
    with zeros among them, the first and last included: every frequency within 0.015 of the
    normalised weight and no zero-weight token ever; a seeded row draws the same tokens alone as
    in a batch."""
    from nanovllm.layers import sampler as sampler_module
    torch.manual_seed(7)
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0])
    draws = 20_000
    tokens = sampler_module.inverse_transform_draw(weights.repeat(draws, 1), tensors(draws, 1.0))
    freq = torch.bincount(tokens, minlength=8).float() / draws
    assert (freq - weights / weights.sum()).abs().max().item() < 0.015
    assert freq[weights == 0].sum().item() == 0

    def seeded(rows: int, row: int) -> list[int]:
        t = tensors(rows, 1.0)._replace(generators=((row, torch.Generator().manual_seed(11)),))
        return [sampler_module.inverse_transform_draw(weights.repeat(rows, 1), t)[row].item() for _ in range(20)]
    assert seeded(1, 0) == seeded(5, 3)
    assert len(set(seeded(1, 0))) > 1  # the generator advances: not one token over and over


def test_top_k_and_top_p_sampling_stay_inside_the_mask():
    torch.manual_seed(5)
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, 1.0]]).repeat(3000, 1)
    top_k = TopKTopP(torch.full((3000,), 2, dtype=torch.int64), None)
    out = Sampler(inverse_transform_from_logits)(logits, tensors(3000, 1.0, after_temperature=(top_k,)))
    assert set(out.token_ids) == {0, 1}
    top_p = TopKTopP(None, torch.full((3000,), 0.5))
    out = Sampler(inverse_transform_from_logits)(logits, tensors(3000, 1.0, after_temperature=(top_p,)))
    assert set(out.token_ids) <= reference_top_k_top_p(logits[0].tolist(), 6, 0.5)


def test_top_k_one_and_tiny_top_p_equal_greedy(llm, qwen3_tiny):
    prompts = random_prompts(200, [5, 17, 33], seed=21)
    expected = hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=MAX_TOKENS, ignore_eos=True)):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == expected


# --- 2. seeds ---

def test_seed_gives_same_tokens_whatever_the_batch(llm):
    target = random_prompts(200, [12], seed=22)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0]["token_ids"]
    others = random_prompts(200, [3, 40, 25, 9], seed=23)
    unseeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS + 5, ignore_eos=True)
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=4, ignore_eos=True)
    batch1 = llm.generate(others[:2] + [target], [unseeded, other_seed, params], use_tqdm=False)
    batch2 = llm.generate([target] + others, [params, other_seed, unseeded, unseeded, other_seed], use_tqdm=False)
    assert batch1[2]["token_ids"] == alone
    assert batch2[0]["token_ids"] == alone
    different = llm.generate([target], SamplingParams(temperature=1.0, top_p=0.95, seed=8, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True), use_tqdm=False)[0]["token_ids"]
    assert different != alone


# --- 3. stop rules ---

def test_stop_token_ids_and_min_tokens(llm, qwen3_tiny):
    prompt = random_prompts(200, [10], seed=24)[0]
    free = hf_greedy(qwen3_tiny, [prompt], MAX_TOKENS)[0]
    stop_id = free[4]
    first = free.index(stop_id)
    (out,) = llm.generate([prompt], greedy(MAX_TOKENS, stop_token_ids=[stop_id]), use_tqdm=False)
    assert out["token_ids"] == free[:first + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop_id)
    # min_tokens forbids the stop token until min_tokens tokens exist.
    (late,) = llm.generate([prompt], greedy(MAX_TOKENS, stop_token_ids=[stop_id], min_tokens=first + 2), use_tqdm=False)
    assert stop_id not in late["token_ids"][:first + 2]
    assert late["token_ids"][:first] == free[:first]
    assert len(late["token_ids"]) >= first + 2


def test_eos_stop_reason_is_none(llm, qwen3_tiny):
    prompt = random_prompts(200, [10], seed=25)[0]
    free = hf_greedy(qwen3_tiny, [prompt], MAX_TOKENS)[0]
    old = llm.stop_checker.eos
    llm.stop_checker.eos = free[3]
    try:
        (out,) = llm.generate([prompt], greedy(MAX_TOKENS, ignore_eos=False), use_tqdm=False)
    finally:
        llm.stop_checker.eos = old
    assert out["token_ids"] == free[:free.index(free[3]) + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", None)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llm, include):
    prompt = llm.tokenizer.encode("The cache is split into fixed blocks of tokens.")
    free = llm.generate([prompt], greedy(max_tokens=24), use_tqdm=False)[0]
    stop, boundary = spanning_stop_string(llm.tokenizer, free["token_ids"])
    full_text = llm.tokenizer.decode(free["token_ids"])
    index = full_text.index(stop)
    (out,) = llm.generate([prompt], greedy(max_tokens=24, stop=["@@never@@", stop],
                                           include_stop_str_in_output=include), use_tqdm=False)
    assert out["text"] == (full_text[:index + len(stop)] if include else full_text[:index])
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)
    # Generation ends with the token that completed the stop string.
    n = len(out["token_ids"])
    assert out["token_ids"] == free["token_ids"][:n]
    assert stop in llm.tokenizer.decode(out["token_ids"]) and stop not in llm.tokenizer.decode(out["token_ids"][:-1])


# --- 4. logprobs against HF ---

def test_logprobs_match_hf_log_softmax(llm, qwen3_tiny):
    prompts = random_prompts(200, [7, 20], seed=26)
    params = [greedy(MAX_TOKENS, logprobs=5),
              SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    model = _hf_model(qwen3_tiny)
    for prompt, out, p in zip(prompts, outputs, params):
        ids = torch.tensor([prompt + out["token_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        assert len(out["logprobs"]) == len(out["token_ids"])
        for step, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
            row = logprobs[len(prompt) - 1 + step]
            assert entry["token_id"] == token
            assert abs(entry["logprob"] - row[token].item()) < 1e-4
            top_values, top_ids = row.topk(p.logprobs)
            assert list(entry["top_logprobs"]) == top_ids.tolist()
            assert all(abs(a - b) < 1e-4 for a, b in zip(entry["top_logprobs"].values(), top_values.tolist()))
    no_logprobs = llm.generate(prompts[:1], greedy(MAX_TOKENS), use_tqdm=False)[0]
    assert "logprobs" not in no_logprobs


# --- 5. penalties ---

def test_penalties_match_reference():
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 6, 30
    logits = torch.randn(batch, vocab, generator=gen) * 2
    prompt = [[random.Random(r).randrange(vocab) for _ in range(5)] for r in range(batch)]
    output = [[random.Random(100 + r).randrange(vocab) for _ in range(8)] for r in range(batch)]
    rep, pres, freq = [1.0, 1.3, 0.8, 2.0, 1.0, 1.5], [0.0, 0.5, -0.5, 1.0, 2.0, 0.0], [0.0, 0.2, 1.0, -1.0, 0.0, 0.3]
    prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool)
    counts = torch.zeros(batch, vocab)
    for r in range(batch):
        prompt_mask[r, prompt[r]] = True
        for t in output[r]:
            counts[r, t] += 1
    out = apply_penalties(logits, torch.tensor(rep), torch.tensor(pres), torch.tensor(freq), prompt_mask, counts)
    for r in range(batch):
        for t in range(vocab):
            x = logits[r, t].item()
            if t in prompt[r] or t in output[r]:
                x = x / rep[r] if x > 0 else x * rep[r]
            x -= freq[r] * output[r].count(t) + pres[r] * (t in output[r])
            assert abs(out[r, t].item() - x) < 1e-5


def test_repetition_penalty_matches_hf_greedy(llm, qwen3_tiny):
    prompts = random_prompts(200, [6, 30], seed=27)
    outputs = llm.generate(prompts, greedy(MAX_TOKENS, repetition_penalty=1.5), use_tqdm=False)
    model = _hf_model(qwen3_tiny)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                             repetition_penalty=1.5, eos_token_id=None, pad_token_id=model.config.pad_token_id)
        assert out["token_ids"] == ref[0, len(prompt):].tolist()


def test_frequency_penalty_changes_greedy_repeats(llm, qwen3_tiny):
    prompt = random_prompts(200, [8], seed=28)[0]
    plain = llm.generate([prompt], greedy(max_tokens=32), use_tqdm=False)[0]["token_ids"]
    penalised = llm.generate([prompt], greedy(max_tokens=32, frequency_penalty=2.0, presence_penalty=2.0),
                             use_tqdm=False)[0]["token_ids"]
    assert len(set(penalised)) >= len(set(plain))


# --- n > 1 ---

def test_n_samples_share_the_prompt_blocks(llm):
    prompt = random_prompts(200, [40], seed=29)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    samples = out["outputs"]
    assert len(samples) == 3 and out["token_ids"] == samples[0]["token_ids"]
    assert out["prompt_token_ids"] == prompt
    assert [s["num_cached_tokens"] for s in samples[1:]] == [32, 32]  # the 2 full prompt blocks
    # Sample i uses seed + i: sample 1 equals a single request seeded 12.
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=12, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0]
    assert samples[1]["token_ids"] == single["token_ids"]
    assert "outputs" not in single
    (greedy_out,) = llm.generate([prompt], greedy(MAX_TOKENS, n=2), use_tqdm=False)
    assert greedy_out["outputs"][0]["token_ids"] == greedy_out["outputs"][1]["token_ids"]


# --- 6. streaming and chat ---

def test_stream_yields_tokens_and_ends_with_generate_text(llm):
    prompts = ["hello world", "The quick brown fox", "Numbers like 0 1 2"]
    params = [greedy(max_tokens=12), greedy(max_tokens=20, stop=["e"]),
              SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=9, ignore_eos=True)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    texts, tokens, finished = {}, {}, {}
    steps = 0
    for chunk in llm.stream(prompts, params):
        key = (chunk.index, chunk.sample)
        assert not finished.get(key), "nothing after the finished chunk"
        texts[key] = texts.get(key, "") + chunk.text
        tokens[key] = tokens.get(key, []) + chunk.token_ids
        finished[key] = chunk.finished
        steps += 1
    assert all(finished.values())
    for i, out in enumerate(expected):
        samples = out.get("outputs", [out])
        for j, sample in enumerate(samples):
            assert texts[(i, j)] == sample["text"]
            assert tokens[(i, j)] == sample["token_ids"]
    assert steps == sum(len(s["token_ids"]) for o in expected for s in o.get("outputs", [o]))


def test_abandoned_stream_frees_its_blocks(llm):
    """close() frees at once, whatever else still holds the stream's internals and whenever the
    interpreter would finalise them (the garbage collector is off, and everything the stream's
    frame refers to is kept alive across the close)."""
    stream = llm.stream(random_prompts(200, [20, 30], seed=30), greedy(max_tokens=50))
    next(stream)
    assert llm.block_manager.num_free_blocks < llm.block_manager.num_blocks
    gc.disable()
    try:
        internals = gc.get_referents(stream)
        internals += [r for o in internals if inspect.isframe(o) or inspect.isgenerator(o)
                      for r in gc.get_referents(o)]
        stream.close()
        assert llm.is_finished()
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        del internals
    finally:
        gc.enable()


def test_chat_applies_the_template(llm):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    (out,) = llm.chat(conversation, greedy(max_tokens=6), use_tqdm=False)
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert out["prompt_token_ids"] == llm.tokenizer.encode(text, add_special_tokens=False)
    (direct,) = llm.generate([out["prompt_token_ids"]], greedy(max_tokens=6), use_tqdm=False)
    assert out["token_ids"] == direct["token_ids"]
    two = llm.chat([conversation, conversation[1:]], greedy(max_tokens=6), use_tqdm=False)
    assert len(two) == 2 and two[0]["token_ids"] == out["token_ids"]
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}])


# --- 7. every invalid field named ---

@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.1), ("min_p", 1.1), ("seed", 1.5), ("stop", ""), ("stop", ["ok", ""]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", "3"), ("include_stop_str_in_output", 1), ("min_tokens", -1),
    ("min_tokens", 100), ("max_tokens", 0), ("ignore_eos", None), ("logprobs", -1), ("logprobs", 21),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("skip_special_tokens", "no"),
])
def test_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_token_outside_vocabulary_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2]], greedy(MAX_TOKENS, stop_token_ids=[10**7]), use_tqdm=False)
    assert llm.is_finished()
