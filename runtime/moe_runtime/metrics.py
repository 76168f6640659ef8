"""Prometheus metrics of one runtime process (own registry, so tests can run several servers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Mirror:
    """One update of a metric and of its vLLM-named twin: autoscalers (the operator's HPA/KEDA on
    vllm:num_requests_waiting / vllm:kv_cache_usage_perc), gateways (the Gateway API Inference
    Extension's endpoint picker reads the vLLM names) and existing vLLM dashboards work unchanged."""

    def __init__(self, *metrics) -> None:
        self._metrics = metrics

    def set(self, value: float) -> None:
        for m in self._metrics:
            m.set(value)

    def inc(self, amount: float = 1) -> None:
        for m in self._metrics:
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self._metrics:
            m.observe(value)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("moe_runtime_requests", "HTTP requests by endpoint (route template; 'unmatched' for "
                                "unknown paths) and status code (499: the client went away first)",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("moe_runtime_request_errors", "HTTP requests that ended in an error, by endpoint "
                              "(route template) and OpenAI error type, 500s and errors inside a stream included",
                              ["endpoint", "type"], registry=r)
        # Each of these also updates its vLLM-named twin (vllm:..., same meaning and unit as in vLLM).
        self.prompt_tokens = _Mirror(
            Counter("moe_runtime_prompt_tokens", "prompt tokens processed", registry=r),
            Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", registry=r))
        self.generation_tokens = _Mirror(
            Counter("moe_runtime_generation_tokens", "tokens generated", registry=r),
            Counter("vllm:generation_tokens", "Number of generation tokens processed.", registry=r))
        self.latency = _Mirror(
            Histogram("moe_runtime_request_latency_seconds", "request latency (end to end)", buckets=_LAT_BUCKETS,
                      registry=r),
            Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                      buckets=_LAT_BUCKETS, registry=r))
        self.ttft = _Mirror(
            Histogram("moe_runtime_time_to_first_token_seconds", "time to first token", buckets=_LAT_BUCKETS,
                      registry=r),
            Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      buckets=_LAT_BUCKETS, registry=r))
        self.queue_depth = _Mirror(
            Gauge("moe_runtime_queue_depth", "requests waiting for a batch slot", registry=r),
            Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", registry=r))
        self.running = _Mirror(
            Gauge("moe_runtime_running_requests", "requests in the decode batch", registry=r),
            Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", registry=r))
        # The paged KV cache: use = blocks referenced by a sequence / blocks (cached blocks no sequence
        # holds count as free). vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (0.10); both
        # are exported (fractions, 0-1).
        self.kv_usage = _Mirror(
            Gauge("moe_runtime_kv_cache_usage", "fraction of KV-cache blocks held by running requests", registry=r),
            Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", registry=r),
            Gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", registry=r))
        self.kv_blocks = Gauge("moe_runtime_kv_cache_blocks", "KV-cache capacity in blocks", registry=r)
        self.kv_block_size = Gauge("moe_runtime_kv_cache_block_size", "tokens per KV-cache block", registry=r)
        self.kv_bytes = Gauge("moe_runtime_kv_cache_bytes", "bytes allocated for the KV cache", registry=r)
        self.prefix_queries = _Mirror(
            Counter("moe_runtime_prefix_cache_queries", "prompt tokens looked up in the prefix cache", registry=r),
            Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                    registry=r))
        self.prefix_hits = _Mirror(
            Counter("moe_runtime_prefix_cache_hits", "prompt tokens served from the prefix cache", registry=r),
            Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", registry=r))
        self.prefix_hit_rate = Gauge("moe_runtime_prefix_cache_hit_rate",
                                     "prefix-cache hits / queries (tokens) since start", registry=r)
        self.prefill_computed = Counter("moe_runtime_prefill_computed_tokens",
                                        "prompt tokens computed by prefill (prefix-cache hits excluded)", registry=r)
        self.preemptions = _Mirror(
            Counter("moe_runtime_preemptions", "sequences preempted (recomputed) for lack of KV blocks", registry=r),
            Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", registry=r))
        self.rejected = Counter("moe_runtime_rejected_requests", "requests refused because the queue was full",
                                registry=r)
        self.fallbacks = Counter("moe_runtime_backend_fallbacks", "MoE backends that failed the self-test and were "
                                 "replaced by the next candidate", ["from_backend", "to_backend"], registry=r)
        self.backend = Gauge("moe_runtime_moe_backend_info", "MoE backend in use (value 1)",
                             ["backend", "weight_format", "family", "deferred_finalize"], registry=r)
        self.ready = Gauge("moe_runtime_ready", "1 once weights are loaded and the self-test passed", registry=r)
        self.load_seconds = Gauge("moe_runtime_weights_load_seconds", "time to read the weights", registry=r)
        self.load_bytes = Gauge("moe_runtime_weights_bytes", "bytes of weights read", registry=r)
        self.decode_steps = Counter("moe_runtime_decode_steps", "batched decode steps", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
