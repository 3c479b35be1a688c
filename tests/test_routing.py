"""One engine, many callers (CPU): every request's output reaches its own caller whoever drives
the step, so interleaved generate()/stream() calls each get what they would get alone; the
online API (add_request / step / pop_output / abort); a second thread is refused, never served
half-way; the scheduler's "cannot admit" case is an error, not an assert."""
import threading
from pathlib import Path

import pytest

from helpers import greedy, hf_greedy, random_prompts
from nanovllm import LLM, RequestDelta, SamplingParams
from nanovllm.engine.outputs import to_nanovllm_dict
from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.scheduler import Scheduler
from nanovllm.scheduling.sequence import Sequence
from nanovllm.scheduling.stop_checker import StopChecker

BLOCK = 16
THREAD_WAIT_S = 60.0  # generous bound on waiting for the other thread (never reached when all is well)


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    engine = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=64, max_model_len=256)
    yield engine
    engine.exit()


def assert_all_free(llm: LLM) -> None:
    assert llm.is_finished() and not llm.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm._requests, "every request is forgotten once its caller has its output"


def samples_of(outputs: list[dict]) -> dict:
    """(prompt index, sample index) -> (text, token ids, finish reason, stop reason) of generate() outputs."""
    return {(i, j): (s["text"], s["token_ids"], s["finish_reason"], s["stop_reason"])
            for i, out in enumerate(outputs) for j, s in enumerate(out.get("outputs", [out]))}


class StreamReader:
    """Reads a stream chunk by chunk and accumulates each sample's text and token ids."""

    def __init__(self, stream):
        self.stream = stream
        self.texts, self.tokens, self.reasons = {}, {}, {}
        self.done = False

    def read_one(self) -> bool:
        chunk = next(self.stream, None)
        if chunk is None:
            self.done = True
            return False
        key = (chunk.index, chunk.sample)
        assert key not in self.reasons, "nothing after a sample's finished chunk"
        self.texts[key] = self.texts.get(key, "") + chunk.text
        self.tokens[key] = self.tokens.get(key, []) + chunk.token_ids
        if chunk.finished:
            self.reasons[key] = chunk.finish_reason
        return True

    def samples(self) -> dict:
        return {key: (self.texts[key], self.tokens[key], self.reasons[key]) for key in self.texts}


def without_stop_reason(samples: dict) -> dict:
    return {key: value[:3] for key, value in samples.items()}


def stop_string_of(llm: LLM, prompt: list[int], params: SamplingParams) -> str:
    """Two clean characters from past the first third of the unconstrained output, so a stop
    string really stops it, part-way through."""
    text = llm.generate([prompt], params, use_tqdm=False)[0]["text"]
    for i in range(len(text) // 3, len(text) - 1):
        candidate = text[i:i + 2]
        if "\ufffd" not in candidate and candidate.strip() == candidate:
            return candidate
    pytest.skip("no clean two characters in the unconstrained output for a stop string")


@pytest.fixture(scope="module")
def mixed_workload(llm):
    """Two calls' prompts and params: greedy and seeded, with stop strings and n > 1."""
    p = random_prompts(200, [9, 23, 14, 31], seed=40)
    seeded = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=17, max_tokens=14, ignore_eos=True)
    stop_greedy = stop_string_of(llm, p[1], greedy(20))
    stop_seeded = stop_string_of(llm, p[3], SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True))
    first = ([p[0], p[1]], [greedy(18), greedy(20, stop=[stop_greedy])])
    second = ([p[2], p[3], "hello world"],
              [seeded, SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, stop=stop_seeded),
               greedy(12, n=2)])
    return first, second


def test_generate_inside_a_stream_loop_leaves_the_stream_whole(llm, qwen3_tiny):
    """The audit's repro: generate() while a stream is open used to steal 16 of its 20 tokens."""
    params = greedy(20)
    got = []
    for chunk in llm.stream([[1, 2, 3]], params):
        got += chunk.token_ids
        if len(got) == 3:
            inner = llm.generate([[4, 5, 6]], greedy(5), use_tqdm=False)
    assert got == llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]["token_ids"]
    assert got == hf_greedy(qwen3_tiny, [[1, 2, 3]], 20)[0]
    assert inner[0]["token_ids"] == hf_greedy(qwen3_tiny, [[4, 5, 6]], 5)[0]
    assert_all_free(llm)


