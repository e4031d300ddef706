"""Typed, validated config objects for one recserve cluster.

External config (TOML, CLI) is parsed into these at the edge (see
:mod:`recserve.config.load`); internals never re-parse dicts. Every ``__post_init__``
validates and raises :class:`~recserve.errors.ConfigError` whose message names the
field, quotes the bad value and says how to fix it. Derive variants with
``dataclasses.replace``; never mutate a caller's config.
"""

from __future__ import annotations

import dataclasses
import math

from recserve.errors import ConfigError
from recserve.errors import require as _require

DTYPES = ("float32", "float16", "int8")
POOLINGS = ("sum", "mean")
PRIORITIES = ("critical", "standard", "best_effort")
PLACEMENTS = ("fractions", "budget")
# gRPC's poll-based I/O path instead of its (experimental-by-default) event engine: a
# loopback round trip 0.43 -> 0.30 ms in the prototype.
POLL_IO_EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"
NO_METRICS_PORT = -1  # a metrics_port meaning "this process serves no /metrics"


def require_metrics_port(field: str, port: int) -> None:
    """ConfigError naming ``field`` unless ``port`` is -1 (no metrics server), 0 (a free
    port) or a TCP port."""
    _require(isinstance(port, int) and NO_METRICS_PORT <= port <= 65535, field, port,
             "use -1 (no /metrics server), 0 (a free port) or a TCP port in 1..65535")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table: ``rows`` × ``dim`` stored as ``dtype``; bags pool by ``pooling``.

    The placement overrides (None = the ``[sharding]`` value) let one table differ from
    the rest: ``hot_fraction`` / ``warm_fraction`` given here are exact demands (the
    planner raises ResourceExhausted when they do not fit the shard budget, instead of
    trimming them as it trims the ``[sharding]`` fractions under ``placement =
    "budget"``); ``column_splits``, ``hot_replicas`` and ``cold_replicas`` replace the
    ``[sharding]`` ones for this table. Ranges against ``num_shards`` are checked by
    the planner, which knows the shard count.
    """

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    pooling: str = "sum"
    hot_fraction: float | None = None
    warm_fraction: float | None = None
    column_splits: int | None = None
    hot_replicas: int | None = None
    cold_replicas: int | None = None

    def __post_init__(self) -> None:
        f = f"tables.{self.name}"
        _require(isinstance(self.name, str) and bool(self.name) and self.name.replace("_", "").isalnum(), "tables[].name", self.name, "use a non-empty name of letters, digits and '_'")
        _require(isinstance(self.rows, int) and self.rows > 0, f"{f}.rows", self.rows, "set a positive integer row count")
        _require(isinstance(self.dim, int) and 0 < self.dim <= 4096, f"{f}.dim", self.dim, "set an embedding width between 1 and 4096")
        _require(self.dtype in DTYPES, f"{f}.dtype", self.dtype, f"use one of {DTYPES}")
        _require(self.pooling in POOLINGS, f"{f}.pooling", self.pooling, f"use one of {POOLINGS}")
        for key in ("hot_fraction", "warm_fraction"):
            v = getattr(self, key)
            _require(v is None or 0.0 <= v <= 1.0, f"{f}.{key}", v, "use a fraction in [0, 1] (or leave it out for the [sharding] value)")
        if self.hot_fraction is not None and self.warm_fraction is not None:
            total = self.hot_fraction + self.warm_fraction
            _require(total <= 1.0, f"{f}.hot_fraction + warm_fraction", total, "keep the sum at most 1")
        _require(self.column_splits is None or self.column_splits >= 0, f"{f}.column_splits", self.column_splits, "use 0 (auto) or a positive slice count")
        for key in ("hot_replicas", "cold_replicas"):
            v = getattr(self, key)
            _require(v is None or v >= 1, f"{f}.{key}", v, "use at least 1 replica")

    @property
    def overrides_tiers(self) -> bool:
        """Whether this table demands its own hot or warm fraction."""
        return self.hot_fraction is not None or self.warm_fraction is not None

@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """A sparse feature (a KeyedJaggedTensor key) and the table it looks up."""

    name: str
    table: str

    def __post_init__(self) -> None:
        _require(bool(self.name), "features[].name", self.name, "give every feature a non-empty name")
        _require(bool(self.table), f"features.{self.name}.table", self.table, "name the table this feature reads")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Hot/warm/cold placement knobs (docs/architecture.md §4). ``column_splits`` 0 = pick from width.

    ``placement`` says what ``shard_memory_bytes`` means to the planner:

    * ``"fractions"`` (default): the tiers are exactly ``hot_fraction`` / ``warm_fraction``
      of each table, and a plan whose DRAM tiers exceed the budget is ResourceExhausted;
    * ``"budget"``: the budget is filled. A table whose whole copy fits every shard's
      remaining budget is replicated whole (TorchRec's data-parallel choice); the other
      tables' hot tiers, then warm tiers, take the most popular ids up to their fractions
      while the budget lasts; what is left of each shard's budget is its row cache
      (``PlanResult.row_cache_bytes``), and the rest of each table stays in RocksDB.
    """

    num_shards: int = 2
    hot_fraction: float = 0.01
    warm_fraction: float = 0.10
    hot_replicas: int = 2
    column_splits: int = 0
    cold_replicas: int = 1
    virtual_nodes: int = 64
    shard_memory_bytes: int = 2 << 30
    placement: str = "fractions"
    # Tables above this many rows route by ring arithmetic + sorted hot/warm sets
    # instead of a dense per-row map (recserve.sharding.router; 2-4 B per row).
    dense_route_max_rows: int = 50_000_000

    def __post_init__(self) -> None:
        _require(self.num_shards >= 1, "sharding.num_shards", self.num_shards, "use at least 1 shard")
        _require(self.placement in PLACEMENTS, "sharding.placement", self.placement, f"use one of {PLACEMENTS}")
        _require(0.0 <= self.hot_fraction <= 1.0, "sharding.hot_fraction", self.hot_fraction, "use a fraction in [0, 1]")
        _require(0.0 <= self.warm_fraction <= 1.0, "sharding.warm_fraction", self.warm_fraction, "use a fraction in [0, 1]")
        _require(self.hot_fraction + self.warm_fraction <= 1.0, "sharding.hot_fraction + warm_fraction", self.hot_fraction + self.warm_fraction, "keep the sum at most 1")
        _require(1 <= self.hot_replicas <= self.num_shards, "sharding.hot_replicas", self.hot_replicas, f"use 1..num_shards ({self.num_shards})")
        _require(0 <= self.column_splits <= self.num_shards, "sharding.column_splits", self.column_splits, f"use 0 (auto) or 1..num_shards ({self.num_shards})")
        _require(1 <= self.cold_replicas <= self.num_shards, "sharding.cold_replicas", self.cold_replicas, f"use 1..num_shards ({self.num_shards})")
        _require(1 <= self.virtual_nodes <= 4096, "sharding.virtual_nodes", self.virtual_nodes, "use 1..4096 virtual nodes per shard")
        _require(self.dense_route_max_rows >= 0, "sharding.dense_route_max_rows", self.dense_route_max_rows, "use 0 (always ring arithmetic) or a row count")
        _require(self.shard_memory_bytes > 0, "sharding.shard_memory_bytes", self.shard_memory_bytes, "set a positive per-shard DRAM budget in bytes")


