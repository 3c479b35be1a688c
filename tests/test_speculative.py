"""Speculative decoding: the n-gram proposer, the lookahead bookkeeping, the rejection sampler's
distribution, and end to end greedy parity with HF transformers for both methods (prompts with
and without repetition, stop conditions, max_tokens, preemption, prefix-cache hits).

Two drafts: a random-weight one-layer model with the target's vocabulary (its proposals are
almost all rejected: the rejection path) and the target itself (all accepted: the bonus path,
and tokens per forward close to k + 1). Tiny checkpoints and short outputs keep this file fast.
"""
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from helpers import greedy, hf_greedy, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.ngram_proposer import ngram_proposal
from nanovllm.scheduling.scheduler import Scheduler
from nanovllm.scheduling.sequence import Sequence
from nanovllm.scheduling.stop_checker import StopChecker
from nanovllm.layers.rejection_sampler import RejectionSampler
from nanovllm.layers.sampler import inverse_transform_draw
from nanovllm.layers.logits_processors import SamplingTensors
from nanovllm.testing.synthetic import build_checkpoint

BLOCK = 16
MAX_TOKENS = 20
K = 3


def ngram(k: int = K, low: int = 1, high: int = 4) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}


def draft(path: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def draft_tiny(tmp_path_factory) -> str:
    """A one-layer random draft with other weights than the target, and the same tokenizer and vocabulary."""
    return build_checkpoint(str(tmp_path_factory.mktemp("draft_tiny")), "qwen3", num_hidden_layers=1, seed=7)


@pytest.fixture(scope="module")
def prompts_and_expected(qwen3_tiny):
    """Random prompts, and prompts that repeat a chunk (what prompt lookup feeds on)."""
    plain = random_prompts(200, [1, 15, 17, 40], seed=31)
    chunks = random_prompts(200, [6, 11], seed=32)
    prompts = plain + [chunks[0] * 4, chunks[1] * 3 + chunks[1][:5]]
    return prompts, hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)


def engine(path: str, spec: dict | None, **kwargs) -> LLM:
    return LLM(path, device="cpu", kvcache_block_size=BLOCK, speculative_config=spec,
               **{"num_kvcache_blocks": 64, **kwargs})


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


# --- the n-gram proposer ---

def test_ngram_prefers_the_longest_match():
    # The 1-gram [3] last occurred before 8, the 2-gram [2, 3] before 5: the longer one wins.
    tokens = [1, 2, 3, 5, 6, 9, 3, 8, 7, 2, 3]
    assert ngram_proposal(tokens, 2, 1, 3) == [5, 6]
    assert ngram_proposal(tokens, 2, 1, 1) == [8, 7]  # only 1-grams: the most recent [3]


def test_ngram_takes_the_most_recent_occurrence_and_at_most_k():
    tokens = [4, 5, 1, 4, 5, 2, 2, 4, 5]
    assert ngram_proposal(tokens, 3, 2, 2) == [2, 2, 4]
    assert ngram_proposal(tokens, 1, 2, 2) == [2]
    assert ngram_proposal([7, 7], 4, 1, 3) == [7]  # what follows may be shorter than k


