"""The server's Prometheus metrics, in a registry of its own (two servers in one process never clash).

Owns the metric names, help texts and histogram buckets. The engine loop feeds the engine-side
ones (batch sizes, KV-cache usage, tokens, latencies); the HTTP layer counts refused requests.
It does not know how any of them is measured.
"""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.kv_cache_usage = Gauge("nanovllm_kv_cache_usage_ratio",
                                    "Share of KV-cache blocks held by sequences (0 to 1)", registry=r)
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

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