@dataclasses.dataclass(frozen=True)
class ShardServerConfig:
    """Per-process settings of an embedding shard server.

    ``max_bags_per_rpc`` bounds a pooled Lookup's bags (summed over its tables): the
    shard allocates bags × width × 4 bytes of partial sums, and empty bags cost the
    caller only 8 request bytes each, so without it memory is bounded by the message
    limit alone. The lookup client sends, per (table, slice) entry, all of its window's
    bags of that table; a window's bags are about its ids (a bag is mostly non-empty),
    so an RPC within ``max_ids_per_rpc`` carries at most a few times that many. The
    default, 4 × the default ``max_ids_per_rpc``, leaves that room and caps the sums at
    ≈ 256 MiB for 64-wide rows.

    ``metrics_port``: where the process serves Prometheus ``/metrics`` over HTTP (bound on
    the gRPC host): 0 = a free port (launchers read it from ``--metrics-port-file``),
    N > 0 = shard k binds N + k, -1 = no metrics server. ``--metrics-port`` wins over it.
    """

    max_ids_per_rpc: int = 262_144
    row_cache_bytes: int = 64 << 20
    block_cache_bytes: int = 64 << 20
    threads: int = 1
    max_message_bytes: int = 256 << 20
    max_bags_per_rpc: int = 1_048_576
    metrics_port: int = 0

    def __post_init__(self) -> None:
        _require(self.max_ids_per_rpc > 0, "shard_server.max_ids_per_rpc", self.max_ids_per_rpc, "use a positive id count")
        _require(self.row_cache_bytes >= 0, "shard_server.row_cache_bytes", self.row_cache_bytes, "use >= 0 bytes")
        _require(self.block_cache_bytes > 0, "shard_server.block_cache_bytes", self.block_cache_bytes, "use a positive byte count")
        _require(1 <= self.threads <= 64, "shard_server.threads", self.threads, "use 1..64 threads (2 cores here: keep it at 1-2)")
        _require(self.max_message_bytes >= 4 << 20, "shard_server.max_message_bytes", self.max_message_bytes, "use at least 4 MiB")
        _require(self.max_bags_per_rpc > 0, "shard_server.max_bags_per_rpc", self.max_bags_per_rpc, "use a positive bag count (default 1,048,576)")
        require_metrics_port("shard_server.metrics_port", self.metrics_port)


@dataclasses.dataclass(frozen=True)
class LookupConfig:
    """Feature-parallel lookup client knobs (docs/architecture.md §5).

    ``close_at_dispatch`` (default on): while the client is busy (a window in flight)
    the next window collects every caller that arrives meanwhile and closes at
    dispatch, when that window is done — no timer; only an idle client waits the small
    fixed ``window_ms``. Off: every window waits its adaptive timer
    ``min(max_window_ms, target_ids / rate)``, the rule before it existed. The idle
    timer defaults to 0: an idle request would wait for company it rarely gets, a burst
    arriving together is collected anyway (a window closes only after every caller
    already runnable on the event loop has queued), and asyncio cannot sleep less than
    about 1 ms (epoll's timeout is in whole milliseconds), so any timer costs >= 1 ms.
    """

    window_ms: float = 0.0
    max_window_ms: float = 2.0
    target_ids: int = 8192
    max_inflight_batches: int = 4
    hedge_percentile: float = 95.0
    hedge_budget: float = 0.05
    near_cache_rows: int = 0
    near_cache_staleness_ms: float = 100.0
    close_at_dispatch: bool = True
    # Transport: process-start settings that a launcher passes to the shards it starts
    # (recserve.lookup.transport.transport_env; the client's own process must have them
    # in its environment before grpc loads). Defaults measured with `recserve bench
    # lookup` at 200k x 64, 2 shards (docs/architecture.md §10): the poll-based I/O path
    # and the malloc thresholds each added 15-35% closed-loop rows/s here.
    grpc_experiments: str = POLL_IO_EXPERIMENTS  # GRPC_EXPERIMENTS; "" = gRPC's default (event engine) I/O path
    # The client channels' grpc.http2.max_frame_size; 0 = gRPC's default (16 KiB). Measured in issue 9's eighth session:
    # 1 MiB frames (with 4 MiB stream lookahead) over 3 interleaved closed-loop pairs read 497k / 383k / 569k -> 468k /
    # 408k / 536k rows/s, no gain, so the default stays.
    http2_max_frame_bytes: int = 0
    shard_malloc_mmap_threshold_bytes: int = 4 << 20  # MALLOC_MMAP/TRIM_THRESHOLD_ of shards (replies stay off fresh mmaps); 0 = glibc's

    def __post_init__(self) -> None:
        _require(0.0 <= self.window_ms <= self.max_window_ms, "lookup.window_ms", self.window_ms, f"use 0..max_window_ms ({self.max_window_ms})")
        _require(self.max_window_ms <= 100.0, "lookup.max_window_ms", self.max_window_ms, "keep the window at most 100 ms")
        _require(self.target_ids > 0, "lookup.target_ids", self.target_ids, "use a positive id count")
        _require(self.max_inflight_batches >= 1, "lookup.max_inflight_batches", self.max_inflight_batches, "use at least 1")
        _require(50.0 <= self.hedge_percentile < 100.0, "lookup.hedge_percentile", self.hedge_percentile, "use a percentile in [50, 100)")
        _require(0.0 <= self.hedge_budget <= 1.0, "lookup.hedge_budget", self.hedge_budget, "use a fraction of RPCs in [0, 1]")
        _require(self.near_cache_rows >= 0, "lookup.near_cache_rows", self.near_cache_rows, "use >= 0 rows (0 disables the near cache)")
        _require(self.near_cache_staleness_ms >= 0, "lookup.near_cache_staleness_ms", self.near_cache_staleness_ms, "use >= 0 ms")
        _require(all(p.strip().lstrip("-").replace("_", "").isalnum() for p in self.grpc_experiments.split(",")) if self.grpc_experiments else True,
                 "lookup.grpc_experiments", self.grpc_experiments, "give comma-separated gRPC experiment names, each optionally prefixed by '-'")
        _require(self.http2_max_frame_bytes == 0 or 16384 <= self.http2_max_frame_bytes <= 16777215, "lookup.http2_max_frame_bytes",
                 self.http2_max_frame_bytes, "use 0 (gRPC default) or 16384..16777215 bytes (HTTP/2's range)")
        _require(self.shard_malloc_mmap_threshold_bytes >= 0, "lookup.shard_malloc_mmap_threshold_bytes", self.shard_malloc_mmap_threshold_bytes, "use >= 0 bytes (0 = glibc's default)")


