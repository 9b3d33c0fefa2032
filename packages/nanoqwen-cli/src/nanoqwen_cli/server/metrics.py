"""The server's Prometheus metrics (prometheus-client), in a registry of its own.

Counters and histograms are updated by app.py as requests run; the engine's gauges (queue depth, running
sequences, KV pages) are read from `Engine.stats()` at scrape time by a collector, so /metrics shows the
engine as it is now, not as it was at the last request.

    nanoqwen_http_requests_total{path, status}       every HTTP answer, errors included
    nanoqwen_requests_finished_total{finish_reason}  generation requests: stop, length, cancelled, error
    nanoqwen_prompt_tokens_total                     prompt tokens of the requests admitted
    nanoqwen_generation_tokens_total                 tokens generated (each engine event is one token)
    nanoqwen_time_to_first_token_seconds             request received -> first token (histogram)
    nanoqwen_inter_token_latency_seconds             between two tokens of one request (histogram)
    nanoqwen_request_duration_seconds                request received -> last token (histogram)
    nanoqwen_model_loaded                            1 once the engine is ready
    nanoqwen_requests_waiting, nanoqwen_requests_running, nanoqwen_kv_pages_{used,free,total},
    nanoqwen_engine_steps_total                      the engine's own figures (Engine.stats())
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# TTFT spans a CPU reference run of seconds down to a GPU prefill of milliseconds; an inter-token gap is
# a decode step (ms on the GPU, tens of ms on the CPU) or a prefill chunk that delayed it.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Engine.stats() key -> (metric name, help); gauges unless the name ends in _total.
ENGINE_FIGURES = {
    "waiting": ("nanoqwen_requests_waiting", "Requests queued in the engine, not yet running"),
    "running": ("nanoqwen_requests_running", "Sequences in the running batch"),
    "kv_pages_used": ("nanoqwen_kv_pages_used", "KV cache pages held by sequences"),
    "kv_pages_free": ("nanoqwen_kv_pages_free", "KV cache pages free"),
    "kv_pages_total": ("nanoqwen_kv_pages_total", "KV cache pages in the pool"),
    "steps": ("nanoqwen_engine_steps_total", "Scheduler steps the engine has run"),
}


class _EngineCollector:
    """Reads the engine's figures when /metrics is scraped (nothing before the model is loaded)."""

    def __init__(self, stats: Callable[[], dict | None]):
        self._stats = stats

    def collect(self):
        stats = self._stats()
        loaded = GaugeMetricFamily("nanoqwen_model_loaded", "1 once the model is loaded and serving")
        loaded.add_metric([], 0.0 if stats is None else 1.0)
        yield loaded
        if stats is None:
            return
        for key, (name, doc) in ENGINE_FIGURES.items():
            if key not in stats:
                continue
            if name.endswith("_total"):
                yield CounterMetricFamily(name[: -len("_total")], doc, value=float(stats[key]))
            else:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict | None]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("nanoqwen_http_requests", "HTTP requests answered", ["path", "status"],
                                     registry=r)
        self.finished = Counter("nanoqwen_requests_finished", "Generation requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("nanoqwen_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("nanoqwen_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("nanoqwen_time_to_first_token_seconds", "Request received to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("nanoqwen_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("nanoqwen_request_duration_seconds", "Request received to its last token",
                                  buckets=DURATION_BUCKETS, registry=r)
        r.register(_EngineCollector(engine_stats))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
