"""Requests fail alone (docs/reliability.md, "Requests fail alone"): a fault injected into one
request among twenty, in each phase the engine works for it (building, admission, sampling
inputs, stop check, detokenizer, output), fails that request alone (finish_reason "abort" and an
"error" message) while the other nineteen give exactly what a clean run gives, greedy and seeded,
n > 1 and shared prefixes included, with the plain and the overlapped loop and with speculative
decoding; every block is free afterwards. A fault in the model pass fails the requests of that
step, and the engine's next call equals a clean run.
"""
from itertools import count

import pytest

import nanovllm.engine.request as request_module
import nanovllm.runner.model_runner as model_runner_module
from helpers import random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.runner.pending_tokens import PendingTokens

BLOCK = 16
NUM_PROMPTS, VICTIM = 20, 7
MAX_TOKENS = 8
# The victim: seeded sampling, n = 2 (siblings share its prompt's blocks), a stop string (so it
# has a detokenizer) and logprobs. Identified by this very object wherever a fault is injected.
VICTIM_PARAMS = SamplingParams(temperature=0.8, seed=99, n=2, max_tokens=MAX_TOKENS, stop=["zzqx"], logprobs=2)


class InjectedFault(RuntimeError):
    pass


def prompts_and_params() -> tuple[list[list[int]], list[SamplingParams]]:
    """Twenty prompts, half behind a shared 2-block prefix (the victim's among them), with greedy,
    seeded and n > 1 sampling."""
    shared = random_prompts(500, [2 * BLOCK], seed=3)[0]
    tails = random_prompts(500, [3 + i for i in range(NUM_PROMPTS)], seed=4)
    prompts = [shared + tail if i % 2 else tail for i, tail in enumerate(tails)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1) if i % 3 == 0 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=MAX_TOKENS, n=1 + i % 2) for i in range(NUM_PROMPTS)]
    params[VICTIM] = VICTIM_PARAMS
    return prompts, params


def is_victim(seq) -> bool:
    return seq.sampling_params is VICTIM_PARAMS


def assert_same(output: dict, expected: dict, what: str) -> None:
    """The same output as a clean run's: text, tokens, finish and stop reasons exactly; logprobs to
    float32 rounding (a batch without the failed request sums in another order). Prefix-cache hit
    counts are left out: they depend on the runs before, not on what was generated."""
    samples, expected_samples = output.get("outputs", [output]), expected.get("outputs", [expected])
    assert len(samples) == len(expected_samples), what
    for sample, reference in zip(samples, expected_samples):
        plain = {k: v for k, v in sample.items() if k not in ("num_cached_tokens", "logprobs")}
        assert plain == {k: v for k, v in reference.items() if k not in ("num_cached_tokens", "logprobs")}, what
        assert ("logprobs" in sample) == ("logprobs" in reference), what
        for lp, ref in zip(sample.get("logprobs", []), reference.get("logprobs", [])):
            assert lp["token_id"] == ref["token_id"] and lp["top_logprobs"].keys() == ref["top_logprobs"].keys(), what
            assert lp["logprob"] == pytest.approx(ref["logprob"], abs=1e-4), what


def assert_all_same(outputs: list[dict], expected: list[dict], skip: set[int] = frozenset()) -> None:
    assert len(outputs) == len(expected)
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        if i not in skip:
            assert "error" not in out, f"prompt {i} failed"
            assert_same(out, ref, f"prompt {i} changed")


def make_engine(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=512, max_num_seqs=16, **kwargs)


@pytest.fixture(scope="module", params=["off", "on"])
def engine(request, qwen3_tiny):
    llm = make_engine(qwen3_tiny, async_scheduling=request.param)
    prompts, params = prompts_and_params()
    clean = llm.generate(prompts, params, use_tqdm=False)
    yield llm, clean
    llm.exit()


# --- the faults, each raising for the victim only ---

def fault_in_building(monkeypatch, llm):
    init = Detokenizer.__init__

    def faulty(self, tokenizer, params, *args):
        if params is VICTIM_PARAMS:
            raise InjectedFault("building")
        init(self, tokenizer, params, *args)
    monkeypatch.setattr(Detokenizer, "__init__", faulty)


def fault_in_admission(monkeypatch, llm):
    allocate = llm.block_manager.allocate

    def faulty(seq):
        if is_victim(seq):
            raise InjectedFault("admission")
        return allocate(seq)
    monkeypatch.setattr(llm.block_manager, "allocate", faulty)


def fault_in_sampling_inputs(monkeypatch, llm):
    prepare = model_runner_module.prepare_sampling

    def faulty(seqs, *args, **kwargs):
        if any(is_victim(seq) and seq.num_completion_tokens >= 2 for seq in seqs):
            raise InjectedFault("sampling inputs")
        return prepare(seqs, *args, **kwargs)
    monkeypatch.setattr(model_runner_module, "prepare_sampling", faulty)


def fault_in_stop_check(monkeypatch, llm):
    check = llm.stop_checker.check

    def faulty(seq):
        if is_victim(seq) and seq.num_completion_tokens >= 3:
            raise InjectedFault("stop check")
        return check(seq)
    monkeypatch.setattr(llm.stop_checker, "check", faulty)


def fault_in_detokenizer(monkeypatch, llm):
    add_token = Detokenizer.add_token

    def faulty(self, token_id, check_stop):
        if self.params is VICTIM_PARAMS and len(self.token_ids) >= 4:
            raise InjectedFault("detokenizer")
        return add_token(self, token_id, check_stop)
    monkeypatch.setattr(Detokenizer, "add_token", faulty)


