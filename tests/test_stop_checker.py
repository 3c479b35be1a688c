"""The stopping rules through the one StopChecker, with no model: tokens are appended one at a
time and checked as the scheduler does after each step. End of text, stop token ids, stop
strings across a token boundary (cut with and without include_stop_str_in_output), min_tokens
(and that the sampler's bans agree with it), max_tokens and max_model_len.

Stop strings use the small synthetic tokenizer (trained in-process, no model)."""
import pytest

from helpers import spanning_stop_string
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.scheduling.sequence import Sequence
from nanovllm.scheduling.stop_checker import Finish, StopChecker, banned_token_ids
from nanovllm.sampling_params import SamplingParams
from nanovllm.testing.synthetic import build_tokenizer
from nanovllm.utils.tokenizer import load_tokenizer

EOS = 7
BLOCK = 16
PROMPT = [1, 2, 3]
MAX_MODEL_LEN = 64
# Plain words the synthetic tokenizer splits into several tokens (its training text has them).
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(str(path))
    return load_tokenizer(str(path))


def sequence(tokenizer=None, **params) -> Sequence:
    sampling_params = SamplingParams(temperature=0, **params)
    seq = Sequence(0, PROMPT, sampling_params, BLOCK)
    if tokenizer is not None:
        seq.detokenizer = Detokenizer(tokenizer, sampling_params)
    return seq


def generate(seq: Sequence, tokens: list[int], checker: StopChecker | None = None) -> tuple[Finish | None, int]:
    """Append `tokens` one by one, checking after each; stops at the first finish. Returns it
    (None if none came) and how many tokens were appended."""
    checker = checker or StopChecker(EOS, MAX_MODEL_LEN)
    for n, token in enumerate(tokens, 1):
        seq.token_ids.append(token)
        finish = checker.check(seq)
        if finish is not None:
            return finish, n
    return None, len(tokens)


def test_end_of_text_stops_with_no_stop_reason_unless_ignored():
    assert generate(sequence(), [10, 11, EOS, 12]) == (Finish("stop", None), 3)
    assert generate(sequence(ignore_eos=True, max_tokens=5), [EOS] * 8) == (Finish("length", None), 5)
    # A checkpoint without an end-of-text token (eos < 0): only the other rules end a sequence.
    no_eos = StopChecker(-1, MAX_MODEL_LEN)
    assert generate(sequence(max_tokens=4), [EOS, 5, 6, 8], no_eos) == (Finish("length", None), 4)


def test_stop_token_ids_stop_with_the_token_as_reason():
    assert generate(sequence(stop_token_ids=[11, 12]), [10, 12, 11]) == (Finish("stop", 12), 2)
    # Given among the stop ids, end-of-text is reported as the stop token it was asked to be.
    assert generate(sequence(stop_token_ids=[EOS]), [10, EOS]) == (Finish("stop", EOS), 2)
    # ignore_eos does not ignore stop_token_ids.
    assert generate(sequence(stop_token_ids=[11], ignore_eos=True), [EOS, 11]) == (Finish("stop", 11), 2)


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
def test_max_tokens_is_exact(max_tokens):
    seq = sequence(max_tokens=max_tokens)
    assert generate(seq, [10] * 20) == (Finish("length", None), max_tokens)
    assert seq.num_completion_tokens == max_tokens


def test_max_model_len_ends_with_length():
    checker = StopChecker(EOS, len(PROMPT) + 2)
    seq = sequence(max_tokens=50)
    assert generate(seq, [10] * 20, checker) == (Finish("length", None), 2)
    assert len(seq) == len(PROMPT) + 2


def test_min_tokens_holds_back_every_stop_rule_and_the_sampler_bans_agree():
    min_tokens, stop_id = 3, 11
    seq = sequence(min_tokens=min_tokens, stop_token_ids=[stop_id])
    # The first two tokens would each stop the sequence but are too early; the third stops it.
    assert generate(seq, [EOS, stop_id, EOS, 12]) == (Finish("stop", None), 3)
    # Before each next token the sampler bans exactly the stop tokens the checker would refuse:
    # one it may pick and that is a stop token always ends the sequence.
    for n in range(min_tokens + 2):
        probe = sequence(min_tokens=min_tokens, stop_token_ids=[stop_id])
        for _ in range(n):
            probe.token_ids.append(10)
        banned = banned_token_ids(probe, EOS)
        assert sorted(banned) == (sorted([stop_id, EOS]) if n < min_tokens else [])
        for token in (stop_id, EOS):
            appended = sequence(min_tokens=min_tokens, stop_token_ids=[stop_id])
            finish, _ = generate(appended, [10] * n + [token])
            stops = finish is not None and finish.finish_reason == "stop"
            if token not in banned:
                assert stops, (n, token)
            if n + 1 < min_tokens:
                assert not stops, (n, token)
    # ignore_eos and a checkpoint without end-of-text leave end-of-text unbanned.
    assert banned_token_ids(sequence(min_tokens=2, ignore_eos=True), EOS) == []
    assert banned_token_ids(sequence(min_tokens=2, stop_token_ids=[4]), -1) == [4]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_a_token_boundary(tokenizer, include):
    ids = tokenizer.encode(TEXT)
    stop, boundary = spanning_stop_string(tokenizer, ids)
    assert stop not in tokenizer.decode([ids[boundary - 1]]) and stop not in tokenizer.decode([ids[boundary]])
    seq = sequence(tokenizer, stop=["@@never@@", stop], include_stop_str_in_output=include, max_tokens=50)
    assert generate(seq, ids) == (Finish("stop", stop), boundary + 1)
    index = TEXT.index(stop)
    assert seq.detokenizer.final_text() == (TEXT[:index + len(stop)] if include else TEXT[:index])


def test_stop_string_before_min_tokens_does_not_stop(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop, boundary = spanning_stop_string(tokenizer, ids)
    seq = sequence(tokenizer, stop=[stop], min_tokens=boundary + 2, max_tokens=len(ids))
    assert generate(seq, ids) == (Finish("length", None), len(ids))
    assert seq.detokenizer.final_text() == TEXT
    # At exactly min_tokens it may stop.
    at_min = sequence(tokenizer, stop=[stop], min_tokens=boundary + 1, max_tokens=len(ids))
    assert generate(at_min, ids) == (Finish("stop", stop), boundary + 1)


def test_stop_string_on_the_last_allowed_token_is_a_stop(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop, boundary = spanning_stop_string(tokenizer, ids)
    seq = sequence(tokenizer, stop=[stop], max_tokens=boundary + 1)
    assert generate(seq, ids) == (Finish("stop", stop), boundary + 1)


def test_a_stop_token_ends_before_the_stop_string_it_completes(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop, boundary = spanning_stop_string(tokenizer, ids)
    completing = ids[boundary]
    assert completing not in ids[:boundary], "the completing token must be new here for the test to mean anything"
    seq = sequence(tokenizer, stop=[stop], stop_token_ids=[completing], max_tokens=50)
    assert generate(seq, ids) == (Finish("stop", completing), boundary + 1)
    # Its text is still produced in full (a stream reads it), not cut at the stop string.
    assert seq.detokenizer.final_text() == tokenizer.decode(ids[:boundary + 1])
