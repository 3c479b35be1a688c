"""The server's Prometheus metrics, in a registry of its own (two servers in one process never clash).

Owns the metric names, help texts and histogram buckets. The engine loop feeds the engine-side
ones (batch sizes, KV-cache usage, tokens, latencies, and the engine's own counters through
`observe_engine`); the HTTP layer counts refused requests. It does not know how any of them is
measured.
"""
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from nanovllm.engine.stats import EngineStats

# The engine's counters (EngineStats fields, which only grow), exported as Prometheus counters:
# metric name, help, label name, {label value: field}.
ENGINE_COUNTERS = (
    ("nanovllm_steps", "Engine steps, by kind (a mixed step computes prompts beside running decodes)", "kind",
     {"prefill": "prefill_steps", "decode": "decode_steps", "mixed": "mixed_steps"}),
    ("nanovllm_preemptions", "Running sequences preempted for want of KV blocks, by mode", "mode",
     {"recompute": "preemptions_recompute", "swap": "preemptions_swap"}),
    ("nanovllm_swap_space_full", "Swap-mode preemptions recomputed instead, for want of host blocks", None,
     {None: "swap_space_full"}),
    ("nanovllm_swap_ins", "Swapped-out sequences brought back to the device", None, {None: "swap_ins"}),
    ("nanovllm_blocks_swapped", "KV blocks copied between device and host, by direction", "direction",
     {"out": "blocks_swapped_out", "in": "blocks_swapped_in"}),
    ("nanovllm_swapped_prefix_lost", "Swapped sequences recomputed because their shared prefix left the cache",
     None, {None: "swapped_prefix_lost"}),
    ("nanovllm_spec_draft_tokens", "Speculative decoding: tokens proposed, and of them accepted", "outcome",
     {"proposed": "spec_proposed_tokens", "accepted": "spec_accepted_tokens"}),
)


class _EngineCounters(Collector):
    """Exports the counters of the last EngineStats it was given (none before the first)."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.stats
        if stats is None:
            return
        for name, help_text, label, fields in ENGINE_COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=[label] if label else None)
            for value, field in fields.items():
                family.add_metric([value] if label else [], getattr(stats, field))
            yield family

# Seconds; from a tiny model on a GPU (milliseconds) to a long prompt behind a full queue on CPU.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Seconds between two tokens of one request: a decode step, from a fast GPU step to a slow CPU one.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_requests_running = Gauge("nanovllm_num_requests_running",
                                          "Sequences in the running batch (a request with n samples counts n)",
                                          registry=r)
        self.num_requests_waiting = Gauge("nanovllm_num_requests_waiting",
                                          "Sequences waiting to be scheduled", registry=r)
        self.num_requests_swapped = Gauge("nanovllm_num_requests_swapped",
                                          "Sequences preempted to host memory, waiting to be swapped in", registry=r)
        self.kv_cache_usage = Gauge("nanovllm_kv_cache_usage_ratio",
                                    "Share of KV-cache blocks held by sequences (0 to 1)", registry=r)
        self.swap_space_usage = Gauge("nanovllm_swap_space_usage_ratio",
                                      "Share of host swap blocks held by swapped-out sequences (0 to 1; 0 without swap)",
                                      registry=r)
        self.prompt_tokens = Counter("nanovllm_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("nanovllm_generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter("nanovllm_request_finished", "Samples finished, by finish reason",
                                         ["finish_reason"], registry=r)
        self.requests_rejected = Counter("nanovllm_request_rejected",
                                         "Requests refused with 503 because the queue was full", registry=r)
        self.time_to_first_token = Histogram("nanovllm_time_to_first_token_seconds",
                                             "From a request's arrival to its first token", buckets=TTFT_BUCKETS,
                                             registry=r)
        self.time_per_output_token = Histogram("nanovllm_time_per_output_token_seconds",
                                               "Between consecutive tokens of one request", buckets=TPOT_BUCKETS,
                                               registry=r)
        self.e2e_request_latency = Histogram("nanovllm_e2e_request_latency_seconds",
                                             "From a request's arrival to its last token", buckets=E2E_BUCKETS,
                                             registry=r)
        self._engine_counters = _EngineCounters()
        r.register(self._engine_counters)

    def observe_engine(self, stats: EngineStats) -> None:
        """Take the engine's queues, block use and counters from a snapshot of LLMEngine.stats()."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(1.0 - stats.num_free_kv_blocks / stats.num_kv_blocks)
        self.swap_space_usage.set(1.0 - stats.num_free_swap_blocks / stats.num_swap_blocks
                                  if stats.num_swap_blocks else 0.0)
        self._engine_counters.stats = stats

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
