"""The one sampling pipeline (layers/logits_processors.py): every way of sampling applies the same
processors, in the same order, and `logit_bias` is one of them.

For random parameter sets (every processor: logit bias, min_tokens bans, penalties, temperature,
min_p, top_k, top_p; greedy and sampled rows mixed) the torch sampler, the Triton race (run by
the CPU interpreter) and the speculative verifier must agree: the same greedy tokens, and the
same distribution for every sampled row, each observed where that path draws from it. Then
logit_bias end to end against HF transformers' logits.
"""
import random

import pytest
import torch

from helpers import _hf_model, kernel_test_device, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.scheduling.sequence import Sequence
from nanovllm.layers import rejection_sampler, sampler
from nanovllm.layers.logits_processors import LogitBias, SamplingTensors
from nanovllm.layers.rejection_sampler import RejectionSampler
from nanovllm.layers.sampler import Sampler, inverse_transform_draw, inverse_transform_from_logits
from nanovllm.platform.sampling import RaceSampler
from nanovllm.runner.sampling_inputs import prepare_sampling

VOCAB = 50
EOS = 3
ROWS = 12
PARAMETER_SETS = 8
MAX_TOKENS = 8


def random_params(rng: random.Random) -> SamplingParams:
    """Any mix of the options; each processor appears in some rows of each batch."""
    options = dict(temperature=rng.choice([0.0, 0.0, 0.6, 1.0, 1.7]), seed=rng.randrange(1000))
    if rng.random() < 0.5:
        options["top_k"] = rng.randrange(1, VOCAB + 5)  # past the vocabulary too
    if rng.random() < 0.5:
        options["top_p"] = rng.uniform(0.2, 1.0)
    if rng.random() < 0.4:
        options["min_p"] = rng.uniform(0.0, 0.3)
    if rng.random() < 0.5:
        options["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 4))}
    if rng.random() < 0.4:
        options.update(repetition_penalty=rng.uniform(0.5, 2.0), presence_penalty=rng.uniform(-2, 2),
                       frequency_penalty=rng.uniform(-2, 2))
    if rng.random() < 0.3:
        options.update(min_tokens=rng.randrange(1, 6), stop_token_ids=[rng.randrange(VOCAB)])
    return SamplingParams(max_tokens=16, **options)


def random_batch(seed: int) -> tuple[list[Sequence], torch.Tensor]:
    rng = random.Random(seed)
    seqs = []
    for i in range(ROWS):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        seq = Sequence(i, prompt, random_params(rng), 16)
        seq.token_ids += [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))]  # some output so far
        seqs.append(seq)
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    return seqs, logits


def spy(monkeypatch, module, name: str, calls: list):
    original = getattr(module, name)

    def record(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, record)


@pytest.mark.parametrize("seed", range(PARAMETER_SETS))
def test_sampler_triton_race_and_verifier_apply_the_same_pipeline(seed, monkeypatch):
    seqs, logits = random_batch(seed)
    greedy = torch.tensor([s.sampling_params.greedy for s in seqs])
    sampled = ~greedy

    # 1. The torch sampler: its greedy tokens, and the logits its race draws from.
    raced: list = []
    spy(monkeypatch, sampler, "inverse_transform_draw", raced)
    t = prepare_sampling(seqs, VOCAB, EOS, torch.device("cpu"))
    assert t.before_temperature or t.after_temperature, "the batch exercises no processor"
    tokens, _ = Sampler(inverse_transform_from_logits).draw(logits.clone(), t)  # the CPU platform's
    weights = raced[0][0]  # [rows, vocab] what the draw picks from; sampled rows only are meaningful
    expected = weights / weights.sum(dim=-1, keepdim=True)
    greedy_tokens = tokens[greedy]

    # 2. The Triton race (fused sampler), interpreted on CPU (or on the GPU): what the kernel is handed.
    from nanovllm.kernels.sampling import _race_chunk_kernel, sample_tokens
    triton_sampler = RaceSampler(sample_tokens)  # the Triton platform's
    kernel_inputs: list = []
    kernel = triton_sampler.race_kernel
    device = kernel_test_device(_race_chunk_kernel)
    triton_sampler.race_kernel = lambda *args, **kw: kernel_inputs.append(args) or kernel(*args, **kw)
    t_triton = prepare_sampling(seqs, VOCAB, EOS, device, philox=True)
    triton_tokens, _ = triton_sampler.draw(logits.clone().to(device), t_triton)
    triton_tokens = triton_tokens.cpu()
    race_logits, race_temperatures = kernel_inputs[0][0].cpu(), kernel_inputs[0][1].cpu()
    assert torch.equal(triton_tokens[greedy], greedy_tokens)
    assert torch.equal(race_temperatures, sampled.float())  # sampled rows come already scaled and filtered
    torch.testing.assert_close(torch.softmax(race_logits[sampled], dim=-1), expected[sampled], atol=1e-6, rtol=1e-5)

    # 3. The verifier: with each sampled row proposing a token x of a deterministic draft, it
    # accepts exactly when u < p(x); u is set just below and just above the sampler's p(x).
    proposed = torch.multinomial(torch.where(sampled.unsqueeze(1), expected, 1.0 / VOCAB), 1).squeeze(1)
    p_x = expected.gather(1, proposed.unsqueeze(1)).squeeze(1)
    for factor, accepts in ((1 - 1e-4, True), (1 + 1e-4, False)):
        monkeypatch.setattr(rejection_sampler, "uniforms", lambda rows, t, device: p_x * factor)
        verdicts = RejectionSampler(inverse_transform_draw)(logits.clone(), proposed, None, t)
        for row in torch.nonzero(sampled).flatten().tolist():
            if p_x[row] > 0:
                assert verdicts.accepted[row] == accepts, (row, factor)
    # Greedy rows accept exactly their argmax, and a row without a proposal emits it.
    verdicts = RejectionSampler(inverse_transform_draw)(logits.clone(), torch.where(greedy, tokens, -1), None, t)
    assert [verdicts.accepted[r] for r in range(ROWS) if greedy[r]] == [True] * int(greedy.sum())
    assert [verdicts.tokens[r] for r in range(ROWS) if greedy[r]] == greedy_tokens.tolist()


