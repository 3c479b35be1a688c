"""The CPU's sampling race (kernels/cpu_fused.cpp race_rows, cpu_kernels.h gumbel64) and the LM
head that draws by it without the logits (kernels/cpu_greedy_head.cpp, sampled rows).

A row with temperature T > 0 takes argmax_v (l_v / T + g_v), g_v Gumbel noise keyed by the row's
key and counter (runner/sampling_inputs.py philox_keys): its draws must follow softmax(l / T)
(chi-square against the exact probabilities, fixed keys so the verdict never changes), depend on
nothing but the row's logits, temperature, key and counter (not its position in the batch), and
a greedy row (T = 0) takes the argmax of the finite logits. The head must draw exactly the race's
token from the float32 logits, for greedy and sampled rows mixed, at small and large temperatures.
In the engine: temperature-only steps (seeded or not) take the head, and a seeded request draws
the same tokens with the head as without it (the logits path), alone or beside others.
"""
import pytest
import torch

from helpers import random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.layers.logits_processors import LOGIT_LIMIT, finite_logits
from nanovllm.runner.step_inputs import HeadDraw
from test_cpu_fused_kernels import DTYPES, randn

# chi-square's 99.99% quantile for 15 degrees of freedom: a correct sampler fails it once in 10,000 keys
CHI2_15_DOF_9999 = 44.26


def race(kernels, logits, temperatures, keys, counters):
    return kernels.race_tokens(logits, torch.tensor(temperatures, dtype=torch.float32),
                               torch.tensor(keys, dtype=torch.int64), torch.tensor(counters, dtype=torch.int64),
                               LOGIT_LIMIT)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_draws_follow_the_softmax(cpu_kernels, temperature):
    vocab, draws = 16, 200_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    rows = logits.expand(draws, vocab).contiguous()
    keys = torch.randint(0, 2**62, (draws,), generator=torch.Generator().manual_seed(4))
    tokens = cpu_kernels.race_tokens(rows, torch.full((draws,), temperature), keys, torch.arange(draws), LOGIT_LIMIT)
    observed = torch.bincount(tokens, minlength=vocab).double()
    expected = torch.softmax(logits.double() / temperature, 0) * draws
    assert ((observed - expected) ** 2 / expected).sum() < CHI2_15_DOF_9999
    # one key, counters 0..draws-1 (a seeded request's tokens): the same law
    same_key = cpu_kernels.race_tokens(rows, torch.full((draws,), temperature), torch.full((draws,), 7),
                                       torch.arange(draws), LOGIT_LIMIT)
    observed = torch.bincount(same_key, minlength=vocab).double()
    assert ((observed - expected) ** 2 / expected).sum() < CHI2_15_DOF_9999


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_depends_on_its_own_inputs_alone(cpu_kernels, dtype):
    rows, vocab = 24, 1000
    logits = randn(rows, vocab, dtype=dtype, seed=5, scale=3.0)
    temperatures = [0.0 if r % 5 == 0 else 0.2 + r / 10 for r in range(rows)]
    keys, counters = [r * 7919 - 10**12 for r in range(rows)], [r % 3 for r in range(rows)]
    tokens = race(cpu_kernels, logits, temperatures, keys, counters)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(6))
    shuffled = race(cpu_kernels, logits[order], [temperatures[i] for i in order], [keys[i] for i in order],
                    [counters[i] for i in order])
    assert torch.equal(shuffled, tokens[order])
    alone = [int(race(cpu_kernels, logits[r:r + 1], temperatures[r:r + 1], keys[r:r + 1], counters[r:r + 1]))
             for r in range(rows)]
    assert alone == tokens.tolist()
    # another counter (the next token of a seeded request) draws anew: not always the same token
    moved = race(cpu_kernels, logits, temperatures, keys, [c + 1 for c in counters])
    sampled = torch.tensor(temperatures) > 0
    assert not torch.equal(moved[sampled], tokens[sampled])
    assert torch.equal(moved[~sampled], tokens[~sampled])


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_rows_take_the_argmax_of_the_finite_logits(cpu_kernels, dtype):
    rows, vocab = 6, 37
    logits = randn(rows, vocab, dtype=dtype, seed=8, scale=5.0)
    logits[0, [3, 9]] = 50.0  # ties: the first index
    logits[1, 4] = float("nan")
    logits[2, 5], logits[2, 6] = float("inf"), float("-inf")
    logits[3] = float("nan")
    tokens = race(cpu_kernels, logits, [0.0] * rows, [1] * rows, [0] * rows)
    assert torch.equal(tokens, finite_logits(logits).argmax(-1))
    # a sampled row over non-finite logits still returns an index of the vocabulary, never the NaN's
    drawn = race(cpu_kernels, logits, [1.0] * rows, list(range(rows)), [0] * rows)
    assert ((drawn >= 0) & (drawn < vocab)).all() and int(drawn[1]) != 4 and int(drawn[2]) == 5


