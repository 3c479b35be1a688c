"""The engine's core: one step of the loop. It owns the scheduler, the model runner and the
step in flight: `step()` schedules a batch, runs it through the runner (any runner: plain,
tensor-parallel or speculative, one `Runner` protocol) or, with async scheduling, launches it
and resolves the step before; hands the tokens to `Scheduler.postprocess`; keeps the logprobs
asked for; marks each request with news (the request table's one news set); and fails a
faulty step's requests alone (the engine serves on). `LLMEngine` (engine/llm_engine.py) wraps it with the request
API and the single-thread rule.
"""
import logging
from time import perf_counter
from typing import NamedTuple

from nanovllm.config import Config
from nanovllm.engine.request_table import RequestTable
from nanovllm.scheduling.scheduler import ScheduledBatch, Scheduler
from nanovllm.scheduling.sequence import Sequence
from nanovllm.engine.stats import InterTokenLatency
from nanovllm.runner.pending_tokens import PendingTokens
from nanovllm.runner.protocol import OverlappedRunner, Runner, RunnerOutput
from nanovllm.runner.worker_group import TensorParallelError

logger = logging.getLogger("nanovllm")

MODEL_PASS = "running the model over its step"


class StepOutput(NamedTuple):
    advanced: list[Sequence]  # sequences that got a new token in this step
    finished: list[Sequence]  # those among them that finished
    num_tokens: int  # tokens the model computed
    is_prefill: bool
    # Live requests with news not yet popped (new tokens, finished, aborted or failed), in the order
    # their news came (LLMEngine.step lists only those made by add_requests()).
    request_ids: list[str]


class InFlightStep(NamedTuple):
    """A step launched by the overlapped loop whose tokens have not been resolved yet."""
    batch: ScheduledBatch
    tokens: PendingTokens
    num_tokens: int  # tokens the model computes in it
    start: float  # perf_counter() when it was scheduled


