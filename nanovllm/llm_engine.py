"""The engine: takes requests, steps the scheduler and the model runner, and routes every
sequence's output to the request it belongs to. The offline API (generate/stream/chat) is
`LLM`, in nanovllm/llm.py, on top of it.

Its parts: `engine/request_builder.py` checks and builds a call's requests (every call is
checked in full before any of it is queued, so bad input raises a clear ValueError and leaves
the engine as it was); `engine/request_table.py` registers them, hands out their outputs and
fails a faulty request alone; `engine/stats.py` keeps the counters. Whoever drives a step, each
request's news goes to its own inbox: a generate()/stream()/chat() call reads only its own
requests, and requests made by add_requests() are read with pop_output(). So calls may
interleave in one thread and each gets exactly what it would get alone. A fault that belongs to
no one request (the batched model pass) fails the requests of that step, and the engine serves
the next ones as before.

The engine is single-threaded: a call from a second thread while one thread is inside it is
refused with a RuntimeError (a server drives it from one engine loop). Its only exit hook
(weakref.finalize) holds the model runner, not the engine, so a dropped engine is freed by the
garbage collector; exit() (or leaving `with LLM(...) as llm:`) frees it at once.
"""
import threading
import weakref
from contextlib import contextmanager
from time import perf_counter
from typing import Iterator, NamedTuple

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.outputs import RequestDelta
from nanovllm.engine.request import Request
from nanovllm.engine.request_builder import Prompt, RequestBuilder
from nanovllm.engine.request_table import RequestTable
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import EngineStats, InterTokenLatency, engine_stats, log_speculation
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.runner.pending_tokens import PendingTokens
from nanovllm.runner.protocol import OverlappedRunner, Runner, RunnerOutput
from nanovllm.runner.tensor_parallel import create_model_runner
from nanovllm.runner.worker_group import TensorParallelError
from nanovllm.sampling_params import SamplingParams

EXITED_MESSAGE = "this engine has exited (exit() was called); create a new LLM to generate again"
MODEL_PASS = "running the model over its step"


class StepOutput(NamedTuple):
    advanced: list[Sequence]  # sequences that got a new token in this step
    finished: list[Sequence]  # those among them that finished
    num_tokens: int  # tokens the model computed
    is_prefill: bool
    # Requests made by add_requests() with news not yet popped (new tokens, finished or aborted),
    # in the order their news came; the requests of generate()/stream()/chat() go to their calls.
    request_ids: list[str]


class InFlightStep(NamedTuple):
    """A step launched by the overlapped loop whose tokens have not been resolved yet."""
    batch: ScheduledBatch
    tokens: PendingTokens
    num_tokens: int  # tokens the model computes in it
    start: float  # perf_counter() when it was scheduled


