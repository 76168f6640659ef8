"""Prometheus metrics of one runtime process (own registry, so tests can run several servers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Mirror:
    """One update of a metric and of its vLLM-named twin: autoscalers (the operator's HPA/KEDA on
    vllm:num_requests_waiting / vllm:kv_cache_usage_perc), gateways (the Gateway API Inference
    Extension's endpoint picker reads the vLLM names) and existing vLLM dashboards work unchanged.
    The twins carry vLLM's `model_name` label (its Grafana dashboard filters every panel on it):
    the served name, bound once the server knows it (Metrics.bind_model)."""

    def __init__(self, owner: "Metrics", own, *twins) -> None:
        self._owner, self._own, self._twins = owner, own, twins

    def _all(self):
        yield self._own
        for t in self._twins:
            yield t.labels(model_name=self._owner.model_name)

    def set(self, value: float) -> None:
        for m in self._all():
            m.set(value)

    def inc(self, amount: float = 1) -> None:
        for m in self._all():
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self._all():
            m.observe(value)


# vLLM's buckets for vllm:time_per_output_token_seconds (vllm/v1/metrics/loggers.py, v0.11.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_M = ["model_name"]
# vLLM's request_latency_buckets and build_1_2_5_buckets (vllm/v1/metrics/loggers.py, v0.11.0; the
# token buckets there stop at max_model_len, here at 2M tokens, beyond any context served)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 2_000_000)
# vLLM's finished_reason values (vllm/v1/engine/__init__.py FinishReason): a cancelled request is "abort"
_FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort"}


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.requests = Counter("moe_runtime_requests", "HTTP requests by endpoint (route template; 'unmatched' for "
                                "unknown paths) and status code (499: the client went away first)",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("moe_runtime_request_errors", "HTTP requests that ended in an error, by endpoint "
                              "(route template) and OpenAI error type, 500s and errors inside a stream included",
                              ["endpoint", "type"], registry=r)
        # Each of these also updates its vLLM-named twin (vllm:..., same meaning and unit as in vLLM).
        self.prompt_tokens = _Mirror(self,
            Counter("moe_runtime_prompt_tokens", "prompt tokens processed", registry=r),
            Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", _M, registry=r))
        self.generation_tokens = _Mirror(self,
            Counter("moe_runtime_generation_tokens", "tokens generated", registry=r),
            Counter("vllm:generation_tokens", "Number of generation tokens processed.", _M, registry=r))
        self.latency = _Mirror(self,
            Histogram("moe_runtime_request_latency_seconds", "request latency (end to end)", buckets=_LAT_BUCKETS,
                      registry=r),
            Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _M,
                      buckets=_LAT_BUCKETS, registry=r))
        self.ttft = _Mirror(self,
            Histogram("moe_runtime_time_to_first_token_seconds", "time to first token", buckets=_LAT_BUCKETS,
                      registry=r),
            Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _M,
                      buckets=_LAT_BUCKETS, registry=r))
        self.queue_depth = _Mirror(self,
            Gauge("moe_runtime_queue_depth", "requests waiting for a batch slot", registry=r),
            Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", _M, registry=r))
        self.running = _Mirror(self,
            Gauge("moe_runtime_running_requests", "requests in the decode batch", registry=r),
            Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", _M, registry=r))
        # The paged KV cache: use = blocks referenced by a sequence / blocks (cached blocks no sequence
        # holds count as free). vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (0.10); both
        # are exported (fractions, 0-1).
        self.kv_usage = _Mirror(self,
            Gauge("moe_runtime_kv_cache_usage", "fraction of KV-cache blocks held by running requests", registry=r),
            Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", _M, registry=r),
            Gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", _M, registry=r))
        self.kv_blocks = Gauge("moe_runtime_kv_cache_blocks", "KV-cache capacity in blocks", registry=r)
        self.kv_block_size = Gauge("moe_runtime_kv_cache_block_size", "tokens per KV-cache block", registry=r)
        self.kv_bytes = Gauge("moe_runtime_kv_cache_bytes", "bytes allocated for the KV cache", registry=r)
        self.prefix_queries = _Mirror(self,
            Counter("moe_runtime_prefix_cache_queries", "prompt tokens looked up in the prefix cache", registry=r),
            Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", _M,
                    registry=r))
        self.prefix_hits = _Mirror(self,
            Counter("moe_runtime_prefix_cache_hits", "prompt tokens served from the prefix cache", registry=r),
            Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", _M, registry=r))
        self.prefix_hit_rate = Gauge("moe_runtime_prefix_cache_hit_rate",
                                     "prefix-cache hits / queries (tokens) since start", registry=r)
        self.prefill_computed = Counter("moe_runtime_prefill_computed_tokens",
                                        "prompt tokens computed by prefill (prefix-cache hits excluded)", registry=r)
        self.preemptions = _Mirror(self,
            Counter("moe_runtime_preemptions", "sequences preempted (recomputed) for lack of KV blocks", registry=r),
            Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", _M, registry=r))
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

        self.tpot = _Mirror(self,
            Histogram("moe_runtime_time_per_output_token_seconds", "time between two output tokens of a request",
                      buckets=_TPOT_BUCKETS, registry=r),
            Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", _M,
                      buckets=_TPOT_BUCKETS, registry=r))

        # per finished request, as vLLM records them (PrometheusStatLogger.record, loggers.py v0.11.0):
        # its dashboard's Finish Reason, Queue Time, Prefill and Decode Time, Request Prompt/Generation
        # Length and Max Generation Token panels
        def twin_hist(own, vname, doc, buckets):
            return _Mirror(self, Histogram(own, doc, buckets=buckets, registry=r),
                           Histogram(vname, doc, _M, buckets=buckets, registry=r))
        self.queue_time = twin_hist("moe_runtime_request_queue_time_seconds", "vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _PHASE_BUCKETS)
        self.prefill_time = twin_hist("moe_runtime_request_prefill_time_seconds", "vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _PHASE_BUCKETS)
        self.decode_time = twin_hist("moe_runtime_request_decode_time_seconds", "vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _PHASE_BUCKETS)
        self.inference_time = twin_hist("moe_runtime_request_inference_time_seconds",
                                        "vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", _PHASE_BUCKETS)
        self.request_prompt_tokens = twin_hist("moe_runtime_request_prompt_tokens", "vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", _TOKEN_BUCKETS)
        self.request_generation_tokens = twin_hist("moe_runtime_request_generation_tokens",
                                                   "vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", _TOKEN_BUCKETS)
        self.request_max_generation_tokens = twin_hist(
            "moe_runtime_request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", _TOKEN_BUCKETS)
        self._success = Counter("moe_runtime_request_success", "Count of successfully processed requests.",
                                ["finished_reason"], registry=r)
        self._vllm_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                     ["model_name", "finished_reason"], registry=r)

    def request_finished(self, reason: str, prompt_n: int, generated_n: int,
                         times: tuple[float, float, float, float] | None) -> None:
        """One finished engine request (not an error): its finish reason and token counts, and, when
        it produced a token, (queue, prefill, decode, inference) seconds as vLLM splits them
        (vllm/v1/metrics/stats.py IterationStats.update_from_finished_request, v0.11.0). The max
        generation tokens histogram is vLLM's per parent request of n choices; here per choice."""
        if reason not in _FINISHED:
            return
        self._success.labels(_FINISHED[reason]).inc()
        self._vllm_success.labels(self.model_name, _FINISHED[reason]).inc()
        self.request_prompt_tokens.observe(prompt_n)
        self.request_generation_tokens.observe(generated_n)
        self.request_max_generation_tokens.observe(generated_n)
        if times is not None:
            for h, t in zip((self.queue_time, self.prefill_time, self.decode_time, self.inference_time), times):
                h.observe(t)

    def bind_model(self, name: str) -> None:
        """The served model name, the vLLM twins' model_name label from now on (their series exist
        from here, at 0, as in vLLM: a dashboard or an HPA finds them before the first request)."""
        self.model_name = name
        for m in vars(self).values():
            if isinstance(m, _Mirror):
                list(m._all())
        for reason in _FINISHED.values():
            self._success.labels(reason)
            self._vllm_success.labels(name, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