def test_two_streams_read_in_turn_each_equal_running_alone(llm, mixed_workload):
    (prompts_a, params_a), (prompts_b, params_b) = mixed_workload
    alone_a = samples_of(llm.generate(prompts_a, params_a, use_tqdm=False))
    alone_b = samples_of(llm.generate(prompts_b, params_b, use_tqdm=False))
    assert any(v[2] == "stop" for v in alone_a.values()) and any(v[2] == "stop" for v in alone_b.values())
    a, b = StreamReader(llm.stream(prompts_a, params_a)), StreamReader(llm.stream(prompts_b, params_b))
    turn = 0
    generated_between = None
    while not (a.done and b.done):
        (a if turn % 2 == 0 else b).read_one()
        if turn == 7:  # and a generate() of both calls' prompts in the middle, as a third caller
            generated_between = llm.generate(prompts_a + prompts_b, params_a + params_b, use_tqdm=False)
        turn += 1
    assert a.samples() == without_stop_reason(alone_a)
    assert b.samples() == without_stop_reason(alone_b)
    between = samples_of(generated_between)
    assert without_stop_reason(between) == without_stop_reason(
        {(i, j): v for (i, j), v in alone_a.items()} | {(i + len(prompts_a), j): v for (i, j), v in alone_b.items()})
    assert_all_free(llm)


def test_streams_at_uneven_rates_with_generate_calls_between(llm, mixed_workload):
    (prompts_a, params_a), (prompts_b, params_b) = mixed_workload
    alone_a = without_stop_reason(samples_of(llm.generate(prompts_a, params_a, use_tqdm=False)))
    alone_b = without_stop_reason(samples_of(llm.generate(prompts_b, params_b, use_tqdm=False)))
    a, b = StreamReader(llm.stream(prompts_a, params_a)), StreamReader(llm.stream(prompts_b, params_b))
    b.read_one()
    for _ in range(3):  # a runs ahead while b's requests are stepped by a's driving
        a.read_one()
    llm.generate([[7, 8, 9]], greedy(6), use_tqdm=False)
    while b.read_one():
        pass
    while a.read_one():
        pass
    assert a.samples() == alone_a and b.samples() == alone_b
    assert_all_free(llm)


def pop_until_final(llm: LLM, request_ids: list[str]) -> dict[str, list[RequestDelta]]:
    """Drive with step() and pop what each step reports, until every request's final output is in."""
    pops = {rid: [] for rid in request_ids}
    pending = set(request_ids)
    while pending:
        step = llm.step()
        for rid in step.request_ids:
            out = llm.pop_output(rid)
            assert out.request_id == rid
            pops[rid].append(out)
            if out.finished:
                pending.discard(rid)
    return pops


def test_add_request_deltas_concatenate_to_generate_output(llm, mixed_workload, qwen3_tiny):
    (prompts_a, params_a), (prompts_b, params_b) = mixed_workload
    prompts, params = prompts_a + prompts_b, params_a + params_b
    params[0] = greedy(18, logprobs=3)
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert expected[0]["token_ids"] == hf_greedy(qwen3_tiny, [prompts[0]], 18)[0]
    request_ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    assert len(set(request_ids)) == len(request_ids) and all(isinstance(r, str) for r in request_ids)
    pops = pop_until_final(llm, request_ids)
    for rid, out, prompt in zip(request_ids, expected, prompts):
        history = pops[rid]
        assert [o.finished for o in history] == [False] * (len(history) - 1) + [True]
        final = to_nanovllm_dict(history[-1].final)
        assert {k: v for k, v in final.items() if k != "num_cached_tokens"} == \
            {k: v for k, v in out.items() if k != "num_cached_tokens"}
        assert all(o.final is None for o in history[:-1])
        for j, sample in enumerate(out.get("outputs", [out])):
            deltas = [s for o in history for s in o.samples if s.index == j]
            assert "".join(s.text for s in deltas) == sample["text"]
            assert [t for s in deltas for t in s.token_ids] == sample["token_ids"]
            assert [s.finished for s in deltas] == [False] * (len(deltas) - 1) + [True]
            assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (sample["finish_reason"],
                                                                          sample["stop_reason"])
            if "logprobs" in sample:
                assert [lp for s in deltas for lp in s.logprobs] == sample["logprobs"]
        assert history[0].prompt_token_ids == out["prompt_token_ids"]
    with pytest.raises(ValueError, match="request_id"):  # forgotten once its final output was popped
        llm.pop_output(request_ids[0])
    assert_all_free(llm)