@pytest.fixture(scope="module")
def make_head(cpu_kernels):
    if cpu_kernels._greedy_head is None:
        pytest.skip("this CPU's build has neither AVX512-VNNI nor AVX2: no greedy head (the logits path runs)")
    return lambda weight: cpu_kernels.greedy_head(weight, LOGIT_LIMIT)


@pytest.mark.parametrize("vocab, width, rows", [(32000, 512, 64), (1000, 100, 7), (4097, 260, 70)])
def test_the_head_draws_the_races_token(cpu_kernels, make_head, vocab, width, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    w = torch.randn(vocab, width, generator=gen) * 0.05
    x = torch.randn(rows, width, generator=gen)
    temperatures = [(0.0, 0.05, 0.7, 1.0, 3.0)[r % 5] for r in range(rows)]
    draw = HeadDraw(temperatures, [r * 104729 + 3 for r in range(rows)], [r // 2 for r in range(rows)])
    head = make_head(w)
    tokens = head(x, draw)
    assert tokens is not None
    assert torch.equal(tokens, race(cpu_kernels, x @ w.T, *draw))
    assert int(head.candidates) <= rows * max(16, vocab // 20)  # the bound still prunes with the noise
    # greedy rows as without a draw
    greedy_rows = torch.tensor(temperatures) == 0
    assert torch.equal(tokens[greedy_rows], head(x)[greedy_rows])


def test_the_head_declines_sampled_rows_whose_scaled_logits_near_the_clamp(make_head):
    """Logits times 1 / T that could reach a tenth of the sampler's clamp go to the logits path."""
    w = torch.randn(100, 64, generator=torch.Generator().manual_seed(10)) * 0.05
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(11)) * 1e24  # logits ~1e24 (the clamp: 1e30)
    head = make_head(w)
    assert head(x, HeadDraw([1.0, 1.0], [1, 2], [0, 0])) is not None
    assert head(x, HeadDraw([1.0, 1e-5], [1, 2], [0, 0])) is None  # the smallest temperature: x 1e5


def count_head_calls(sampler) -> list[int]:
    calls = []
    original = sampler.head_tokens
    sampler.head_tokens = lambda hidden, draw=None: calls.append(hidden.size(0)) or original(hidden, draw)
    return calls


# Whole prompts in one step; and chunked prefills beside decode rows (steps where some sequences do
# not sample yet: the head draws for the rows that do, HeadDraw.rows).
ENGINES = {"whole": {}, "chunked": {"max_num_batched_tokens": 48, "kvcache_block_size": 16}}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_seeded_requests_draw_the_same_tokens_with_and_without_the_head(qwen3_tiny, make_head, engine):
    llm = LLM(qwen3_tiny, dtype="float32", **ENGINES[engine])
    model = llm.model_runner.model
    sampler = llm.model_runner.sampler
    calls = count_head_calls(sampler)
    prompts = random_prompts(200, [5, 17, 9, 70], seed=9)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=12, ignore_eos=True)
              for t, s in ((0.7, 1), (1.0, 2), (1.6, 3), (0.3, 2**63))]
    with_head = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(calls) >= 4 * 12 - 4  # every sampling step took the head
    alone = [llm.generate([p], [sp], use_tqdm=False)[0]["token_ids"] for p, sp in zip(prompts, params)]
    assert alone == with_head
    # beside a request with logprobs every step computes the logits: the seeded rows draw the same
    calls.clear()
    logprobs = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    beside = llm.generate(prompts + prompts[:1], params + [logprobs], use_tqdm=False)
    assert calls == [] and [o["token_ids"] for o in beside[:4]] == with_head
    sampler.head = None  # the logits path for every step
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == with_head
    # unseeded sampled requests differ between runs and are tokens of the vocabulary
    sampler.head = make_head(model.lm_head.weight)
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first, second = (llm.generate(prompts, free, use_tqdm=False) for _ in range(2))
    assert [o["token_ids"] for o in first] != [o["token_ids"] for o in second]
    vocab = model.lm_head.weight.size(0)
    assert all(0 <= t < vocab for o in first + second for t in o["token_ids"])
