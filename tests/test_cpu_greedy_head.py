"""The greedy LM head (kernels/cpu_greedy_head.cpp, cpu_build.py GreedyHead): a float32 head's
argmax per row through int8 scores, a proven bound and a float32 recheck of the tokens the bound
leaves. It must give the argmax of the exact logits wherever float32 can tell them apart: random
heads of vocabularies that leave a partial panel and widths that leave a partial vector, 1 to 70
rows, strided rows, near-ties far below the int8 scores' resolution, exact ties (the first index,
as torch.argmax), rows with an outlier; recheck only a few tokens on random data (the bound
prunes); and decline (None) rows it cannot prove: not finite, logits near the sampler's clamp,
neither float32 nor bfloat16. The head is made only for float32 and bfloat16 finite heads of a
width a multiple of 4.

bfloat16 rows (a bf16 model's; the head bf16, or held in float32 for a CPU without native bf16
products) have bfloat16 logits: the token must be the first of the largest logits rounded to
bfloat16 (ties between tokens that round alike are common): on heads whose float32 logits are
exact (small integers), against the rounded exact logits, greedy and sampled (the race over the
rounded logits); on random heads, a token whose rounded logit is the largest.

The engine gives a float32 head on one rank to it (where the CPU has AVX512-VNNI or AVX2; the AVX2
form runs in tests/test_cpu_kernel_isa_builds.py): steps whose
sequences are all greedy with nothing else to sample take their tokens from it (HF's greedy
tokens, every family), and a step with logprobs, a sampled row or a processor computes the logits.
"""
import pytest
import torch

from helpers import greedy, hf_greedy, integer_head, random_prompts, rounded_logits

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.cpu_build import GREEDY_HEAD_CHUNK, GreedyHead
from nanovllm.layers.logits_processors import LOGIT_LIMIT
from nanovllm.runner.step_inputs import HeadDraw, StepMessage


@pytest.fixture(scope="module")
def make_head(cpu_kernels):
    if cpu_kernels._greedy_head is None:
        pytest.skip("this CPU's build has neither AVX512-VNNI nor AVX2: no greedy head (the logits path runs)")
    return lambda weight: cpu_kernels.greedy_head(weight, LOGIT_LIMIT)


def exact_argmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).argmax(1)


@pytest.mark.parametrize("vocab, width, rows", [(32000, 512, 64), (1000, 100, 7), (50, 64, 1), (4097, 260, 70),
                                                (GREEDY_HEAD_CHUNK, 4, 3)])
def test_random_heads_give_the_exact_argmax(make_head, vocab, width, rows):
    gen = torch.Generator().manual_seed(vocab + width + rows)
    w = torch.randn(vocab, width, generator=gen) * 0.05
    x = torch.randn(rows, width, generator=gen)
    head = make_head(w)
    tokens = head(x)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert torch.equal(tokens, exact_argmax(x, w))
    assert torch.equal(tokens, (x @ w.T).argmax(1))  # float32 logits agree where nothing is near a tie
    # The bound prunes: on random data a row rechecks a handful of the vocabulary, not most of it.
    assert int(head.candidates) <= rows * max(8, vocab // 50)


def test_strided_rows(make_head):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3000, 128, generator=gen)
    wide = torch.randn(9, 200, generator=gen)
    x = wide[:, 10:138]  # row stride 200, unit stride along the row
    assert torch.equal(make_head(w)(x), exact_argmax(x, w))


def test_near_ties_below_int8_resolution_are_decided_in_float32(make_head):
    """Pairs of vocabulary rows whose logits differ by ~1e-4 relative: their int8 scores cannot tell
    them apart (both pass the bound), the float32 recheck does."""
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(200, 256, generator=gen)
    x = torch.randn(16, 256, generator=gen)
    # Each row's favourite direction, then near copies of it scaled by 1 +- 1e-4.
    top = x / x.norm(dim=1, keepdim=True) * 10  # well above any random row
    w = torch.cat([base, top, top * (1 + 1e-4), top * (1 - 1e-4)])
    head = make_head(w)
    tokens = head(x)
    assert torch.equal(tokens, exact_argmax(x, w))
    assert bool((tokens >= 200 + 16).all() & (tokens < 200 + 32).all())  # the scaled-up copies win
    assert int(head.candidates) >= 3 * 16  # every row rechecked its three near-equal candidates