def test_pop_output_between_steps_and_with_nothing_new(llm):
    rid = llm.add_request("hello world", greedy(4), request_id="mine")
    assert rid == "mine"
    empty = llm.pop_output(rid)
    assert empty.samples == [] and not empty.finished and empty.final is None
    llm.step()
    llm.step()  # two steps between pops: both tokens come in one delta
    (sample,) = llm.pop_output(rid).samples
    assert len(sample.token_ids) == 2 and not sample.finished
    pops = pop_until_final(llm, [rid])
    assert pops[rid][-1].final.outputs[0].token_ids[:2] == sample.token_ids
    assert_all_free(llm)


def test_abort_frees_blocks_and_reports_abort(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=100, ignore_eos=True)
    doomed = llm.add_request(random_prompts(200, [40], seed=41)[0], params)
    other = llm.add_request(random_prompts(200, [20], seed=42)[0], greedy(50))
    for _ in range(3):  # prefill both, then the second sample (it waits for the prompt's blocks), then decode
        llm.step()
    assert llm.block_manager.num_free_blocks < llm.block_manager.num_blocks
    assert llm.abort(doomed) is True
    assert llm.abort(doomed) is False  # already finished
    assert llm.abort("no-such-request") is False
    assert doomed in llm.step().request_ids  # the abort is news
    out = llm.pop_output(doomed)
    assert out.finished and [s.finish_reason for s in out.samples] == ["abort", "abort"]
    for sample, final in zip(out.samples, out.final.outputs):
        assert final.finish_reason == "abort" and 0 < len(final.token_ids) < 100
        assert sample.token_ids == final.token_ids  # the first pop: every token so far
    assert llm.abort(other) is True
    out = llm.pop_output(other)
    (final,) = out.final.outputs
    assert out.finished and final.finish_reason == "abort" and len(final.token_ids) < 50
    assert_all_free(llm)
    # The engine goes on as before.
    assert llm.generate([[1, 2, 3]], greedy(5), use_tqdm=False)[0]["finish_reason"] == "length"


def test_abort_of_a_queued_request_before_any_step(llm):
    rid = llm.add_request([5, 6, 7], SamplingParams(n=3, temperature=0.5, max_tokens=8))
    assert llm.abort(rid)
    out = llm.pop_output(rid)
    assert out.finished and [s.index for s in out.samples] == [0, 1, 2]
    assert all(s.finish_reason == "abort" and s.token_ids == [] and s.text == "" for s in out.samples)
    assert_all_free(llm)


@pytest.mark.parametrize("args, message", [
    (([], greedy(4)), "empty"),
    (([1, 10**9], greedy(4)), "vocabulary"),
    (([1, 2], {"temperature": 0}), "sampling_params"),
    (([1, 2], greedy(4), 17), "request_id"),
    (([1, 2], greedy(4), ""), "request_id"),
])
def test_add_request_validates_before_queueing(llm, args, message):
    with pytest.raises(ValueError, match=message):
        llm.add_request(*args)
    assert_all_free(llm)