class LLMEngine:

    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, kwargs)  # settings checked and resolved, tokenizer loaded
        self.config = config
        # None with skip_tokenizer_init: token-id prompts only, and outputs have empty text.
        self.tokenizer = config.tokenizer
        # Plain, tensor-parallel (spawns the other ranks) or speculative: the loop uses them alike.
        self.model_runner: Runner = create_model_runner(config)
        self.attention_backend: str = self.model_runner.attention_backend  # what "auto" chose
        # The one exit hook of the whole engine (tensor-parallel workers included). It holds the
        # runner, not the engine, so dropping the engine lets the garbage collector run it; it
        # also runs at interpreter exit if the engine is still alive then.
        self._finalizer = weakref.finalize(self, self.model_runner.exit)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, self.model_runner.num_swap_blocks)
        self.stop_checker = StopChecker(config.eos, config.max_model_len)
        # Speculative decoding: the runner proposes and verifies; the scheduler reserves the slots.
        self.speculative = config.speculative is not None
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager,
                                   self.stop_checker, config.scheduling_policy, config.preemption_mode,
                                   config.speculative.num_speculative_tokens if self.speculative else 0)
        # The overlapped loop (Config.async_scheduling): the step launched last, not yet resolved.
        self.async_scheduling = config.async_scheduling == "on"
        assert not self.async_scheduling or isinstance(self.model_runner, OverlappedRunner), \
            "Config allows async scheduling only with a runner that launches (the single-rank ModelRunner)"
        self._in_flight: InFlightStep | None = None
        self._builder = RequestBuilder(self.tokenizer, config.hf_config.vocab_size, config.max_model_len,
                                       config.kvcache_block_size, self.block_manager.num_blocks)
        self._table = RequestTable(self.scheduler, self.block_manager, self.tokenizer, config.enable_prefix_caching)
        self._requests = self._table.requests  # every live request, whoever made it
        self._news = self._table.news  # add_requests()'s requests with news not yet popped
        self._lock = threading.Lock()  # held by the thread inside the engine
        self._inside: str | None = None  # that thread's name, for the refusal message
        # Calls whose requests were released by a thread that could not enter; they are freed at
        # the next step or the next entry, whichever comes first.
        self._deferred: list[list[Request]] = []
        self._exited = False
        self._prefill_tps = self._decode_tps = 0.0  # the latest step's throughput, for the progress bar
        self._itl = InterTokenLatency()

    # --- lifetime and the single-thread rule ---

    def exit(self) -> None:
        """Free the model and the KV cache (and stop tensor-parallel workers) now. Idempotent;
        every later call raises RuntimeError."""
        if self._exited:
            return
        with self._entered():
            self._exited = True
            if self.speculative:
                log_speculation(self.scheduler.stats, self.config.speculative.method)
            self._finalizer()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit()

    @contextmanager
    def _entered(self) -> Iterator[None]:
        """Hold the engine for one call: refused once it has exited, or while another thread is inside."""
        if self._exited:
            raise RuntimeError(EXITED_MESSAGE)
        if not self._lock.acquire(blocking=False):
            inside = self._inside
            raise RuntimeError(f"the engine is single-threaded and another thread ({inside}) is inside it now; "
                               f"call it from one thread only (thread {threading.current_thread().name} was "
                               "refused). To serve many clients, let one engine loop own it, as the server in "
                               "nanovllm.entrypoints does")
        self._inside = threading.current_thread().name
        try:
            if self._exited:  # another thread exited it between the check above and the lock
                raise RuntimeError(EXITED_MESSAGE)
            self._free_deferred()
            yield
        finally:
            self._inside = None
            self._lock.release()

    # --- the online API: add_requests / step / pop_output / abort ---

    def add_requests(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                     request_ids: list[str | None] | None = None, priority: list[int] | None = None) -> list[str]:
        """Check and queue prompts, all or none: every prompt is checked and built first, and if
        one is bad a ValueError names it (its index, the field) and none is queued. Returns their
        request ids (unique strings, or the ones given). Their outputs are read with pop_output()
        as step() reports news of them. Lower `priority` values (one int per prompt; None: all 0)
        are admitted first and preempted last (ties: earlier requests first), as vLLM."""
        with self._entered():
            requests = self._builder.build_all(prompts, sampling_params, self._news, deltas=True, priority=priority,
                                               request_ids=request_ids, live=self._requests)
            try:
                self._table.submit(requests)
            except BaseException:  # an internal error part-way: take back what was queued
                self._forget(requests)
                raise
            return [request.request_id for request in requests]

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        """add_requests() of one prompt; returns its request id."""
        return self.add_requests([prompt], [sampling_params], [request_id], [priority])[0]

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks: its unfinished samples finish with finish_reason
        "abort", and its final output is still delivered by pop_output(). Returns whether it was
        running or waiting (False for an unknown or already finished request)."""
        with self._entered():
            request = self._requests.get(request_id) if isinstance(request_id, str) else None
            if request is None or request.finished:
                return False
            self._drain()  # an aborted sample keeps no placeholder, and gets no token after its abort
            self.scheduler.abort([seq for seq in request.seqs if not seq.is_finished])
            request.inbox[request_id] = None
            return True

    def pop_output(self, request_id: str) -> RequestDelta:
        """What is new in an add_requests() request since its last pop (new token ids, text and
        logprobs of the samples with news). Once `finished`, `final` holds its RequestOutput and
        the engine forgets the id."""
        with self._entered():
            request = self._requests.get(request_id) if isinstance(request_id, str) else None
            if request is None or request.inbox is not self._news:
                raise ValueError(f"request_id={request_id!r} is not a live request made by add_request() "
                                 "(unknown, or finished and already popped)")
            self._news.pop(request_id, None)
            output = self._table.pop(request)
            if output.finished:
                self._table.unregister(request)
            return output

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def stats(self) -> EngineStats:
        """The scheduler's counters, the queues' sizes, block use and inter-token latency, as a snapshot."""
        return engine_stats(self.scheduler, self.block_manager, self._itl)

    # --- releasing a call's requests ---

    def _forget(self, requests: list[Request]) -> None:
        """Abort what is unfinished of these requests (freeing their blocks at once) and forget
        them. The caller is inside the engine."""
        submitted = [r for r in requests if self._requests.get(r.request_id) is r]
        unfinished = [seq for r in submitted for seq in r.seqs if not seq.is_finished]
        if unfinished:
            self._drain()
            self.scheduler.abort([seq for seq in unfinished if not seq.is_finished])
        for request in submitted:
            self._table.unregister(request)
            request.inbox.pop(request.request_id, None)

    def _release(self, requests: list[Request]) -> None:
        """_forget() from a call that has ended (a stream closed, finished or dropped), which may
        happen while another thread is inside the engine: then that thread does it at its next step."""
        if not any(r.request_id is not None for r in requests):  # never submitted
            return
        if self._lock.acquire(blocking=False):
            try:
                self._forget(requests)
            finally:
                self._lock.release()
        else:
            self._deferred.append(requests)

    def _free_deferred(self) -> None:
        while self._deferred:
            self._forget(self._deferred.pop())

    # --- the step ---

    def step(self) -> StepOutput:
        """Run one scheduled batch; the scheduler advances its sequences and finishes those the
        stop checker says are done. Every request that got news is told through its inbox."""
        with self._entered():
            return self._step()

    def _step(self) -> StepOutput:
        """One step, which never raises for a request's fault. A fault the step's parts could not
        pin on a sequence or a batch (a bug in the bookkeeping itself) fails every live request,
        as nothing else is known to be sound, and leaves the engine empty and usable."""
        try:
            return self._run_step()
        except Exception as exc:
            seqs = [seq for request in self._requests.values() for seq in request.seqs]
            if self._in_flight is not None:
                seqs += self._in_flight.batch.seqs
                self._in_flight = None
            queued = [*self.scheduler.running, *self.scheduler.waiting, *self.scheduler.swapped]
            self._table.fail_seqs(exc, seqs + queued, "stepping the engine")
            if isinstance(exc, TensorParallelError):  # the group is stopped: the caller must know
                raise
            return self._no_tokens(True)

    def _run_step(self) -> StepOutput:
        self._free_deferred()
        start = perf_counter()
        overlap = self.async_scheduling and not self._table.num_plain_only
        if self._in_flight is not None and not overlap:
            return self._drain()  # a plain step must find every token on the host
        batch = self.scheduler.schedule()  # a sequence's own fault fails it alone (scheduler.fail)
        if not batch.seqs:  # idle, or everything was preempted (the next step prefills again)
            if batch.has_copies:  # a swap-out's K/V must reach host memory before its blocks are reused
                try:
                    self.model_runner.run([], True, batch.swap_out, batch.swap_in)
                except Exception as exc:
                    self._fail_step(exc, [batch])
            return self._drain()
        num_tokens = batch.num_tokens  # before postprocess clears the scheduled counts
        if not overlap:
            try:
                out = self.model_runner.run(batch.seqs, batch.is_prefill, batch.swap_out, batch.swap_in)
            except Exception as exc:
                self._fail_step(exc, [batch])
                return self._no_tokens(batch.is_prefill)
            self._fail_rows(batch, out.failed)
            # One path for every runner: a speculative one's output adds each sequence's accepted proposals.
            advanced = self.scheduler.postprocess(batch, out.token_ids, out.accepted, out.num_proposed)
            return self._report(batch, out, advanced, num_tokens, start)
        try:
            tokens = self.model_runner.launch(batch.seqs, batch.is_prefill, batch.swap_out, batch.swap_in)
        except Exception as exc:
            in_flight, self._in_flight = self._in_flight, None
            self._fail_step(exc, [batch] + ([in_flight.batch] if in_flight is not None else []))
            return self._no_tokens(batch.is_prefill)
        # The overlapped loop: while the device runs this step, resolve the one before (its tokens,
        # stop checks, outputs), then advance this one with placeholders so the next can be scheduled.
        previous, self._in_flight = self._in_flight, InFlightStep(batch, tokens, num_tokens, start)
        # Faults found by now (this step's scheduling, the previous step's sampling and stop checks)
        # are settled before `advance`, so a failed sequence gets no placeholder.
        step = self._no_tokens(batch.is_prefill) if previous is None else self._resolve(previous, batch)
        if self._in_flight is None:  # the previous step's tokens never came: this one failed with it
            return step
        self.scheduler.advance(batch, tokens.sample_indices)
        return step

    def _drain(self) -> StepOutput:
        """Resolve the step in flight, if any (async scheduling), so no placeholder is left."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return self._no_tokens(True)
        return self._resolve(in_flight)

    def _resolve(self, step: InFlightStep, next_batch: ScheduledBatch | None = None) -> StepOutput:
        """An in-flight step's tokens, stop checks and news. If its tokens never come (the device
        pass failed), it fails, and so does `next_batch`, launched after it (its placeholders
        read those tokens)."""
        try:
            out = step.tokens.result()
        except Exception as exc:
            self._in_flight = None
            self._fail_step(exc, [step.batch] + ([next_batch] if next_batch is not None else []))
            return self._no_tokens(step.batch.is_prefill)
        self._fail_rows(step.batch, out.failed)
        advanced = self.scheduler.resolve(step.batch, out.token_ids, step.tokens.sample_indices)
        return self._report(step.batch, out, advanced, step.num_tokens, step.start)

    def _report(self, batch: ScheduledBatch, out: RunnerOutput, advanced: list[Sequence], num_tokens: int,
                start: float) -> StepOutput:
        """A step's news: logprobs kept, each request with news told through its inbox, the counters."""
        self._itl.observe(advanced, batch.num_prefill_seqs > 0)
        # The runner returns logprobs exactly for the rows that sampled; those of sequences that
        # finished before them (async scheduling) are not kept, as their tokens are not.
        for seq, lp in zip(batch.seqs, out.logprobs):
            n = seq.sampling_params.logprobs
            if lp is not None and n is not None and len(seq.logprobs) < seq.num_completion_tokens:
                seq.logprobs.append(lp._replace(top_logprobs=dict(list(lp.top_logprobs.items())[:n])))
        for seq, prompt in zip(batch.seqs, out.prompt_logprobs or ()):
            have = len(seq.prompt_logprobs) if seq.prompt_logprobs is not None else -1
            if prompt is not None and 0 <= prompt.first <= have:  # entries it has already are skipped
                seq.prompt_logprobs.extend(prompt.entries[have - prompt.first:])
        requests, finished = self._requests, []
        for seq in advanced:
            if seq.is_finished:
                finished.append(seq)
            elif seq.detokenizer is None:  # no text deltas (generate()): its caller needs only its finish
                continue
            request = requests.get(seq.request_id)
            if request is not None:  # a benchmark may step bare sequences
                request.inbox[seq.request_id] = None
        tps = num_tokens / max(perf_counter() - start, 1e-9)
        if batch.is_prefill:
            self._prefill_tps = tps
        else:
            self._decode_tps = tps
        self._table.settle_faults()
        return StepOutput(advanced, finished, num_tokens, batch.is_prefill, list(self._news))

    def _no_tokens(self, is_prefill: bool) -> StepOutput:
        """A step's output when no tokens came back (nothing ran, or its pass failed): the faults
        settled, the requests with news listed."""
        self._table.settle_faults()
        return StepOutput([], [], 0, is_prefill, list(self._news))

    # --- failing a step's requests ---

    def _fail_rows(self, batch: ScheduledBatch, failed: dict[int, Exception] | None) -> None:
        """The sequences whose sampling inputs raised sampled nothing: they fail alone."""
        for i, error in (failed or {}).items():
            self.scheduler.fail(batch.seqs[i], error, "building its sampling inputs")

    def _fail_step(self, error: Exception, batches: list[ScheduledBatch]) -> None:
        """A step's device work failed: no one request is to blame, so every request of these
        batches fails, and so does every sequence swapped out by them (its copy may not have
        been made)."""
        seqs = [seq for batch in batches for seq in batch.seqs]
        host_blocks = {h for batch in batches for h in batch.swap_out.dst}
        if host_blocks:
            seqs += [seq for seq in self.scheduler.swapped if host_blocks.intersection(seq.host_block_table)]
        self._table.fail_seqs(error, seqs, MODEL_PASS)
        if isinstance(error, TensorParallelError):  # the group is stopped: no later step can run either
            raise error  # (_step fails what is left and lets it through)
