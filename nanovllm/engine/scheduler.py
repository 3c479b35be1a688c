"""Continuous batching: decides which sequences run in the next step, and how many tokens each.

Prefill first (as nano-vllm): waiting sequences are admitted in order within
max_num_batched_tokens; the first one that does not fit is chunked, and stays at the head of
the queue until its prompt is done. Otherwise every running sequence decodes one token;
when the KV cache runs out, the newest running sequences are preempted (their blocks freed,
to be recomputed later). After the step, `postprocess` advances each sequence and finishes the
ones the StopChecker says are done, freeing their blocks. Plain Python: no tensors.
"""
from collections import deque
from typing import NamedTuple

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stop_checker import StopChecker


class ScheduledBatch(NamedTuple):
    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_scheduled_tokens for seq in self.seqs)


class Scheduler:

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager,
                 stop_checker: StopChecker):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.stop_checker = stop_checker
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0  # since start; a sign the KV cache is too small for the load
        self.num_unswept_finished = 0  # finished since the last drop_finished()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill()
        if batch.seqs or not self.waiting and not self.running:  # an idle engine has an empty batch
            return batch
        if not self.running:
            # Requests that could never fit are refused up front, and nothing but running sequences
            # holds blocks, so an engine with nothing running always admits the head of the queue.
            raise RuntimeError(f"internal error: no waiting request can be admitted ({len(self.waiting)} waiting, "
                               f"{self.block_manager.num_free_blocks} of {self.block_manager.num_blocks} KV blocks "
                               "free) and none is running; please report it")
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        # A chunked sequence ends the loop, so every admitted one is already counted in running.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and not self.block_manager.allocate(seq):
                break
            remaining = len(seq) - seq.num_computed_tokens
            seq.num_scheduled_tokens = min(remaining, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < remaining:  # chunked: it stays at the head of the queue
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return ScheduledBatch(scheduled, True)

    def _schedule_decode(self) -> ScheduledBatch:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return ScheduledBatch(scheduled, False)

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int]) -> list[Sequence]:
        """Advance each scheduled sequence by its computed tokens and its sampled token (a
        prefill chunk that does not finish the prompt samples nothing), and finish those the
        stop checker says are done. Returns the sequences that got a new token; the finished
        ones among them have their blocks freed and have left `running`."""
        bs = self.block_manager.block_size
        check = self.stop_checker.check
        advanced = []
        for seq, token_id in zip(batch.seqs, token_ids):
            first_block = seq.num_computed_tokens // bs
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_computed_tokens // bs > first_block:  # a block filled up: publish it
                self.block_manager.cache_blocks(seq, first_block, seq.num_computed_tokens // bs)
            if seq.num_computed_tokens < len(seq.token_ids):
                continue
            if seq.pending_siblings:  # the prompt's blocks are published now: let the other samples in
                self.waiting.extendleft(reversed(seq.pending_siblings))
                seq.pending_siblings = []
            seq.append_token(token_id)
            advanced.append(seq)
            finish = check(seq)
            if finish is not None:
                self.finish(seq, finish.finish_reason, finish.stop_reason)
        self.drop_finished()
        return advanced

    def finish(self, seq: Sequence, finish_reason: str, stop_reason: int | str | None) -> None:
        """Mark a sequence finished and free its blocks; it leaves `running` at the next
        `drop_finished` (one O(n) rebuild per step, not an O(n) deque.remove per sequence)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        self.block_manager.deallocate(seq)
        self.num_unswept_finished += 1

    def drop_finished(self) -> None:
        if self.num_unswept_finished:
            self.running = deque(seq for seq in self.running if not seq.is_finished)
            self.num_unswept_finished = 0

    def abort(self, seqs: list[Sequence]) -> None:
        """Finish unfinished sequences with finish_reason "abort" (a request aborted, or a call its
        caller stopped early) and free their blocks at once."""
        doomed = {id(s) for seq in seqs for s in [seq, *seq.pending_siblings]}
        for seq in seqs:
            seq.pending_siblings = []
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason, seq.stop_reason = "abort", None
                self.num_unswept_finished += 1
                if seq.block_table:
                    self.block_manager.deallocate(seq)
        self.waiting = deque(seq for seq in self.waiting if id(seq) not in doomed)
        self.drop_finished()