MODEL_NAMES = ("dlrm", "two_tower", "l3")


@dataclasses.dataclass(frozen=True)
class RankerConfig:
    """The Ranking service (docs/architecture.md §7): the models it serves, where, the
    export it loads and how it batches.

    ``models``: every model one process serves (a Rank request names one; '' = the
    first). ``models_dir`` is a ``recserve train --out`` directory ('' = none yet); its
    dense weights and the shards' tables must carry one ``model_version``.

    Batching (DynamicBatchPolicy, cost = candidates): a batch holds up to
    ``max_batch_candidates``; its window waits at most ``max_wait_ms`` (adaptive to the
    arrival rate) and the SLO controller shrinks both when p99 nears ``slo_ms``.
    ``batching = false`` runs one request per forward (the benchmark's baseline; lookups
    still go through the lookup client). ``max_candidates`` caps one request (more is
    INVALID_ARGUMENT: retrying cannot help). ``threads``: torch intra-op threads of the
    forward executor (0 = torch's default; 1 is faster on a shared 2-core box).
    ``default_timeout_ms`` bounds a request that carries no deadline.

    ``metrics_port``: Prometheus ``/metrics`` over HTTP on the gRPC host: 0 = a free port
    (launchers read it from ``--metrics-port-file``), N > 0 = ranker k binds N + k, -1 =
    no metrics server. ``--metrics-port`` wins over it.
    """

    models: tuple[str, ...] = MODEL_NAMES
    device: str = "auto"
    max_candidates: int = 4096
    max_batch_candidates: int = 8192
    max_wait_ms: float = 2.0
    slo_ms: float = 50.0
    batching: bool = True
    max_inflight_batches: int = 2
    threads: int = 1
    default_timeout_ms: float = 1000.0
    # A batch's lookups resolve this long before its earliest deadline, plus twice the
    # measured forward time, with what has arrived (missing rows -> lookup_missing): a
    # lookup that waited for a slow shard up to the deadline left no time to score and
    # answer, so the caller got nothing instead of a degraded answer (bench faults,
    # shard_slow: every L2/L3 stage timed out at the cascade, coverage 0.50).
    reply_margin_ms: float = 3.0
    models_dir: str = ""
    metrics_port: int = 0

    def __post_init__(self) -> None:
        _require(0.0 <= self.reply_margin_ms <= 1000.0, "ranker.reply_margin_ms", self.reply_margin_ms, "use 0..1000 ms")
        _require(len(self.models) > 0 and all(m in MODEL_NAMES for m in self.models) and len(set(self.models)) == len(self.models),
                 "ranker.models[]", list(self.models), f"list distinct models among {list(MODEL_NAMES)}")
        _require(self.device in ("auto", "cpu", "cuda"), "ranker.device", self.device, "use 'auto', 'cpu' or 'cuda'")
        _require(self.max_candidates > 0, "ranker.max_candidates", self.max_candidates, "use a positive candidate count")
        _require(self.max_batch_candidates >= self.max_candidates, "ranker.max_batch_candidates", self.max_batch_candidates,
                 f"use at least max_candidates ({self.max_candidates}): a batch must fit one whole request")
        _require(0 <= self.max_wait_ms <= 1000, "ranker.max_wait_ms", self.max_wait_ms, "use 0..1000 ms")
        _require(self.slo_ms > 0, "ranker.slo_ms", self.slo_ms, "use a positive SLO in ms")
        _require(1 <= self.max_inflight_batches <= 64, "ranker.max_inflight_batches", self.max_inflight_batches, "use 1..64 batches")
        _require(0 <= self.threads <= 64, "ranker.threads", self.threads, "use 0..64 threads (0 = torch's default)")
        _require(self.default_timeout_ms > 0, "ranker.default_timeout_ms", self.default_timeout_ms, "use a positive timeout in ms")
        require_metrics_port("ranker.metrics_port", self.metrics_port)


