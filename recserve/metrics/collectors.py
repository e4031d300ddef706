"""Scrape-time collectors: Prometheus families read from counters the code keeps anyway.

The lookup client (``LookupStats``), the shard (its counters, row caches and cold tiers)
and every scheduler (queue depth, drops, sheds) already count what the catalogue exports, as
plain integers on their own objects. These collectors read them when ``/metrics`` is
scraped (on prometheus_client's HTTP thread: plain attribute reads, no locks on the
request path), so exporting costs the request path nothing.

A process may hold several sources of one kind at once, or one after another (a ranker
reload builds a new lookup client; every model has its own scheduler): live sources are
summed per label value, and a source that is retired (closed) leaves its last counters
behind, so an exported counter never goes down while the process lives. Nothing is
exported for a kind this process never tracked (a ranker has no shard families).

The module-level :data:`LOOKUP`, :data:`SHARD` and :data:`SCHEDULERS` are registered on
the default registry at import; tests build their own on a fresh ``CollectorRegistry``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from recserve.metrics import catalog
from recserve.metrics.catalog import Family

Reading = Mapping[str, float]  # field -> current value
Reader = Callable[[], Reading]


class Sources:
    """Live sources by label value plus the summed last counters of retired ones
    (``gauges`` are fields that are not carried over when a source retires)."""

    def __init__(self, gauges: Iterable[str] = ()) -> None:
        self._gauges = frozenset(gauges)
        self._lock = threading.Lock()  # track/retire (rare, event loop) vs totals (scrape thread)
        self._live: dict[int, tuple[object, str, Reader]] = {}
        self._retired: dict[str, dict[str, float]] = {}

    def track(self, key: object, label: str, read: Reader) -> None:
        """Start reading ``read()`` under ``label``; ``key`` (the source object) identifies it for :meth:`retire`."""
        with self._lock:
            self._live[id(key)] = (key, label, read)

    def retire(self, key: object) -> None:
        """Stop reading ``key``; its counters stay in the totals. Unknown keys are ignored."""
        with self._lock:
            entry = self._live.pop(id(key), None)
            if entry is None:
                return
            _, label, read = entry
            kept = self._retired.setdefault(label, {})
            for field, value in read().items():
                if field not in self._gauges:
                    kept[field] = kept.get(field, 0.0) + value

    def totals(self) -> dict[str, dict[str, float]]:
        """label -> field -> live sum + retired counters; empty if nothing was ever tracked."""
        with self._lock:
            live = list(self._live.values())
            out = {label: dict(fields) for label, fields in self._retired.items()}
        for _, label, read in live:
            fields = out.setdefault(label, {})
            for field, value in read().items():
                fields[field] = fields.get(field, 0.0) + value
        return out


def _family(spec: Family) -> CounterMetricFamily | GaugeMetricFamily:
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


class _Base(Collector):
    families: tuple[Family, ...] = ()

    def describe(self) -> Iterator[Metric]:
        # Registration asks for the names only; without describe() it would collect().
        for spec in self.families:
            yield _family(spec)


# -- the lookup client ----------------------------------------------------------------------

# LookupStats fields read (recserve.lookup.stats); one source per LookupClient.
LOOKUP_FIELDS = ("windows", "ids_requested", "ids_unique", "rpcs_primary", "rpcs_hedge", "ids_sent", "near_cache_hits", "near_cache_lookups")


class LookupCollector(_Base):
    """``recserve_lookup_*`` summed over the process's lookup clients (their ``LookupStats``)."""

    families = (catalog.LOOKUP_WINDOWS, catalog.LOOKUP_IDS_REQUESTED, catalog.LOOKUP_IDS_UNIQUE, catalog.LOOKUP_RPCS,
                catalog.LOOKUP_IDS_SENT, catalog.LOOKUP_NEAR_CACHE_HITS, catalog.LOOKUP_NEAR_CACHE_LOOKUPS)  # fmt: skip

    def __init__(self) -> None:
        self.sources = Sources()

    def track(self, stats: Any) -> None:
        """Export ``stats`` (a ``LookupStats``, read at scrape time) until :meth:`retire`."""
        self.sources.track(stats, "", lambda: {f: float(getattr(stats, f)) for f in LOOKUP_FIELDS})

    def retire(self, stats: Any) -> None:
        self.sources.retire(stats)

    def collect(self) -> Iterator[Metric]:
        totals = self.sources.totals()
        if not totals:
            return
        t = totals[""]
        simple = (
            (catalog.LOOKUP_WINDOWS, "windows"), (catalog.LOOKUP_IDS_REQUESTED, "ids_requested"), (catalog.LOOKUP_IDS_UNIQUE, "ids_unique"),
            (catalog.LOOKUP_IDS_SENT, "ids_sent"), (catalog.LOOKUP_NEAR_CACHE_HITS, "near_cache_hits"),
            (catalog.LOOKUP_NEAR_CACHE_LOOKUPS, "near_cache_lookups"),
        )  # fmt: skip
        for spec, field in simple:
            family = _family(spec)
            family.add_metric([], t.get(field, 0.0))
            yield family
        rpcs = _family(catalog.LOOKUP_RPCS)
        rpcs.add_metric(["primary"], t.get("rpcs_primary", 0.0))
        rpcs.add_metric(["hedge"], t.get("rpcs_hedge", 0.0))
        yield rpcs


