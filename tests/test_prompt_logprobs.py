"""Prompt logprobs (SamplingParams.prompt_logprobs) end to end, offline and over HTTP: every
prompt position's logprob, rank and top-N equal HF transformers' float32 log-softmax of the same
prompt, whether the prompt is computed in one pass, in chunks, or after its prefix was cached
by another request; and /v1/completions' echo with logprobs (max_tokens 0 included) returns them
as vLLM does."""
import json

import pytest
import torch

from helpers import _hf_model, greedy, random_prompts
from nanovllm import LLM, SamplingParams
from serving import httpx, server_thread

BLOCK = 16
TOLERANCE = 1e-4  # float32 end to end; the engine's kernels differ from HF's in summation order only
TOP = 3
PROMPT_LENGTHS = [1, 2, 7, 40]  # one token (no logprob at all), within a block, across blocks


@torch.inference_mode()
def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """HF's float32 log-softmax at every prompt position: [len(prompt), vocab]."""
    logits = _hf_model(path)(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_hf(path: str, prompt: list[int], prompt_logprobs: list, num_top: int) -> None:
    """vLLM's shape (None first, then one dict per token) with HF's values."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    expected = hf_prompt_logprobs(path, prompt)
    for position, entry in enumerate(prompt_logprobs[1:]):
        reference, token_id = expected[position], prompt[position + 1]
        own = entry[token_id]
        assert abs(own["logprob"] - reference[token_id].item()) < TOLERANCE
        assert own["rank"] == 1 + int((reference > reference[token_id] + TOLERANCE).sum())
        top_ids = reference.topk(num_top).indices.tolist()
        others = [t for t in entry if t != token_id]
        assert set(others) <= set(top_ids) and len(entry) in (num_top, num_top + 1)
        for t, info in entry.items():
            assert abs(info["logprob"] - reference[t].item()) < TOLERANCE
            if t != token_id:
                assert info["rank"] == top_ids.index(t) + 1


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", kvcache_block_size=BLOCK, **kwargs)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(500, PROMPT_LENGTHS, seed=3)


def test_prompt_logprobs_equal_hf(qwen3_tiny, prompts):
    with engine(qwen3_tiny) as llm:
        outs = llm.generate(prompts, greedy(2, prompt_logprobs=TOP), use_tqdm=False)
        plain = llm.generate(prompts, greedy(2), use_tqdm=False)
    for prompt, out, reference in zip(prompts, outs, plain):
        check_against_hf(qwen3_tiny, prompt, out["prompt_logprobs"], TOP)
        assert out["token_ids"] == reference["token_ids"]  # scoring the prompt changes nothing else
        assert "prompt_logprobs" not in reference


@pytest.mark.parametrize("loop", [{}, {"async_scheduling": "on"}, {"speculative_config": {"method": "ngram",
                                                                                         "num_speculative_tokens": 2}},
                                  {"tensor_parallel_size": 2}],
                         ids=["plain", "async", "speculative", "tensor_parallel"])
def test_prompt_logprobs_with_chunked_prefill(qwen3_tiny, prompts, loop):
    """A 40-token prompt in chunks of 8 and 9 tokens (with the others in the same steps): each
    chunk's positions are scored once, gathered in order; so too when the step's tokens resolve
    a step later (async scheduling), through the speculative runner, and with the LM head split
    across two ranks (its gather a collective every rank joins)."""
    for budget in (8, 9):
        with engine(qwen3_tiny, max_num_batched_tokens=budget, max_num_seqs=2, **loop) as llm:
            outs = llm.generate(prompts, greedy(2, prompt_logprobs=1), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            check_against_hf(qwen3_tiny, prompt, out["prompt_logprobs"], 1)


def test_prompt_logprobs_with_a_cached_prefix(qwen3_tiny, prompts):
    """The prompt's first blocks are cached by an earlier request: the request asking for prompt
    logprobs computes them anyway (no hit), and a later one without them still hits."""
    prompt = prompts[-1]
    with engine(qwen3_tiny) as llm:
        first = llm.generate([prompt], greedy(1), use_tqdm=False)[0]
        scored = llm.generate([prompt], greedy(1, prompt_logprobs=2), use_tqdm=False)[0]
        again = llm.generate([prompt], greedy(1), use_tqdm=False)[0]
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] > 0
    assert scored["num_cached_tokens"] == 0
    check_against_hf(qwen3_tiny, prompt, scored["prompt_logprobs"], 2)


def test_prompt_logprobs_streamed_once_and_with_n(qwen3_tiny, prompts):
    """add_request's outputs carry them once (with the first token); n > 1 computes them once."""
    prompt = prompts[2]
    with engine(qwen3_tiny) as llm:
        request_id = llm.add_request(prompt, SamplingParams(n=2, max_tokens=3, prompt_logprobs=0, seed=1))
        carried, final = [], None
        while final is None:
            llm.step()
            out = llm.pop_output(request_id)
            carried.append(out.prompt_logprobs)
            final = out.final
    given = [p for p in carried if p is not None]
    assert len(given) == 1 and given[0] == final.prompt_logprobs
    check_against_hf(qwen3_tiny, prompt, final.prompt_logprobs, 0)


def test_prompt_logprobs_refused_out_of_range():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


# ---- over HTTP: /v1/completions ----

@pytest.fixture(scope="module")
def server(qwen3_tiny):
    """Chunks of 9 tokens, so the 40-token prompt is scored across chunks over HTTP too."""
    with server_thread(qwen3_tiny, {"max_num_batched_tokens": 9, "max_num_seqs": 4}) as running:
        yield running


def complete(server, **body) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        return http.post("/completions", json={"temperature": 0, **body})


def check_echoed(path: str, prompt: list[int], logprobs: dict, num_top: int) -> None:
    """OpenAI's legacy logprobs of an echoed prompt: null first, then HF's logprob of each token,
    and its top-N (texts) with the token's own."""
    expected = hf_prompt_logprobs(path, prompt)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position, token_id in enumerate(prompt[1:]):
        assert abs(logprobs["token_logprobs"][position + 1] - expected[position][token_id].item()) < TOLERANCE
        top = logprobs["top_logprobs"][position + 1]
        assert len(top) <= num_top + 1
        assert max(top.values()) == pytest.approx(expected[position].max().item(), abs=TOLERANCE)


def test_echo_with_logprobs_scores_the_prompt(server, qwen3_tiny, prompts):
    prompt = prompts[-1]
    for _ in range(2):  # the second time its blocks are cached: it is scored anyway
        response = complete(server, prompt=prompt, max_tokens=3, logprobs=2, echo=True, ignore_eos=True)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 3
        check_echoed(qwen3_tiny, prompt, logprobs, 2)
        assert all(lp is not None for lp in logprobs["token_logprobs"][len(prompt):])  # the completion's
        assert choice["text"].startswith("".join(logprobs["tokens"][:len(prompt)]))  # the echoed prompt
        assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:k])) for k in range(len(prompt) + 3)]


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server, qwen3_tiny, prompts):
    prompt = prompts[2]
    plain = complete(server, prompt=prompt, max_tokens=0, logprobs=1, echo=True).json()
    streamed = []
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        with http.stream("POST", "/completions", json={"prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True,
                                                       "temperature": 0, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed.extend(json.loads(line[6:])["choices"])
    for choice in (plain["choices"][0], streamed[0]):
        assert len(choice["logprobs"]["tokens"]) == len(prompt)
        check_echoed(qwen3_tiny, prompt, choice["logprobs"], 1)
        assert choice["text"] == "".join(choice["logprobs"]["tokens"])
    assert plain["choices"][0]["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 0
    assert [c["text"] for c in streamed[1:]] in ([], [""])  # at most the finish, with no token
    refused = complete(server, prompt=prompt, max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_field_equals_offline(server, qwen3_tiny, prompts):
    """vLLM's prompt_logprobs request field: the choice's prompt_logprobs are the offline ones."""
    prompt = prompts[-1]
    with engine(qwen3_tiny) as llm:
        expected = llm.generate([prompt], greedy(2, prompt_logprobs=2), use_tqdm=False)[0]["prompt_logprobs"]
    choice = complete(server, prompt=prompt, max_tokens=2, prompt_logprobs=2).json()["choices"][0]
    assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
    got = [{int(t): info for t, info in entry.items()} for entry in choice["prompt_logprobs"][1:]]
    assert len(got) == len(expected) - 1
    for entry, reference in zip(got, expected[1:]):
        assert entry.keys() == reference.keys()
        for token_id, info in entry.items():
            assert info["rank"] == reference[token_id]["rank"]
            assert info["decoded_token"] == reference[token_id]["decoded_token"]
            assert info["logprob"] == pytest.approx(reference[token_id]["logprob"], abs=TOLERANCE)
    check_against_hf(qwen3_tiny, prompt, [None] + got, 2)


def test_chat_prompt_logprobs(server, qwen3_tiny):
    """Chat's prompt_logprobs (vLLM's top-level field) score the rendered conversation; with
    stream=true they are refused, as vLLM refuses them."""
    messages = [{"role": "user", "content": "The cache is split into blocks."}]
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        body = {"messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
        response = http.post("/chat/completions", json=body).json()
        refused = http.post("/chat/completions", json={**body, "stream": True})
    with engine(qwen3_tiny) as llm:
        expected = llm.chat(messages, greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    prompt = expected["prompt_token_ids"]
    got = [None] + [{int(t): info for t, info in entry.items()} for entry in response["prompt_logprobs"][1:]]
    check_against_hf(qwen3_tiny, prompt, got, 1)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