@dataclasses.dataclass(frozen=True)
class GenerationServiceConfig:
    """The Generation service (``recserve generate serve``, docs/architecture.md §6,
    "The generation service"): the decode engine behind ``Generation.Generate``.

    * ``checkpoint``: a ``recserve train --lm`` directory ('' = none: seeded random
      weights of the shape below, ``seed``; ``--model DIR`` wins over it). A checkpoint
      brings its own shape and its ``model_version`` (the prefix-cache key).
    * ``n_layers`` / ``n_heads`` / ``dim`` / ``max_seq_len``: the random-weight model
      (``max_seq_len`` = the context limit: prompt + ``max_new_tokens`` must fit in it).
    * KV pool and batching (:class:`generation.config.ContinuousBatchConfig`):
      ``num_blocks`` blocks of ``block_tokens`` tokens, ``max_seqs`` live sequences,
      ``token_budget`` tokens per step, prompts prefilled ``prefill_chunk_tokens`` at a
      time.
    * ``max_new_tokens_cap``: the most tokens one request may ask for (more is
      INVALID_ARGUMENT).
    * ``stop_token``: greedy decoding ends after emitting it (10 = "\\n": the LM is
      trained on one fact per line); -1 = never (only ``max_new_tokens`` ends it).
    * ``default_timeout_ms``: bounds a request that carries no deadline; past its
      deadline a stream ends with ``finish_reason = "deadline"``.
    * ``threads``: torch intra-op threads of the decode executor (0 = torch's default).
    * ``metrics_port``: Prometheus ``/metrics`` (0 = a free port, N > 0 = replica k binds
      N + k, -1 = none); ``--metrics-port`` wins over it.
    * ``co_locate``: the ranker process also serves Generation on its device
      (``recserve ranker serve --with-generation`` turns it on too): one device executor
      runs both, ranker batches first (:mod:`recserve.scheduling.bulkhead`), decode keeping
      at least ``min_device_share`` of device time while both have work (0 = rankers
      strictly first; at most 0.9).

    Example::

        [generation]
        checkpoint = "checkpoints/lm"
        max_new_tokens_cap = 128
    """

    checkpoint: str = ""
    seed: int = 0
    n_layers: int = 2
    n_heads: int = 4
    dim: int = 64
    max_seq_len: int = 512
    device: str = "auto"
    num_blocks: int = 256
    block_tokens: int = 16
    max_seqs: int = 32
    token_budget: int = 256
    prefill_chunk_tokens: int = 64
    max_new_tokens_cap: int = 256
    stop_token: int = 10
    default_timeout_ms: float = 30_000.0
    threads: int = 1
    metrics_port: int = 0
    co_locate: bool = False
    min_device_share: float = 0.2

    def __post_init__(self) -> None:
        _require(self.device in ("auto", "cpu", "cuda"), "generation.device", self.device, "use 'auto', 'cpu' or 'cuda'")
        _require(isinstance(self.co_locate, bool), "generation.co_locate", self.co_locate, "use true or false")
        _require(0.0 <= self.min_device_share <= 0.9, "generation.min_device_share", self.min_device_share,
                 "use a fraction of device time in 0..0.9 (decode's guaranteed share while ranker batches wait)")
        _require(1 <= self.n_layers <= 64, "generation.n_layers", self.n_layers, "use 1..64 layers")
        _require(self.n_heads >= 1 and self.dim >= 1 and self.dim % self.n_heads == 0, "generation.dim", self.dim,
                 f"use a positive width divisible by n_heads ({self.n_heads})")
        _require(2 <= self.max_seq_len <= 65_536, "generation.max_seq_len", self.max_seq_len, "use 2..65536 positions")
        _require(self.num_blocks >= 1, "generation.num_blocks", self.num_blocks, "use at least 1 KV block")
        _require(1 <= self.block_tokens <= 1024, "generation.block_tokens", self.block_tokens, "use 1..1024 tokens per block (16 is the usual)")
        _require(self.max_seqs >= 1, "generation.max_seqs", self.max_seqs, "use at least 1 live sequence")
        _require(self.token_budget >= 1, "generation.token_budget", self.token_budget, "use at least 1 token per step")
        _require(1 <= self.prefill_chunk_tokens <= self.token_budget, "generation.prefill_chunk_tokens", self.prefill_chunk_tokens,
                 f"use 1..token_budget ({self.token_budget}) tokens")
        _require(1 <= self.max_new_tokens_cap < self.max_seq_len, "generation.max_new_tokens_cap", self.max_new_tokens_cap,
                 f"use 1..max_seq_len - 1 ({self.max_seq_len - 1}) tokens")
        _require(-1 <= self.stop_token < 259, "generation.stop_token", self.stop_token, "use a byte-tokenizer id in 0..258, or -1 for none")
        _require(math.isfinite(self.default_timeout_ms) and self.default_timeout_ms > 0, "generation.default_timeout_ms",
                 self.default_timeout_ms, "use a positive timeout in ms")
        _require(0 <= self.threads <= 64, "generation.threads", self.threads, "use 0..64 threads (0 = torch's default)")
        require_metrics_port("generation.metrics_port", self.metrics_port)


