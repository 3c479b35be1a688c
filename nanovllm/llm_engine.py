"""The engine loop: validates and queues requests, steps the scheduler and the model runner,
and routes every sequence's output to the request it belongs to.

Every request is checked in full before any of a call's requests is queued, so a bad one
raises a clear error and leaves the engine as it was. Whoever drives a step, each request's
news goes to its own inbox: a generate()/stream()/chat() call reads only its own requests, and
requests made by add_request() are read with pop_output(). So calls may interleave in one
thread (a generate() inside a stream() loop, two streams read in turn) and each gets exactly
what it would get alone.

A fault fails its request alone, by construction: whatever raises while one request is built,
scheduled, sampled, stop-checked or turned into output fails that request (its samples finish
with finish_reason "abort", its blocks are freed, its final output carries "error", a message
for its caller; the traceback goes to the log under its request id), and every other request
goes on as if it had never been there. A fault that belongs to no one request (the batched
model pass) fails the requests of that step, and the engine serves the next ones as before.
Bad input is not a fault: it is refused with a ValueError before anything is queued.

The engine is single-threaded: a call from a second thread while one thread is inside it is
refused with a RuntimeError (a server drives it from one engine loop). Its only exit hook
(weakref.finalize) holds the model runner, not the engine, so a dropped engine is freed by the
garbage collector; exit() (or leaving `with LLM(...) as llm:`) frees it at once.
"""
import logging
import threading
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import count
from time import perf_counter
from typing import Iterator, NamedTuple

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.chat import ChatOptions, render_chat
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.request import Request, RequestOutput
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler, SchedulerStats
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.layers.sampler import SamplerOutput
from nanovllm.runner.pending_tokens import PendingTokens
from nanovllm.runner.tensor_parallel import create_model_runner
from nanovllm.runner.worker_group import TensorParallelError
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs import GrammarCompiler
from nanovllm.utils.math_utils import cdiv
from nanovllm.utils.validation import first_surrogate, is_int, shown

Prompt = str | list[int]

logger = logging.getLogger("nanovllm")

EXITED_MESSAGE = "this engine has exited (exit() was called); create a new LLM to generate again"
# What the caller of a failed request is told: no exception text, which may hold paths or data.
FAILED_MESSAGE = ("request {request_id} failed: an internal error while {phase}; it was aborted and the engine "
                  "goes on serving (the server log has the details under this request id)")
MODEL_PASS = "running the model over its step"


class StreamOutput(NamedTuple):
    index: int  # which prompt of the call
    sample: int  # which of its n samples
    text: str  # text new since this sample's previous output
    token_ids: list[int]  # token ids new since then
    finished: bool
    finish_reason: str | None


class StepOutput(NamedTuple):
    advanced: list[Sequence]  # sequences that got a new token in this step
    finished: list[Sequence]  # those among them that finished
    num_tokens: int  # tokens the model computed
    is_prefill: bool
    # Requests made by add_request() with news not yet popped (new tokens, finished or aborted),
    # in the order their news came; the requests of generate()/stream()/chat() go to their calls.
    request_ids: list[str]


class InFlightStep(NamedTuple):
    """A step launched by the overlapped loop whose tokens have not been resolved yet."""
    batch: ScheduledBatch
    tokens: PendingTokens
    num_tokens: int  # tokens the model computes in it
    start: float  # perf_counter() when it was scheduled


@dataclass
class EngineStats(SchedulerStats):
    """A snapshot of the engine's counters (since start) and queues, from LLMEngine.stats();
    `asdict(stats)` gives them by name (what a /metrics endpoint exports)."""
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_free_kv_blocks: int = 0
    num_kv_blocks: int = 0
    num_free_swap_blocks: int = 0
    num_swap_blocks: int = 0
    # Time between a sequence's consecutive tokens: every gap, and the gaps during which a step
    # with prefill work ran (what a prefill costs the running sequences).
    inter_token_latency_sum_s: float = 0.0
    inter_token_latency_count: int = 0
    inter_token_latency_during_prefill_sum_s: float = 0.0
    inter_token_latency_during_prefill_count: int = 0

    @property
    def mean_inter_token_latency_s(self) -> float | None:
        return self.inter_token_latency_sum_s / self.inter_token_latency_count if self.inter_token_latency_count \
            else None

    @property
    def mean_inter_token_latency_during_prefill_s(self) -> float | None:
        n = self.inter_token_latency_during_prefill_count
        return self.inter_token_latency_during_prefill_sum_s / n if n else None


