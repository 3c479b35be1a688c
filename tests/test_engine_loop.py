"""EngineClient (the engine-loop thread and its asyncio side) with a stand-in engine, no model:
outputs arrive in order, a refused call queues nothing, the queue limit, a step that raises
fails the live requests with an error output and the loop serves on (only an engine that cannot
step at all stops it, never leaving a caller waiting), a failed build."""
import asyncio
import os
import pickle
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from nanovllm.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, SampleDelta
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.stats import EngineStats
from nanovllm.entrypoints.openai.engine_loop import (MAX_CONSECUTIVE_STEP_FAILURES, EngineClient, EngineDeadError,
                                              QueueFullError, _portable)
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.validation import ParamError
from serving import metric

BOOM = "boom"  # a prompt that makes the stand-in's next step raise
SILENT = "silent"  # a prompt that never gets a token (it stays queued until aborted)


class StandInEngine:
    """LLMEngine's online API, single-threaded like it: each request gets one token per step
    (the token is its step count) until max_tokens; a prompt "bad" is refused. The loop drives it
    with LLMEngine's own driver (run: its fault policy), over the stand-in's step, pop and abort."""
    STEP_SECONDS = 0.001  # a step that produced nothing still takes a little while, as a real one
    run, _drive, _fail_live = LLMEngine.run, LLMEngine._drive, LLMEngine._fail_live
    _entered = staticmethod(nullcontext)

    def __init__(self):
        self.config = SimpleNamespace(max_model_len=64, kvcache_block_size=16)
        self.block_manager = SimpleNamespace(num_blocks=8, num_free_blocks=8)
        self.live: dict[str, list] = {}  # request id -> [prompt, params, tokens, finish_reason]
        self.news: dict[str, None] = {}
        self.exited = False
        self.num_steps = 0
        self.grammars = SimpleNamespace(load=lambda: None)  # the structured-outputs compiler, unused here

    def add_requests(self, prompts, params, request_ids, priority=None):
        if "bad" in prompts:  # all or none, as the engine
            raise ParamError("prompt", "prompt='bad' is not allowed")
        for prompt, sampling_params, request_id in zip(prompts, params, request_ids):
            self.live[request_id] = [prompt, sampling_params, [], None]
        return request_ids

    def stats(self) -> EngineStats:
        running = sum(entry[3] is None for entry in self.live.values())
        return EngineStats(num_running=running, num_kv_blocks=8, num_free_kv_blocks=8, decode_steps=self.num_steps)

    def has_unfinished_requests(self) -> bool:
        return any(entry[3] is None for entry in self.live.values())

    def _step(self):
        time.sleep(self.STEP_SECONDS)
        self.num_steps += 1
        for request_id, entry in self.live.items():
            if entry[3] is None and entry[0] != SILENT:
                if entry[0] == BOOM:
                    raise RuntimeError("the model blew up")
                entry[2].append(len(entry[2]))
                if len(entry[2]) == entry[1].max_tokens:
                    entry[3] = "length"
                self.news[request_id] = None
        news, self.news = list(self.news), {}
        return SimpleNamespace(request_ids=news)

    def _num_samples(self, request_id) -> int:
        return self.live[request_id][1].n

    def abort(self, request_id) -> bool:
        entry = self.live.get(request_id)
        if entry is None or entry[3] is not None:
            return False
        entry[3] = "abort"
        return True

    def pop_output(self, request_id) -> RequestDelta:
        prompt, params, tokens, reason = self.live[request_id]
        finished = reason is not None
        if finished:
            del self.live[request_id]
        sample = SampleDelta(0, tokens[-1:], "", [], finished, reason, None)
        final = RequestOutput(request_id, prompt, [1, 2], None, [CompletionOutput(0, "", tokens, None, None, reason,
                                                                                  None)], True)
        return RequestDelta(request_id, [1, 2], [sample], finished, final if finished else None)

    _abort, _pop = abort, pop_output

    def exit(self):
        self.exited = True


def run_client(test, engine_factory=StandInEngine, max_queue_len: int = 8):
    async def main():
        engines = []

        def build():
            engines.append(engine_factory())
            return engines[-1]
        client = EngineClient(build, max_queue_len)
        await client.start()
        try:
            await test(client)
        finally:
            await client.shutdown()
        assert engines[0].exited
    asyncio.run(main())


def test_outputs_arrive_in_order_until_finished():
    async def test(client):
        submission = await client.add(["a", "b"], SamplingParams(max_tokens=3), "r")
        seen = {rid: [] for rid in submission.request_ids}
        async for output in submission:
            seen[output.request_id] += output.samples[0].token_ids
        assert seen == {"r-0": [0, 1, 2], "r-1": [0, 1, 2]}
        assert client.num_queued == 0
    run_client(test)