def test_duplicate_live_request_id_refused(llm):
    rid = llm.add_request([1, 2, 3], greedy(3), request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        llm.add_request([4, 5, 6], greedy(3), request_id="dup")
    auto = [llm.add_request([4], greedy(2)) for _ in range(3)]
    assert len(set(auto + [rid])) == 4
    pop_until_final(llm, [rid] + auto)
    assert llm.add_request([1, 2, 3], greedy(3), request_id="dup") == "dup"  # free again once popped
    pop_until_final(llm, ["dup"])
    assert_all_free(llm)


def test_pop_output_refuses_what_add_request_did_not_make(llm):
    with pytest.raises(ValueError, match="request_id"):
        llm.pop_output("never-made")
    stream = llm.stream([[1, 2, 3]], greedy(4))
    next(stream)
    (stream_rid,) = llm._requests  # a stream's request goes to the stream only
    with pytest.raises(ValueError, match="add_request"):
        llm.pop_output(stream_rid)
    assert llm.step().request_ids == []
    assert sum(len(c.token_ids) for c in stream) == 3  # the 3 tokens left, none lost to the step above
    assert_all_free(llm)


def test_idle_step_is_empty(llm):
    out = llm.step()
    assert (out.advanced, out.finished, out.num_tokens, out.request_ids) == ([], [], 0, [])


def test_second_thread_refused_while_one_drives(llm):
    prompts = random_prompts(200, [12, 25], seed=43)
    expected = llm.generate(prompts, greedy(10), use_tqdm=False)
    inside, release = threading.Event(), threading.Event()
    real_run = llm.model_runner.run

    def held_run(seqs, is_prefill, *copies):
        inside.set()
        assert release.wait(THREAD_WAIT_S)
        return real_run(seqs, is_prefill, *copies)

    # A stream opened here before the other thread drives; closed while it drives.
    open_stream = llm.stream(random_prompts(200, [30], seed=44), greedy(40))
    next(open_stream)
    box = {}
    llm.model_runner.run = held_run
    try:
        def drive():
            try:
                box["out"] = llm.generate(prompts, greedy(10), use_tqdm=False)
            except BaseException as error:  # handed to the test
                box["error"] = error
        thread = threading.Thread(target=drive, name="driver")
        thread.start()
        assert inside.wait(THREAD_WAIT_S)
        refused = [lambda: llm.generate(prompts, greedy(2), use_tqdm=False), llm.step,
                   lambda: llm.add_request([1, 2], greedy(2)), lambda: llm.abort("0"), lambda: llm.pop_output("0"),
                   lambda: llm.stream(prompts, greedy(2)), lambda: next(open_stream),
                   lambda: llm.chat([{"role": "user", "content": "hi"}], greedy(2)), llm.exit]
        for call in refused:
            with pytest.raises(RuntimeError, match=r"single-threaded.*driver.*nanovllm\.entrypoints"):
                call()
        open_stream.close()  # its request is released by the driving thread at its next step
        release.set()
        thread.join(THREAD_WAIT_S)
        assert not thread.is_alive()
    finally:
        release.set()
        del llm.model_runner.run
    assert "error" not in box, box.get("error")
    assert [o["token_ids"] for o in box["out"]] == [o["token_ids"] for o in expected]
    assert_all_free(llm)


def test_scheduler_that_cannot_admit_raises_even_without_asserts():
    """Nothing but running sequences holds blocks, so this cannot happen in the engine; if it
    ever did, it is a RuntimeError (an assert would vanish under python -O and the loop spin)."""
    params = greedy(4)
    manager = BlockManager(4, BLOCK)
    scheduler = Scheduler(8, 256, manager, StopChecker(-1, 256))
    leaked = Sequence(0, list(range(3 * BLOCK)), params, BLOCK)
    assert manager.allocate(leaked)  # blocks held by a sequence the scheduler does not know
    scheduler.add(Sequence(1, list(range(2 * BLOCK)), params, BLOCK))
    with pytest.raises(RuntimeError, match="cannot be admitted|can be admitted"):
        scheduler.schedule()
    assert Scheduler(8, 256, BlockManager(4, BLOCK), StopChecker(-1, 256)).schedule().seqs == []  # idle: empty batch


def test_run_yields_only_its_own_requests_news(llm):
    """LLMEngine.run, every caller's driver: it pops the news of the requests it drives; another
    caller's news waits for that caller, whole."""
    mine = llm.add_request([1, 2, 3], greedy(3))
    other = llm.add_request([4, 5], greedy(2))
    live = {mine}
    seen = []
    for outputs in llm.run(live):
        seen += outputs
        live -= {out.request_id for out in outputs if out.finished}
        if not live:
            break
    assert {out.request_id for out in seen} == {mine} and seen[-1].finished
    assert sum(len(s.token_ids) for out in seen for s in out.samples) == 3
    assert other in llm.step().request_ids
    out = llm.pop_output(other)
    assert out.finished and len(out.samples[0].token_ids) == 2
    assert_all_free(llm)


# Per driver of the engine: how it must drive it (LLMEngine.run, or _drive from inside the engine)
# and the step calls of its own it must not make.
DRIVERS = {"llm.py": (["self.run(", "self._drive("], ["self.step(", "self._step(", "self.core.step("]),
           "entrypoints/openai/engine_loop.py": (["engine.run("], ["engine.step(", "engine._step("]),
           "entrypoints/batch/job.py": (["self.llm.run("], ["llm.step(", "llm._step("])}


def test_every_driver_steps_the_engine_through_run_only():
    """One request lifecycle: LLM's calls, the server's engine loop and batch jobs step the engine
    only through its one driver, so they share its fault policy."""
    package = Path(__file__).resolve().parents[1] / "nanovllm"
    for path, (required, forbidden) in DRIVERS.items():
        text = (package / path).read_text()
        assert all(call in text for call in required), f"{path} does not drive the engine with {required}"
        assert not [call for call in forbidden if call in text], f"{path} steps the engine itself"
