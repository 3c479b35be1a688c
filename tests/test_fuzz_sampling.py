"""Every SamplingParams field and every prompt is bounded (docs/reliability.md, "Sampling
parameters and prompts"): a property test drives SamplingParams and the engine with arbitrary
values (integers up to 2**70, NaN and infinities, wrong types, text with lone surrogates) and
finds either a ValueError naming the field or a run whose token ids are in the vocabulary and
whose logprobs are finite. And the numeric edge cases: a temperature of 1e-38 is greedy, the
penalties at their bounds stay finite, logits with inf/NaN rows yield in-range tokens."""
import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.scheduling.sequence import Sequence
from nanovllm.layers.sampler import Sampler, inverse_transform_from_logits
from nanovllm.runner.sampling_inputs import prepare_sampling
from nanovllm.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

RUN_MAX_TOKENS, RUN_MAX_N = 3, 2  # an accepted request is run this short, so a hundred examples take seconds

huge_ints = st.integers(min_value=-2**70, max_value=2**70)
small_ints = st.integers(min_value=-3, max_value=40)
any_floats = st.floats(allow_nan=True, allow_infinity=True)
unit_floats = st.floats(min_value=0.0, max_value=1.0)
# Text with lone surrogates among ordinary characters (what JSON's "\ud800" escape makes).
texts = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), st.characters(min_codepoint=0xD800,
                                                                             max_codepoint=0xDFFF)), max_size=8)
wrong_types = st.one_of(st.none(), st.booleans(), texts, st.lists(small_ints, max_size=2))


def field(good, *odd):
    """A field's values: mostly ones in (or near) its range, some arbitrary."""
    return st.one_of(good, *odd, wrong_types)


FIELDS = {
    "n": field(st.integers(1, 3), huge_ints),
    "temperature": field(st.floats(0, 2), st.sampled_from([1e-38, 1e-6, 1e-5, 1e4, 1e5]), any_floats, huge_ints),
    "top_p": field(unit_floats, st.sampled_from([1e-300, 5e-324]), any_floats),
    "top_k": field(small_ints, st.sampled_from([-1, 0, 2**31 - 1, 2**63]), huge_ints),
    "min_p": field(unit_floats, any_floats),
    "seed": field(small_ints, huge_ints, st.sampled_from([-2**63, 2**64 - 1, 2**64])),
    "stop": field(texts, st.lists(texts, max_size=3)),
    "stop_token_ids": field(st.lists(small_ints, max_size=3), st.lists(huge_ints, max_size=2)),
    "include_stop_str_in_output": field(st.booleans()),
    "min_tokens": field(st.integers(0, 3), huge_ints),
    "max_tokens": field(st.integers(1, 3), huge_ints),
    "ignore_eos": field(st.booleans()),
    "logprobs": field(st.integers(0, 5), huge_ints),
    "repetition_penalty": field(st.floats(0.005, 3), st.sampled_from([1e-300, 0.01, 2.0]), any_floats),
    "presence_penalty": field(st.floats(-2.5, 2.5), any_floats),
    "frequency_penalty": field(st.floats(-2.5, 2.5), any_floats),
    "skip_special_tokens": field(st.booleans()),
}
# Values inside every range, edges included (the extremes are where NaN used to come from).
VALID_FIELDS = {
    "n": st.integers(1, 3),
    "temperature": st.one_of(st.floats(0, 1e4), st.sampled_from([0.0, 1e-38, 5e-324, 1e-5, 1e4])),
    "top_p": st.one_of(st.floats(5e-324, 1.0), st.sampled_from([1e-300, 1.0])),
    "top_k": st.one_of(st.integers(-1, 60), st.sampled_from([1, -1, 0])),
    "min_p": st.one_of(unit_floats, st.sampled_from([0.0, 1.0])),
    "seed": st.one_of(small_ints, st.sampled_from([-2**63, 2**64 - 3])),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "min_tokens": st.integers(0, RUN_MAX_TOKENS),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 20),
    "repetition_penalty": st.one_of(st.floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
                                    st.sampled_from([MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "skip_special_tokens": st.booleans(),
}
prompts = st.one_of(texts.filter(bool), st.lists(st.integers(-5, 2000), min_size=1, max_size=6),
                    st.lists(huge_ints, min_size=1, max_size=2))


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    engine = LLM(qwen3_tiny, device="cpu", kvcache_block_size=16, num_kvcache_blocks=256)
    yield engine
    engine.exit()


def assert_names_a_field(error: ValueError, names) -> None:
    message = str(error)
    assert any(name in message for name in names), f"{message!r} names none of {sorted(names)}"


def assert_sane(outputs: list[dict], params: SamplingParams, vocab_size: int) -> None:
    (output,) = outputs
    assert "error" not in output
    for sample in output.get("outputs", [output]):
        assert sample["finish_reason"] in ("stop", "length")
        assert all(0 <= t < vocab_size for t in sample["token_ids"])
        if params.logprobs is not None:
            for entry in sample["logprobs"]:
                assert math.isfinite(entry["logprob"])
                assert all(math.isfinite(v) and 0 <= t < vocab_size for t, v in entry["top_logprobs"].items())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=st.fixed_dictionaries({}, optional=FIELDS), prompt=prompts)
def test_params_are_refused_by_name_or_run_sanely(llm, kwargs, prompt):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        assert_names_a_field(exc, kwargs)
        event("refused by SamplingParams")
        return
    # Accepted: run it, short (the bounds of max_tokens and n themselves are checked above).
    max_tokens = min(params.max_tokens, RUN_MAX_TOKENS)
    params = dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens),
                                 n=min(params.n, RUN_MAX_N))
    try:
        outputs = llm.generate([prompt], params, use_tqdm=False)
    except ValueError as exc:  # what depends on the model: the vocabulary, the context, the prompt
        assert_names_a_field(exc, [*kwargs, "prompt"])
        event("refused by the engine")
        return
    assert_sane(outputs, params, llm.config.hf_config.vocab_size)
    event("run")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=st.fixed_dictionaries({"max_tokens": st.integers(RUN_MAX_TOKENS, RUN_MAX_TOKENS)}, optional=VALID_FIELDS),
       prompt=st.lists(st.integers(0, 400), min_size=1, max_size=20))
