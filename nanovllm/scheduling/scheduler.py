"""Continuous batching: decides which sequences run in the next step, and how many tokens each.

Three queues. `waiting` holds sequences without KV blocks (new, or preempted to be recomputed),
`swapped` those whose computed K/V wait in host memory, both ordered by (priority, arrival):
lower priority values first, as vLLM. `running` holds every sequence with device blocks, in the
same order; some may still be in their prompt (a chunked prefill in progress).

A step under either policy is built from three parts:
1. decodes: every running sequence whose prompt is computed gets its one next token. When a
   sequence needs a block and none is free, the last running sequence (lowest priority, latest
   arrival) is preempted, which may be the sequence itself: never a higher-priority one to make
   room for a lower-priority one.
2. prefill chunks of running sequences still in their prompt, in order, within the token budget.
3. admissions, unless part 1 preempted something: the best of `swapped` and `waiting` in
   order, while the budget, max_num_seqs and the free blocks allow; the first that does not fit
   ends the step's admissions (no lower-priority sequence overtakes it). A swapped sequence is
   swapped in; a waiting one gets blocks for all its tokens and its first chunk.
"mixed" (chunked prefill beside decode, as vLLM and SGLang): 1, 2 and 3 in one batch, so a
prefill never stalls the running decodes. "prefill_first" (nano-vllm): 2 and 3 (waiting only)
when they schedule anything; otherwise 1 and 3 (swapped only), a pure decode step.

Preemption frees a sequence's device blocks: "recompute" sends it to `waiting` to be computed
again from its tokens; "swap" copies its K/V to host blocks first (BlockManager.swap_out), and
falls back to recompute when host blocks run out (or when the sequence is still in its prompt,
which has no decode to resume). Running sequences are at most min(max_num_seqs,
max_num_batched_tokens), so every one of them gets at least one token in each mixed step.

After the step, `postprocess` advances each sequence and finishes the ones the StopChecker says
are done, freeing their blocks. It is two halves, which async scheduling (the engine's
overlapped loop) calls apart: `advance` once the step is launched (computed counts, published
blocks, a placeholder for each token still on the device), `resolve` once its tokens are on the
host, after the next step has been scheduled and launched. Plain Python: no tensors; the block copies of swaps travel in
the ScheduledBatch for the runner to make.

Speculative decoding (num_lookahead_tokens > 0): after part 1, each decode that may speculate
gets lookahead slots for the tokens the runner may propose after its newest one (token budget
and free blocks only: a lookahead never preempts). The runner's output gives each sequence its
accepted proposals before its token, and the same `postprocess` takes them: `resolve` appends
them one at a time through the stop checker (so no stop and no max_tokens is overshot), counts
only the accepted proposals as computed, and gives back the lookahead blocks past the
sequence's tokens: the rejected proposals leave nothing behind in the block table or the
prefix cache.

A fault in the work done for one sequence (its blocks at admission, a swap, its stop check,
or the step it ran in) fails its request alone: `fail` finishes it with "abort", frees its
blocks, takes it out of every queue and records a `SequenceFault`; `take_failed` aborts the
other samples of its request too and hands the faults over, the step's failed outcomes, which
the engine's request table reports to their callers. The step goes on for every other sequence.
"""
import heapq
from bisect import insort
from dataclasses import dataclass
from itertools import count
from typing import Iterator, NamedTuple

from nanovllm.scheduling.block_manager import NO_COPIES, BlockCopies, BlockManager
from nanovllm.scheduling.sequence import Sequence, SequenceStatus
from nanovllm.scheduling.stop_checker import StopChecker

FINISHED = SequenceStatus.FINISHED
WAITING, SWAPPED = SequenceStatus.WAITING, SequenceStatus.SWAPPED
MIXED, PREFILL_FIRST = "mixed", "prefill_first"
SCHEDULING_POLICIES = (MIXED, PREFILL_FIRST)
# Measured on bench.py: docs/BENCHMARKS.md, "Scheduling policies".
DEFAULT_SCHEDULING_POLICY = MIXED
RECOMPUTE, SWAP = "recompute", "swap"
PREEMPTION_MODES = (RECOMPUTE, SWAP)


