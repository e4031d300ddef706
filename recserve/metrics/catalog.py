"""Every recserve metric, defined once (docs/architecture.md §3, "Metrics").

The metric objects below live on prometheus_client's default registry, so a process's
``/metrics`` (:func:`recserve.metrics.serve.start_metrics_server`, or the gateway's
``GET /metrics``) serves whichever of them that process touched. Families read from
existing counters at scrape time (:mod:`recserve.metrics.collectors`: the lookup client,
the shard, the schedulers' depth, drops and sheds) are named here as :class:`Family` rows, so
the whole catalogue is in this one file. Processes do not label themselves: the scraper
adds the process label from its target list.

Names end as Prometheus writes them: a counter ``recserve_rpc_requests`` is exposed as
``recserve_rpc_requests_total``; histograms as ``..._bucket`` / ``..._sum`` / ``..._count``.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import Counter, Histogram

from recserve.metrics.histogram import BatchHistogram

# Latency buckets (seconds): a shard Lookup answers in well under 1 ms on loopback, a
# Recommend in tens of ms, a slow admin call in seconds.
LATENCY_BUCKETS_S = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Items per batch: a lookup window holds one caller or hundreds; a ranker batch tens.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# -- every gRPC server (recserve.metrics.interceptor.MetricsInterceptor; health and reflection are not counted)
RPC_REQUESTS = Counter(
    "recserve_rpc_requests", "gRPC calls served, by service (e.g. Ranking), method and the status code the caller got (e.g. OK)",
    ["service", "method", "code"],
)  # fmt: skip
RPC_LATENCY = Histogram(
    "recserve_rpc_latency_seconds", "gRPC call handling time on the server, whatever the outcome", ["service", "method"], buckets=LATENCY_BUCKETS_S,
)  # fmt: skip

# -- the gateway's HTTP endpoints (an aiohttp middleware)
HTTP_REQUESTS = Counter("recserve_http_requests", "HTTP requests served by the gateway, by route and status", ["route", "status"])
HTTP_LATENCY = Histogram("recserve_http_latency_seconds", "HTTP request handling time in the gateway", ["route"], buckets=LATENCY_BUCKETS_S)

# -- every ServingLoop (recserve.scheduling.loop): label ``loop`` is the loop's name; queue
# waits come a batch at a time (BatchHistogram.observe_many: one call per batch, not per item)
SCHEDULER_BATCH_SIZE = Histogram("recserve_scheduler_batch_size", "Items per batch a scheduler formed", ["loop"], buckets=BATCH_SIZE_BUCKETS)
SCHEDULER_QUEUE_WAIT = BatchHistogram(
    "recserve_scheduler_queue_wait_seconds", "Time an item waited in a scheduler's queue before a batch took it", ["loop"], buckets=LATENCY_BUCKETS_S,
)  # fmt: skip

# -- the shared device executor of a co-located ranker + decoder (recserve.scheduling.device): label ``lane``
DEVICE_JOBS = Counter("recserve_device_jobs", "Jobs the shared device ran, by bulkhead lane (critical: ranker batches, best_effort: decode steps)", ["lane"])
DEVICE_BUSY = Counter("recserve_device_busy_seconds", "Device time the jobs of a bulkhead lane took", ["lane"])
DEVICE_PACED = Counter("recserve_device_paced_seconds", "Time the shared device idled because decode had used its share while a ranker batch was in flight")
DEVICE_QUEUE_WAIT = Histogram(
    "recserve_device_queue_wait_seconds", "Time a job waited for the shared device, by bulkhead lane", ["lane"], buckets=LATENCY_BUCKETS_S,
)  # fmt: skip

# -- the cascade (cascade/service.py): one sample per stage report of every Recommend
CASCADE_STAGE_LATENCY = Histogram(
    "recserve_cascade_stage_latency_seconds", "Time a cascade stage (L0..L3) took, skipped stages included", ["stage"], buckets=LATENCY_BUCKETS_S,
)  # fmt: skip
CASCADE_STAGE_DEGRADED = Counter(
    "recserve_cascade_stage_degraded", "Cascade stages that ran degraded, by stage and reason (shrunk_input, skipped_budget, timeout, lookup_missing, cold_start)", ["stage", "reason"],
)  # fmt: skip

# -- degraded answers of the ranker's Rank and the cascade's Recommend (one per reason of a response)
DEGRADED_RESPONSES = Counter(
    "recserve_degraded_responses", "Responses answered degraded, by service (Ranking, Recommender) and reason; a response with two reasons counts under each",
    ["service", "reason"],
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Family:
    """A family a scrape-time collector builds from counters the code keeps anyway."""

    name: str  # without the _total suffix Prometheus adds to counters
    kind: str  # "counter" | "gauge"
    help: str
    labels: tuple[str, ...] = ()


# -- the lookup client (recserve.lookup.stats.LookupStats, summed over the process's clients)
LOOKUP_WINDOWS = Family("recserve_lookup_windows", "counter", "Lookup windows the client dispatched")
LOOKUP_IDS_REQUESTED = Family("recserve_lookup_ids_requested", "counter", "Id lookups callers asked for (with repeats); / ids_unique = the dedup ratio")
LOOKUP_IDS_UNIQUE = Family("recserve_lookup_ids_unique", "counter", "Unique (table, id) rows per window after dedup")
LOOKUP_RPCS = Family("recserve_lookup_rpcs", "counter", "Lookup RPCs sent to shards: kind primary (routing) or hedge (hedges and failover retries)", ("kind",))
LOOKUP_IDS_SENT = Family("recserve_lookup_ids_sent", "counter", "Ids carried by lookup RPCs; / rpcs = ids per RPC")
LOOKUP_NEAR_CACHE_HITS = Family("recserve_lookup_near_cache_hits", "counter", "Id lookups (with repeats) answered by the client's near cache")
LOOKUP_NEAR_CACHE_LOOKUPS = Family("recserve_lookup_near_cache_lookups", "counter", "Id lookups (with repeats) that asked the near cache")

# -- the shard (embedding_server: its ShardCounters, row caches and cold tiers)
SHARD_ROWS = Family("recserve_shard_rows", "counter", "Rows a shard served, by tier (hot, warm, cold)", ("tier",))
SHARD_ROW_CACHE_HITS = Family("recserve_shard_row_cache_hits", "counter", "Cold-tier rows answered by the row cache")
SHARD_ROW_CACHE_MISSES = Family("recserve_shard_row_cache_misses", "counter", "Cold-tier rows the row cache did not hold")
SHARD_ROW_CACHE_EVICTIONS = Family("recserve_shard_row_cache_evictions", "counter", "Rows the row cache evicted (least recently used) to make room")
SHARD_ROCKSDB_READS = Family("recserve_shard_rocksdb_reads", "counter", "Keys the cold tier read from RocksDB (row-cache misses, deduplicated per request)")

# -- every ServingLoop, read from its scheduler
SCHEDULER_QUEUE_DEPTH = Family("recserve_scheduler_queue_depth", "gauge", "Items waiting in a scheduler's queue", ("loop",))
SCHEDULER_CANCELLED = Family("recserve_scheduler_cancelled", "counter", "Items cancelled (the caller went away or gave up) before they finished", ("loop",))
SCHEDULER_EXPIRED = Family("recserve_scheduler_expired", "counter", "Items whose deadline passed before they ran (never executed)", ("loop",))
SCHEDULER_SHED = Family(
    "recserve_scheduler_shed", "counter", "Requests refused at admission (RESOURCE_EXHAUSTED / HTTP 429): deadline slack below the estimated queue wait plus service time", ("loop",),
)  # fmt: skip