def test_pipeline_order_and_fast_path_come_from_the_parameters():
    """SamplingParams.processors names each processor a request needs, in the pipeline's order;
    the fast path is taken exactly when no row needs one (and none wants logprobs)."""
    assert SamplingParams().processors == ()
    assert SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.1).processors == ()  # greedy: no draw
    full = SamplingParams(logit_bias={1: 2.0}, min_tokens=1, repetition_penalty=1.2, min_p=0.1, top_k=3)
    assert full.processors == ("logit_bias", "min_tokens", "penalties", "min_p", "top_k_top_p")
    seq = Sequence(0, [1, 2], SamplingParams(logit_bias={4: 1.0}), 16)
    t = prepare_sampling([seq], VOCAB, EOS, torch.device("cpu"))
    assert [type(p) for p in t.before_temperature] == [LogitBias] and not t.after_temperature
    assert not t.needs_only_temperature and not SamplingParams(logit_bias={4: 1.0}).needs_only_temperature
    fast = prepare_sampling([Sequence(1, [1, 2], SamplingParams(), 16)], VOCAB, EOS, torch.device("cpu"))
    assert fast.needs_only_temperature and fast == SamplingTensors(fast.temperatures, all_greedy=False)


def test_logit_bias_adds_to_the_chosen_tokens_only():
    logits = torch.randn(3, VOCAB)
    bias = LogitBias(torch.tensor([0, 0, 2]), torch.tensor([5, 7, 5]), torch.tensor([1.5, -2.0, 100.0]))
    out = bias(logits)
    expected = logits.clone()
    expected[0, 5] += 1.5
    expected[0, 7] -= 2.0
    expected[2, 5] += 100.0
    assert torch.equal(out, expected)
    assert not torch.equal(out, logits)  # the input is left as it was (logprobs read it)


@pytest.mark.parametrize("field_value", [{"x": 1.0}, {-1: 1.0}, {3: float("inf")}, {3: 101.0}, [1, 2], {True: 1.0}])
def test_bad_logit_bias_is_refused_naming_it(field_value):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=field_value)


def test_logit_bias_greedy_equals_hf_on_biased_logits(qwen3_tiny):
    """Greedy decoding with a bias equals HF's step-by-step argmax of (logits + bias); the bias
    reaches greedy rows and sampled ones alike, and a token outside the vocabulary is refused."""
    prompts = random_prompts(200, [5, 9], seed=7)
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=128)
    try:
        clean = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                             use_tqdm=False)
        # Push down each prompt's first greedy token and push up another: the path must change.
        biases = [{out["token_ids"][0]: -5.0, out["token_ids"][1]: 3.0} for out in clean]
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=b) for b in biases]
        biased = llm.generate(prompts, params, use_tqdm=False)
        vocab = llm.config.hf_config.vocab_size
        with pytest.raises(ValueError, match="logit_bias"):
            llm.generate(prompts[:1], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
        forced = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=3, max_tokens=4,
                                                          logit_bias={11: 100.0}), use_tqdm=False)
    finally:
        llm.exit()
    model = _hf_model(qwen3_tiny)
    for prompt, bias, out in zip(prompts, biases, biased):
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            for token, value in bias.items():
                logits[token] += value
            ids.append(int(logits.argmax()))
        assert out["token_ids"] == ids[len(prompt):]
    assert [o["token_ids"] for o in biased] != [o["token_ids"] for o in clean]
    assert forced[0]["token_ids"] == [11] * 4  # +100 all but forces a token, sampled or not


def test_logit_bias_over_http(qwen3_tiny):
    """OpenAI's shape (token ids as string keys): +100 forces the token on both endpoints; a key
    that is not a token id, one outside the vocabulary and a value past 100 are 400s naming
    logit_bias, and the server answers the next request."""
    from serving import httpx, server_thread
    with server_thread(qwen3_tiny) as server:
        def post(path: str, **body) -> httpx.Response:
            return httpx.post(server.url + path, json=body, timeout=60)
        completion = post("/v1/completions", prompt="Hello", max_tokens=3, temperature=0, logit_bias={"11": 100})
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] == decoded(qwen3_tiny, [11] * 3)
        chat = post("/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                    temperature=0.8, seed=1, logit_bias={"12": 100})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == \
            decoded(qwen3_tiny, [12] * 2)
        for bias in ({"x1": 1}, {"-3": 1}, {"10000000": 1}, {"5": 101}):
            refused = post("/v1/completions", prompt="Hello", max_tokens=2, logit_bias=bias)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias", refused.text
        assert post("/v1/completions", prompt="Hello", max_tokens=2).status_code == 200


def decoded(path: str, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path).decode(token_ids, skip_special_tokens=True)