# -- the shard ------------------------------------------------------------------------------

# What a shard's reader returns (embedding_server/server.py builds it from its service).
SHARD_FIELDS = ("rows_hot", "rows_warm", "rows_cold", "row_cache_hits", "row_cache_misses", "row_cache_evictions", "rocksdb_reads")


class ShardCollector(_Base):
    """``recserve_shard_*`` of this process's shard (one reader returning :data:`SHARD_FIELDS`)."""

    families = (catalog.SHARD_ROWS, catalog.SHARD_ROW_CACHE_HITS, catalog.SHARD_ROW_CACHE_MISSES,
                catalog.SHARD_ROW_CACHE_EVICTIONS, catalog.SHARD_ROCKSDB_READS)  # fmt: skip

    def __init__(self) -> None:
        self.sources = Sources()

    def track(self, key: object, read: Reader) -> None:
        self.sources.track(key, "", read)

    def retire(self, key: object) -> None:
        self.sources.retire(key)

    def collect(self) -> Iterator[Metric]:
        totals = self.sources.totals()
        if not totals:
            return
        t = totals[""]
        rows = _family(catalog.SHARD_ROWS)
        for tier in ("hot", "warm", "cold"):
            rows.add_metric([tier], t.get(f"rows_{tier}", 0.0))
        yield rows
        for spec, field in ((catalog.SHARD_ROW_CACHE_HITS, "row_cache_hits"), (catalog.SHARD_ROW_CACHE_MISSES, "row_cache_misses"),
                            (catalog.SHARD_ROW_CACHE_EVICTIONS, "row_cache_evictions"), (catalog.SHARD_ROCKSDB_READS, "rocksdb_reads")):  # fmt: skip
            family = _family(spec)
            family.add_metric([], t.get(field, 0.0))
            yield family


# -- the schedulers -------------------------------------------------------------------------

SCHEDULER_FIELDS = ("queue_depth", "cancelled", "expired", "shed")


class SchedulerCollector(_Base):
    """``recserve_scheduler_queue_depth`` / ``_cancelled_total`` / ``_expired_total`` /
    ``_shed_total`` by loop name, summed over live loops of one name plus the drops of closed ones."""

    families = (catalog.SCHEDULER_QUEUE_DEPTH, catalog.SCHEDULER_CANCELLED, catalog.SCHEDULER_EXPIRED, catalog.SCHEDULER_SHED)

    def __init__(self) -> None:
        self.sources = Sources(gauges=("queue_depth",))

    def track(self, key: object, loop: str, read: Reader) -> None:
        """Export ``read()`` (:data:`SCHEDULER_FIELDS`) under label ``loop`` until :meth:`retire`."""
        self.sources.track(key, loop, read)

    def retire(self, key: object) -> None:
        self.sources.retire(key)

    def collect(self) -> Iterator[Metric]:
        totals = self.sources.totals()
        if not totals:
            return
        fields_by_spec = ((catalog.SCHEDULER_QUEUE_DEPTH, "queue_depth"), (catalog.SCHEDULER_CANCELLED, "cancelled"),
                          (catalog.SCHEDULER_EXPIRED, "expired"), (catalog.SCHEDULER_SHED, "shed"))  # fmt: skip
        for spec, field in fields_by_spec:
            family = _family(spec)
            for loop, fields in sorted(totals.items()):
                family.add_metric([loop], fields.get(field, 0.0))
            yield family


def register_defaults(registry: CollectorRegistry) -> tuple[LookupCollector, ShardCollector, SchedulerCollector]:
    """Fresh collectors of every kind, registered on ``registry``."""
    made = (LookupCollector(), ShardCollector(), SchedulerCollector())
    for collector in made:
        registry.register(collector)
    return made


LOOKUP, SHARD, SCHEDULERS = register_defaults(REGISTRY)