class LLMEngine:

    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, kwargs)  # settings checked and resolved, tokenizer loaded
        self.config = config
        # None with skip_tokenizer_init: token-id prompts only, and outputs have empty text.
        self.tokenizer = config.tokenizer
        self.model_runner = create_model_runner(config)  # tensor_parallel_size > 1 spawns the other ranks
        # Compiles structured_outputs constraints (thread-safe and cached: the server compiles in its
        # prompt thread first, so building the request here finds them compiled).
        self.grammars = GrammarCompiler(self.tokenizer, config.hf_config.vocab_size, config.eos)
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
        self._in_flight: InFlightStep | None = None
        # Live requests whose sampling reads their output tokens' values on the host (penalties):
        # while any is live, every step waits for its tokens (the plain loop).
        self._num_plain_only = 0
        self._init_routing()

    def _init_routing(self) -> None:
        """The request bookkeeping, the single-thread lock and the exit flag."""
        self._seq_ids = count()
        self._request_ids = count()
        self._requests: dict[str, Request] = {}  # every live request, whoever made it
        self._news: dict[str, None] = {}  # add_request()'s requests with news not yet popped (an ordered set)
        self._lock = threading.Lock()  # held by the thread inside the engine
        self._inside: str | None = None  # that thread's name, for the refusal message
        # Calls whose requests were released by a thread that could not enter; they are freed at
        # the next step or the next entry, whichever comes first.
        self._deferred: list[list[Request]] = []
        self._exited = False
        self._prefill_tps = self._decode_tps = 0.0  # the latest step's throughput, for the progress bar
        self._num_prefill_steps = 0  # steps with prefill work so far (for the inter-token latency counters)
        self._itl = [0.0, 0, 0.0, 0]  # inter-token latency: sum, count, and the same during prefills

    # --- lifetime and the single-thread rule ---

    def exit(self) -> None:
        """Free the model and the KV cache (and stop tensor-parallel workers) now. Idempotent;
        every later call raises RuntimeError."""
        if self._exited:
            return
        with self._entered():
            self._exited = True
            if self.speculative:
                self._log_speculation()
            self._finalizer()

    def _log_speculation(self) -> None:
        stats = self.scheduler.stats
        rate, per_forward = stats.spec_acceptance_rate, stats.spec_tokens_per_forward
        logger.info("speculative decoding (%s): %d tokens proposed, %d accepted (acceptance rate %s), "
                    "%s tokens per target forward pass per decoding sequence", self.config.speculative.method,
                    stats.spec_proposed_tokens, stats.spec_accepted_tokens,
                    "n/a" if rate is None else f"{rate:.3f}", "n/a" if per_forward is None else f"{per_forward:.3f}")

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

    # --- making and releasing requests ---

    def _make_request(self, index: int, prompt: Prompt, params: SamplingParams, inbox: dict[str, None],
                      deltas: bool = False, request_id: str | None = None, priority: int = 0) -> Request:
        """Validate one prompt and build its sequences; nothing is queued here. With `deltas`,
        every sample detokenizes incrementally (for stream() and pop_output())."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} is not allowed; a priority must be an int (lower runs first)")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r} is not allowed; it must be a SamplingParams")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt={prompt!r:.80} is a string, but this engine has no tokenizer "
                                 "(skip_tokenizer_init=True); give each prompt as a list of token ids")
            token_ids = self._encode(prompt, "prompt")
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt={prompt!r:.80} is not allowed; a prompt must be a str or a list of int token ids")
        if not token_ids:
            raise ValueError(f"prompt={prompt!r} is empty; a prompt needs at least one token")
        vocab_size = self.config.hf_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary; token ids must be in [0, {vocab_size})")
        if params.structured_outputs and self.tokenizer is None:
            raise ValueError("structured_outputs needs the tokenizer's vocabulary to compile its constraint, but this "
                             "engine has none (skip_tokenizer_init=True)")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"stop={list(params.stop_strings)!r} needs a tokenizer to find the strings in the text, "
                             "but this engine has none (skip_tokenizer_init=True); use stop_token_ids instead")
        params.check_vocabulary(vocab_size)
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"prompt length {len(token_ids)} is longer than max_model_len={max_len}")
        # The longest this sequence can grow must fit in the whole cache, or it could never run.
        bs = self.config.kvcache_block_size
        longest = min(len(token_ids) + params.max_tokens, max_len)
        needed = cdiv(longest, bs)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"a request of {len(token_ids)} prompt tokens and max_tokens={params.max_tokens} "
                             f"needs {needed} KV blocks of {bs} tokens, more than the whole cache "
                             f"({self.block_manager.num_blocks} blocks); shorten it or enlarge the cache")
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        seqs = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), token_ids, params, bs, priority=priority)
            seq.grammar = None if grammar is None else self.grammars.new_state(grammar)  # one matcher per sample
            seq.seed = None if params.seed is None else params.seed + i
            # generate() decodes a sample's text once, at the end, unless stop strings need it on the
            # way. A sample with a detokenizer reports each new token to its caller (see _step): so
            # every sample of stream() and add_request() does.
            if deltas or params.stop_strings:
                seq.detokenizer = Detokenizer(self.tokenizer, params)
            seqs.append(seq)
        return Request(index, token_ids, params, seqs, request_id, inbox)

    def _encode(self, text: str, name: str, **kwargs) -> list[int]:
        """Tokenize a caller's text: lone surrogates (JSON's "\\ud800", which no UTF-8 text holds)
        are refused, not replaced, and any tokenizer error is a ValueError naming the field."""
        bad = first_surrogate(text)
        if bad is not None:
            raise ValueError(f"{name} has a lone surrogate (U+{ord(text[bad]):04X}) at index {bad}; {name} must be "
                             "valid Unicode text")
        try:
            return self.tokenizer.encode(text, **kwargs)
        except Exception as exc:
            raise ValueError(f"{name}={shown(text)} could not be tokenized; {name} must be text the tokenizer "
                             "accepts") from exc

    def _build_request(self, index: int, prompt: Prompt, params: SamplingParams, inbox: dict[str, None],
                       deltas: bool = False, request_id: str | None = None, priority: int = 0) -> Request:
        """_make_request, where a fault other than bad input (a ValueError, which refuses the
        call) fails this request alone: it is submitted already failed, and its caller gets its
        error output."""
        try:
            return self._make_request(index, prompt, params, inbox, deltas, request_id, priority)
        except ValueError:
            raise
        except Exception as exc:
            token_ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
            seqs = [Sequence(next(self._seq_ids), token_ids, params, self.config.kvcache_block_size, priority=priority)
                    for _ in range(params.n)]
            for seq in seqs:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            request = Request(index, token_ids, params, seqs, request_id, inbox)
            request.fault = exc
            return request

    def _make_requests(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                       inbox: dict[str, None], deltas: bool = False, priority: list[int] | None = None
                       ) -> list[Request]:
        """Validate a whole call before any of it is queued."""
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts={prompts!r:.80} is not allowed; prompts must be a list of str or of token-id lists")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts; "
                                 "give one per prompt or a single SamplingParams")
        else:
            sampling_params = [sampling_params] * len(prompts)
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise ValueError(f"priority={priority!r:.80} is not allowed; give a list of one int per prompt "
                             f"({len(prompts)}), or None for all 0")
        return [self._build_request(i, p, sp, inbox, deltas, priority=pr)
                for i, (p, sp, pr) in enumerate(zip(prompts, sampling_params, priority))]

    def _new_request_id(self) -> str:
        while True:
            request_id = str(next(self._request_ids))
            if request_id not in self._requests:  # a caller may have chosen this one
                return request_id

    def _submit(self, requests: list[Request]) -> None:
        """Register validated requests and queue their samples."""
        for request in requests:
            if request.request_id is None:
                request.request_id = self._new_request_id()
            self._requests[request.request_id] = request
            self._num_plain_only += request.params.reads_output_tokens
            first, *others = request.seqs
            for seq in request.seqs:
                seq.request_id = request.request_id
            if request.fault is not None:  # building it raised: it is failed, never queued
                self._fail_request(request, "building it (tokenization, detokenizer)", request.fault)
                continue
            self.scheduler.add(first)
            if self.config.enable_prefix_caching:  # the other samples follow once the prompt is cached
                first.pending_siblings = others
            else:
                for seq in others:
                    self.scheduler.add(seq)

    def _forget(self, requests: list[Request]) -> None:
        """Abort what is unfinished of these requests (freeing their blocks at once) and forget
        them. The caller is inside the engine."""
        submitted = [r for r in requests if self._requests.get(r.request_id) is r]
        unfinished = [seq for r in submitted for seq in r.seqs if not seq.is_finished]
        if unfinished:
            self._drain()
            self.scheduler.abort([seq for seq in unfinished if not seq.is_finished])
        for request in submitted:
            self._unregister(request)
            request.inbox.pop(request.request_id, None)

    def _unregister(self, request: Request) -> None:
        del self._requests[request.request_id]
        self._num_plain_only -= request.params.reads_output_tokens

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

    # --- the online API: add_request / step / pop_output / abort ---

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Validate and queue one prompt; returns its request id (a unique string unless given).
        Its output is read with pop_output() as step() reports news of it. Lower `priority`
        values are admitted first and preempted last (ties: earlier requests first), as vLLM."""
        with self._entered():
            if request_id is not None and (not isinstance(request_id, str) or not request_id):
                raise ValueError(f"request_id={request_id!r} is not allowed; it must be None or a non-empty str")
            if request_id in self._requests:
                raise ValueError(f"request_id={request_id!r} is already a live request; request ids must be unique")
            request = self._build_request(0, prompt, sampling_params, self._news, deltas=True, request_id=request_id,
                                          priority=priority)
            self._submit([request])
            return request.request_id

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

    def pop_output(self, request_id: str) -> RequestOutput:
        """What is new in an add_request() request since its last pop (new token ids, text and
        logprobs of the samples with news). Once `finished`, `final` holds generate()'s dict for
        it and the engine forgets the id."""
        with self._entered():
            request = self._requests.get(request_id) if isinstance(request_id, str) else None
            if request is None or request.inbox is not self._news:
                raise ValueError(f"request_id={request_id!r} is not a live request made by add_request() "
                                 "(unknown, or finished and already popped)")
            self._news.pop(request_id, None)
            output = self._pop(request)
            if output.finished:
                self._unregister(request)
            return output

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

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
            self._fail_seqs(exc, seqs + queued, "stepping the engine")
            if isinstance(exc, TensorParallelError):  # the group is stopped: the caller must know
                raise
            return self._no_tokens(True)

    def _run_step(self) -> StepOutput:
        self._free_deferred()
        start = perf_counter()
        overlap = self.async_scheduling and not self._num_plain_only
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
            if self.speculative:  # each sequence's accepted proposals and one more token
                advanced = self.scheduler.postprocess_speculative(batch, out.token_ids, out.num_proposed)
            else:
                advanced = self.scheduler.postprocess(batch, out.token_ids)
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

    def _report(self, batch: ScheduledBatch, out: SamplerOutput, advanced: list[Sequence], num_tokens: int,
                start: float) -> StepOutput:
        """A step's news: logprobs kept, each request with news told through its inbox, the counters."""
        self._count_inter_token_latency(advanced, batch.num_prefill_seqs > 0)
        # The runner returns logprobs exactly for the rows that sampled; those of sequences that
        # finished before them (async scheduling) are not kept, as their tokens are not.
        for seq, lp in zip(batch.seqs, out.logprobs):
            n = seq.sampling_params.logprobs
            if lp is not None and n is not None and len(seq.logprobs) < seq.num_completion_tokens:
                seq.logprobs.append(lp._replace(top_logprobs=dict(list(lp.top_logprobs.items())[:n])))
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
        self._settle_faults()
        return StepOutput(advanced, finished, num_tokens, batch.is_prefill, list(self._news))

    def _no_tokens(self, is_prefill: bool) -> StepOutput:
        """A step's output when no tokens came back (nothing ran, or its pass failed): the faults
        settled, the requests with news listed."""
        self._settle_faults()
        return StepOutput([], [], 0, is_prefill, list(self._news))

    # --- failing requests alone ---

    def _fail_request(self, request: Request, phase: str, error: Exception | None) -> None:
        """Fail one request: its unfinished samples finish with "abort" (blocks freed at once), its
        final output carries `error`, its caller is told. `error` is logged with its traceback
        under the request id (None: the caller logged it already)."""
        if request.error is None:
            request.error = FAILED_MESSAGE.format(request_id=request.request_id, phase=phase)
            if error is not None:
                logger.error("request %s failed while %s; aborting it alone", request.request_id, phase,
                             exc_info=error)
        unfinished = [seq for seq in request.seqs if not seq.is_finished]
        if unfinished:
            self.scheduler.abort(unfinished)
        request.inbox[request.request_id] = None

    def _settle_faults(self) -> None:
        """Fail the requests of the sequences the scheduler failed alone (their other samples too)."""
        if not self.scheduler.faults:
            return
        for fault in self.scheduler.take_faults():
            request = self._requests.get(fault.seq.request_id)
            if request is not None:  # a bare sequence (a benchmark's) is finished already
                self._fail_request(request, fault.phase, fault.error)
        self.scheduler.drop_finished()

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
        self._fail_seqs(error, seqs, MODEL_PASS)
        if isinstance(error, TensorParallelError):  # the group is stopped: no later step can run either
            raise error  # (_step fails what is left and lets it through)

    def _fail_seqs(self, error: Exception, seqs: list[Sequence], phase: str) -> None:
        """Fail the requests these sequences belong to (bare sequences are aborted), logging the
        error once. Blocks only they hold leave the prefix cache first: their K/V may never have
        been written."""
        seqs = [seq for seq in seqs if not seq.is_finished]  # one that finished normally keeps its output
        requests = {seq.request_id: self._requests.get(seq.request_id) for seq in seqs}
        logger.error("a fault while %s fails %d request(s): %s", phase, len(requests),
                     ", ".join(map(str, list(requests)[:20])), exc_info=error)
        self.block_manager.unpublish(seqs)
        for request in requests.values():
            if request is not None:
                self._fail_request(request, phase, None)
        self.scheduler.abort([seq for seq in seqs if not seq.is_finished])
        self._settle_faults()  # sequences failed alone before this: their requests fail too

    def _pop(self, request: Request) -> RequestOutput:
        """request.pop(); if building the output raises, the request fails alone and its error
        output is built instead (without the detokenizer)."""
        try:
            return request.pop(self.tokenizer)
        except Exception as exc:
            self._fail_request(request, "building its output (detokenization)", exc)
            request.inbox.pop(request.request_id, None)  # this very pop reports it
            return request.pop(self.tokenizer)

    def _final(self, request: Request) -> dict:
        """request.final_output(), failing the request alone if building it raises."""
        try:
            return request.final_output(self.tokenizer)
        except Exception as exc:
            self._fail_request(request, "building its output (detokenization)", exc)
            return request.final_output(self.tokenizer)

    def _count_inter_token_latency(self, advanced: list[Sequence], computed_prompts: bool) -> None:
        """The time since each advanced sequence's previous token, counted apart as well when a
        step with prefill work ran in between (this one included)."""
        now = perf_counter()
        self._num_prefill_steps += computed_prompts
        epoch = self._num_prefill_steps
        total = count = prefill_total = prefill_count = 0
        for seq in advanced:
            last = seq.last_token_time
            if last is not None:
                gap = now - last
                total += gap
                count += 1
                if seq.last_token_prefill_steps != epoch:
                    prefill_total += gap
                    prefill_count += 1
            seq.last_token_time = now
            seq.last_token_prefill_steps = epoch
        itl = self._itl
        itl[0] += total
        itl[1] += count
        itl[2] += prefill_total
        itl[3] += prefill_count

    def stats(self) -> EngineStats:
        """The scheduler's counters (preemptions by mode, swaps, mixed steps...), the queues'
        sizes, block use and inter-token latency, as a snapshot."""
        scheduler, bm = self.scheduler, self.block_manager
        return EngineStats(
            **asdict(scheduler.stats),
            num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
            num_swapped=len(scheduler.swapped), num_free_kv_blocks=bm.num_free_blocks, num_kv_blocks=bm.num_blocks,
            num_free_swap_blocks=bm.num_free_host_blocks, num_swap_blocks=bm.num_host_blocks,
            inter_token_latency_sum_s=self._itl[0], inter_token_latency_count=self._itl[1],
            inter_token_latency_during_prefill_sum_s=self._itl[2],
            inter_token_latency_during_prefill_count=self._itl[3])

    def _next_news(self, inbox: dict[str, None]) -> list[str]:
        """Step until one of a caller's requests has news; returns (and clears) their ids."""
        while not inbox:
            if self.scheduler.is_finished():  # the caller's requests are unfinished, so they must be queued
                raise RuntimeError("internal error: a call's requests are unfinished but nothing is scheduled; "
                                   "please report it")
            self._step()
        request_ids = list(inbox)
        inbox.clear()
        return request_ids

    # --- the offline API: generate / stream / chat, on the same per-request machinery ---

    def _run_to_end(self, requests: list[Request], inbox: dict[str, None], use_tqdm: bool) -> list[dict]:
        """Submit a call's requests and step until all have finished; their outputs in order. If
        a step raises (Ctrl-C included), the call's unfinished requests are aborted."""
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            self._submit(requests)
            unfinished = {r.request_id: r for r in requests}
            while unfinished:
                for request_id in self._next_news(inbox):
                    request = unfinished.get(request_id)
                    if request is not None and request.finished:
                        del unfinished[request_id]
                        pbar.update(1)
                if use_tqdm:
                    pbar.set_postfix({"Prefill": f"{int(self._prefill_tps)}tok/s",
                                      "Decode": f"{int(self._decode_tps)}tok/s"})
            return [self._final(r) for r in requests]
        finally:
            pbar.close()
            self._forget(requests)

    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams],
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[dict]:
        """One output dict per prompt, in input order: "text", "token_ids", "finish_reason",
        "stop_reason", "prompt_token_ids", "num_cached_tokens", "logprobs" when asked, and for
        n > 1 every sample under "outputs" (the top-level fields are sample 0's). `priority`:
        one int per prompt, lower first (see add_request); None gives all 0. A request the
        engine failed (a fault in its own work, see the module docstring) is among them with
        finish_reason "abort" and "error", a message naming its request id; the others are
        exactly what they would be without it. Bad input raises ValueError before any work."""
        with self._entered():
            inbox: dict[str, None] = {}
            requests = self._make_requests(prompts, sampling_params, inbox, priority=priority)
            return self._run_to_end(requests, inbox, use_tqdm)

    def stream(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
               priority: list[int] | None = None) -> Iterator[StreamOutput]:
        """Yield each sample's new text and token ids as they are produced; the concatenated
        text of a sample equals what generate() returns for it. The prompts are checked now and
        queued at the first next(); closing the generator aborts what is unfinished at once."""
        with self._entered():
            inbox: dict[str, None] = {}
            requests = self._make_requests(prompts, sampling_params, inbox, deltas=True, priority=priority)
        return self._stream(requests, inbox)

    def _stream(self, requests: list[Request], inbox: dict[str, None]) -> Iterator[StreamOutput]:
        # The generator stream() returns. Its own finally releases its requests, so close() (or an
        # error) frees them at once; nothing here waits on another generator being finalised.
        try:
            with self._entered():
                self._submit(requests)
            mine = {r.request_id: r for r in requests}
            unfinished = set(mine)
            while unfinished:
                with self._entered():
                    outputs = [self._pop(mine[request_id]) for request_id in self._next_news(inbox)
                               if request_id in unfinished]
                for out in outputs:
                    if out.finished:
                        unfinished.discard(out.request_id)
                    index = mine[out.request_id].index
                    for s in out.samples:
                        yield StreamOutput(index, s.index, s.text, s.token_ids, s.finished, s.finish_reason)
        finally:
            self._release(requests)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **chat_options) -> list[dict]:
        """generate() over conversations rendered by the tokenizer's chat template; takes one
        conversation (a list of {"role", "content"} dicts) or a list of them. `chat_options` are
        the other ChatOptions fields (continue_final_message, chat_template, chat_template_kwargs,
        tools), as vLLM's LLM.chat takes them."""
        with self._entered():
            if self.tokenizer is None:
                raise ValueError("chat() needs the tokenizer's chat template, but this engine has no tokenizer "
                                 "(skip_tokenizer_init=True); render the conversation yourself and call generate() "
                                 "with token ids")
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
            conversations = [messages] if isinstance(messages[0], dict) else messages
            for conversation in conversations:
                # content may be None only in an assistant message that made tool calls (OpenAI's shape)
                if not isinstance(conversation, list) or not all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and (isinstance(m.get("content"), str) or (
                            m.get("content") is None and m["role"] == "assistant" and m.get("tool_calls")))
                        for m in conversation):
                    raise ValueError(f"conversation {conversation!r:.80} is not allowed; it must be a list of "
                                     "{'role': str, 'content': str} dicts (content None only in an assistant "
                                     "message with tool_calls)")
                for m in conversation:
                    bad = first_surrogate(m["role"] + (m["content"] or ""))
                    if bad is not None:
                        raise ValueError(f"messages has a lone surrogate in {m!r:.80}; messages must be valid "
                                         "Unicode text")
            options = ChatOptions(add_generation_prompt=add_generation_prompt, **chat_options)
            prompts = [render_chat(self.tokenizer, c, options) for c in conversations]
            inbox: dict[str, None] = {}
            requests = self._make_requests(prompts, sampling_params or SamplingParams(), inbox)
            return self._run_to_end(requests, inbox, use_tqdm)
