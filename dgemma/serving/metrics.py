"""The server's Prometheus metrics (`GET /metrics`, text format, behind the API key like /v1).

Each app has its own CollectorRegistry, so several servers in one process (tests) keep their own counts.
Three places feed it:
  - the HTTP layer (middleware.py): requests by route and status, errors by kind (the OpenAI error's `code`,
    else its `type`), requests in flight;
  - the engine thread (worker.py calls `EngineObserver`): step time and rows per step, prompt and generated
    tokens and denoising steps per canvas when a request finishes, engine failures;
  - gauges read when scraped: queue depth, active rows, which step runs (eager or compiled).

Prefix cache: an engine request that reused cached prefix positions says how many in
its `cached_tokens` (0 without a prefix cache); `finished` counts them in
dgemma_prefix_cache_hit_tokens_total and the requests that hit in dgemma_prefix_cache_hits_total. What
the cache holds (blocks, bytes, budget) and its blocks stored and evicted are read from the engine's
`PrefixCacheStats` at each scrape, as /health shows them (nothing while the cache is off).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

# denoising steps a canvas took: 1 .. the 48 of the released model, a few past it for custom --steps
STEP_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# seconds per engine step: a tiny model on a CPU (~1 ms) to the 26B-A4B on a CPU (~20 s)
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
REQUEST_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self, model_name: str):
        # which served model (base or adapter) an engine request ran: the base unless told otherwise
        self.model_of = lambda request: model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("dgemma_http_requests", "HTTP requests answered, by route template and status",
                                ["route", "method", "status"], registry=r)
        self.request_seconds = Histogram("dgemma_http_request_duration_seconds",
                                         "Time from a request's arrival to its response's last byte",
                                         ["route"], buckets=REQUEST_SECONDS_BUCKETS, registry=r)
        self.in_flight = Gauge("dgemma_http_requests_in_flight", "HTTP requests being answered", registry=r)
        self.errors = Counter("dgemma_errors", "Errors by kind: the OpenAI error's code, else its type; "
                              "engine_failure when an engine step raised", ["kind"], registry=r)
        self.prompt_tokens = Counter("dgemma_prompt_tokens", "Prompt tokens of finished engine requests",
                                     registry=r)
        self.generated_tokens = Counter("dgemma_generation_tokens", "Tokens generated (committed, before stop "
                                        "strings)", registry=r)
        self.finished = Counter("dgemma_engine_requests_finished", "Engine requests finished, by reason "
                                "(stop, length, cancelled, scored)", ["reason", "model"], registry=r)
        self.decoder_positions = Counter("dgemma_decoder_positions", "Canvas positions run through the decoder by "
                                         "finished engine requests (fewer with the step cache)", registry=r)
        self.steps_per_canvas = Histogram("dgemma_denoising_steps_per_canvas", "Denoising steps each committed "
                                          "canvas took", buckets=STEP_BUCKETS, registry=r)
        self.step_seconds = Histogram("dgemma_engine_step_seconds", "Wall time of one engine step (a decoder "
                                      "forward over every active row, prefills and commits included)",
                                      buckets=STEP_SECONDS_BUCKETS, registry=r)
        self.step_rows = Counter("dgemma_engine_step_rows", "Rows in use after each engine step, summed "
                                 "(divided by dgemma_engine_step_seconds_count: the mean batch)", registry=r)
        self.prefix_hits = Counter("dgemma_prefix_cache_hits", "Requests whose prompt reused cached prefix "
                                   "positions (0 while the engine has no prefix cache)", registry=r)
        self.prefix_hit_tokens = Counter("dgemma_prefix_cache_hit_tokens", "Prompt positions read from the "
                                         "prefix cache instead of encoded", registry=r)
        self.queue_depth = Gauge("dgemma_queue_depth", "Requests waiting for a cache row", registry=r)
        self.active_rows = Gauge("dgemma_active_rows", "Cache rows in use (requests being generated or scored)",
                                 registry=r)
        self.compiled = Gauge("dgemma_step_compiled", "1 while the compiled denoising step runs, 0 while "
                              "the eager one does", registry=r)

    def watch(self, worker, step_kind=lambda: "eager"):
        """Gauges read from the worker at each scrape; `step_kind()` says "eager", "compiling" or "compiled"."""
        self.queue_depth.set_function(lambda: worker.load()["waiting"])
        self.active_rows.set_function(lambda: worker.load()["active"])
        self.compiled.set_function(lambda: float(step_kind() == "compiled"))
        self.registry.register(_PrefixCacheCollector(worker))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- called from the engine thread (EngineWorker's observer) --------------------------------------------
    def engine_step(self, seconds: float, rows: int):
        self.step_seconds.observe(seconds)
        self.step_rows.inc(rows)

    def request_finished(self, request):
        """An engine request ended (any reason): its tokens, its canvases' steps, its prefix-cache reuse."""
        self.finished.labels(reason=request.finish_reason or "unknown", model=self.model_of(request)).inc()
        self.prompt_tokens.inc(len(request.prompt))
        if not request.scoring:
            self.generated_tokens.inc(len(request.tokens))
            for steps in request.steps_per_canvas:
                self.steps_per_canvas.observe(steps)
            self.decoder_positions.inc(request.state.decoder_positions)
        cached = request.cached_tokens
        if cached:
            self.prefix_hits.inc()
            self.prefix_hit_tokens.inc(cached)

    def engine_failure(self):
        self.errors.labels(kind="engine_failure").inc()


class _PrefixCacheCollector:
    """The engine's prefix cache as /health shows it, read at each scrape (`PrefixCacheStats`)."""

    GAUGES = (("blocks", "dgemma_prefix_cache_blocks", "Blocks the prefix cache holds"),
              ("bytes", "dgemma_prefix_cache_bytes", "Bytes the prefix cache's blocks take"),
              ("budget_bytes", "dgemma_prefix_cache_budget_bytes", "The prefix cache's budget (--prefix-cache-gib)"))
    COUNTERS = (("inserted", "dgemma_prefix_cache_inserted_blocks", "Blocks stored in the prefix cache"),
                ("evictions", "dgemma_prefix_cache_evictions", "Blocks dropped, least recently used first, to "
                                                              "stay within the budget"))

    def __init__(self, worker):
        self.worker = worker

    def describe(self):
        return []  # families exist only while the cache is on

    def collect(self):
        stats = self.worker.load()["prefix_cache"]
        if stats is None:
            return
        for key, name, doc in self.GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, name, doc in self.COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats[key])