def test_ngram_proposes_nothing_without_a_match():
    assert ngram_proposal([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_proposal([1, 2, 1, 3], 3, 2, 3) == []  # [1] recurs, but no 2-gram does
    assert ngram_proposal([5], 3, 1, 3) == []
    assert ngram_proposal([1, 2, 1], 0, 1, 3) == []


# --- the scheduler's lookahead and rollback (no model) ---

def test_lookahead_is_bounded_by_max_tokens_and_free_blocks_and_rolled_back():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(8, 64, bm, StopChecker(eos=-1, max_model_len=64), num_lookahead_tokens=5)
    seq = Sequence(0, [1, 2, 3], SamplingParams(temperature=0, max_tokens=5), block_size=4)
    scheduler.add(seq)
    batch = scheduler.schedule()  # the prompt
    scheduler.postprocess(batch, [9], [[]], [0])
    assert seq.token_ids == [1, 2, 3, 9] and seq.num_computed_tokens == 3
    batch = scheduler.schedule()
    # max_tokens=5 with one token made: at most 4 more, so 3 proposals and the token after them.
    assert seq.num_lookahead_slots == 3 and len(seq.block_table) == 2
    # One proposal accepted, then one more token: 3 new tokens, the newest not computed.
    advanced = scheduler.postprocess(batch, [6], [[5]], [3])
    assert advanced == [seq] and seq.token_ids == [1, 2, 3, 9, 5, 6] and seq.num_computed_tokens == 5
    assert len(seq.block_table) == 2 and seq.num_lookahead_slots == 0
    stats = scheduler.stats
    assert (stats.spec_proposed_tokens, stats.spec_accepted_tokens, stats.spec_decode_rows) == (3, 1, 1)
    batch = scheduler.schedule()
    assert seq.num_lookahead_slots == 1
    scheduler.postprocess(batch, [7], [[6]], [1])  # max_tokens reached exactly, never passed
    assert seq.is_finished and seq.completion_token_ids == [9, 5, 6, 6, 7] and bm.num_free_blocks == 4


def test_lookahead_never_takes_blocks_it_would_have_to_preempt_for_and_trim_returns_them():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Sequence(0, [1, 2, 3, 4, 5], SamplingParams(), block_size=4)
    assert bm.allocate(seq) and bm.num_free_blocks == 0
    assert bm.reserve_lookahead(seq, 8) == 3  # the rest of its last block only
    other = Sequence(1, [1, 2], SamplingParams(), block_size=4)
    bm2 = BlockManager(num_blocks=3, block_size=4)
    assert bm2.allocate(other) and bm2.reserve_lookahead(other, 20) == 10 and len(other.block_table) == 3
    bm2.trim(other)
    assert len(other.block_table) == 1 and bm2.num_free_blocks == 2


# --- the rejection sampler keeps the target's distribution ---

VOCAB = 6
SAMPLES = 60_000


def _tensors(rows: int) -> SamplingTensors:
    return SamplingTensors(torch.ones(rows), all_greedy=False)


def _verify_many(p_logits: torch.Tensor, proposed: list[int], q: torch.Tensor | None) -> list[list[int]]:
    """SAMPLES independent sequences, each with the same target rows and proposals (drafts drawn
    from q per sequence when q is given): each one's kept tokens."""
    d = len(proposed)
    torch.manual_seed(0)
    if q is not None:
        drafts = torch.multinomial(q, SAMPLES, replacement=True).T  # [SAMPLES, d]
    else:
        drafts = torch.tensor(proposed).expand(SAMPLES, d)
    ids = torch.cat([drafts, torch.full((SAMPLES, 1), -1)], dim=1).reshape(-1)
    logits = p_logits.repeat(SAMPLES, 1)
    draft_probs = None if q is None else torch.cat([q, torch.zeros(1, VOCAB)]).repeat(SAMPLES, 1)
    verdicts = RejectionSampler(inverse_transform_draw)(logits, ids, draft_probs, _tensors(SAMPLES * (d + 1)))
    out = []
    for s in range(SAMPLES):
        row, n = s * (d + 1), 0
        while n < d and verdicts.accepted[row + n]:
            n += 1
        out.append(drafts[s, :n].tolist() + [verdicts.tokens[row + n]])
    return out


def _assert_distributed_as(tokens: list[int], probs: torch.Tensor) -> None:
    counts = Counter(tokens)
    observed = [counts.get(t, 0) for t in range(VOCAB)]
    expected = (probs.double() / probs.double().sum() * len(tokens)).tolist()
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


@pytest.mark.parametrize("with_draft_model", [False, True], ids=["ngram", "draft_model"])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_model):
    gen = torch.Generator().manual_seed(3)
    p_logits = torch.randn(3, VOCAB, generator=gen) * 1.5  # the target's rows before, between and after 2 proposals
    p = torch.softmax(p_logits, dim=-1)
    q = torch.softmax(torch.randn(2, VOCAB, generator=gen), dim=-1) if with_draft_model else None
    proposed = [int(p[0].argsort()[1]), 2]  # a deterministic draft whose first token the target finds unlikely
    out = _verify_many(p_logits, proposed, q)
    _assert_distributed_as([o[0] for o in out], p[0])
    # A second token comes only after the first proposal was accepted; it is then the target's
    # next row's (the rows stand for the context the accepted proposal made).
    seconds = [o[1] for o in out if len(o) > 1]
    assert len(seconds) > 500
    _assert_distributed_as(seconds, p[1])
    accepted = sum(len(o) - 1 for o in out)
    assert 0 < accepted < 2 * SAMPLES


def test_rejection_sampler_greedy_rows_accept_while_the_argmax_agrees():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    t = SamplingTensors(torch.zeros(3), all_greedy=True)
    verdicts = RejectionSampler(inverse_transform_draw)(logits, torch.tensor([1, 2, -1]), None, t)
    assert verdicts.accepted == [True, False, False] and verdicts.tokens == [1, 0, 2]


# --- end to end: greedy parity with HF ---

@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_is_target"])
def test_greedy_parity_with_hf(qwen3_tiny, draft_tiny, prompts_and_expected, method):
    prompts, expected = prompts_and_expected
    spec = {"ngram": ngram(), "draft_model": draft(draft_tiny), "draft_is_target": draft(qwen3_tiny)}[method]
    llm = engine(qwen3_tiny, spec)
    assert generate(llm, prompts, greedy(MAX_TOKENS)) == expected
    stats = llm.stats()
    llm.exit()
    assert stats.spec_proposed_tokens > 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    if method == "draft_is_target":  # every proposal is the target's own choice
        assert stats.spec_acceptance_rate == 1.0 and stats.spec_tokens_per_forward > K


def test_ngram_accepts_on_a_repetitive_workload(qwen3_tiny, prompts_and_expected):
    prompts, expected = prompts_and_expected
    llm = engine(qwen3_tiny, ngram(k=4))
    assert generate(llm, prompts[-2:], greedy(MAX_TOKENS)) == expected[-2:]
    stats = llm.stats()
    llm.exit()
    assert stats.spec_accepted_tokens > 0 and stats.spec_tokens_per_forward > 1


@pytest.mark.parametrize("method", ["ngram", "draft_is_target"])
def test_stops_and_max_tokens_are_never_overshot(qwen3_tiny, prompts_and_expected, method):
    """Stop tokens and stop strings inside an accepted run end the sequence there, exactly as
    without speculation; every length is its max_tokens exactly."""
    prompts, expected = prompts_and_expected
    spec = ngram(k=4) if method == "ngram" else draft(qwen3_tiny, k=4)
    base, llm = engine(qwen3_tiny, None), engine(qwen3_tiny, spec)
    prompts, expected = prompts[-3:], expected[-3:]
    stop_ids = greedy(MAX_TOKENS, stop_token_ids=[expected[-1][6], expected[0][9]])
    text = llm.tokenizer.decode(expected[-2][:12])
    stop_str = greedy(MAX_TOKENS, stop=[text[len(text) // 2:len(text) // 2 + 2]])
    lengths = [greedy(n) for n in (1, 2, 5, 7, 11)]
    for params in (stop_ids, stop_str):
        want = base.generate(prompts, params, use_tqdm=False)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [(o["token_ids"], o["text"], o["finish_reason"], o["stop_reason"]) for o in got] == \
            [(o["token_ids"], o["text"], o["finish_reason"], o["stop_reason"]) for o in want]
    got = generate(llm, prompts[-2:] * 5, [p for p in lengths for _ in range(2)])
    assert got == [e[:p.max_tokens] for p in lengths for e in expected[-2:]]
    assert llm.stats().spec_accepted_tokens > 0
    base.exit()
    llm.exit()


@pytest.mark.parametrize("method, mode", [("ngram", "recompute"), ("draft_is_target", "swap")])
def test_parity_under_preemption_and_prefix_hits(qwen3_tiny, prompts_and_expected, method, mode):
    """A cache of 8 blocks: sequences are preempted and recomputed, or swapped (the draft model's
    cache beside the target's); the same prompts twice: prefix-cache hits for the second."""
    prompts, expected = (x[-4:] for x in prompts_and_expected)
    spec = ngram() if method == "ngram" else draft(qwen3_tiny)
    llm = engine(qwen3_tiny, spec, num_kvcache_blocks=8, max_num_batched_tokens=48, preemption_mode=mode,
                 swap_space=0.01)
    assert generate(llm, prompts, greedy(MAX_TOKENS)) == expected
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.spec_accepted_tokens > 0
    llm.exit()
    llm = engine(qwen3_tiny, spec)
    generate(llm, prompts, greedy(MAX_TOKENS))
    outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    llm.exit()
    assert [o["token_ids"] for o in outputs] == expected
    assert sum(o["num_cached_tokens"] for o in outputs) > 0


def test_sampled_speculation_runs_and_is_reproducible_with_a_seed(qwen3_tiny, prompts_and_expected):
    prompts = prompts_and_expected[0][-3:]
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11)
    outputs = []
    for _ in range(2):
        llm = engine(qwen3_tiny, draft(qwen3_tiny))
        outputs.append(generate(llm, prompts, params))
        stats = llm.stats()
        llm.exit()
        assert stats.spec_accepted_tokens > 0
    assert outputs[0] == outputs[1] and all(len(o) == MAX_TOKENS for o in outputs[0])


def test_sequences_that_cannot_be_verified_exactly_decode_without_proposals(qwen3_tiny, prompts_and_expected):
    """Penalties and logprobs depend on the tokens before each proposed one: no proposals for them."""
    prompts, expected = prompts_and_expected
    llm = engine(qwen3_tiny, draft(qwen3_tiny))
    base = engine(qwen3_tiny, None)
    params = greedy(MAX_TOKENS, logprobs=2, repetition_penalty=1.3)
    got, want = llm.generate(prompts[:3], params, use_tqdm=False), base.generate(prompts[:3], params, use_tqdm=False)
    assert [(o["token_ids"], o["logprobs"]) for o in got] == [(o["token_ids"], o["logprobs"]) for o in want]
    assert llm.stats().spec_proposed_tokens == 0
    llm.exit()
    base.exit()


# --- configuration ---

@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config['method']='medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens']=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max']=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown key(s) ['model']"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config['model']=None"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"}, "not a usable draft model"),
    ([2], "speculative_config=[2]"),
])
def test_bad_speculative_configs_are_refused(qwen3_tiny, spec, message):
    with pytest.raises(ValueError) as error:
        LLM(qwen3_tiny, device="cpu", speculative_config=spec)
    assert message in str(error.value)


def test_a_draft_with_another_vocabulary_or_tensor_parallelism_is_refused(qwen3_tiny, tmp_path):
    other = build_checkpoint(str(tmp_path / "other_vocab"), "qwen3", vocab_size=704, num_hidden_layers=1)
    with pytest.raises(ValueError, match="must share the target's vocabulary"):
        LLM(qwen3_tiny, device="cpu", speculative_config=draft(other))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not allowed"):
        LLM(qwen3_tiny, device="cpu", tensor_parallel_size=2, speculative_config=ngram())