def test_refused_call_queues_nothing():
    async def test(client):
        with pytest.raises(ValueError, match="bad"):
            await client.add(["a", "bad"], SamplingParams(max_tokens=3), "r")
        assert client.num_queued == 0
        submission = await client.add(["a"], SamplingParams(max_tokens=1), "s")
        assert [o.finished async for o in submission] == [True]
    run_client(test)


def test_queue_limit():
    async def test(client):
        with pytest.raises(ValueError, match="max_queue_len"):  # could never fit
            await client.add(["a"] * 3, SamplingParams(n=2, max_tokens=1), "big")
        first = await client.add([SILENT], SamplingParams(n=3, max_tokens=50), "r")
        assert client.num_queued == 3
        with pytest.raises(QueueFullError):  # 3 + 2 > 4 while the first waits for its first output
            await client.add(["a"], SamplingParams(n=2, max_tokens=1), "s")
        client.abort(first.request_ids)
        assert [o.samples[0].finish_reason async for o in first] == ["abort"]
        assert client.num_queued == 0  # its places are given back
        second = await client.add(["a"], SamplingParams(n=2, max_tokens=1), "s")
        assert [o.finished async for o in second] == [True]
    run_client(test, max_queue_len=4)


def test_a_failing_step_fails_live_requests_and_the_loop_serves_on():
    async def test(client):
        running = await client.add(["a"], SamplingParams(n=2, max_tokens=60), "r")
        boom = await client.add([BOOM], SamplingParams(max_tokens=1), "b")
        for submission in (running, boom):
            outputs = [output async for output in submission]
            last = outputs[-1]
            assert last.finished and all(s.finish_reason == "abort" for s in last.samples)
            # A message for the client: its request id, not the exception's text.
            assert submission.request_ids[0] in last.error and "blew up" not in last.error
            assert last.final.error == last.error and last.final.outputs[0].finish_reason == "abort"
        assert client.is_serving
        later = await client.add(["a"], SamplingParams(max_tokens=2), "late")
        outputs = [output async for output in later]
        assert outputs[-1].samples[0].finish_reason == "length" and outputs[-1].error is None
    run_client(test)


def test_an_engine_that_cannot_step_stops_the_loop():
    class Broken(StandInEngine):
        def _step(self):
            raise RuntimeError("the device is gone")

    async def test(client):
        for k in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):  # each failure fails its requests; the loop goes on
            submission = await client.add(["a"], SamplingParams(max_tokens=3), f"r{k}")
            assert [output.error is not None async for output in submission] == [True]
            assert client.is_serving
        last = await client.add(["a"], SamplingParams(max_tokens=3), "last")
        with pytest.raises(EngineDeadError):
            async for _ in last:
                pass
        assert not client.is_serving and not client.is_running
        with pytest.raises(EngineDeadError):
            await client.add(["a"], SamplingParams(max_tokens=1), "late")
    run_client(test, engine_factory=Broken)


def test_a_failure_after_the_build_is_raised_by_start_and_frees_the_engine():
    """Start-up past the build (reading the engine's config, stats, compiler) failing must not
    leave start() waiting forever: it raises, and the built engine is exited."""
    built = []

    class NoStats(StandInEngine):
        def stats(self):
            raise RuntimeError("stats are broken")

    def build():
        built.append(NoStats())
        return built[-1]

    async def main():
        client = EngineClient(build, 4)
        with pytest.raises(RuntimeError, match="stats are broken"):
            await asyncio.wait_for(client.start(), timeout=30)
        assert not client.is_running and built[0].exited
        await client.shutdown()
    asyncio.run(main())


def test_a_failed_build_is_raised_by_start():
    def broken():
        raise ValueError("model='x' is not a directory")

    async def main():
        client = EngineClient(broken, 4)
        with pytest.raises(ValueError, match="not a directory"):
            await client.start()
        assert not client.is_running
        with pytest.raises(EngineDeadError):
            await client.add(["a"], SamplingParams(max_tokens=1), "r")
        await client.shutdown()
    asyncio.run(main())