ROUTING_POLICIES = ("two_choices", "weighted_random", "least_loaded")


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """How one replica set is routed (docs/architecture.md §9; defaults: reference §10.11).

    * ``policy``: a :class:`~recserve.routing.choice.ChoiceKind` value (``two_choices``;
      ``weighted_random`` / ``least_loaded`` are baselines for benchmarks).
    * ``retry_budget`` / ``retry_burst``: retries + hedges stay within ``retry_budget`` x
      primary calls + ``retry_burst`` (:class:`~recserve.routing.budget.RetryBudget`).
    * ``breaker_failures`` consecutive retryable failures open a replica's breaker for
      ``breaker_open_ms``; then ``half_open_probes`` calls at a time test it.
    * ``affinity_virtual_nodes`` / ``affinity_seed``: the session-affinity ring.
    * ``hedge_percentile``: the hedge delay is this percentile of a replica's recent
      latency (:class:`~recserve.routing.latency.LatencyTracker`), floored at
      ``hedge_min_ms``.
    * ``dns_refresh_ms``: a replica address that is a name (a Kubernetes headless
      Service) is re-resolved this often, each answer one replica
      (:mod:`recserve.routing.resolve`); IP literals and ``unix:`` are never looked up.
    """

    policy: str = "two_choices"
    retry_budget: float = 0.1
    retry_burst: float = 10.0
    breaker_failures: int = 3
    breaker_open_ms: float = 500.0
    half_open_probes: int = 1
    affinity_virtual_nodes: int = 128
    affinity_seed: int = 0
    hedge_percentile: float = 95.0
    hedge_min_ms: float = 2.0
    dns_refresh_ms: float = 30_000.0

    def __post_init__(self) -> None:
        _require(math.isfinite(self.dns_refresh_ms) and self.dns_refresh_ms >= 0, "routing.dns_refresh_ms", self.dns_refresh_ms,
                 "use >= 0 ms between re-resolutions of replica names (0 = resolve once)")
        _require(self.policy in ROUTING_POLICIES, "routing.policy", self.policy, f"use one of {list(ROUTING_POLICIES)}")
        _require(0.0 <= self.retry_budget <= 1.0, "routing.retry_budget", self.retry_budget, "use a fraction of primary calls in [0, 1]")
        _require(self.retry_burst >= 0.0, "routing.retry_burst", self.retry_burst, "use >= 0 tokens")
        _require(self.breaker_failures >= 1, "routing.breaker_failures", self.breaker_failures, "use at least 1 failure")
        _require(self.breaker_open_ms > 0, "routing.breaker_open_ms", self.breaker_open_ms, "use a positive duration in ms")
        _require(self.half_open_probes >= 1, "routing.half_open_probes", self.half_open_probes, "let at least 1 probe through")
        _require(self.affinity_virtual_nodes >= 1, "routing.affinity_virtual_nodes", self.affinity_virtual_nodes, "use at least 1 point per replica")
        _require(50.0 <= self.hedge_percentile < 100.0, "routing.hedge_percentile", self.hedge_percentile, "use a percentile in [50, 100)")
        _require(self.hedge_min_ms >= 0.0, "routing.hedge_min_ms", self.hedge_min_ms, "use >= 0 ms")


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    """The L0-L3 cascade: stage sizes, deadline budgets, the stage cost model, the L0
    index and the serving log (docs/architecture.md §3, §8; used by ``cascade/budget.py``).

    Stage sizes follow reference Table 28 (1,000,000 -> 10,000 -> 1,000 -> 100 -> 10).
    L0 keeps a fraction of the catalog (``l0_out = 0``: ``l0_fraction`` of it, at least
    ``l1_out``), since retrieval is what grows with the catalog; L1-L3 keep Table 28's
    absolute sizes, because their cost is per candidate and their recall is measured
    against a fixed top-k. ``cascade.budget.stage_sizes_for`` applies the rule and caps
    every size at the catalog. ``l3_out`` is also the k of a request that asks for 0.

    Budgets: stage i gets ``budget_shares[i] / sum(budget_shares[i:])`` of what remains
    before ``deadline - reply_margin_ms`` when it starts, so time a finished stage did
    not use flows to the later ones. A stage with less than ``min_stage_ms`` is skipped.

    Cost model (``StageCostModel``): an exponentially weighted (``cost_alpha``) fit of
    ``fixed + per_item * n`` per stage, starting from the priors ``cost_prior_fixed_ms``
    / ``cost_prior_per_item_us`` (L0..L3); ``cost_quantile`` > 0 adds that quantile of
    recent relative errors as a safety margin (0 = none). A stage skipped for budget
    ``probe_after_skips`` times in a row runs once on a few candidates so that a stale,
    too-high estimate can recover (0 = never probe).

    ``metrics_port``: Prometheus ``/metrics`` over HTTP on the gRPC host: 0 = a free port
    (launchers read it from ``--metrics-port-file``), N > 0 = that port, -1 = no metrics
    server. ``--metrics-port`` wins over it.
    """

    # Stage output sizes (reference Table 28).
    l0_out: int = 0  # 0 = auto: l0_fraction of the catalog, at least l1_out
    l0_fraction: float = 0.01
    # Twice Table 28's 1,000: `recserve bench recall` at 200k items and the default 100 ms
    # deadline kept 0.936 of exhaustive DLRM's top-10 through L2 with 1,000 (65 of 129
    # misses cut at L1) and 0.973 with 2,000 (final 0.928 -> 0.964), for ~6 ms more in L2.
    l1_out: int = 2_000
    l2_out: int = 100
    l3_out: int = 10
    max_k: int = 1_000  # the largest k a request may ask for
    # Deadlines and budgets.
    budget_shares: tuple[float, float, float, float] = (0.15, 0.15, 0.45, 0.25)
    default_deadline_ms: float = 100.0  # when the caller sets no deadline
    reply_margin_ms: float = 3.0  # kept back for serialising and sending the answer
    min_stage_ms: float = 0.5
    # The per-stage cost model.
    cost_alpha: float = 0.1
    cost_quantile: float = 0.9
    cost_prior_fixed_ms: tuple[float, float, float, float] = (2.0, 1.0, 5.0, 5.0)
    cost_prior_per_item_us: tuple[float, float, float, float] = (0.5, 1.0, 20.0, 100.0)
    probe_after_skips: int = 5  # 50 kept a stage skipped after one cold sample for 50 requests (bench recall)
    # The door (cascade/service.py): Recommend calls run at most this many at once; the
    # rest queue (EDF), and one whose slack is below the estimated queue wait plus a
    # call's service time is shed at once with RESOURCE_EXHAUSTED and a retry hint.
    # Without it an overload queues every call in the event loop and runs it into its
    # deadline. Enough to keep the rankers' batches full (their batching needs concurrent
    # calls); more only moves the queue downstream, where it degrades answers instead.
    max_concurrent: int = 8
    shed_by_slack: bool = True
    # L0: the index (validated by cascade/index.py, which knows faiss) and the popular source.
    index_factory: str = "auto"  # "auto" | "Flat" | "IVF{n},Flat" | "IVF{n},PQ{m}" | "HNSW{M}"
    nprobe: int = 0  # 0 = the index's default (or what the stage budget allows)
    ef_search: int = 0  # 0 = the index's default (or what the stage budget allows)
    popular_per_category: int = 100
    # The serving (impression) log.
    log_path: str = ""  # "" = no serving log
    log_max_bytes: int = 64 << 20  # rotate the log file at this size
    log_backups: int = 3  # rotated files kept
    # Prometheus /metrics of the cascade process (0 = a free port, -1 = none).
    metrics_port: int = 0

    def __post_init__(self) -> None:
        fixed = (self.l1_out, self.l2_out, self.l3_out)
        _require(all(s > 0 for s in fixed), "cascade.l1_out..l3_out", fixed, "use positive stage sizes")
        _require(list(fixed) == sorted(fixed, reverse=True), "cascade.l1_out..l3_out", fixed, "stage sizes must shrink: l1_out >= l2_out >= l3_out")
        _require(self.l0_out == 0 or self.l0_out >= self.l1_out, "cascade.l0_out", self.l0_out, f"use 0 (auto from the catalog size) or at least l1_out ({self.l1_out})")
        _require(0.0 < self.l0_fraction <= 1.0, "cascade.l0_fraction", self.l0_fraction, "use a fraction of the catalog in (0, 1] (Table 28: 0.01)")
        _require(self.max_k >= self.l3_out, "cascade.max_k", self.max_k, f"use at least l3_out ({self.l3_out}), the default k")
        _require(len(self.budget_shares) == 4 and all(s >= 0 for s in self.budget_shares), "cascade.budget_shares", self.budget_shares, "give 4 non-negative shares (L0..L3)")
        _require(math.isclose(sum(self.budget_shares), 1.0, abs_tol=1e-6), "cascade.budget_shares", self.budget_shares, "shares must sum to 1.0")
        _require(self.default_deadline_ms > 0, "cascade.default_deadline_ms", self.default_deadline_ms, "use a positive deadline in ms")
        _require(0.0 <= self.reply_margin_ms < self.default_deadline_ms, "cascade.reply_margin_ms", self.reply_margin_ms,
                 f"use 0..default_deadline_ms ({self.default_deadline_ms}) ms; a few ms covers serialising the answer")
        _require(self.min_stage_ms >= 0.0, "cascade.min_stage_ms", self.min_stage_ms, "use >= 0 ms")
        _require(0.0 < self.cost_alpha <= 1.0, "cascade.cost_alpha", self.cost_alpha, "use an EWMA weight in (0, 1]")
        _require(self.cost_quantile == 0.0 or 0.5 <= self.cost_quantile < 1.0, "cascade.cost_quantile", self.cost_quantile, "use 0 (no safety margin) or a quantile in [0.5, 1)")
        for key in ("cost_prior_fixed_ms", "cost_prior_per_item_us"):
            v = getattr(self, key)
            _require(len(v) == 4 and all(math.isfinite(x) and x >= 0 for x in v), f"cascade.{key}", v, "give 4 finite costs >= 0 (L0..L3)")
        _require(self.probe_after_skips >= 0, "cascade.probe_after_skips", self.probe_after_skips, "use >= 0 skips (0 = never probe)")
        _require(1 <= self.max_concurrent <= 4096, "cascade.max_concurrent", self.max_concurrent, "use 1..4096 Recommend calls at once")
        _require(bool(self.index_factory) and not any(c.isspace() for c in self.index_factory), "cascade.index_factory", self.index_factory,
                 "use \"auto\" or a faiss factory string without spaces: Flat, IVF{n},Flat, IVF{n},PQ{m}, HNSW{M}")
        _require(self.nprobe >= 0, "cascade.nprobe", self.nprobe, "use 0 (the index's default) or a positive list count")
        _require(self.ef_search >= 0, "cascade.ef_search", self.ef_search, "use 0 (the index's default) or a positive efSearch")
        _require(self.popular_per_category >= 1, "cascade.popular_per_category", self.popular_per_category, "use at least 1 item per category")
        _require(self.log_max_bytes >= 4096, "cascade.log_max_bytes", self.log_max_bytes, "use at least 4096 bytes per log file")
        _require(self.log_backups >= 1, "cascade.log_backups", self.log_backups, "keep at least 1 rotated file")
        require_metrics_port("cascade.metrics_port", self.metrics_port)


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """The HTTP gateway (``recserve gateway serve``, docs/architecture.md §3, "The HTTP gateway").

    * ``host`` / ``port``: where it listens (0 = a free port; ``recserve serve`` prints
      the URL).
    * ``timeout_ms``: the longest a request may take; a body's ``deadline_ms`` can only
      shorten it. The earlier of the two is the absolute deadline sent downstream.
    * ``max_body_bytes``: a larger request body is refused (400) before it is read whole.
    * ``max_concurrency``: requests in flight in the process, all tenants together; one
      more is refused at once with 429 and ``Retry-After`` (the tenant caps are
      ``[[tenants]] max_concurrent_requests``).
    * ``api_key_header``: the header carrying a tenant's API key.
    """

    host: str = "127.0.0.1"
    port: int = 0
    timeout_ms: float = 1000.0
    max_body_bytes: int = 1 << 20
    max_concurrency: int = 256
    api_key_header: str = "X-API-Key"

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "gateway.port", self.port, "use a TCP port in 0..65535 (0 = pick a free one)")
        _require(bool(self.host) and not any(c.isspace() for c in self.host), "gateway.host", self.host, 'use an address of this machine, e.g. "127.0.0.1"')
        _require(math.isfinite(self.timeout_ms) and 0 < self.timeout_ms <= 600_000, "gateway.timeout_ms", self.timeout_ms, "use a timeout in (0, 600000] ms")
        _require(1024 <= self.max_body_bytes <= 256 << 20, "gateway.max_body_bytes", self.max_body_bytes, "use 1024..268435456 bytes (default 1 MiB)")
        _require(1 <= self.max_concurrency <= 1_000_000, "gateway.max_concurrency", self.max_concurrency, "use 1..1000000 requests in flight")
        _require(_is_token(self.api_key_header), "gateway.api_key_header", self.api_key_header, 'use an HTTP header name of letters, digits and "-", e.g. "X-API-Key"')


