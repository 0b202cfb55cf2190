"""Prometheus metrics under vLLM's names, twice: with a `jaxinfer:` prefix
and with vLLM's own `vllm:` prefix, so that dashboards and autoscalers
written for vLLM read a jaxinfer server unchanged.

Gauges and engine counters are refreshed from the engine's stats() after
every step (by the engine thread, which owns the engine); token counters and
latency histograms are fed as the engine thread posts outputs, so
`generation_tokens_total` counts exactly the tokens sent to clients. Each
app gets its own registry, so several servers (tests) can live in one process.

Latencies follow vLLM's definitions, measured from the moment the HTTP
handler submits the request: time to first token, inter-token latency
(between successive posts of a request, per post: a post after a
speculative step carries several tokens), end-to-end latency. The phases of
a finished request come from the engine's own timestamps (outputs.py
RequestMetrics): queue (arrival to first scheduled), prefill (first
scheduled to first token), decode (first to last token) and inference
(first scheduled to last token).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

# The `_created` timestamp series double what a scraper reads and no vLLM
# dashboard uses them (vLLM turns them off the same way; process-wide).
disable_created_metrics()

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0)

# engine stats() key -> counter suffix (monotonic counts in the engine, turned into counter increments)
_ENGINE_COUNTERS = {
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "spec_proposed_tokens": "spec_decode_num_draft_tokens",
    "spec_accepted_tokens": "spec_decode_num_accepted_tokens",
    "spec_verifications": "spec_decode_num_drafts",
}


PREFIXES = ("jaxinfer", "vllm")
_PHASE_BUCKETS = _E2E_BUCKETS


class _Both:
    """One metric under each prefix; labels() and the updates reach both."""

    def __init__(self, metrics):
        self.metrics = metrics

    def labels(self, **labels):
        return _Both([m.labels(**labels) for m in self.metrics])

    def inc(self, amount=1):
        for m in self.metrics:
            m.inc(amount)

    def set(self, value):
        for m in self.metrics:
            m.set(value)

    def observe(self, value):
        for m in self.metrics:
            m.observe(value)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def make(kind, name, doc, **kw):
            extra = kw.pop("extra_labels", [])
            return _Both([kind(f"{prefix}:{name}", doc, labels + extra, registry=self.registry, **kw)
                          for prefix in PREFIXES])

        self._running = make(Gauge, "num_requests_running", "Requests with sequences in the running batch.")
        self._waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = make(Gauge, "kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).")
        self._prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of accepted requests.")
        self._generation_tokens = make(Counter, "generation_tokens", "Generated tokens sent to clients.")
        self._success = make(Counter, "request_success", "Finished requests by finish reason.",
                             extra_labels=["finished_reason"])
        self._engine_counters = {key: make(Counter, name, f"Engine counter {key}.")
                                 for key, name in _ENGINE_COUNTERS.items()}
        self._ttft = make(Histogram, "time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS)
        self._itl = make(Histogram, "inter_token_latency_seconds", "Time between a request's outputs.",
                         buckets=_ITL_BUCKETS)
        self._e2e = make(Histogram, "e2e_request_latency_seconds", "End-to-end request latency.",
                         buckets=_E2E_BUCKETS)
        self._phases = {phase: make(Histogram, f"request_{phase}_time_seconds", doc, buckets=_PHASE_BUCKETS)
                        for phase, doc in (("queue", "Time from arrival to first scheduling."),
                                           ("prefill", "Time from first scheduling to the first token."),
                                           ("decode", "Time from the first to the last token."),
                                           ("inference", "Time from first scheduling to the last token."))}
        self._name = model_name
        self._last_engine_counts = {key: 0 for key in _ENGINE_COUNTERS}
        # Export every series from the start (at 0), not from its first event.
        for metric in (self._running, self._waiting, self._kv_usage, self._prompt_tokens, self._generation_tokens,
                       *self._engine_counters.values(), self._ttft, self._itl, self._e2e, *self._phases.values()):
            self._l(metric)
        for reason in ("stop", "length", "abort"):
            self._l(self._success, finished_reason=reason)

    def _l(self, metric, **extra):
        return metric.labels(model_name=self._name, **extra)

    # -- fed by the engine thread -------------------------------------------
    def on_request_added(self, num_prompt_tokens: int) -> None:
        self._l(self._prompt_tokens).inc(num_prompt_tokens)

    def on_tokens(self, count: int, arrival: float, last_token_time: float | None, now: float) -> None:
        self._l(self._generation_tokens).inc(count)
        if last_token_time is None:
            self._l(self._ttft).observe(now - arrival)
        else:
            self._l(self._itl).observe(now - last_token_time)

    def on_request_finished(self, reason: str, e2e_seconds: float | None, times=None) -> None:
        """times: the engine's RequestMetrics of the request, or None."""
        self._l(self._success, finished_reason=reason).inc()
        if e2e_seconds is not None and reason != "abort":
            self._l(self._e2e).observe(e2e_seconds)
        if times is None or reason == "abort" or times.first_scheduled_time is None:
            return
        phases = {"queue": (times.arrival_time, times.first_scheduled_time),
                  "prefill": (times.first_scheduled_time, times.first_token_time),
                  "decode": (times.first_token_time, times.last_token_time),
                  "inference": (times.first_scheduled_time, times.last_token_time)}
        for phase, (start, end) in phases.items():
            if start is not None and end is not None:
                self._l(self._phases[phase]).observe(max(0.0, end - start))

    def on_engine_stats(self, stats: dict) -> None:
        self._l(self._running).set(stats["num_requests_running"])
        self._l(self._waiting).set(stats["num_requests_waiting"])
        self._l(self._kv_usage).set(stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"]))
        for key, counter in self._engine_counters.items():
            value = stats.get(key, 0)
            if value > self._last_engine_counts[key]:
                self._l(counter).inc(value - self._last_engine_counts[key])
            self._last_engine_counts[key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
