"""`/metrics`: Prometheus text under `shoal:`, named like vLLM's `vllm:` metrics; the
metrics vLLM has are also given under its own names (`VLLM_NAMES`), so that dashboards
built for vLLM read them as they are.

Two sources. The server observes each request (latency histograms, successes by finish
reason) as it runs. The engine's counters and gauges come from `llm.stats()` at scrape
time, one sample per owner (`owner` label: an ADP rank; rank 0 alone otherwise).
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no `*_created` series (vLLM has none either)

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine counters: (shoal name without _total, stats key, help)
ENGINE_COUNTERS = (
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests"),
    ("generation_tokens", "generated_tokens", "Generated tokens of finished requests"),
    ("prefix_cache_queries", "prompt_tokens", "Prompt tokens looked up in the local prefix cache"),
    ("prefix_cache_hits", "local_prefix_hit_tokens", "Prompt tokens served by the local prefix cache"),
    ("pool_lookups", "pool_lookups", "Requests looked up in the KV pool"),
    ("pool_hit_blocks", "pool_hit_blocks", "Blocks the KV pool had"),
    ("pool_miss_blocks", "pool_miss_blocks", "Blocks the KV pool lacked"),
    ("pool_tokens_loaded", "connector_tokens_loaded", "Prompt tokens loaded from the KV pool"),
    ("pool_bytes_loaded", "bytes_loaded", "Bytes loaded from the KV pool"),
    ("pool_bytes_saved", "bytes_saved", "Bytes saved to the KV pool"),
    ("pool_corrupt_blocks", "corrupt_blocks", "Corrupt pool blocks found (recomputed)"),
    ("pool_load_failures_recomputed", "load_failures_recomputed", "Failed loads recomputed"),
    ("deadline_expiries", "deadline_expiries", "KV transfers past their deadline"),
    ("num_preemptions", "preemptions", "Requests preempted (recomputed later)"),
    ("num_cancellations", "cancellations", "Requests cancelled (client gone, stop string, shutdown)"),
    ("iterations", "iterations", "Engine steps"),
    ("pool_hits_loaded", "pool_hits_loaded", "Pool hits loaded whole, then computed on"),
    ("pool_hits_split", "pool_hits_split",
     "Pool hits whose front was computed while their back loaded"),
    ("pool_hits_computed", "pool_hits_computed",
     "Pool hits not loaded: computing them was faster"),
    ("pool_front_tokens_computed", "front_tokens_computed",
     "Tokens of pool hits computed by the engine while the rest loaded"),
    ("pool_hit_host_tokens", "pool_hit_host_tokens",
     "Tokens of pool hits expected from the worker's host memory (faster than the store)"),
)

# engine gauges from stats: (shoal name, stats key, help)
ENGINE_GAUGES = (
    ("prefill_tokens_per_second", "prefill_tokens_per_s",
     "Measured prefill rate a load split weighs, in tokens at the start of a context "
     "(deeper in, a token costs more: docs/connectors.md; 0: not measured yet)"),
    ("pool_load_tokens_per_second", "load_tokens_per_s",
     "Measured KV pool load rate a load split weighs (0: not measured yet)"),
    ("pool_load_latency_seconds", "load_latency_s",
     "Measured time to a pool load's first landed block (0: not measured yet)"),
    ("pool_host_load_tokens_per_second", "host_load_tokens_per_s",
     "Measured rate of loads from the worker's host memory (0: not measured yet)"),
    ("pool_host_load_latency_seconds", "host_load_latency_s",
     "Measured time to the first landed block of a load from host memory"),
    ("pool_front_slowdown", "front_slowdown",
     "How much slower a pool hit's front runs beside its load than alone, as measured "
     "(0: not measured yet)"),
    ("pool_load_slowdown", "load_slowdown",
     "How much longer a split pool hit's load takes beside its front than alone, as "
     "measured (0: not measured yet)"),
)


# the metrics vLLM exposes under these names (without the prefix): given under both
VLLM_NAMES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "request_success_total", "prompt_tokens_total", "generation_tokens_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
    "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_inference_time_seconds"})
# the phases of a request: (name, help); each observed from the engine's timestamps
PHASES = (
    ("request_queue_time_seconds", "Time waiting: from arrival at the server (a place "
     "included) to the first step that took it"),
    ("request_prefill_time_seconds", "Time from the first step that took the request to its "
     "first token (prefill, pool loads)"),
    ("request_decode_time_seconds", "Time from the first token to the last"),
    ("request_inference_time_seconds", "Time from the first step that took the request to "
     "its end (prefill and decode)"))
_SAMPLE_SUFFIXES = ("_bucket", "_sum", "_count")


def with_vllm_names(text: bytes) -> bytes:
    """The exposition plus a copy, under `vllm:`, of every family in VLLM_NAMES (its
    HELP, TYPE and samples, histograms' buckets, sums and counts included)."""
    extra = []
    for line in text.decode().splitlines():
        words = line.split(" ", 3)
        if line.startswith("# "):  # "# HELP name ..." / "# TYPE name kind"
            name = words[2] if len(words) > 2 else ""
        else:  # "name{labels} value"
            name = line.split("{")[0].split(" ")[0]
        if not name.startswith("shoal:"):
            continue
        base = name[len("shoal:"):]
        for suffix in _SAMPLE_SUFFIXES:
            if base.endswith(suffix) and base[:-len(suffix)] in VLLM_NAMES:
                base = base[:-len(suffix)]
        family = base.removesuffix("_total") if base not in VLLM_NAMES else base
        if base in VLLM_NAMES or family + "_total" in VLLM_NAMES:
            extra.append(line.replace("shoal:", "vllm:", 1))
    return text + ("\n".join(extra) + "\n").encode() if extra else text


class ServerMetrics:
    """The registry behind /metrics."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.request_success = Counter(
            "shoal:request_success", "Finished requests by finish reason",
            labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("shoal:time_to_first_token_seconds",
                              "Time to first token (from arrival at the server)", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("shoal:inter_token_latency_seconds", "Time between output tokens",
                             labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("shoal:e2e_request_latency_seconds",
                             "End-to-end request latency (arrival to last token)", labels,
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.phases = {name: Histogram(f"shoal:{name}", doc, labels, buckets=E2E_BUCKETS,
                                       registry=self.registry) for name, doc in PHASES}
        self.rejected = Counter("shoal:num_requests_rejected",
                                "Requests refused with 429: every place taken, the queue full",
                                labels, registry=self.registry)
        self._stats: dict | None = None
        self._admission = None
        self.registry.register(_EngineCollector(self))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` arrived together `seconds` after the previous ones: each counts as
        seconds / num_tokens apart."""
        h = self.itl.labels(self.model_name)
        for _ in range(num_tokens):
            h.observe(seconds / num_tokens)

    def observe_finished(self, finish_reason: str, e2e_seconds: float) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_seconds)

    def observe_phases(self, arrival: float, metrics) -> None:
        """The phases of an ended request (`metrics`: its RequestMetrics; `arrival`: when it
        reached the server, on the same clock); those it never reached are not observed."""
        start, first, end = metrics.scheduled_time, metrics.first_token_time, metrics.finish_time
        if start is None:
            return  # ended before any step took it (cancelled while queued)
        self.phases["request_queue_time_seconds"].labels(self.model_name).observe(
            max(start - arrival, 0.0))
        if first is not None:
            self.phases["request_prefill_time_seconds"].labels(self.model_name).observe(
                first - start)
            if end is not None:
                self.phases["request_decode_time_seconds"].labels(self.model_name).observe(
                    end - first)
        if end is not None:
            self.phases["request_inference_time_seconds"].labels(self.model_name).observe(
                end - start)

    def observe_rejected(self) -> None:
        self.rejected.labels(self.model_name).inc()

    def render(self, stats: dict | None, admission=None) -> bytes:
        """The text exposition with `stats` (an `llm.stats()`, None: not known) as the
        engine's part and the server's places (`admission.Admission`)."""
        self._stats, self._admission = stats, admission
        try:
            return with_vllm_names(generate_latest(self.registry))
        finally:
            self._stats = self._admission = None