@dataclasses.dataclass(frozen=True)
class AdminConfig:
    """Who may run admin operations (shard ``Upsert``; ``Admin.ReloadModels``,
    ``RefreshIndex``, ``AddItems``): callers sending ``authorization: Bearer <token>``
    in call metadata (:mod:`recserve.rpc.auth`).

    * ``token_env``: the environment variable every process reads the token from (the
      token itself never sits in the spec). A process without a token refuses admin
      operations unless it was started with ``--insecure-admin``.
    """

    token_env: str = "RECSERVE_ADMIN_TOKEN"

    def __post_init__(self) -> None:
        _require(_is_token(self.token_env) and "-" not in self.token_env and "." not in self.token_env, "admin.token_env", self.token_env,
                 'name an environment variable (letters, digits, "_"), e.g. "RECSERVE_ADMIN_TOKEN"')  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """Optional TLS on every gRPC server that reads this spec and on the HTTP gateway
    (:mod:`recserve.rpc.auth`). All empty = plaintext (the default, for loopback).

    * ``cert_file`` / ``key_file``: the PEM certificate chain and private key the
      servers present; both or neither.
    * ``ca_file``: the PEM roots clients verify the servers with (default: the system
      roots); for a self-signed certificate, the certificate itself.
    """

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""

    def __post_init__(self) -> None:
        _require(bool(self.cert_file) == bool(self.key_file), "tls.cert_file / tls.key_file", (self.cert_file, self.key_file),
                 "give both the certificate and its private key (PEM files), or neither for plaintext")  # fmt: skip
        _require(not self.ca_file or bool(self.cert_file), "tls.ca_file", self.ca_file, "set tls.cert_file and tls.key_file too (ca_file alone enables nothing)")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