def test_exact_ties_take_the_first_index(make_head):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(500, 64, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    best = exact_argmax(x, w)
    tied = torch.cat([w, w[best]])  # each row's best again, later in the vocabulary
    assert torch.equal(make_head(tied)(x), best)
    first_later = torch.cat([w[best], w])  # and earlier: the copies at 0..4 win (the first of equals)
    assert torch.equal(make_head(first_later)(x), exact_argmax(x, first_later))
    assert torch.equal(make_head(first_later)(x), (first_later.double() @ x.double().T).T.argmax(1))


def test_an_outlier_feature_keeps_the_result_exact(make_head):
    """One component 1,000 times the rest coarsens the int8 rows of x: more tokens pass the bound,
    the answer stays exact."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2000, 128, generator=gen)
    x = torch.randn(6, 128, generator=gen)
    x[:, 7] = 1000.0
    assert torch.equal(make_head(w)(x), exact_argmax(x, w))


def test_rows_it_cannot_prove_are_declined(make_head):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 64, generator=gen)
    head = make_head(w)
    x = torch.randn(3, 64, generator=gen)
    assert head(x) is not None
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 5] = bad
        assert head(y) is None
    assert head(x * 1e28) is None  # logits could reach the sampler's clamp (1e30)
    assert head(x.half()) is None


def test_only_float32_and_bfloat16_finite_heads_of_whole_quads(cpu_kernels, make_head):
    w = torch.randn(100, 64)
    assert isinstance(make_head(w), GreedyHead) and isinstance(make_head(w.bfloat16()), GreedyHead)
    assert cpu_kernels.greedy_head(w.half(), LOGIT_LIMIT) is None
    assert cpu_kernels.greedy_head(torch.randn(100, 66), LOGIT_LIMIT) is None
    w[3, 3] = float("inf")
    assert cpu_kernels.greedy_head(w, LOGIT_LIMIT) is None


@pytest.mark.parametrize("head_dtype", [torch.bfloat16, torch.float32])  # a bf16 head, or one held in float32
@pytest.mark.parametrize("vocab, width, rows", [(3000, 64, 9), (640, 256, 64), (100, 32, 1)])
def test_bfloat16_rows_take_the_first_of_the_largest_rounded_logits(cpu_kernels, make_head, head_dtype, vocab,
                                                                     width, rows):
    x, w = integer_head(vocab, width, rows, seed=vocab + rows)
    logits = rounded_logits(x, w)
    ties = (logits == logits.max(1, keepdim=True).values).sum(1)
    if rows >= 64:
        assert (ties > 1).any()  # the rounding makes ties: the first index must win them
    tokens = make_head(w.to(head_dtype))(x)
    assert torch.equal(tokens, logits.float().argmax(1))  # torch.argmax: the first of the largest
    assert torch.equal(tokens, cpu_kernels.greedy_tokens(logits, LOGIT_LIMIT))


def test_bfloat16_sampled_rows_race_over_the_rounded_logits(cpu_kernels, make_head):
    x, w = integer_head(2000, 128, 12, seed=9)
    # Rows scaled to logits of a few units, so the noise decides among many tokens; float32 sums stay
    # exact (bf16 x of 8 bits times w of 4, |x . w| < 2^10 in steps of 2^-11).
    x = (x.float() * 0.1).bfloat16()
    logits = rounded_logits(x, w)
    temperatures = torch.tensor([0.0, 0.7, 1.0, 1.5] * 3)
    keys, counters = torch.arange(12) * 7919 + 5, torch.arange(12) % 4
    head = make_head(w.bfloat16())
    tokens = head(x, HeadDraw(temperatures.tolist(), keys.tolist(), counters.tolist()))
    expected = cpu_kernels.race_tokens(logits, temperatures, keys, counters, LOGIT_LIMIT)
    assert torch.equal(tokens, expected)
    assert len(set(tokens[1::4].tolist() + tokens[3::4].tolist())) > 1  # drawn, not all the argmax


def test_bfloat16_random_rows_take_a_largest_rounded_logit(make_head):
    gen = torch.Generator().manual_seed(10)
    w = (torch.randn(32000, 512, generator=gen) * 0.05).bfloat16()
    x = torch.randn(64, 512, generator=gen).bfloat16()
    logits = rounded_logits(x, w).float()
    tokens = make_head(w)(x)
    top = logits.max(1).values
    # Its rounded logit is the largest (float32's order of the sum may round a near-boundary value
    # the other way: one bf16 step at most), and it is the first of the largest nearly always.
    picked = logits.gather(1, tokens[:, None]).squeeze(1)
    assert bool((picked >= top - top.abs() * 2 ** -7).all())
    assert (tokens == logits.argmax(1)).float().mean() >= 0.95


@pytest.mark.parametrize("family", ["qwen3_tiny", "qwen3_tiny_tied", "llama_tiny", "gpt2_tiny"])
def test_engine_greedy_steps_take_the_head_and_give_hf_tokens(request, make_head, family):
    path = request.getfixturevalue(family)
    llm = LLM(path, dtype="float32")
    sampler = llm.model_runner.sampler
    assert sampler.head is not None
    calls = []
    original = sampler.head_tokens
    sampler.head_tokens = lambda hidden, draw=None: calls.append(hidden.size(0)) or original(hidden, draw)
    prompts = random_prompts(200, [5, 17, 33, 9], seed=6)
    out = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert [o["token_ids"] for o in out] == hf_greedy(path, prompts, 12)
    assert sum(calls) >= 4 * 12 - 4  # every sampling step (the prefill's rows and each decode step's)


def test_steps_needing_logits_compute_them(qwen3_tiny, make_head):
    """A step with logprobs, a sampled row with top_p or a processor (logit_bias) never takes the
    head; the greedy rows among them still get HF's tokens."""
    llm = LLM(qwen3_tiny, dtype="float32")
    sampler = llm.model_runner.sampler
    calls = []
    original = sampler.head_tokens
    sampler.head_tokens = lambda hidden, draw=None: calls.append(hidden.size(0)) or original(hidden, draw)
    prompts = random_prompts(200, [7, 11], seed=7)
    expected = hf_greedy(qwen3_tiny, prompts[:1], 8)
    for other in (greedy(8, logprobs=2), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=1, ignore_eos=True),
                  greedy(8, logit_bias={3: 0.5})):
        out = llm.generate(prompts, [greedy(8), other], use_tqdm=False)
        assert out[0]["token_ids"] == expected[0]
    assert calls == []
    assert StepMessage.of([], False).head_draw is None  # callers opt in; speculative steps never do


def test_head_norms_bound_the_exact_ones(make_head):
    """The bound's per-token factors are upper bounds of the exact norms (float64), and tight."""
    gen = torch.Generator().manual_seed(8)
    vocab, width = 1000, 264
    w = torch.randn(vocab, width, generator=gen) * torch.rand(vocab, 1, generator=gen)
    head = make_head(w)
    q = head.packed.permute(0, 2, 3, 1, 4).reshape(-1, width)[:vocab].double()  # back to [vocab, width]
    assert torch.equal(q, torch.round(w / head.scale[:vocab, None]).double())
    exact_norm = w.double().norm(dim=1)
    exact_err = (w.double() - head.scale[:vocab].double()[:, None] * q).norm(dim=1)
    for bound, exact in ((head.norm[:vocab].double(), exact_norm), (head.err[:vocab].double(), exact_err)):
        assert bool((bound >= exact).all()) and float((bound / exact).max()) < 1.01
    assert torch.equal(head.qsum[:vocab], q.sum(1).int())
    assert not head.norm[vocab:].any()  # padding rows: zeros
