"""The bfloat16 greedy LM head on AMX tiles (kernels/cpu_amx_linear.cpp head_argmax, cpu_build.py
AmxGreedyHead): per row the first index of the largest logit, each logit as the AMX product writes
it (bfloat16, nearest even) and as the sampler's greedy pass reads it (NaN as -limit, clamped to
+-limit), without writing the logits. So its tokens must equal greedy_tokens() over the AMX
product's own logits, exactly: random heads from one pair of column blocks to the real-proportion
model's 32,000 x 512, row counts that pad a tile, strided rows, exact ties (the first index), logits
past the sampler's clamp and NaN logits. What it does not take (rows that are not bfloat16, fewer
than its min_rows, a step that samples) goes to the int8 head it is given, or gets None; it is made
only for bfloat16 weights of whole tiles.

The engine gives a bf16 head on one rank to it where the CPU has AMX, with the int8 head
(tests/test_cpu_greedy_head.py) for the rest: greedy steps of min_rows rows or more take their
tokens from AMX tiles, and they equal the tokens of the logits path over the same AMX product;
fewer rows and steps with a sampled row go to the int8 head. Without AMX every test here skips.
"""
import pytest
import torch

from helpers import greedy, random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.cpu_build import AMX_GREEDY_HEAD_MIN_ROWS, AmxGreedyHead
from nanovllm.layers.logits_processors import LOGIT_LIMIT
from nanovllm.runner.step_inputs import HeadDraw


@pytest.fixture(scope="module")
def make_head(cpu_kernels):
    if cpu_kernels.amx_linear(torch.zeros(32, 32, dtype=torch.bfloat16)) is None:
        pytest.skip("this CPU's build has no AMX product (it needs AMX-TILE, AMX-BF16 and AVX512-BF16)")
    return lambda weight: cpu_kernels.amx_greedy_head(weight, LOGIT_LIMIT, 1)


def product_argmax(cpu_kernels, head: AmxGreedyHead, x: torch.Tensor) -> torch.Tensor:
    """The sampler's greedy tokens over the logits the same AMX product writes."""
    return cpu_kernels.greedy_tokens(head.product(x.contiguous(), None), LOGIT_LIMIT)


@pytest.mark.parametrize("vocab, width, rows", [(32000, 512, 64), (32, 32, 1), (640, 64, 17), (4096, 256, 256),
                                                (96, 96, 300), (1024, 128, 5)])
