"""The engine's public all-or-none add_requests() and its typed outputs (CPU): a call with one bad
prompt queues none and names the prompt; ids are unique; add_request is add_requests of one;
the typed RequestOutput carries what generate() returns, and to_nanovllm_dict (the offline API's
only adapter) gives exactly generate()'s dict."""
import pytest

from helpers import greedy
from nanovllm import LLM, CompletionOutput, RequestOutput, SamplingParams
from nanovllm.engine.outputs import to_nanovllm_dict

BLOCK = 16


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    # No prefix caching: a prompt run twice reports the same num_cached_tokens (0) both times.
    engine = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=64, max_model_len=256,
                 enable_prefix_caching=False)
    yield engine
    engine.exit()


def finals(llm: LLM, request_ids: list[str]) -> list[RequestOutput]:
    """Step until every request has finished; their final outputs, in the order of request_ids."""
    done: dict[str, RequestOutput] = {}
    while len(done) < len(request_ids):
        for request_id in llm.step().request_ids:
            out = llm.pop_output(request_id)
            if out.finished:
                done[request_id] = out.final
    return [done[request_id] for request_id in request_ids]


def assert_empty(llm: LLM) -> None:
    assert llm.is_finished() and not llm._requests
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("bad, message", [
    ([1, 2, 10 ** 6], r"prompt token id 1000000 is outside the vocabulary.*\(prompts\[2\]\)"),
    ("", r"prompt='' is empty.*\(prompts\[2\]\)"),
    ([1, "x"], r"prompt=.* is not allowed.*\(prompts\[2\]\)"),
])
def test_add_requests_is_all_or_none(llm, bad, message):
    good = [[1, 2, 3], "hello world"]
    with pytest.raises(ValueError, match=message):
        llm.add_requests(good + [bad, [4, 5]], greedy(3))
    assert_empty(llm)  # the good prompts before the bad one were not queued either
    with pytest.raises(ValueError, match=r"sampling_params=.* must be a SamplingParams.*\(prompts\[1\]\)"):
        llm.add_requests(good, [greedy(3), "greedy"])
    with pytest.raises(ValueError, match=r"priority=.* must be an int.*\(prompts\[0\]\)"):
        llm.add_requests(good, greedy(3), priority=[1.5, 0])
    assert_empty(llm)
    request_ids = llm.add_requests(good, greedy(3))
    assert len(set(request_ids)) == 2 and all(isinstance(r, str) for r in request_ids)
    assert [out.outputs[0].token_ids for out in finals(llm, request_ids)] == \
        [out["token_ids"] for out in llm.generate(good, greedy(3), use_tqdm=False)]
    assert_empty(llm)


def test_add_requests_request_ids(llm):
    with pytest.raises(ValueError, match=r"request_id='a' is already a live request.*\(prompts\[1\]\)"):
        llm.add_requests([[1], [2]], greedy(2), request_ids=["a", "a"])
    with pytest.raises(ValueError, match=r"request_ids=.* one id .* per prompt \(2\)"):
        llm.add_requests([[1], [2]], greedy(2), request_ids=["a"])
    assert_empty(llm)
    request_ids = llm.add_requests([[1], [2]], greedy(2), request_ids=["a", None])
    assert request_ids[0] == "a" and isinstance(request_ids[1], str) and request_ids[1] != "a"
    with pytest.raises(ValueError, match=r"request_id='a' is already a live request.*\(prompts\[1\]\)"):
        llm.add_requests([[3], [4]], greedy(2), request_ids=[None, "a"])  # its other prompt is not queued
    assert [out.request_id for out in finals(llm, request_ids)] == request_ids
    assert_empty(llm)


def test_add_request_is_add_requests_of_one(llm):
    """The same checks with the same messages; one prompt's errors name no index."""
    for args in ([[1, 10 ** 6], greedy(2)], [[1, 2], [greedy(2)]], [[], greedy(2)]):
        with pytest.raises(ValueError) as one:
            llm.add_request(*args)
        with pytest.raises(ValueError) as many:
            llm.add_requests([args[0]], [args[1]])
        assert str(one.value) == str(many.value) and "prompts[" not in str(one.value)
    assert_empty(llm)


def test_offline_and_online_refuse_alike(llm):
    """generate() and add_requests() (the server's and batch jobs' way in) share one builder."""
    prompts = [[1, 2], [3, 10 ** 6]]
    with pytest.raises(ValueError) as offline:
        llm.generate(prompts, greedy(2), use_tqdm=False)
    with pytest.raises(ValueError) as online:
        llm.add_requests(prompts, greedy(2))
    assert str(offline.value) == str(online.value)
    assert "(prompts[1])" in str(online.value)
    assert_empty(llm)


@pytest.mark.parametrize("params", [greedy(6), greedy(6, logprobs=2),
                                    SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=5, logprobs=1),
                                    SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, stop=["a"])],
                         ids=["greedy", "logprobs", "n3-logprobs", "n2-stop"])
def test_the_adapter_gives_generates_dict(llm, params):
    prompts = ["hello world", [5, 6, 7, 8]]
    expected = llm.generate(prompts, params, use_tqdm=False)
    outputs = finals(llm, llm.add_requests(prompts, params))
    for prompt, out, want in zip(prompts, outputs, expected):
        assert to_nanovllm_dict(out) == want
        # Field by field: the dict is the typed object's, under nano-vllm's keys.
        assert out.finished and out.error is None and "error" not in want
        assert out.prompt == (prompt if isinstance(prompt, str) else None) and out.prompt_logprobs is None
        assert out.prompt_token_ids == want["prompt_token_ids"]
        assert len(out.outputs) == params.n and ("outputs" in want) == (params.n > 1)
        for j, (sample, sample_dict) in enumerate(zip(out.outputs, want.get("outputs", [want]))):
            assert isinstance(sample, CompletionOutput) and sample.index == j
            assert (sample.text, sample.token_ids, sample.finish_reason, sample.stop_reason,
                    sample.num_cached_tokens) == (sample_dict["text"], sample_dict["token_ids"],
                                                  sample_dict["finish_reason"], sample_dict["stop_reason"],
                                                  sample_dict["num_cached_tokens"])
            if params.logprobs is None:
                assert "logprobs" not in sample_dict and sample.logprobs is None and sample.cumulative_logprob is None
            else:
                assert sample.logprobs == sample_dict["logprobs"] and len(sample.logprobs) == len(sample.token_ids)
                assert sample.cumulative_logprob == pytest.approx(sum(lp["logprob"] for lp in sample.logprobs))
        assert out.num_cached_tokens == want["num_cached_tokens"]
    assert_empty(llm)


def test_the_adapter_on_a_failed_request():
    """A failed request's dict gains "error"; its samples' fields are the typed ones (no model)."""
    samples = [CompletionOutput(j, "", [], None, None, "abort", None) for j in range(2)]
    out = RequestOutput("r-1", None, [1, 2], None, samples, True, error="request r-1 failed: ...")
    assert to_nanovllm_dict(out) == {
        "text": "", "token_ids": [], "finish_reason": "abort", "stop_reason": None, "num_cached_tokens": 0,
        "prompt_token_ids": [1, 2], "error": "request r-1 failed: ...",
        "outputs": [{"text": "", "token_ids": [], "finish_reason": "abort", "stop_reason": None,
                     "num_cached_tokens": 0}] * 2}