def _is_token(text: str) -> bool:
    """Letters, digits, '-', '_' and '.', non-empty: header, tenant and variable names."""
    return bool(text) and text.replace("-", "").replace("_", "").replace(".", "").isalnum() and text.isascii()


@dataclasses.dataclass(frozen=True)
class TenantConfig:
    """One tenant: who it is and its quotas (reference §10.12).

    * ``api_key_env``: the environment variable holding the tenant's API key, read by the
      gateway when it starts (the key itself never sits in the spec). ``""`` = no key:
      such a tenant serves the requests that carry no key header; at most one tenant may
      be key-less.
    * ``rate_per_s`` / ``burst``: the gateway's token bucket (requests/s; ``burst``
      requests may arrive at once, 0 = ``max(1, rate_per_s)``, one second's worth).
    * ``max_concurrent_requests``: the tenant's requests in flight at the gateway (0 = no
      cap). Over either quota: 429 with ``Retry-After``.
    * ``max_concurrent_cost``: the schedulers' per-tenant cost cap (their cost unit).
    * ``priority``: what its requests are sent downstream with.

    Example::

        [[tenants]]
        name = "feed"
        api_key_env = "FEED_API_KEY"
        rate_per_s = 200.0
        burst = 50
        max_concurrent_requests = 32
    """

    name: str
    max_concurrent_cost: float = math.inf
    rate_per_s: float = math.inf
    priority: str = "standard"
    api_key_env: str = ""
    burst: float = 0.0
    max_concurrent_requests: int = 0

    def __post_init__(self) -> None:
        _require(_is_token(self.name), "tenants[].name", self.name, 'give every tenant a name of letters, digits, "-", "_" or "."')
        _require(self.max_concurrent_cost > 0, f"tenants.{self.name}.max_concurrent_cost", self.max_concurrent_cost, "use a positive cost")
        _require(self.rate_per_s > 0, f"tenants.{self.name}.rate_per_s", self.rate_per_s, "use a positive rate")
        _require(self.priority in PRIORITIES, f"tenants.{self.name}.priority", self.priority, f"use one of {PRIORITIES}")
        _require(self.api_key_env == "" or (_is_token(self.api_key_env) and not self.api_key_env[0].isdigit() and "-" not in self.api_key_env and "." not in self.api_key_env),
                 f"tenants.{self.name}.api_key_env", self.api_key_env, 'name an environment variable (letters, digits, "_"), e.g. "FEED_API_KEY", or "" for no key')
        _require(math.isfinite(self.burst) and self.burst >= 0, f"tenants.{self.name}.burst", self.burst, "use >= 0 requests (0 = one second's worth of rate_per_s)")
        _require(self.max_concurrent_requests >= 0, f"tenants.{self.name}.max_concurrent_requests", self.max_concurrent_requests, "use >= 0 requests (0 = no cap)")

    @property
    def bucket_size(self) -> float:
        """Requests the token bucket holds: ``burst``, or one second of ``rate_per_s`` (at least 1)."""
        return self.burst if self.burst > 0 else max(1.0, self.rate_per_s)


FREE_PORTS = "0"  # a [topology] port range meaning "each process picks a free port"


def parse_port_range(field: str, text: str) -> tuple[int, int] | None:
    """A ``[topology]`` port range: ``"0"`` -> None (every process binds port 0 and reports
    the port it got), ``"7100-7199"`` -> ``(7100, 7199)`` (inclusive). ConfigError naming
    ``field`` otherwise."""
    if text == FREE_PORTS:
        return None
    lo_text, sep, hi_text = text.partition("-")
    ok = bool(sep) and lo_text.isdigit() and hi_text.isdigit() and 1 <= int(lo_text) <= int(hi_text) <= 65535
    _require(ok, field, text, 'use "0" (free ports) or an inclusive range "LOW-HIGH" within 1..65535, e.g. "7100-7199"')
    return int(lo_text), int(hi_text)