class EngineCore:
    """Schedules, runs and reports one step at a time; never raises for a request's fault.

    Its step is chosen once, at construction: the plain step (schedule, run, wait for the tokens,
    post-process) or, with async scheduling, the overlapped one, which launches a step and
    resolves the one before while the device runs it. The overlapped loop's state, the step in
    flight, is here alone (the scheduler's placeholders and the runner's tokens in transit are
    its two halves: scheduling/sequence.py, runner/pending_tokens.py)."""

    def __init__(self, config: Config, scheduler: Scheduler, model_runner: Runner, table: RequestTable):
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.table = table
        self.async_scheduling = config.async_scheduling == "on"
        assert not self.async_scheduling or isinstance(model_runner, OverlappedRunner), \
            "Config allows async scheduling only with a runner that launches (the single-rank ModelRunner)"
        self._step = self._overlapped_step if self.async_scheduling else self._plain_step
        self.in_flight: InFlightStep | None = None  # the overlapped loop's step launched last, not yet resolved
        self.itl = InterTokenLatency()
        self.prefill_tps = self.decode_tps = 0.0  # the latest step's throughput, for the progress bar

    def step(self) -> StepOutput:
        """One step, which never raises for a request's fault. A fault the step's parts could not
        pin on a sequence or a batch (a bug in the bookkeeping itself) fails every live request,
        as nothing else is known to be sound, and leaves the engine empty and usable."""
        try:
            return self._step()
        except Exception as exc:
            seqs = [seq for request in self.table.requests.values() for seq in request.seqs]
            if self.in_flight is not None:
                seqs += self.in_flight.batch.seqs
                self.in_flight = None
            queued = [*self.scheduler.running, *self.scheduler.waiting, *self.scheduler.swapped]
            self._fail_seqs(exc, seqs + queued, "stepping the engine")
            if isinstance(exc, TensorParallelError):  # the group is stopped: the caller must know
                raise
            return self._no_tokens(True)

    def _plain_step(self) -> StepOutput:
        """Schedule a batch, run it, wait for its tokens and post-process them."""
        start = perf_counter()
        batch = self.scheduler.schedule()  # a sequence's own fault fails it alone (scheduler.fail)
        if not batch.seqs:  # idle, or everything was preempted (the next step prefills again)
            self._copy_blocks(batch)
            return self._no_tokens(True)
        num_tokens = batch.num_tokens  # before postprocess clears the scheduled counts
        try:
            out = self.model_runner.run(batch.seqs, batch.is_prefill, batch.swap_out, batch.swap_in)
        except Exception as exc:
            self._fail_step(exc, [batch])
            return self._no_tokens(batch.is_prefill)
        self._fail_rows(batch, out.failed)
        # One path for every runner: a speculative one's output adds each sequence's accepted proposals.
        advanced = self.scheduler.postprocess(batch, out.token_ids, out.accepted, out.num_proposed)
        return self._report(batch, out, advanced, num_tokens, start)

    def _overlapped_step(self) -> StepOutput:
        """Launch a batch, and while the device runs it, resolve the one before (its tokens, stop
        checks, outputs); then advance this one with placeholders so the next can be scheduled.
        While a live request reads its output tokens on the host (penalties), plain steps."""
        if self.table.num_plain_only:
            return self.drain() if self.in_flight is not None else self._plain_step()
        start = perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self._copy_blocks(batch)
            return self.drain()
        num_tokens = batch.num_tokens
        try:
            tokens = self.model_runner.launch(batch.seqs, batch.is_prefill, batch.swap_out, batch.swap_in)
        except Exception as exc:
            in_flight, self.in_flight = self.in_flight, None
            self._fail_step(exc, [batch] + ([in_flight.batch] if in_flight is not None else []))
            return self._no_tokens(batch.is_prefill)
        previous, self.in_flight = self.in_flight, InFlightStep(batch, tokens, num_tokens, start)
        # Faults found by now (this step's scheduling, the previous step's sampling and stop checks)
        # are settled before `advance`, so a failed sequence gets no placeholder.
        step = self._no_tokens(batch.is_prefill) if previous is None else self._resolve(previous, batch)
        if self.in_flight is None:  # the previous step's tokens never came: this one failed with it
            return step
        self.scheduler.advance(batch, tokens.sample_indices)
        return step

    def _copy_blocks(self, batch: ScheduledBatch) -> None:
        """A batch with no sequences may still swap: a swap-out's K/V must reach host memory
        before its blocks are reused."""
        if batch.has_copies:
            try:
                self.model_runner.run([], True, batch.swap_out, batch.swap_in)
            except Exception as exc:
                self._fail_step(exc, [batch])

    def drain(self) -> StepOutput:
        """Resolve the step in flight, if any (async scheduling), so no placeholder is left."""
        in_flight, self.in_flight = self.in_flight, None
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
            self.in_flight = None
            self._fail_step(exc, [step.batch] + ([next_batch] if next_batch is not None else []))
            return self._no_tokens(step.batch.is_prefill)
        self._fail_rows(step.batch, out.failed)
        advanced = self.scheduler.resolve(step.batch, out.token_ids, step.tokens.sample_indices)
        return self._report(step.batch, out, advanced, step.num_tokens, step.start)

    def _report(self, batch: ScheduledBatch, out: RunnerOutput, advanced: list[Sequence], num_tokens: int,
                start: float) -> StepOutput:
        """A step's news: logprobs kept, each request with news marked, the failed ones reported, the counters."""
        self.itl.observe(advanced, batch.num_prefill_seqs > 0)
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
        requests, finished = self.table.requests, []
        news = self.table.news
        for seq in advanced:
            if seq.is_finished:
                finished.append(seq)
            elif seq.detokenizer is None:  # no text deltas (generate()): its caller needs only its finish
                continue
            if seq.request_id in requests:  # a benchmark may step bare sequences
                news[seq.request_id] = None
        tps = num_tokens / max(perf_counter() - start, 1e-9)
        if batch.is_prefill:
            self.prefill_tps = tps
        else:
            self.decode_tps = tps
        self.table.report_failed(self.scheduler.take_failed())
        return StepOutput(advanced, finished, num_tokens, batch.is_prefill, list(self.table.news))

    def _no_tokens(self, is_prefill: bool) -> StepOutput:
        """A step's output when no tokens came back (nothing ran, or its pass failed): the faults
        settled, the requests with news listed."""
        self.table.report_failed(self.scheduler.take_failed())
        return StepOutput([], [], 0, is_prefill, list(self.table.news))

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
        self._fail_seqs(error, seqs, MODEL_PASS)
        if isinstance(error, TensorParallelError):  # the group is stopped: no later step can run either
            raise error  # (_step fails what is left and lets it through)

    def _fail_seqs(self, error: Exception, seqs: list[Sequence], phase: str) -> None:
        """Fail these sequences (and so their requests), logging the error once. Blocks only they
        hold leave the prefix cache first: their K/V may never have been written."""
        seqs = [seq for seq in seqs if not seq.is_finished]  # one that finished normally keeps its output
        request_ids = list(dict.fromkeys(seq.request_id for seq in seqs))
        logger.error("a fault while %s fails %d request(s): %s", phase, len(request_ids),
                     ", ".join(map(str, request_ids[:20])), exc_info=error)
        self.scheduler.block_manager.unpublish(seqs)
        for seq in seqs:
            if not seq.is_finished:  # a sequence listed twice (a request's and the queue's) fails once
                self.scheduler.fail(seq, None, phase)