class ScheduledBatch(NamedTuple):
    seqs: list[Sequence]
    # Some sequence computes more than its newest token (a prefill chunk), so the step takes the
    # varlen path, decode rows included; False for a pure decode step (CUDA graphs).
    is_prefill: bool
    swap_out: BlockCopies = NO_COPIES  # device -> host, made first
    swap_in: BlockCopies = NO_COPIES  # host -> device, made after the swap-outs, before the forward pass
    # Sequences computing their prompt (admitted from `waiting`, or a chunk of one in progress);
    # the others decode. A step with both is a mixed step.
    num_prefill_seqs: int = 0

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_prefill_seqs < len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_scheduled_tokens for seq in self.seqs)

    @property
    def has_copies(self) -> bool:
        return bool(self.swap_out.src or self.swap_in.src)


class SequenceFault(NamedTuple):
    """An exception raised while working for one sequence: its request failed (finish_reason "abort")."""
    seq: Sequence
    error: Exception | None  # None: logged already (a step's fault, logged once for all its requests)
    phase: str  # what was being done for it ("checking its stop conditions"), for the log and its caller


@dataclass
class SchedulerStats:
    """Counters since start, for users and for /metrics; each only ever grows."""
    prefill_steps: int = 0  # steps that compute prompts (mixed ones included)
    decode_steps: int = 0  # steps that only decode
    mixed_steps: int = 0  # steps that compute prompts beside running sequences' decodes
    preemptions_recompute: int = 0  # preemptions that freed the blocks, to recompute later
    preemptions_swap: int = 0  # preemptions that swapped the K/V out to host memory
    swap_space_full: int = 0  # swap-mode preemptions recomputed instead, for want of host blocks
    swap_ins: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    # Swapped sequences whose shared prefix blocks left the prefix cache while they were away,
    # so they were recomputed instead of swapped in.
    swapped_prefix_lost: int = 0
    # Speculative decoding: tokens proposed and accepted, and the decode rows (a sequence's newest
    # token through one target forward pass) with the tokens they produced.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_decode_rows: int = 0
    spec_decode_tokens: int = 0

    @property
    def num_preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted share of the proposed tokens; None before any was proposed."""
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else None

    @property
    def spec_tokens_per_forward(self) -> float | None:
        """Tokens a decoding sequence got per target forward pass (1 without speculation)."""
        return self.spec_decode_tokens / self.spec_decode_rows if self.spec_decode_rows else None


def may_speculate(seq: Sequence) -> bool:
    """Whether proposals for this sequence can be verified exactly: the rejection sampler applies
    temperature, min_p, top_k and top_p, not what depends on the tokens before each proposed one
    (penalties, min_tokens bans), nor logprobs."""
    params = seq.sampling_params
    return params.logprobs is None and not params.has_penalties and \
        len(seq.token_ids) - seq.num_prompt_tokens >= params.min_tokens


class SequenceQueue:
    """Sequences in scheduling order (priority, then arrival): a heap, so adding and taking the
    first are O(log n) whatever the priorities."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], int, Sequence]] = []
        self._tie = count()  # keeps the heap from ever comparing two sequences

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.sort_key, next(self._tie), seq))

    def peek(self) -> Sequence | None:
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[2]

    def remove(self, seq_ids: set[int]) -> list[Sequence]:
        """Take out the sequences whose id() is in seq_ids; returns them. O(n)."""
        taken = [entry[2] for entry in self._heap if id(entry[2]) in seq_ids]
        if taken:
            self._heap = [entry for entry in self._heap if id(entry[2]) not in seq_ids]
            heapq.heapify(self._heap)
        return taken

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """In scheduling order (sorts a copy: for tests and inspection, not the hot path)."""
        return (entry[2] for entry in sorted(self._heap, key=lambda entry: entry[:2]))


class _StepPlan:
    """What schedule() has decided so far in this step."""

    def __init__(self, budget: int):
        self.budget = budget  # tokens left of max_num_batched_tokens
        self.seqs: list[Sequence] = []
        self.num_prefill_seqs = 0
        self.varlen = False  # some sequence computes more than its newest token
        self.in_prompt: list[Sequence] = []  # running sequences still in their prompt, in order
        self.preempted = False
        self.requeued = False  # a swapped sequence went back to waiting, to be recomputed
        self.swap_out = BlockCopies([], [])
        self.swap_in = BlockCopies([], [])

    def add(self, seq: Sequence, num_tokens: int, prefill: bool) -> None:
        assert 0 < num_tokens <= self.budget
        seq.num_scheduled_tokens = num_tokens
        self.budget -= num_tokens
        self.seqs.append(seq)
        self.num_prefill_seqs += prefill
        self.varlen = self.varlen or not seq.is_decoding