def test_params_in_range_run_sanely(llm, kwargs, prompt):
    """Every combination of in-range values, the extremes included, runs: ids in the vocabulary,
    finite logprobs."""
    kwargs["min_tokens"] = min(kwargs.get("min_tokens", 0), kwargs["max_tokens"])
    params = SamplingParams(**kwargs)
    assert_sane(llm.generate([prompt], params, use_tqdm=False), params, llm.config.hf_config.vocab_size)


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"])
def test_an_int_past_float_range_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"^{name}=1000000000.*\.\.\. is not allowed"):  # quoted, cut short
        SamplingParams(**{name: 10**400})


def test_lone_surrogates_are_refused_by_name(llm):
    with pytest.raises(ValueError, match="prompt has a lone surrogate"):
        llm.generate(["abc\ud800"], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", "\udfff"])
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user", "content": "hi \ud800"}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.generate(["abc"], SamplingParams(max_tokens=1), use_tqdm=False)[0]["token_ids"]  # still serving


def test_top_k_past_the_vocabulary_is_refused(llm):
    vocab_size = llm.config.hf_config.vocab_size
    with pytest.raises(ValueError, match=rf"top_k={vocab_size + 1} .*vocabulary \({vocab_size} tokens\)"):
        llm.generate([[1, 2]], SamplingParams(top_k=vocab_size + 1, max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63)
    assert llm.generate([[1, 2]], SamplingParams(top_k=vocab_size, max_tokens=1), use_tqdm=False)[0]["token_ids"]


def test_a_tiny_temperature_is_greedy(llm):
    prompts = random_prompts(500, [3, 9, 17], seed=5)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for temperature in (1e-38, 5e-324, 9e-6):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=6, ignore_eos=True)
        assert params.temperature == 0.0
        tiny = llm.generate(prompts, params, use_tqdm=False)
        assert [o["token_ids"] for o in tiny] == [o["token_ids"] for o in greedy]


@pytest.mark.parametrize("penalty", [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
def test_repetition_penalty_at_its_bounds_stays_finite(llm, penalty):
    prompts = random_prompts(500, [5, 12], seed=6)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=3, repetition_penalty=penalty, presence_penalty=2.0,
                                frequency_penalty=-2.0, logprobs=3, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for output in outputs:
            assert len(output["token_ids"]) == 8
            assert_sane([output], params, llm.config.hf_config.vocab_size)


def test_non_finite_logits_yield_tokens_in_range():
    """Rows with +inf, -inf and NaN planted (a model gone wrong), under greedy, seeded and
    filtered sampling with penalties: every token is in the vocabulary, every logprob finite,
    and a row with one +inf takes that token when greedy."""
    vocab = 50
    rows = torch.randn(5, vocab)
    rows[0, 7] = float("inf")
    rows[1] = float("nan")
    rows[2] = float("-inf")
    rows[3, ::3] = float("nan")
    rows[4, 11] = 3e38
    cases = [SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=1.0, seed=4),
             SamplingParams(temperature=0.7, seed=5, top_p=1e-300, top_k=3, min_p=1.0, logprobs=4),
             SamplingParams(temperature=1e-5, repetition_penalty=MIN_REPETITION_PENALTY, frequency_penalty=2.0,
                            logprobs=1)]
    sampler = Sampler(inverse_transform_from_logits)  # the CPU platform's
    for params in cases:
        seqs = [Sequence(i, [1, 2, 7, 11], params, 16) for i in range(len(rows))]
        out = sampler(rows.clone(), prepare_sampling(seqs, vocab, -1, torch.device("cpu")))
        assert all(0 <= t < vocab for t in out.token_ids)
        for lp in out.logprobs:
            if lp is not None:
                assert math.isfinite(lp.logprob) and all(map(math.isfinite, lp.top_logprobs.values()))
        if params.temperature == 0.0:
            assert out.token_ids[0] == 7