class _EngineCollector:
    """The engine's counters and gauges from the stats of the scrape, per owner."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self):
        name = self._metrics.model_name
        admission = self._metrics._admission
        if admission is not None:
            for metric, doc, value in (
                    ("server_requests_running", "Generation requests holding a place "
                     "(--max-concurrent-requests)", admission.num_running),
                    ("server_requests_queued", "Generation requests waiting for a place "
                     "(--max-queue)", admission.num_waiting)):
                g = GaugeMetricFamily(f"shoal:{metric}", doc, labels=["model_name"])
                g.add_metric([name], value)
                yield g
        stats = self._metrics._stats
        if stats is None:
            return
        per_rank = stats.get("per_rank") or [stats]
        labels = ["model_name", "owner"]

        def gauge(metric: str, doc: str, value_of) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"shoal:{metric}", doc, labels=labels)
            for owner, s in enumerate(per_rank):
                g.add_metric([name, str(owner)], value_of(s))
            return g

        yield gauge("num_requests_running", "Requests computing in the engine",
                    lambda s: s.get("num_requests_running", 0))
        yield gauge("num_requests_waiting", "Requests queued (new, preempted or loading KV)",
                    lambda s: s.get("num_requests_waiting", 0))
        yield gauge("kv_cache_usage_perc", "Share of KV blocks held by requests (1 = full)",
                    lambda s: s["kv_blocks_used"] / s["num_kv_blocks"]
                    if s.get("num_kv_blocks") else 0.0)
        for metric, key, doc in ENGINE_GAUGES:
            yield gauge(metric, doc, lambda s, key=key: s.get(key, 0.0))
        for metric, key, doc in ENGINE_COUNTERS:
            c = CounterMetricFamily(f"shoal:{metric}", doc, labels=labels)
            for owner, s in enumerate(per_rank):
                c.add_metric([name, str(owner)], s.get(key, 0))
            yield c