def test_tokens_are_the_argmax_of_the_products_logits(cpu_kernels, make_head, vocab, width, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    w = (torch.randn(vocab, width, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, width, generator=gen).bfloat16()
    head = make_head(w)
    tokens = head(x)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert torch.equal(tokens, product_argmax(cpu_kernels, head, x))
    # And the argmax of float32 logits rounded to bf16 wherever no two logits round alike.
    exact = (x.double() @ w.double().T).bfloat16()
    top = exact.float().topk(2, dim=1).values
    clear = top[:, 0] > top[:, 1]
    assert clear.sum() >= rows // 2
    assert torch.equal(tokens[clear], exact.float().argmax(1)[clear])


def test_strided_rows(cpu_kernels, make_head):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(512, 64, generator=gen).bfloat16()
    wide = torch.randn(40, 160, generator=gen).bfloat16()
    x = wide[:, 32:96]  # rows 160 apart
    assert x.stride(0) == 160
    head = make_head(w)
    assert torch.equal(head(x), product_argmax(cpu_kernels, head, x))


def test_ties_take_the_first_index(make_head):
    w = torch.randn(256, 64).bfloat16()
    w[200] = w[70] = w[130] = 8 * w[5].abs()  # three equal columns, far above the rest for x >= 0
    x = torch.rand(16, 64).bfloat16()
    assert make_head(w)(x).tolist() == [70] * 16
    assert make_head(w)(torch.zeros(16, 64).bfloat16()).tolist() == [0] * 16  # every logit 0


def test_logits_past_the_clamp_and_nan_as_the_sampler(cpu_kernels, make_head):
    """Logits above the sampler's clamp are equal there (the first index of them wins), NaN
    logits count as -limit, -inf as -limit too, as greedy_tokens over the logits."""
    w = torch.randn(128, 32).bfloat16()
    w[40] = 1e20  # with x = 1e20: logits of 3.2e41, past bf16's range: inf, clamped to the limit
    w[90] = 1e19  # 3.2e39: past it too
    w[10] = 2e8  # 6.4e29: below the limit, beaten by the clamped ones
    x = torch.full((16, 32), 1e20).bfloat16()
    head = make_head(w)
    assert head(x).tolist() == [40] * 16
    assert torch.equal(head(x), product_argmax(cpu_kernels, head, x))
    w = torch.randn(128, 32).bfloat16()
    w[:100] = float("nan")  # NaN logits for the first 100 tokens: -limit, below every real one
    x = torch.randn(16, 32).bfloat16()
    head = make_head(w)
    tokens = head(x)
    assert (tokens >= 100).all()
    assert torch.equal(tokens, product_argmax(cpu_kernels, head, x))
    w[100:] = float("-inf")  # with x > 0 every logit NaN or -inf: all -limit, the first index
    assert make_head(w)(torch.rand(16, 32).bfloat16() + 0.5).tolist() == [0] * 16


def test_declines_or_hands_on_what_it_does_not_take(cpu_kernels, make_head):
    w = torch.randn(64, 32).bfloat16()
    head = cpu_kernels.amx_greedy_head(w, LOGIT_LIMIT, AMX_GREEDY_HEAD_MIN_ROWS)
    rows = AMX_GREEDY_HEAD_MIN_ROWS
    x = torch.randn(rows, 32).bfloat16()
    assert head(x) is not None
    assert head(x.float()) is None  # float32 rows (a float32-held head's)
    assert head(x[:rows - 1]) is None  # too few rows
    assert head(x, HeadDraw([0.0] * rows, [], [])) is not None  # every row greedy
    sampled = HeadDraw([0.0] * (rows - 1) + [0.7], [1] * rows, [0] * rows)
    assert head(x, sampled) is None  # a row that samples
    assert not head.samples
    calls = []
    others = cpu_kernels.greedy_head(w, LOGIT_LIMIT)
    real = others._fn
    others._fn = lambda *a: calls.append(a[3]) or real(*a)  # its rows argument
    both = cpu_kernels.amx_greedy_head(w, LOGIT_LIMIT, rows, others)
    assert both.samples
    assert torch.equal(both(x), head(x)) and calls == []
    assert torch.equal(both(x[:3]), others(x[:3]))
    assert both(x, sampled) is not None and both(x.float()) is not None
    assert calls == [3, 3, rows, rows]
    for weight in (torch.randn(64, 32), torch.randn(64, 32).half(), torch.randn(48, 32).bfloat16(),
                   torch.randn(64, 40).bfloat16()):
        assert cpu_kernels.amx_greedy_head(weight, LOGIT_LIMIT, 1) is None, (weight.dtype, weight.shape)


@pytest.mark.parametrize("family", ["qwen3_tiny", "qwen3_tiny_tied"])
def test_engine_greedy_steps_take_the_head(request, make_head, family):
    """bf16 engine: greedy steps of 5+ rows take their tokens from the AMX head, and they are the
    logits path's tokens when that path multiplies on the same AMX product."""
    path = request.getfixturevalue(family)
    llm = LLM(path, dtype="bfloat16", enable_prefix_caching=False)
    sampler, head = llm.model_runner.sampler, llm.model_runner.model.lm_head
    assert isinstance(sampler.head, AmxGreedyHead) and sampler.head.min_rows == AMX_GREEDY_HEAD_MIN_ROWS
    calls = []
    original = sampler.head_tokens
    sampler.head_tokens = lambda hidden, draw=None: calls.append(hidden.size(0)) or original(hidden, draw)
    assert sampler.head.others is not None  # the int8 head for the rest
    prompts = random_prompts(600, [5, 17, 33, 9, 60, 2, 41, 12] * 2 + [3, 8], seed=6)
    out = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert len(prompts) >= AMX_GREEDY_HEAD_MIN_ROWS and calls.count(len(prompts)) >= 11  # every decode step of all
    greedy_head, sampler.head = sampler.head, None
    # the logits path on the same product (from 1 row; AmxProduct.min_rows)
    head.linear_method.amx = greedy_head.product
    head.linear_method.few_rows = None
    expected = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert [o["token_ids"] for o in out] == [o["token_ids"] for o in expected]
    llm.exit()


def test_steps_with_a_sampled_row_go_to_the_int8_head(qwen3_tiny, make_head, monkeypatch):
    llm = LLM(qwen3_tiny, dtype="bfloat16", enable_prefix_caching=False)
    head = llm.model_runner.sampler.head
    amx_rows, int8_rows = [], []
    amx, int8 = head._fn, head.others._fn
    monkeypatch.setattr(head, "_fn", lambda *a: amx_rows.append(a[2]) or amx(*a))
    monkeypatch.setattr(head.others, "_fn", lambda *a: int8_rows.append(a[3]) or int8(*a))
    prompts = random_prompts(600, [7, 11, 5, 9, 13, 6] * 3, seed=7)
    sampled = SamplingParams(temperature=0.8, max_tokens=8, seed=3, ignore_eos=True)
    first = llm.generate(prompts, [greedy(8)] * 17 + [sampled], use_tqdm=False)
    assert amx_rows == [] and int8_rows.count(len(prompts)) >= 7  # every step drew through the int8 head
    monkeypatch.setattr(llm.model_runner.sampler, "head", None)
    again = llm.generate(prompts, [greedy(8)] * 17 + [sampled], use_tqdm=False)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in again]
    llm.exit()