def test_metrics_export_the_engine_stats():
    """observe_engine puts a stats snapshot's queues, block use and counters into /metrics."""
    metrics = ServerMetrics()
    assert metric(metrics.render().decode(), "nanovllm_steps_total", 'kind="decode"') == 0
    stats = EngineStats(prefill_steps=7, decode_steps=11, mixed_steps=5, preemptions_recompute=2,
                        preemptions_swap=3, swap_space_full=1, swap_ins=4, blocks_swapped_out=9,
                        blocks_swapped_in=6, swapped_prefix_lost=1, spec_proposed_tokens=12, spec_accepted_tokens=8, num_running=3, num_waiting=2, num_swapped=1,
                        num_free_kv_blocks=6, num_kv_blocks=8, num_free_swap_blocks=1, num_swap_blocks=4)
    metrics.observe_engine(stats)
    text = metrics.render().decode()
    expected = {
        ("nanovllm_steps_total", 'kind="prefill"'): 7, ("nanovllm_steps_total", 'kind="decode"'): 11,
        ("nanovllm_steps_total", 'kind="mixed"'): 5, ("nanovllm_preemptions_total", 'mode="recompute"'): 2,
        ("nanovllm_preemptions_total", 'mode="swap"'): 3, ("nanovllm_swap_space_full_total", ""): 1,
        ("nanovllm_swap_ins_total", ""): 4, ("nanovllm_spec_draft_tokens_total", 'outcome="proposed"'): 12,
        ("nanovllm_spec_draft_tokens_total", 'outcome="accepted"'): 8, ("nanovllm_blocks_swapped_total", 'direction="out"'): 9,
        ("nanovllm_blocks_swapped_total", 'direction="in"'): 6, ("nanovllm_swapped_prefix_lost_total", ""): 1,
        ("nanovllm_num_requests_running", ""): 3, ("nanovllm_num_requests_waiting", ""): 2,
        ("nanovllm_num_requests_swapped", ""): 1, ("nanovllm_kv_cache_usage_ratio", ""): 0.25,
        ("nanovllm_swap_space_usage_ratio", ""): 0.75,
    }
    assert {key: metric(text, *key) for key in expected} == expected


def test_the_loop_feeds_the_metrics():
    """Steps the loop drives show in its metrics (the stand-in counts each as a decode step)."""
    async def test(client):
        submission = await client.add(["a"], SamplingParams(max_tokens=3), "r")
        assert len([o async for o in submission]) == 3
        text = client.metrics.render().decode()
        assert metric(text, "nanovllm_steps_total", 'kind="decode"') >= 3
        assert metric(text, "nanovllm_generation_tokens_total") == 3
    run_client(test)


def refuse_to_build():
    raise ValueError("model='x' is not a directory")


def test_a_loop_in_its_own_process_serves_refuses_and_stops():
    """engine_process=True: the loop runs in another process; outputs, a refusal naming its field
    and the queue's accounting cross the pipe as in a thread, and shutdown ends the process."""
    async def main():
        client = EngineClient(StandInEngine, 4, engine_process=True)
        await client.start()
        try:
            assert client.engine_pid not in (None, os.getpid()) and client.is_serving
            submission = await client.add(["a", "b"], SamplingParams(max_tokens=3), "r")
            seen = {rid: [] for rid in submission.request_ids}
            async for output in submission:
                seen[output.request_id] += output.samples[0].token_ids
            assert seen == {"r-0": [0, 1, 2], "r-1": [0, 1, 2]}
            with pytest.raises(ParamError, match="prompt='bad'") as refused:
                await client.add(["a", "bad"], SamplingParams(max_tokens=1), "x")
            assert refused.value.param == "prompt" and client.num_queued == 0
            silent = await client.add([SILENT], SamplingParams(max_tokens=2), "s")
            client.abort(silent.request_ids)
            outputs = [output async for output in silent]
            assert outputs[-1].finished and outputs[-1].samples[0].finish_reason == "abort"
            pid = client.engine_pid
        finally:
            await client.shutdown()
        assert not client.is_running
        with pytest.raises(ProcessLookupError):  # the engine process has exited and been reaped
            os.kill(pid, 0)
        with pytest.raises(EngineDeadError):
            await client.add(["a"], SamplingParams(max_tokens=1), "late")
    asyncio.run(main())


def test_a_failed_build_in_the_engine_process_is_raised_by_start():
    """A build that raises in the engine process, and one that cannot be sent there (a lambda
    does not pickle), fail start(); the client is then not running and shuts down as a no-op."""
    async def main():
        for build, error, started in ((refuse_to_build, "not a directory", True),
                                      (lambda: StandInEngine(), "pickle", False)):
            client = EngineClient(build, 4, engine_process=True)
            with pytest.raises(Exception, match=error):
                await client.start()
            assert not client.is_running and (client.engine_pid is not None) == started
            await client.shutdown()
    asyncio.run(main())


def test_errors_cross_the_pipe_whole_or_as_their_kind():
    """A refusal keeps the field it names across the pipe; an exception that cannot be pickled
    arrives as one of its kind (ValueError: still the caller's 400) with its message."""
    error = pickle.loads(pickle.dumps(ParamError("top_k", "top_k=0 is not allowed")))
    assert isinstance(error, ParamError) and error.param == "top_k" and str(error) == "top_k=0 is not allowed"

    class Unpicklable(ValueError):
        def __init__(self, message, extra):
            super().__init__(message)

    crossed = _portable(Unpicklable("n=0 is not allowed", object()))
    assert type(crossed) is ValueError and str(crossed) == "n=0 is not allowed"
    assert type(_portable(KeyError("k"))) is KeyError
