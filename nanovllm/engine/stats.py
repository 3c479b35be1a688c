"""The engine's counters: `EngineStats` (what LLMEngine.stats() returns and a /metrics endpoint
exports), the inter-token latency counter each step feeds, and the speculative decoding summary
logged at exit. It reads the scheduler's and the block manager's counts; it changes nothing.
"""
import logging
from dataclasses import asdict, dataclass
from time import perf_counter

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.scheduler import Scheduler, SchedulerStats
from nanovllm.scheduling.sequence import Sequence

logger = logging.getLogger("nanovllm")


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


class InterTokenLatency:
    """The time between each sequence's consecutive tokens, summed and counted, and apart for
    the gaps during which a step with prefill work ran."""

    def __init__(self):
        self.num_prefill_steps = 0  # steps with prefill work so far: a sequence remembers the count at its last token
        self.sum_s = 0.0
        self.count = 0
        self.during_prefill_sum_s = 0.0
        self.during_prefill_count = 0

    def observe(self, advanced: list[Sequence], computed_prompts: bool) -> None:
        """The time since each advanced sequence's previous token, counted apart as well when a
        step with prefill work ran in between (this one included)."""
        now = perf_counter()
        self.num_prefill_steps += computed_prompts
        epoch = self.num_prefill_steps
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
        self.sum_s += total
        self.count += count
        self.during_prefill_sum_s += prefill_total
        self.during_prefill_count += prefill_count


def engine_stats(scheduler: Scheduler, bm: BlockManager, itl: InterTokenLatency) -> EngineStats:
    """The scheduler's counters (preemptions by mode, swaps, mixed steps...), the queues' sizes,
    block use and inter-token latency, as a snapshot."""
    return EngineStats(
        **asdict(scheduler.stats),
        num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
        num_swapped=len(scheduler.swapped), num_free_kv_blocks=bm.num_free_blocks, num_kv_blocks=bm.num_blocks,
        num_free_swap_blocks=bm.num_free_host_blocks, num_swap_blocks=bm.num_host_blocks,
        inter_token_latency_sum_s=itl.sum_s, inter_token_latency_count=itl.count,
        inter_token_latency_during_prefill_sum_s=itl.during_prefill_sum_s,
        inter_token_latency_during_prefill_count=itl.during_prefill_count)


def log_speculation(stats: SchedulerStats, method: str) -> None:
    """The speculative decoding summary: proposals made and accepted, tokens per target pass."""
    rate, per_forward = stats.spec_acceptance_rate, stats.spec_tokens_per_forward
    logger.info("speculative decoding (%s): %d tokens proposed, %d accepted (acceptance rate %s), "
                "%s tokens per target forward pass per decoding sequence", method,
                stats.spec_proposed_tokens, stats.spec_accepted_tokens,
                "n/a" if rate is None else f"{rate:.3f}", "n/a" if per_forward is None else f"{per_forward:.3f}")