class Scheduler:

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager,
                 stop_checker: StopChecker, policy: str = DEFAULT_SCHEDULING_POLICY,
                 preemption_mode: str = RECOMPUTE, num_lookahead_tokens: int = 0):
        assert policy in SCHEDULING_POLICIES and preemption_mode in PREEMPTION_MODES and num_lookahead_tokens >= 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # So that every running sequence can have a token in one step.
        self.max_running = min(max_num_seqs, max_num_batched_tokens)
        self.block_manager = block_manager
        self.stop_checker = stop_checker
        self.policy = policy
        self.preemption_mode = preemption_mode
        self.num_lookahead_tokens = num_lookahead_tokens  # speculative decoding's k; 0: off
        self.waiting = SequenceQueue()
        self.swapped = SequenceQueue()
        self.running: list[Sequence] = []  # sorted by sort_key
        self.stats = SchedulerStats()
        self.num_unswept_finished = 0  # finished since the last drop_finished()
        self.failed: list[SequenceFault] = []  # sequences failed since the last take_failed()

    @property
    def num_preemptions(self) -> int:
        """Since start, either mode; a sign the KV cache is too small for the load."""
        return self.stats.num_preemptions

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.swapped

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)

    # --- building a step ---

    def schedule(self) -> ScheduledBatch:
        plan = _StepPlan(self.max_num_batched_tokens)
        if self.policy == MIXED:
            self._schedule_decodes(plan)
            self._schedule_prefill_chunks(plan, plan.in_prompt)
            if not plan.preempted:
                self._admit(plan, take_waiting=True, take_swapped=True)
        else:
            self._schedule_prefill_chunks(plan, self.running)
            self._admit(plan, take_waiting=True, take_swapped=False)
            if not plan.seqs:
                self._schedule_decodes(plan)
                if not plan.preempted:
                    self._admit(plan, take_waiting=False, take_swapped=True)
        # Host blocks read by this step's swap-ins are free from the next step on, so no swap-out
        # of this step (the runner makes those first) can overwrite them before they are read.
        self.block_manager.free_host(plan.swap_in.src)
        batch = ScheduledBatch(plan.seqs, plan.varlen, plan.swap_out, plan.swap_in, plan.num_prefill_seqs)
        if batch.seqs:
            self._count_step(batch)
        elif not self.running and not (plan.preempted or plan.requeued) and (self.waiting or self.swapped):
            # Requests that could never fit are refused up front, and nothing but running sequences
            # holds device blocks, so an engine with nothing running always admits the head of the queue.
            raise RuntimeError(f"internal error: no waiting request can be admitted ({len(self.waiting)} waiting, "
                               f"{len(self.swapped)} swapped, {self.block_manager.num_free_blocks} of "
                               f"{self.block_manager.num_blocks} KV blocks free) and none is running; please report it")
        return batch

    def _count_step(self, batch: ScheduledBatch) -> None:
        stats = self.stats
        if batch.num_prefill_seqs:
            stats.prefill_steps += 1
            stats.mixed_steps += batch.is_mixed
        else:
            stats.decode_steps += 1

    def _schedule_decodes(self, plan: _StepPlan) -> None:
        """One token for every running sequence whose prompt is computed, best first, preempting
        from the end of `running` when a new block is needed and none is free. The sequences
        still in their prompt are noted in plan.in_prompt (a victim is always later in the order
        than the sequence that needs its blocks, so none of them is preempted after being noted).
        The hot loop of a decode step: plain attribute reads, no per-row call but the block checks."""
        running, in_prompt, decoded = self.running, plan.in_prompt, plan.seqs
        can_append, may_append = self.block_manager.can_append, self.block_manager.may_append
        num_before = len(decoded)
        i = 0
        while i < len(running):
            seq = running[i]
            i += 1
            if seq.num_computed_tokens != len(seq.token_ids) - 1:
                in_prompt.append(seq)
                continue
            try:
                while not can_append(seq):
                    victim = running[-1]  # the lowest priority, latest arrival: may be seq itself
                    self._preempt(plan)
                    if victim is seq:
                        break
                else:
                    may_append(seq)
                    seq.num_scheduled_tokens = 1
                    decoded.append(seq)
            except Exception as exc:  # a preemption failing fails its victim alone (in _preempt)
                if running[i - 1] is seq:
                    del running[i - 1]
                    i -= 1
                self.fail(seq, exc, "scheduling its next token (its KV blocks)")
        plan.budget -= len(decoded) - num_before
        assert plan.budget >= 0, "more running sequences than the token budget"
        if self.num_lookahead_tokens:
            self._reserve_lookahead(plan, decoded[num_before:])

    def _reserve_lookahead(self, plan: _StepPlan, decoded: list[Sequence]) -> None:
        """Lookahead slots for the decodes that may speculate, best first, within the budget and
        the free blocks, and short of max_tokens and max_model_len: every proposal kept still
        leaves room for the one more token the step adds."""
        bm, max_model_len = self.block_manager, self.stop_checker.max_model_len
        for seq in decoded:
            if plan.budget == 0:
                return
            if not may_speculate(seq):
                continue
            room = min(seq.max_tokens - seq.num_completion_tokens, max_model_len - len(seq)) - 1
            n = bm.reserve_lookahead(seq, min(self.num_lookahead_tokens, plan.budget, room))
            seq.num_lookahead_slots = n
            plan.budget -= n

    @staticmethod
    def _schedule_prefill_chunks(plan: _StepPlan, candidates: list[Sequence]) -> None:
        """The next prompt chunk of each candidate still in its prompt, in order, within the budget."""
        for seq in candidates:
            if plan.budget == 0:
                return
            if seq.num_computed_tokens < len(seq) - 1:
                plan.add(seq, min(len(seq) - seq.num_computed_tokens, plan.budget), prefill=True)

    def _admit(self, plan: _StepPlan, take_waiting: bool, take_swapped: bool) -> None:
        """Bring swapped and waiting sequences in, best first, until one does not fit."""
        bm = self.block_manager
        while plan.budget > 0 and len(self.running) < self.max_running:
            head_w, head_s = self.waiting.peek(), self.swapped.peek()
            if head_s is not None and (head_w is None or head_s.sort_key < head_w.sort_key):
                seq = head_s
                try:
                    lost = bm.swapped_prefix_lost(seq)
                    copies = bm.swap_in(seq) if take_swapped and not lost else None
                except Exception as exc:
                    self.fail(seq, exc, "swapping it back in")
                    continue
                if lost:  # it cannot be swapped in: recompute it instead
                    self.swapped.pop()
                    bm.deallocate(seq)
                    self.stats.swapped_prefix_lost += 1
                    self.add(seq)
                    plan.requeued = True
                    continue
                if copies is None:  # not this step's turn (take_swapped), or too few free blocks
                    return
                self.swapped.pop()
                plan.swap_in.src.extend(copies.src)
                plan.swap_in.dst.extend(copies.dst)
                self.stats.swap_ins += 1
                self.stats.blocks_swapped_in += len(copies.src)
            elif head_w is not None:
                if not take_waiting:
                    return
                seq = head_w
                try:
                    allocated = bm.allocate(seq)
                except Exception as exc:
                    self.fail(seq, exc, "admitting it (its KV blocks and prefix-cache lookup)")
                    continue
                if not allocated:
                    return
                self.waiting.pop()
            else:
                return
            seq.status = SequenceStatus.RUNNING
            insort(self.running, seq, key=_sort_key)
            # A swapped sequence resumes its decode; a waiting one computes its tokens.
            plan.add(seq, min(len(seq) - seq.num_computed_tokens, plan.budget), prefill=seq is head_w)

    def _preempt(self, plan: _StepPlan) -> None:
        """Preempt the last running sequence: swap it out when the mode and host space allow,
        else free its blocks to recompute it later."""
        seq = self.running.pop()
        plan.preempted = True
        try:
            self._preempt_one(seq, plan)
        except Exception as exc:
            self.fail(seq, exc, "preempting it")

    def _preempt_one(self, seq: Sequence, plan: _StepPlan) -> None:
        if self.preemption_mode == SWAP and seq.is_decoding:
            copies = self.block_manager.swap_out(seq)
            if copies is not None:
                seq.status = SequenceStatus.SWAPPED
                self.swapped.push(seq)
                plan.swap_out.src.extend(copies.src)
                plan.swap_out.dst.extend(copies.dst)
                self.stats.preemptions_swap += 1
                self.stats.blocks_swapped_out += len(copies.src)
                return
            self.stats.swap_space_full += 1
        self.block_manager.deallocate(seq)
        self.stats.preemptions_recompute += 1
        self.add(seq)

    # --- after the step ---

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int], accepted: list[list[int]] | None = None,
                    num_proposed: list[int] | None = None) -> list[Sequence]:
        """The plain loop's end of a step, whatever the runner: `advance`, then `resolve` with the
        step's tokens (a prefill chunk that does not finish the prompt sampled nothing: token -1)
        and, from a speculative runner, each sequence's accepted proposals (which come before its
        token) and how many were proposed (counted in the stats). Returns the sequences that got
        a new token; the finished ones among them have their blocks freed and have left `running`."""
        if num_proposed is not None:
            self._count_speculation(batch, accepted, num_proposed)
        return self.resolve(batch, token_ids, self.advance(batch), accepted)

    def _count_speculation(self, batch: ScheduledBatch, accepted: list[list[int]], num_proposed: list[int]) -> None:
        """The speculative counters of a step's sequences that sample (read before `advance`
        clears their scheduled counts): a decode row computed just its newest token."""
        stats = self.stats
        for seq, kept, proposed in zip(batch.seqs, accepted, num_proposed):
            if seq.status is FINISHED or seq.num_computed_tokens + seq.num_scheduled_tokens < len(seq.token_ids):
                continue  # failed in this step (its sampling inputs), or a prefill chunk short of the prompt's end
            stats.spec_proposed_tokens += proposed
            stats.spec_accepted_tokens += len(kept)
            if seq.num_scheduled_tokens == 1:
                stats.spec_decode_rows += 1
                stats.spec_decode_tokens += len(kept) + 1

    def advance(self, batch: ScheduledBatch, sample_indices: list[int] | None = None) -> list[int]:
        """Record that the step ran: each scheduled sequence's computed count grows by its
        scheduled tokens, blocks that filled up are published (their tokens are all known: the
        previous step's are resolved before this is called) and a sequence whose prompt is now
        computed lets its siblings in.
        Async scheduling passes the rows that sample (`sample_indices`, as the runner launched
        them) while their tokens are still on the device: each sequence that goes on gets a
        placeholder for its token (sequence.py), so the next step can be scheduled now. One that
        the token ends by length whatever it is gets none, so nothing is scheduled after it. A
        sequence the previous step's tokens finished is left alone: its row is discarded.
        Returns the rows that sample (index into the batch's sequences), for `resolve`."""
        # The hot loop of a decode step's end: plain attribute reads, no per-row call.
        bs, cache_blocks = self.block_manager.block_size, self.block_manager.cache_blocks
        sampling = []
        for i, seq in enumerate(batch.seqs):
            num_scheduled, seq.num_scheduled_tokens = seq.num_scheduled_tokens, 0
            seq.num_lookahead_slots = 0  # the step ran: any proposals in them are verified
            if seq.status is FINISHED:
                continue
            first_block = seq.num_computed_tokens // bs
            computed = seq.num_computed_tokens = seq.num_computed_tokens + num_scheduled
            if computed // bs > first_block:  # a block filled up: publish it
                cache_blocks(seq, first_block, computed // bs)
            if computed == len(seq.token_ids):  # its prompt is computed: it samples
                sampling.append(i)
                if seq.pending_siblings:
                    self._release_siblings(seq)
        if sample_indices is None:
            return sampling
        ends_by_length, seqs = self.stop_checker.next_token_ends_by_length, batch.seqs
        for row, i in enumerate(sample_indices):
            seq = seqs[i]
            if seq.status is not FINISHED and not ends_by_length(seq):
                seq.token_ids.append(-(row + 1))
        return sample_indices

    def resolve(self, batch: ScheduledBatch, token_ids: list[int], sampling: list[int],
                accepted: list[list[int]] | None = None) -> list[Sequence]:
        """Give each sequence that sampled in an advanced step (the rows `advance` returned) its
        token from `token_ids` (one per sequence of the batch; in place of its placeholder, or
        appended) and finish those the stop checker says are done, freeing their blocks. A
        sequence finished meanwhile (async scheduling: by the step before) gets nothing, so no
        token ever follows a stop. Returns the sequences that got a token.
        With `accepted` (a speculative step, never overlapped), a sequence's accepted proposals
        come first, each stop-checked so no stop and no max_tokens is overshot, and none is
        kept after a stop. Their K/V are computed (they were the step's input) and counted so;
        the lookahead blocks past the sequence's tokens (rejected proposals) go back to the pool."""
        check = self.stop_checker.check
        seqs, advanced, queued = batch.seqs, [], set()
        for i in sampling:
            seq = seqs[i]
            if seq.status is FINISHED:
                continue
            tokens = seq.token_ids
            advanced.append(seq)
            try:
                finish = None
                if accepted is not None:
                    for token_id in accepted[i]:
                        tokens.append(token_id)
                        finish = check(seq)
                        if finish is not None:
                            break
                if finish is None:
                    if tokens[-1] < 0:
                        tokens[-1] = token_ids[i]
                    else:
                        tokens.append(token_ids[i])
                    finish = check(seq)
            except Exception as exc:
                self.fail(seq, exc, "checking its stop conditions (stop strings, detokenization)")
                continue
            if finish is not None:
                if seq.status != SequenceStatus.RUNNING:  # preempted by the step scheduled meanwhile
                    queued.add(id(seq))
                self.finish(seq, finish.finish_reason, finish.stop_reason)
            elif accepted is not None:
                self._keep_accepted(seq)
        if queued:
            self.waiting.remove(queued)
            self.swapped.remove(queued)
        self.drop_finished()
        return advanced

    def _keep_accepted(self, seq: Sequence) -> None:
        """After a speculative step: the accepted proposals' K/V count as computed (the newest
        token, as always, is not), the blocks they filled are published, the rest are trimmed."""
        bm = self.block_manager
        first_block = seq.num_computed_tokens // bm.block_size
        seq.num_computed_tokens = len(seq.token_ids) - 1
        bm.cache_blocks(seq, first_block, seq.num_computed_tokens // bm.block_size)
        bm.trim(seq)

    def _release_siblings(self, seq: Sequence) -> None:
        """The prompt's blocks are published now: let the other samples in."""
        for sibling in seq.pending_siblings:
            self.add(sibling)
        seq.pending_siblings = []

    def finish(self, seq: Sequence, finish_reason: str, stop_reason: int | str | None) -> None:
        """Mark a sequence finished and free its blocks; it leaves `running` at the next
        `drop_finished` (one O(n) rebuild per step, not an O(n) list.remove per sequence)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        self.block_manager.deallocate(seq)
        self.num_unswept_finished += 1

    def drop_finished(self) -> None:
        if self.num_unswept_finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
            self.num_unswept_finished = 0

    def abort(self, seqs: list[Sequence]) -> None:
        """Finish unfinished sequences with finish_reason "abort" (a request aborted, or a call its
        caller stopped early) and free their blocks, device and host, at once."""
        doomed = {id(s) for seq in seqs for s in [seq, *seq.pending_siblings]}
        for seq in seqs:
            seq.pending_siblings = []
            if not seq.is_finished:
                _drop_placeholder(seq)
                self.finish(seq, "abort", None)
        self.waiting.remove(doomed)
        self.swapped.remove(doomed)
        self.drop_finished()

    def fail(self, seq: Sequence, error: Exception | None, phase: str) -> None:
        """A fault in the work for this sequence: finish it with "abort" now (its blocks freed,
        out of `waiting` and `swapped`; out of `running` at the next drop_finished) and record it
        (`take_failed` fails the other samples of its request with it)."""
        self.failed.append(SequenceFault(seq, error, phase))
        if seq.is_finished:
            return
        status = seq.status
        seq.pending_siblings = []  # never queued: the engine aborts them with the request
        _drop_placeholder(seq)
        self.finish(seq, "abort", None)
        if status is WAITING:
            self.waiting.remove({id(seq)})
        elif status is SWAPPED:
            self.swapped.remove({id(seq)})

    def take_failed(self) -> list[SequenceFault]:
        """The sequences failed since the last call, each with its fault; the other samples of
        their requests are aborted now (a request fails as a whole)."""
        failed, self.failed = self.failed, []
        if failed:
            self.abort([s for fault in failed for s in fault.seq.samples if not s.is_finished])
        return failed


def _drop_placeholder(seq: Sequence) -> None:
    """An aborted sequence gets no more tokens: a placeholder for one still on the device
    (async scheduling) goes, so its output holds only real token ids."""
    if seq.token_ids and seq.token_ids[-1] < 0:
        seq.token_ids.pop()


def _sort_key(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key
