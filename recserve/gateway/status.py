"""The status page: scrape every process's ``/metrics``, keep a minute of it, sum it up.

The gateway serves a small page for people (``GET /``, ``static/status.html``) that
refreshes itself from ``GET /v1/status``, the JSON built here. Three layers, the core
free of I/O (docs/architecture.md §2, "core logic is a synchronous state machine"):

- :func:`parse_metrics` turns Prometheus text into a flat ``{(sample, labels): value}``
  map (``prometheus_client.parser``); :class:`Snapshot` is one timestamped map.
- :class:`StatusCore` keeps, per target, the snapshots of the last ``window_s`` seconds
  (a small ring, on an injected clock) and whether its last scrape worked, and builds
  the status JSON: each process up or down; per cascade stage the request rate and
  p50/p99 over the window (from histogram bucket deltas, the way Prometheus'
  ``histogram_quantile`` does it); per shard the rows served by tier and the row-cache
  hit rate; per lookup client the dedup ratio, ids per RPC, hedges and the near-cache
  hit rate; degraded responses by reason. Totals are the processes' own counters (so
  they match what each ``/metrics`` says); rates and percentiles are window deltas.
- :class:`StatusScraper` fetches every target concurrently with aiohttp, short
  timeouts, every ``interval_s``; a target that does not answer, answers non-200 or
  answers garbage is recorded as down, never an error page.

:func:`add_routes` wires the page and the JSON into a gateway ``web.Application`` and runs
the scrape loop with the app's lifecycle::

    app = web.Application()
    add_routes(app, {"shard-0": "http://127.0.0.1:9100/metrics", "cascade-0": ...})
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.resources
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from recserve.cluster.supervise import SUPERVISOR_STATE_ENV, read_report
from recserve.errors import ConfigError

log = logging.getLogger(__name__)

WINDOW_S = 60.0
INTERVAL_S = 2.0
TIMEOUT_S = 1.0
STAGES = ("L0", "L1", "L2", "L3")
TIERS = ("hot", "warm", "cold")

# The metric catalogue (recserve/metrics/catalog.py defines them; names are the contract).
# Sample names: a counter's sample carries ``_total``; a histogram's ``_bucket`` / ``_count``.
STAGE_LATENCY = "recserve_cascade_stage_latency_seconds"
STAGE_DEGRADED = "recserve_cascade_stage_degraded_total"
DEGRADED = "recserve_degraded_responses_total"
SHARD_ROWS = "recserve_shard_rows_total"
ROW_CACHE_HITS = "recserve_shard_row_cache_hits_total"
ROW_CACHE_MISSES = "recserve_shard_row_cache_misses_total"
ROW_CACHE_EVICTIONS = "recserve_shard_row_cache_evictions_total"
ROCKSDB_READS = "recserve_shard_rocksdb_reads_total"
LOOKUP_WINDOWS = "recserve_lookup_windows_total"
LOOKUP_REQUESTED = "recserve_lookup_ids_requested_total"
LOOKUP_UNIQUE = "recserve_lookup_ids_unique_total"
LOOKUP_RPCS = "recserve_lookup_rpcs_total"
LOOKUP_IDS_SENT = "recserve_lookup_ids_sent_total"
NEAR_HITS = "recserve_lookup_near_cache_hits_total"
NEAR_LOOKUPS = "recserve_lookup_near_cache_lookups_total"
RPC_REQUESTS = "recserve_rpc_requests_total"

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
SampleKey = tuple[str, Labels]  # (sample name, labels)


def parse_metrics(text: str) -> dict[SampleKey, float]:
    """Prometheus exposition text → ``{(sample name, sorted labels): value}``.

    Raises ValueError on text the parser rejects. ``_created`` samples (start times, not
    counts) are dropped. Example: ``'x_total{tier="hot"} 3'`` → ``{("x_total",
    (("tier", "hot"),)): 3.0}``.
    """
    samples: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def _matches(labels: Labels, match: Mapping[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in match.items())


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One scrape of one target: ``samples`` as :func:`parse_metrics` returns them,
    taken at ``t_s`` (the core's clock, monotonic seconds)."""

    t_s: float
    samples: Mapping[SampleKey, float]

    def has(self, name: str) -> bool:
        return any(key[0] == name for key in self.samples)

    def total(self, name: str, **match: str) -> float:
        """Sum of every ``name`` sample whose labels include ``match`` (0 when none)."""
        return sum(v for (n, labels), v in self.samples.items() if n == name and _matches(labels, match))

    def by_label(self, name: str, label: str, **match: str) -> dict[str, float]:
        """``name`` summed per value of ``label`` (over the other labels)."""
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name and _matches(labels, match):
                key = dict(labels).get(label)
                if key is not None:
                    out[key] = out.get(key, 0.0) + v
        return out

    def by_labels(self, name: str, label_names: tuple[str, ...]) -> dict[tuple[str, ...], float]:
        """``name`` summed per combination of ``label_names``."""
        out: dict[tuple[str, ...], float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                have = dict(labels)
                key = tuple(have.get(label, "") for label in label_names)
                out[key] = out.get(key, 0.0) + v
        return out


def delta(new: Snapshot, old: Snapshot) -> Snapshot:
    """What the counters did between two scrapes of one target: ``new - old`` per sample,
    at ``t_s = new.t_s - old.t_s`` (the span). A sample that went down (the process
    restarted and its counters reset) counts from zero, as Prometheus' ``increase`` does."""
    out: dict[SampleKey, float] = {}
    for key, value in new.samples.items():
        d = value - old.samples.get(key, 0.0)
        out[key] = value if d < 0 else d
    return Snapshot(t_s=new.t_s - old.t_s, samples=out)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0..1) of a histogram given as cumulative ``(le, count)``
    buckets, interpolating linearly inside the bucket it falls in (Prometheus'
    ``histogram_quantile``). None when the histogram is empty; the largest finite bound
    when the quantile falls in the ``+Inf`` bucket.

    Example: buckets ``[(0.1, 10), (0.2, 20), (inf, 20)]``, q = 0.75 → 0.15.
    """
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def _buckets(snapshot: Snapshot, name: str, **match: str) -> list[tuple[float, float]]:
    """The cumulative buckets of histogram ``name`` summed over every other label."""
    per_le = snapshot.by_label(f"{name}_bucket", "le", **match)
    return sorted((float(le), count) for le, count in per_le.items())


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _kind(name: str) -> str:
    """``shard-0`` → ``shard``; ``gateway`` → ``gateway``."""
    head, sep, tail = name.rpartition("-")
    return head if sep and tail.isdigit() else name


@dataclasses.dataclass
class _Target:
    name: str
    url: str
    kind: str
    history: collections.deque[Snapshot]  # oldest first, within the window
    up: bool = False
    error: str = "not scraped yet"
    last_attempt_s: float | None = None


class StatusCore:
    """The status page's state: per target, its last ``window_s`` seconds of snapshots
    and whether its last scrape worked. No I/O; ``clock`` (monotonic seconds) is
    injected so tests step it by hand.

    ``targets`` maps a process name (``shard-0``, ``ranker-1``, ``cascade-0``,
    ``gateway``; the part before ``-k`` is its kind) to its ``/metrics`` URL.
    """

    def __init__(self, targets: Mapping[str, str], *, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ConfigError(f"status window_s = {window_s} is invalid: give the seconds of history to keep, > 0 (default {WINDOW_S:g})")
        self.window_s = window_s
        self._clock = clock
        self._targets = {name: _Target(name=name, url=url, kind=_kind(name), history=collections.deque()) for name, url in targets.items()}

    @property
    def targets(self) -> dict[str, str]:
        """Name → ``/metrics`` URL, in the order given."""
        return {t.name: t.url for t in self._targets.values()}

    def record(self, name: str, text: str) -> None:
        """A successful scrape of ``name``: its ``/metrics`` text, now. Text the parser
        rejects marks the target down (it is not a working metrics endpoint)."""
        target = self._targets[name]
        try:
            samples = parse_metrics(text)
        except Exception as e:  # the parser raises ValueError mostly, but not only: any failure means "not metrics"
            self.record_down(name, f"unparseable /metrics: {type(e).__name__} {e}")
            return
        now = self._clock()
        if not target.up and target.last_attempt_s is not None:
            log.info("status: %s is up again (%s)", name, target.url)
        target.up, target.error, target.last_attempt_s = True, "", now
        target.history.append(Snapshot(t_s=now, samples=samples))
        self._expire(target, now)

    def record_down(self, name: str, error: str) -> None:
        """A failed scrape of ``name`` (refused, timed out, non-200): it is down. Its
        older snapshots age out of the window as usual but the last one stays, so its
        totals are still shown (next to "down")."""
        target = self._targets[name]
        now = self._clock()
        if target.up or target.last_attempt_s is None:  # once per outage, not once per scrape
            log.warning("status: %s is down: %s", name, error)
        target.up, target.error, target.last_attempt_s = False, error, now
        self._expire(target, now)

    def _expire(self, target: _Target, now: float) -> None:
        # Keep one snapshot at or before the window's start, so the window delta spans
        # the whole window rather than the part after the first snapshot inside it.
        while len(target.history) > 1 and target.history[1].t_s <= now - self.window_s:
            target.history.popleft()

    # -- the JSON --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The ``GET /v1/status`` body (JSON-able; undefined ratios are None).

        ``processes``: name, kind, url, up, error, seconds since the last scrape.
        ``stages``: per cascade stage L0..L3 the window's request rate (/s), p50/p99
        (ms) and count. ``shards`` / ``lookup``: one row per process exposing those
        metrics, plus a summed ``*_total`` row. ``degraded`` / ``stage_degraded``: per
        (service|stage, reason) the total and the window's count.
        """
        now = self._clock()
        latest: dict[str, Snapshot] = {}
        window: dict[str, Snapshot] = {}
        for t in self._targets.values():
            if t.history:
                latest[t.name] = t.history[-1]
                window[t.name] = delta(t.history[-1], t.history[0])
        processes = [
            {
                "name": t.name, "kind": t.kind, "url": t.url, "up": t.up, "error": t.error,
                "scraped_s_ago": None if t.last_attempt_s is None else round(now - t.last_attempt_s, 3),
            }
            for t in self._targets.values()
        ]  # fmt: skip
        spans = [w.t_s for w in window.values() if w.t_s > 0]
        return {
            "window_s": round(max(spans), 3) if spans else 0.0,
            "processes": processes,
            "stages": self._stages(window),
            "shards": self._shards(latest),
            "lookup": self._lookup(latest),
            "degraded": self._reasons(latest, window, DEGRADED, ("service", "reason")),
            "stage_degraded": self._reasons(latest, window, STAGE_DEGRADED, ("stage", "reason")),
        }

    def _stages(self, window: Mapping[str, Snapshot]) -> list[dict[str, Any]]:
        count_name = f"{STAGE_LATENCY}_count"
        stages = set(STAGES)
        for w in window.values():
            stages.update(w.by_label(count_name, "stage"))
        spans = any(w.t_s > 0 for w in window.values())  # a rate needs two scrapes of someone
        rows = []
        for stage in sorted(stages):
            rate, count = 0.0, 0.0
            per_le: dict[float, float] = {}
            for w in window.values():
                n = w.total(count_name, stage=stage)
                count += n
                if w.t_s > 0:
                    rate += n / w.t_s
                for le, c in _buckets(w, STAGE_LATENCY, stage=stage):
                    per_le[le] = per_le.get(le, 0.0) + c
            p50, p99 = (histogram_quantile(q, per_le.items()) for q in (0.5, 0.99))
            rows.append({
                "stage": stage, "count": count, "rate_per_s": rate if spans else None,
                "p50_ms": None if p50 is None else p50 * 1e3, "p99_ms": None if p99 is None else p99 * 1e3,
            })  # fmt: skip
        return rows

    def _shards(self, latest: Mapping[str, Snapshot]) -> list[dict[str, Any]]:
        names = [t.name for t in self._targets.values() if t.kind == "shard" or (t.name in latest and latest[t.name].has(SHARD_ROWS))]
        rows = [self._shard_row(name, latest.get(name)) for name in names]
        if rows:
            rows.append(self._shard_row("total", None, [latest[n] for n in names if n in latest]))
        return rows

    @staticmethod
    def _shard_row(name: str, snap: Snapshot | None, parts: list[Snapshot] | None = None) -> dict[str, Any]:
        snaps = parts if parts is not None else ([snap] if snap is not None else [])
        if not snaps:
            return {"name": name, "rows": None, "tier_fraction": None, "row_cache": None, "rocksdb_reads": None}
        rows = {tier: sum(s.total(SHARD_ROWS, tier=tier) for s in snaps) for tier in TIERS}
        served = sum(rows.values())
        hits, misses = (sum(s.total(n) for s in snaps) for n in (ROW_CACHE_HITS, ROW_CACHE_MISSES))
        return {
            "name": name,
            "rows": rows,
            "tier_fraction": {tier: _ratio(n, served) for tier, n in rows.items()},
            "row_cache": {
                "hits": hits, "misses": misses, "evictions": sum(s.total(ROW_CACHE_EVICTIONS) for s in snaps),
                "hit_rate": _ratio(hits, hits + misses),
            },
            "rocksdb_reads": sum(s.total(ROCKSDB_READS) for s in snaps),
        }  # fmt: skip

    def _lookup(self, latest: Mapping[str, Snapshot]) -> list[dict[str, Any]]:
        names = [t.name for t in self._targets.values() if t.name in latest and latest[t.name].has(LOOKUP_REQUESTED)]
        rows = [self._lookup_row(name, [latest[name]]) for name in names]
        if rows:
            rows.append(self._lookup_row("total", [latest[n] for n in names]))
        return rows

    @staticmethod
    def _lookup_row(name: str, snaps: list[Snapshot]) -> dict[str, Any]:
        def tot(metric: str, **match: str) -> float:
            return sum(s.total(metric, **match) for s in snaps)

        requested, unique, rpcs, sent = tot(LOOKUP_REQUESTED), tot(LOOKUP_UNIQUE), tot(LOOKUP_RPCS), tot(LOOKUP_IDS_SENT)
        near_hits, near_lookups = tot(NEAR_HITS), tot(NEAR_LOOKUPS)
        return {
            "name": name, "windows": tot(LOOKUP_WINDOWS), "ids_requested": requested, "ids_unique": unique,
            "dedup_ratio": _ratio(requested, unique), "rpcs": rpcs, "hedges": tot(LOOKUP_RPCS, kind="hedge"),
            "ids_per_rpc": _ratio(sent, rpcs), "near_cache_hits": near_hits, "near_cache_lookups": near_lookups,
            "near_cache_hit_rate": _ratio(near_hits, near_lookups),
        }  # fmt: skip

    @staticmethod
    def _reasons(latest: Mapping[str, Snapshot], window: Mapping[str, Snapshot], metric: str, labels: tuple[str, str]) -> list[dict[str, Any]]:
        totals: dict[tuple[str, ...], float] = {}
        recent: dict[tuple[str, ...], float] = {}
        for source, into in ((latest, totals), (window, recent)):
            for snap in source.values():
                for key, v in snap.by_labels(metric, labels).items():
                    into[key] = into.get(key, 0.0) + v
        return [
            {labels[0]: key[0], labels[1]: key[1], "total": totals[key], "last_window": recent.get(key, 0.0)}
            for key in sorted(totals)
            if totals[key] > 0
        ]