@dataclasses.dataclass(frozen=True)
class TopologyConfig:
    """Which processes ``recserve serve`` starts and where they listen (docs/architecture.md §3).

    * ``rankers``: ranker replicas; the cascade routes over them (``[routing]``).
    * ``generators``: Generation replicas (``recserve generate serve``); the gateway
      routes ``/v1/generate`` over them. 0 = none (``/v1/generate`` answers 503).
    * ``host``: the IPv4 address every process binds and is reached at. The launcher
      starts them all on this machine, so it must be one of its addresses.
    * ``shard_ports`` / ``ranker_ports``: ``"0"`` = each process binds a free port and
      writes it to its port file (no race between picking and binding), or an inclusive
      range ``"7100-7199"`` whose k-th port process k binds (a restart keeps it).
    * ``cascade_port``: the Recommender's port (0 = a free one). ``generator_ports``: as
      ``ranker_ports``, for the Generation replicas.
    * ``unix_sockets``: the processes share this host, so every shard also listens on a
      unix socket in its data root and the rankers and the cascade dial it (``unix:``
      addresses: no TCP stack on the shard fan-out, the widest hop).

    Example::

        [topology]
        rankers = 2
        ranker_ports = "7200-7209"
        cascade_port = 7300
    """

    rankers: int = 2
    host: str = "127.0.0.1"
    shard_ports: str = FREE_PORTS
    ranker_ports: str = FREE_PORTS
    cascade_port: int = 0
    unix_sockets: bool = False
    generators: int = 1
    generator_ports: str = FREE_PORTS

    def __post_init__(self) -> None:
        _require(1 <= self.rankers <= 64, "topology.rankers", self.rankers, "use 1..64 ranker processes")
        _require(0 <= self.generators <= 64, "topology.generators", self.generators, "use 0..64 generation processes (0 = none)")
        generator_range = parse_port_range("topology.generator_ports", self.generator_ports)
        if generator_range is not None:
            size = generator_range[1] - generator_range[0] + 1
            _require(size >= self.generators, "topology.generator_ports", self.generator_ports,
                     f"give at least generators = {self.generators} ports (the range holds {size})")
        parts = self.host.split(".")
        _require(len(parts) == 4 and all(p.isdigit() and int(p) <= 255 for p in parts), "topology.host", self.host,
                 'use an IPv4 address of this machine, e.g. "127.0.0.1" (processes are started here)')  # fmt: skip
        shard_range = parse_port_range("topology.shard_ports", self.shard_ports)
        ranker_range = parse_port_range("topology.ranker_ports", self.ranker_ports)
        _require(0 <= self.cascade_port <= 65535, "topology.cascade_port", self.cascade_port, "use a TCP port in 0..65535 (0 = pick a free one)")
        if ranker_range is not None:
            size = ranker_range[1] - ranker_range[0] + 1
            _require(size >= self.rankers, "topology.ranker_ports", self.ranker_ports, f"give at least rankers = {self.rankers} ports (the range holds {size})")
        if shard_range is not None and ranker_range is not None:
            overlap = shard_range[0] <= ranker_range[1] and ranker_range[0] <= shard_range[1]
            _require(not overlap, "topology.ranker_ports", self.ranker_ports, f"use a range disjoint from shard_ports = {self.shard_ports!r}")
        for name, rng in (("shard_ports", shard_range), ("ranker_ports", ranker_range)):
            inside = rng is not None and self.cascade_port != 0 and rng[0] <= self.cascade_port <= rng[1]
            _require(not inside, "topology.cascade_port", self.cascade_port, f"use a port outside {name} = {getattr(self, name)!r}")

    def ports(self, field: str, count: int) -> tuple[int, ...]:
        """The ports of ``count`` processes whose range is ``field`` (``"shard_ports"``,
        ``"ranker_ports"`` or ``"generator_ports"``): all 0 (free ports) or the range's
        first ``count`` ports.

        >>> TopologyConfig(ranker_ports="7200-7209").ports("ranker_ports", 2)
        (7200, 7201)
        """
        rng = parse_port_range(f"topology.{field}", getattr(self, field))
        if rng is None:
            return (0,) * count
        size = rng[1] - rng[0] + 1
        _require(size >= count, f"topology.{field}", getattr(self, field), f"give at least {count} ports (the range holds {size})")
        return tuple(range(rng[0], rng[0] + count))


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The whole cluster spec. Cross-references are checked here: every feature names a
    known table, shard addresses match ``sharding.num_shards``."""

    tables: tuple[TableConfig, ...]
    features: tuple[FeatureConfig, ...]
    sharding: ShardingConfig = ShardingConfig()
    shard_addresses: tuple[str, ...] = ()
    shard_server: ShardServerConfig = ShardServerConfig()
    lookup: LookupConfig = LookupConfig()
    ranker: RankerConfig = RankerConfig()
    routing: RoutingConfig = RoutingConfig()
    cascade: CascadeConfig = CascadeConfig()
    gateway: GatewayConfig = GatewayConfig()
    tenants: tuple[TenantConfig, ...] = ()
    topology: TopologyConfig = TopologyConfig()
    generation: GenerationServiceConfig = GenerationServiceConfig()
    admin: AdminConfig = AdminConfig()
    tls: TlsConfig = TlsConfig()

    def __post_init__(self) -> None:
        _require(len(self.tables) > 0, "tables", list(self.tables), "declare at least one [[tables]] entry")
        names = [t.name for t in self.tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        _require(not dup, "tables[].name", dup, "table names must be unique")
        fnames = [f.name for f in self.features]
        fdup = sorted({n for n in fnames if fnames.count(n) > 1})
        _require(not fdup, "features[].name", fdup, "feature names must be unique")
        for f in self.features:
            _require(f.table in names, f"features.{f.name}.table", f.table, f"name one of the declared tables {names}")
        if self.shard_addresses:
            _require(
                len(self.shard_addresses) == self.sharding.num_shards,
                "shard_addresses",
                list(self.shard_addresses),
                f"give exactly sharding.num_shards ({self.sharding.num_shards}) addresses, or none to let the launcher pick",
            )
        tnames = [t.name for t in self.tenants]
        _require(len(set(tnames)) == len(tnames), "tenants[].name", tnames, "tenant names must be unique")
        keyless = [t.name for t in self.tenants if not t.api_key_env]
        _require(len(keyless) <= 1, "tenants[].api_key_env", keyless, "give every tenant but one an api_key_env: the key-less tenant serves requests without a key")
        envs = [t.api_key_env for t in self.tenants if t.api_key_env]
        _require(len(set(envs)) == len(envs), "tenants[].api_key_env", envs, "give each tenant its own key variable")
        # L2 sends up to max(l1_out, k) candidates in one Rank call (k widens the stages).
        widest = max(self.cascade.l1_out, self.cascade.max_k)
        _require(widest <= self.ranker.max_candidates, "cascade.l1_out / cascade.max_k", widest,
                 f"keep both at most ranker.max_candidates ({self.ranker.max_candidates:,}): L2 ranks that many in one Rank call, or raise ranker.max_candidates")
        shard_ports = parse_port_range("topology.shard_ports", self.topology.shard_ports)
        if shard_ports is not None:
            size = shard_ports[1] - shard_ports[0] + 1
            _require(size >= self.sharding.num_shards, "topology.shard_ports", self.topology.shard_ports,
                     f"give at least sharding.num_shards = {self.sharding.num_shards} ports (the range holds {size})")  # fmt: skip

    def table(self, name: str) -> TableConfig:
        for t in self.tables:
            if t.name == name:
                return t
        raise ConfigError(f"table {name!r} is not declared; declared tables: {[t.name for t in self.tables]}")

    def features_of(self, table: str) -> list[str]:
        return [f.name for f in self.features if f.table == table]