def fault_in_output(monkeypatch, llm):
    completion = request_module._completion

    def faulty(index, seq, tokenizer, failed):
        if is_victim(seq) and not failed:
            raise InjectedFault("output")
        return completion(index, seq, tokenizer, failed)
    monkeypatch.setattr(request_module, "_completion", faulty)


FAULTS = [fault_in_building, fault_in_admission, fault_in_sampling_inputs, fault_in_stop_check,
          fault_in_detokenizer, fault_in_output]


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert llm.scheduler.is_finished() and not llm._requests


def assert_failed(output: dict) -> None:
    assert output["finish_reason"] == "abort"
    assert "injected" not in output["error"].lower() and "InjectedFault" not in output["error"]
    assert "failed" in output["error"]
    assert all(sample["finish_reason"] == "abort" for sample in output.get("outputs", [output]))


def generate_with_one_fault(llm, clean: list[dict], inject, monkeypatch) -> None:
    """generate() with `inject`'s fault in the victim: it alone fails, the others give the clean
    run's outputs, and every block is free afterwards."""
    prompts, params = prompts_and_params()
    with monkeypatch.context() as patch:
        inject(patch, llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_failed(outputs[VICTIM])
    assert_all_same(outputs, clean, skip={VICTIM})
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("inject", FAULTS, ids=lambda f: f.__name__)
def test_a_fault_in_one_request_fails_it_alone(engine, inject, monkeypatch, caplog):
    llm, clean = engine
    prompts, params = prompts_and_params()
    generate_with_one_fault(llm, clean, inject, monkeypatch)
    assert "InjectedFault" in caplog.text  # the traceback is in the log, under the request id
    assert_all_same(llm.generate(prompts, params, use_tqdm=False), clean)  # the engine is as good as new


@pytest.mark.parametrize("inject", [fault_in_stop_check, fault_in_detokenizer, fault_in_output],
                         ids=lambda f: f.__name__)
def test_a_streamed_request_fails_alone(engine, inject, monkeypatch):
    """stream() and the online API (what the server uses) end a failed request with "abort"."""
    llm, clean = engine
    prompts, params = prompts_and_params()
    with monkeypatch.context() as patch:
        inject(patch, llm)
        texts: dict[tuple[int, int], str] = {}
        reasons: dict[tuple[int, int], str] = {}
        for piece in llm.stream(prompts, params):
            texts[piece.index, piece.sample] = texts.get((piece.index, piece.sample), "") + piece.text
            if piece.finished:
                reasons[piece.index, piece.sample] = piece.finish_reason
    # The victim's samples all end; the one the fault hit (or any after it) with "abort" (a sample
    # that ended before the fault keeps its reason, as it was streamed).
    assert "abort" in [reason for (i, _), reason in reasons.items() if i == VICTIM]
    for (i, j), reason in reasons.items():
        if i != VICTIM:
            sample = clean[i].get("outputs", [clean[i]])[j]
            assert (texts[i, j], reason) == (sample["text"], sample["finish_reason"])
    assert len(reasons) == sum(p.n for p in params)
    assert_all_blocks_free(llm)


def test_a_failed_online_request_reports_its_error(engine, monkeypatch):
    llm, _ = engine
    prompts, params = prompts_and_params()
    with monkeypatch.context() as patch:
        fault_in_stop_check(patch, llm)
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        finals = {}
        while len(finals) < len(ids):
            for request_id in llm.step().request_ids:
                out = llm.pop_output(request_id)
                if out.finished:
                    finals[request_id] = out
    victim = finals[ids[VICTIM]]
    assert ids[VICTIM] in victim.final.error and all(s.finish_reason == "abort" for s in victim.final.outputs)
    assert all(finals[i].final.error is None for i in ids if i != ids[VICTIM])
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("where", ["forward", "tokens"])
def test_a_model_pass_fault_fails_its_step_and_the_engine_serves_on(engine, where, monkeypatch):
    """The forward pass raising as it is launched, or the step's tokens never reaching the host
    (what a device fault looks like under async scheduling: raised when they are waited for)."""
    llm, clean = engine
    prompts, params = prompts_and_params()
    calls = count()
    owner, name = (llm.model_runner, "forward") if where == "forward" else (PendingTokens, "result")
    original = getattr(owner, name)

    def faulty(*args):
        if next(calls) == 3:  # mid-run: some requests decoding, some still waiting
            raise InjectedFault("the device pass")
        return original(*args)
    with monkeypatch.context() as patch:
        patch.setattr(owner, name, faulty)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    failed = {i for i, out in enumerate(outputs) if "error" in out}
    assert failed, "the fault failed no request"
    for i in failed:
        assert_failed(outputs[i])
    assert_all_same(outputs, clean, skip=failed)
    assert_all_blocks_free(llm)
    assert_all_same(llm.generate(prompts, params, use_tqdm=False), clean)


@pytest.mark.parametrize("inject", [fault_in_sampling_inputs, fault_in_stop_check], ids=lambda f: f.__name__)
def test_speculative_decoding_fails_one_request_alone(qwen3_tiny, inject, monkeypatch):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_engine(qwen3_tiny, speculative_config=spec)
    prompts, params = prompts_and_params()
    clean = llm.generate(prompts, params, use_tqdm=False)
    generate_with_one_fault(llm, clean, inject, monkeypatch)
    llm.exit()