class StatusScraper:
    """Scrapes every target of ``core`` concurrently every ``interval_s`` with one
    aiohttp session (``timeout_s`` per request) and records each answer. Explicit
    :meth:`start` / :meth:`aclose`; :meth:`scrape_once` for a caller that paces itself."""

    def __init__(self, core: StatusCore, *, interval_s: float = INTERVAL_S, timeout_s: float = TIMEOUT_S) -> None:
        for field, value in (("interval_s", interval_s), ("timeout_s", timeout_s)):
            if value <= 0:
                raise ConfigError(f"status {field} = {value} is invalid: give seconds > 0")
        self.core = core
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self._task = asyncio.create_task(self._run(), name="status-scraper")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape_once(self) -> None:
        """One round: every target fetched at once; each recorded up or down."""
        await asyncio.gather(*(self._scrape(name, url) for name, url in self.core.targets.items()))

    async def _run(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except Exception:  # a bug in one round must not stop the page updating
                log.exception("status scrape round failed")
            await asyncio.sleep(self.interval_s)

    async def _scrape(self, name: str, url: str) -> None:
        assert self._session is not None, "StatusScraper.start() first"
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    self.core.record_down(name, f"GET {url} answered HTTP {response.status}")
                    return
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self.core.record_down(name, f"GET {url} failed: {type(e).__name__} {e}".rstrip())
            return
        self.core.record(name, text)


STATUS_KEY = web.AppKey("recserve_status_core", StatusCore)


def page_html() -> str:
    """The status page, shipped as package data (recserve/gateway/static/status.html)."""
    return (importlib.resources.files("recserve.gateway") / "static" / "status.html").read_text(encoding="utf-8")


def add_routes(
    app: web.Application, targets: Mapping[str, str], *, interval_s: float = INTERVAL_S, timeout_s: float = TIMEOUT_S,
    window_s: float = WINDOW_S,
) -> None:  # fmt: skip
    """Register ``GET /`` (the page) and ``GET /v1/status`` (its JSON) on ``app`` and
    scrape ``targets`` (name → ``/metrics`` URL) while the app runs (started on
    start-up, stopped on clean-up). The core is at ``app[STATUS_KEY]``."""
    core = StatusCore(targets, window_s=window_s)
    scraper = StatusScraper(core, interval_s=interval_s, timeout_s=timeout_s)
    html = page_html()  # read once: a missing file fails at start-up, not on a request
    app[STATUS_KEY] = core

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html", charset="utf-8")

    async def status(request: web.Request) -> web.Response:
        body = core.status()
        # Under `recserve serve`: the supervisor's restarts and crash-loops, not hidden.
        body["supervisor"] = read_report(os.environ.get(SUPERVISOR_STATE_ENV))
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await scraper.start()
        yield
        await scraper.aclose()

    app.router.add_get("/", page)
    app.router.add_get("/v1/status", status)
    app.cleanup_ctx.append(lifecycle)


def openapi_paths() -> dict[str, Any]:
    """The OpenAPI 3.0 path items of ``GET /`` and ``GET /v1/status`` (with the status
    body's schema inline), for the gateway's ``/openapi.json``."""

    def num(description: str) -> dict[str, Any]:
        return {"type": "number", "nullable": True, "description": description}

    def obj(properties: dict[str, Any], description: str = "", nullable: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "object", "properties": properties, "required": sorted(properties)}
        if description:
            out["description"] = description
        if nullable:
            out["nullable"] = True
        return out

    def array(items: dict[str, Any], description: str) -> dict[str, Any]:
        return {"type": "array", "items": items, "description": description}

    text = {"type": "string"}
    tiers = obj({tier: num(f"{tier} tier") for tier in TIERS}, nullable=True)
    process = obj({
        "name": text, "kind": text, "url": text, "up": {"type": "boolean"}, "error": text,
        "scraped_s_ago": num("seconds since the last scrape attempt; null before the first"),
    })  # fmt: skip
    stage = obj({
        "stage": text, "count": num("stage runs in the window"), "rate_per_s": num("runs per second over the window; null until two scrapes"),
        "p50_ms": num("median latency over the window"), "p99_ms": num("99th percentile latency over the window"),
    })  # fmt: skip
    shard = obj({
        "name": text, "rows": {**tiers, "description": "rows served per tier since start"},
        "tier_fraction": {**tiers, "description": "share of rows served per tier"},
        "row_cache": obj({"hits": num(""), "misses": num(""), "evictions": num(""), "hit_rate": num("hits / (hits + misses)")}, nullable=True),
        "rocksdb_reads": num("keys read from RocksDB since start"),
    })  # fmt: skip
    lookup = obj({
        name: num(description) for name, description in (
            ("windows", ""), ("ids_requested", ""), ("ids_unique", ""), ("dedup_ratio", "ids_requested / ids_unique"), ("rpcs", ""),
            ("hedges", ""), ("ids_per_rpc", "ids sent / RPCs"), ("near_cache_hits", ""), ("near_cache_lookups", ""),
            ("near_cache_hit_rate", "near_cache_hits / near_cache_lookups"),
        )
    } | {"name": text})  # fmt: skip

    def reasons(first: str) -> dict[str, Any]:
        return obj({first: text, "reason": text, "total": num("since start"), "last_window": num("within the window")})

    body = obj({
        "window_s": {"type": "number", "description": "seconds of history the window spans (at most 60)"},
        "processes": array(process, "every scrape target, up or down"),
        "stages": array(stage, "per cascade stage L0..L3"),
        "shards": array(shard, "per shard process, then a 'total' row"),
        "lookup": array(lookup, "per process with a lookup client, then a 'total' row"),
        "degraded": array(reasons("service"), "degraded responses by service and reason"),
        "stage_degraded": array(reasons("stage"), "degraded cascade stages by stage and reason"),
        "supervisor": {"type": "object", "nullable": True, "description": "under `recserve serve`: crash_looping (child names) and "
                       "per child its state, restarts, last exit code and recent exits (recserve/cluster/supervise.py); null otherwise"},
    }, "The status page's numbers, from every process's /metrics")  # fmt: skip
    body["required"].remove("supervisor")  # added by the route, not by StatusCore
    return {
        "/": {"get": {"summary": "The status page (HTML, for people)", "responses": {
            "200": {"description": "one HTML page that refreshes itself from /v1/status", "content": {"text/html": {"schema": text}}}}}},
        "/v1/status": {"get": {"summary": "The status page's JSON: health, stage latencies, tiers, dedup, degraded reasons", "responses": {
            "200": {"description": "the aggregate of every process's /metrics", "content": {"application/json": {"schema": body}}}}}},
    }  # fmt: skip
