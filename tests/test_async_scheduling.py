"""Async scheduling (Config.async_scheduling): the overlapped loop, which schedules and launches
step N+1 before step N's tokens reach the host, must give token for token what the plain loop
gives: greedy and seeded sampling, n > 1, stop strings, stop token ids, end of text, max_tokens
and max_model_len (the one-step lag never emits a token past a stop), logprobs, penalties (which
fall back to the plain loop), preemption under a tiny KV budget in both modes and both policies,
streams, and the online API with aborts. On CPU the forward pass is synchronous, but the code
path is the one CUDA takes, streams and events aside.
"""
import pytest

from helpers import greedy, random_prompts, spanning_stop_string
from nanovllm import LLM, SamplingParams
from nanovllm.scheduling.scheduler import MIXED, PREFILL_FIRST, RECOMPUTE, SWAP

BLOCK = 16
LENGTHS = [1, 3, 5, 9, 15, 16, 17, 33, 48, 70, 2, 7]
TINY_KV = dict(num_kvcache_blocks=10, max_num_batched_tokens=48)  # preempts again and again


def engine(path: str, mode: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", kvcache_block_size=BLOCK, async_scheduling=mode, **{"max_num_seqs": 16, **kwargs})


def outputs_of(path: str, mode: str, prompts, params, **kwargs) -> tuple[list[dict], LLM]:
    llm = engine(path, mode, **kwargs)
    return llm.generate(prompts, params, use_tqdm=False), llm


def assert_same_both_ways(path: str, prompts, params, **kwargs) -> list[dict]:
    plain, _ = outputs_of(path, "off", prompts, params, **kwargs)
    overlapped, llm = outputs_of(path, "on", prompts, params, **kwargs)
    for i, (a, b) in enumerate(zip(plain, overlapped)):
        assert a == b, f"prompt {i}: the overlapped loop differs from the plain one"
    return plain


def mixed_params() -> list[SamplingParams]:
    """Greedy, seeded sampling, filters, n > 1 (seeded and greedy), short max_tokens."""
    return [greedy(20), SamplingParams(temperature=0.8, seed=3, max_tokens=15, n=2),
            SamplingParams(temperature=1.0, seed=7, top_k=20, top_p=0.9, max_tokens=12),
            greedy(1), greedy(2, n=3), SamplingParams(temperature=0.7, seed=11, min_p=0.05, max_tokens=9, n=2)] * 2


@pytest.mark.parametrize("policy, preemption", [(MIXED, RECOMPUTE), (PREFILL_FIRST, SWAP), (MIXED, SWAP)])
def test_same_tokens_under_preemption(qwen3_tiny, policy, preemption):
    prompts = random_prompts(200, LENGTHS, seed=21)
    kwargs = dict(TINY_KV, scheduling_policy=policy, preemption_mode=preemption)
    assert_same_both_ways(qwen3_tiny, prompts, mixed_params(), **kwargs)
    _, llm = outputs_of(qwen3_tiny, "on", prompts, mixed_params(), **kwargs)
    assert llm.stats().num_preemptions > 0  # what the test is about really happened


def test_same_tokens_with_a_roomy_cache_and_prefix_hits(qwen3_tiny):
    shared = random_prompts(200, [40], seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(200, [3, 9, 17, 1], seed=6)] + random_prompts(200, [20], 8)
    params = [greedy(24), SamplingParams(temperature=0.9, seed=1, max_tokens=18, n=3)] * 2 + [greedy(5)]
    assert_same_both_ways(qwen3_tiny, prompts, params)


def test_stops_end_where_the_plain_loop_ends(qwen3_tiny):
    """Stop ids and stop strings met mid-output, end of text, max_tokens and max_model_len: the
    token the device samples after a stop is never emitted."""
    max_len = 64
    llm = engine(qwen3_tiny, "off", max_model_len=max_len)
    text_prompt = llm.tokenizer.encode("The cache is split into fixed blocks of tokens.")
    prompts = random_prompts(200, [5, 9, 14, 50], seed=3) + [text_prompt]
    free = [out["token_ids"] for out in llm.generate(prompts, greedy(16), use_tqdm=False)]
    stop_string, boundary = spanning_stop_string(llm.tokenizer, free[4])
    stop_id = free[0][4]
    params = [greedy(16, stop_token_ids=[stop_id]), greedy(16, ignore_eos=False, min_tokens=2), greedy(3),
              greedy(20), greedy(16, stop=[stop_string])]
    plain = assert_same_both_ways(qwen3_tiny, prompts, params, max_model_len=max_len)
    assert plain[0]["token_ids"] == free[0][:free[0].index(stop_id) + 1]
    assert plain[0]["finish_reason"] == "stop" and plain[0]["stop_reason"] == stop_id
    assert len(plain[2]["token_ids"]) == 3 and plain[2]["finish_reason"] == "length"
    assert len(plain[3]["token_ids"]) == max_len - 50 and plain[3]["finish_reason"] == "length"
    assert plain[4]["stop_reason"] == stop_string and len(plain[4]["token_ids"]) == boundary + 1


def test_logprobs_and_penalties(qwen3_tiny):
    """Logprobs are kept only for emitted tokens; penalties read output tokens on the host, so
    while such a request lives the engine runs the plain loop, and outputs still agree."""
    prompts = random_prompts(200, [4, 11, 19], seed=9)
    params = [greedy(10, logprobs=3), SamplingParams(temperature=0.8, seed=2, max_tokens=10, repetition_penalty=1.3,
                                                     frequency_penalty=0.5), greedy(10, stop_token_ids=[0, 1, 2])]
    assert_same_both_ways(qwen3_tiny, prompts, params, **TINY_KV)


def test_streams_and_the_online_api(qwen3_tiny):
    prompts = random_prompts(200, [6, 13, 21, 30], seed=4)
    params = [greedy(12), SamplingParams(temperature=0.8, seed=5, max_tokens=12, n=2)] * 2
    plain, _ = outputs_of(qwen3_tiny, "off", prompts, params)
    llm = engine(qwen3_tiny, "on")
    streamed: dict[tuple[int, int], list[int]] = {}
    for out in llm.stream(prompts, params):
        assert all(t >= 0 for t in out.token_ids), "a placeholder reached a caller"
        streamed.setdefault((out.index, out.sample), []).extend(out.token_ids)
    for i, out in enumerate(plain):
        samples = out.get("outputs", [out])
        assert [streamed[(i, s)] for s in range(len(samples))] == [s["token_ids"] for s in samples]
    # add_request/step/pop_output with an abort while a step is in flight: the aborted request
    # gets no token after its abort, and the other one is untouched by it.
    keep = llm.add_request(prompts[0], params[0])
    doomed = llm.add_request(prompts[2], greedy(12))
    seen = []
    for _ in range(4):
        for request_id in llm.step().request_ids:
            out = llm.pop_output(request_id)
            seen += [t for s in out.samples for t in s.token_ids]
    assert llm.core.in_flight is not None  # the loop really runs a step ahead
    assert all(t >= 0 for t in seen)
    assert llm.abort(doomed)
    final = llm.pop_output(doomed)
    assert final.finished and final.final.outputs[0].finish_reason == "abort"
    popped = len(final.final.outputs[0].token_ids)
    while not llm.is_finished():
        llm.step()
    result = llm.pop_output(keep)
    while not result.finished:
        result = llm.pop_output(keep)
    assert result.final.outputs[0].token_ids == plain[0]["token_ids"]
    assert popped < 12


def test_config(qwen3_tiny):
    assert engine(qwen3_tiny, "auto").config.async_scheduling == "off"  # CPU: nothing to overlap with
    with pytest.raises(ValueError, match="async_scheduling"):
        engine(qwen3_tiny, "yes")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine(qwen3_tiny, "on", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config"):
        engine(qwen3_tiny, "on", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
