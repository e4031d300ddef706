"""Capacity and equal-memory parts of ``recserve bench lookup`` (issue: lookup path at the
physical limit).

* **Equal memory.** :func:`equal_memory_plan` caps recserve's DRAM tiers, row cache,
  block cache and near cache together at Redis's ``used_memory`` after loading the same
  table, through the memory-budgeted planner (``sharding.placement = "budget"``).
  :func:`tiered_plan` is the bigger-than-RAM case: DRAM tiers plus row cache at a
  fraction of the table, the rest in RocksDB read with direct I/O.
* **Knees.** :func:`probe` runs one open-loop Poisson probe and classifies every offered
  request for :class:`~recserve.bench.knee.ProbeResult` (shed, failed, late, degraded
  all count against the knee); :func:`knee_of` bisects with the shared
  :func:`~recserve.bench.knee.find_knee_async` and keeps each probe's p99 for the plot.
* **Best-shot Redis.** :func:`redis_threads_closed_loop` (sync clients on threads) beside
  the asyncio pool of :mod:`recserve.bench.lookup_modes`; :func:`redis_near_window_handler`
  runs MGET on the client's own deduplicated windows with the same near cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from recserve.bench.arrivals import poisson_arrivals
from recserve.bench.knee import OK_TARGET, ProbeResult, find_knee_async

#: ``handle(i, deadline)`` serves request i by ``deadline`` (monotonic s); returns False
#: for a degraded answer; raises for none.
Handler = Callable[[int, float], Awaitable["bool | None"]]

NEAR_CACHE_ROW_OVERHEAD_BYTES = 24  # per cached row: its id, fetch time and version (8 B each)


# ---- memory ------------------------------------------------------------------------------


def redis_memory(port: int) -> dict[str, int]:
    """``used_memory`` and ``used_memory_rss`` (bytes) of the Redis on ``port``."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    try:
        info = r.info("memory")
    finally:
        r.close()
    return {"used_memory": int(info["used_memory"]), "used_memory_rss": int(info["used_memory_rss"])}


def rss_bytes(pid: int) -> int | None:
    """Resident set size of process ``pid`` (``VmRSS``), None if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """How a total byte budget is split: per shard ``shard_memory_bytes`` for the planner
    (DRAM tiers, then row cache) and ``block_cache_bytes``; once, the client's near cache."""

    total_bytes: int
    near_cache_bytes: int
    block_cache_bytes: int
    shard_memory_bytes: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def split_budget(
    total_bytes: int, num_shards: int, *, near_cache_rows: int, dim: int, block_cache_bytes: int, id_space: int = 0
) -> MemoryBudget:
    """Take the near cache (fp32 rows + bookkeeping, plus its dense id -> slot map over
    at most ``id_space`` ids, the table's rows) off the top, then one block cache per
    shard; what is left, split evenly, is each shard's planner budget."""
    from recserve.lookup.near_cache import DENSE_SLOT_MAX_ID

    near = near_cache_rows * (dim * 4 + NEAR_CACHE_ROW_OVERHEAD_BYTES)
    if near_cache_rows and 0 < id_space <= DENSE_SLOT_MAX_ID:
        near += (id_space + 3) * (2 if near_cache_rows < 1 << 15 else 4)  # the map spans up to the largest cached id
    per_shard = (total_bytes - near) // num_shards - block_cache_bytes
    return MemoryBudget(total_bytes, near, block_cache_bytes, max(int(per_shard), 1))


def plan_for_budget(table: Any, popularity: np.ndarray, num_shards: int, shard_memory_bytes: int, *, warm_fraction: float, seed: int) -> Any:
    """The budget planner's result for one table (hot 1% on 2 replicas, warm up to
    ``warm_fraction``, the rest of each shard's budget its row cache)."""
    from recserve.config.spec import ShardingConfig
    from recserve.sharding.planner import plan_tables

    sharding = ShardingConfig(
        num_shards=num_shards, hot_replicas=min(2, num_shards), hot_fraction=0.01, warm_fraction=warm_fraction,
        placement="budget", shard_memory_bytes=shard_memory_bytes,
    )  # fmt: skip
    return plan_tables([table], {table.name: popularity}, sharding, seed=seed)


def data_bytes(result: Any, budget: MemoryBudget, row_cache_bytes: int) -> int:
    """recserve's cache and tier bytes under the cap: DRAM tiers of every shard, their
    row and block caches, the near cache."""
    s = result.plan.num_shards
    return int(result.bytes_per_shard["dram"].sum()) + s * (row_cache_bytes + budget.block_cache_bytes) + budget.near_cache_bytes


# ---- the tiered run's disk floor -----------------------------------------------------------

DIRECT_READ_BLOCK_BYTES = 4096  # RocksDB's data block here: one cold id that misses the caches reads one
DIRECT_READ_THREADS = 16  # the best of 1-32 here: ≈ 13k reads/s on 1 thread, 35-48k on 8-16, fewer on 32


def direct_read_rate(paths: Sequence[Path], *, seconds: float = 0.5, threads: int = DIRECT_READ_THREADS, block_bytes: int = DIRECT_READ_BLOCK_BYTES, seed: int = 0) -> float | None:
    """Random aligned ``block_bytes`` reads per second from ``paths`` (the tiered run's
    SST files) with ``O_DIRECT`` on ``threads`` threads, as a cold read that misses the
    block cache does: the disk's ceiling for the tiered run. None where the files are
    smaller than a block or the file system refuses ``O_DIRECT`` (tmpfs)."""
    import mmap
    import os

    if not hasattr(os, "O_DIRECT"):  # not Linux: no page-cache-free read to measure
        return None
    fds: list[tuple[int, int]] = []
    try:
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                continue
            blocks = os.fstat(fd).st_size // block_bytes
            if blocks:
                fds.append((fd, blocks))
            else:
                os.close(fd)
        if not fds:
            return None
        counts = [0] * threads
        failed: list[OSError] = []
        stop_at = time.monotonic() + seconds

        def reader(t: int) -> None:
            buf = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT needs
            rng = np.random.default_rng(seed + t)
            picks = rng.integers(0, len(fds), 1 << 16)
            fracs = rng.random(1 << 16)
            i = 0
            try:
                while time.monotonic() < stop_at:
                    fd, blocks = fds[picks[i & 0xFFFF]]
                    os.preadv(fd, [buf], int(fracs[i & 0xFFFF] * blocks) * block_bytes)
                    i += 1
            except OSError as exc:  # EINVAL: O_DIRECT accepted at open, refused at read
                failed.append(exc)
            counts[t] = i

        started = time.monotonic()
        workers = [threading.Thread(target=reader, args=(t,), daemon=True) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.monotonic() - started
        return None if failed or elapsed <= 0 else sum(counts) / elapsed
    finally:
        for fd, _ in fds:
            os.close(fd)


def io_floor_rows_per_s(disk_reads_per_s: float | None, cold_reads: int, rows: int) -> float | None:
    """The tiered run's best rows/s if the disk did nothing but its cold reads:
    ``disk_reads_per_s`` / (RocksDB reads per requested row). None without a disk rate
    or without cold reads (then the disk bounds nothing)."""
    if disk_reads_per_s is None or cold_reads <= 0 or rows <= 0:
        return None
    return disk_reads_per_s * rows / cold_reads


# ---- open-loop probes and knees ---------------------------------------------------------


async def probe(rate_per_s: float, seconds: float, total: int, handle: Handler, *, slo_s: float, seed: int) -> tuple[ProbeResult, float | None]:
    """One Poisson probe at ``rate_per_s`` for ``seconds``: every request gets the
    deadline arrival + ``slo_s`` (a later answer is late, none is failed; an arrival the
    generator reaches after its deadline is shed). Returns the classified result and the
    p99 latency (ms) of answered requests."""
    arrivals = poisson_arrivals(rate_per_s, duration_s=seconds, count=total, rng=np.random.default_rng(seed))
    n = int(arrivals.size)
    latency = np.full(n, np.nan)
    degraded = np.zeros(n, dtype=bool)
    shed = np.zeros(n, dtype=bool)
    sent_at = np.zeros(n)
    t0 = time.monotonic()

    async def one(i: int, deadline: float) -> None:
        try:
            full = await handle(i, deadline)
        except Exception:
            return  # no answer: failed
        latency[i] = time.monotonic() - (t0 + arrivals[i])
        degraded[i] = full is False

    tasks = []
    for i, at in enumerate(arrivals.tolist()):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule itself, not synchronisation
        now = time.monotonic()
        sent_at[i] = now - t0
        deadline = t0 + at + slo_s
        if now >= deadline:
            shed[i] = True
            continue
        tasks.append(asyncio.ensure_future(one(i, deadline)))
    if tasks:
        await asyncio.gather(*tasks)
    offered = n / float(arrivals[-1]) if n and arrivals[-1] > 0 else rate_per_s
    achieved = n / float(sent_at[-1]) if n and sent_at[-1] > 0 else 0.0
    answered = latency[~np.isnan(latency)]
    p99 = float(np.percentile(answered, 99) * 1e3) if answered.size else None
    result = ProbeResult.from_requests(offered, achieved_per_s=achieved, latency_s=latency, slo_s=slo_s, degraded=degraded, shed=shed)
    return result, p99


async def knee_of(
    handle: Handler, *, lo_rps: float, hi_rps: float, seconds: float, total: int, slo_s: float, seed: int, settle_s: float = 0.5,
    settle_after_fail_s: float = 2.0, fail_retries: int = 0,
) -> dict[str, Any]:
    """The knee of one contender (:func:`~recserve.bench.knee.find_knee_async`), with
    every probe's p99 (``curve``: [(rate, p99_ms)] in probe order); each probe after the
    first starts ``settle_s`` after the previous one ended, ``settle_after_fail_s`` after
    one that failed (an overloaded probe leaves the most behind)."""
    curve: list[tuple[float, float | None]] = []
    count = 0
    failed = False

    async def run(rate: float) -> ProbeResult:
        nonlocal count, failed
        if count:
            # Let the previous probe's work drain first: right after an overloaded probe
            # the shards still answer its abandoned RPCs, and a probe started then
            # measures that backlog instead of its own rate (naive at 500 req/s right
            # after 10,000: 61-82 % OK, and 90-92 % after a 1 s pause; the client's 517
            # req/s probe after one at 10,687 read 81 %). 0.5 s was not always enough
            # after the first, deepest overload (hi_rps, ≈ 15k req/s): the client's
            # 614 req/s probe after it read 97.3 % and 99.0 % OK, its 599 passed at
            # 100 %, and the knee came out at 599 (issue 9, eighth session; 100 % after
            # a 1 s pause, 96.8 % with none). A failed probe gets the longer pause.
            await asyncio.sleep(settle_after_fail_s if failed else settle_s)
        count += 1
        result, p99 = await probe(rate, seconds, total, handle, slo_s=slo_s, seed=seed + count)
        failed = result.ok_fraction < OK_TARGET
        curve.append((rate, p99))
        return result

    found = await find_knee_async(run, lo_rps=lo_rps, hi_rps=hi_rps, fail_retries=fail_retries)
    out = found.to_dict()
    out["curve"] = curve
    return out


def plot_capacity(path: str | Path, curves: dict[str, Sequence[tuple[float, float | None]]], *, slo_ms: float, title: str) -> None:
    """PNG of p99 against offered rate for every contender (each knee probe one point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
    for name, curve in curves.items():
        pts = sorted((r, p) for r, p in curve if p is not None)
        if pts:
            ax.plot([r for r, _ in pts], [p for _, p in pts], marker="o", label=name)
    ax.axhline(slo_ms, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("p99 latency (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title, fontsize="medium")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- Redis, best shot --------------------------------------------------------------------


def redis_threads_closed_loop(port: int, ids: np.ndarray, lengths: np.ndarray, dim: int, concurrency: int, seconds: float) -> float:
    """Rows/s of MGET per request from ``concurrency`` threads, each with its own sync
    client (hiredis parses; the GIL is released while a thread waits on its socket)."""
    import redis

    from recserve.bench.lookup_modes import Stream, _decode, pool_rows, redis_keys

    stream = Stream(ids=ids, lengths=lengths)
    counter = iter(range(ids.shape[0]))
    lock = threading.Lock()
    done = [0] * concurrency
    stop = time.monotonic() + seconds

    def worker(w: int) -> None:
        r = redis.Redis(host="127.0.0.1", port=port)
        try:
            while time.monotonic() < stop:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                values = cast("list[bytes | None]", r.mget(redis_keys(ids[i])))
                pool_rows(_decode(values, dim), stream)
                done[w] += 1
        finally:
            r.close()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) * ids.shape[1] / (time.perf_counter() - t0)


def redis_near_window_handler(client: Any, ids: np.ndarray, lengths: np.ndarray, weights: np.ndarray, window: int, near_ids: np.ndarray) -> Callable[[int], Awaitable[None]]:
    """Handler of window index w: requests ``[w * window, (w + 1) * window)``, deduplicated,
    the near cache's ids (``near_ids``, sorted; rows held locally, as the client's near
    cache holds them) served locally and one MGET of the rest; then every request pooled."""
    from recserve.bench.lookup_modes import Stream, _decode, pool_rows, redis_keys

    stream = Stream(ids=ids, lengths=lengths)
    near_rows = np.take(weights, near_ids, axis=0)
    dim = weights.shape[1]

    async def handle(w: int) -> None:
        block = ids[w * window : (w + 1) * window]
        uids, inverse = np.unique(block, return_inverse=True)
        slot = np.minimum(np.searchsorted(near_ids, uids), max(near_ids.size - 1, 0))
        hit = (np.take(near_ids, slot) == uids) if near_ids.size else np.zeros(uids.size, bool)
        rows = np.empty((uids.size, dim), dtype=np.float32)
        rows[hit] = np.take(near_rows, slot[hit], axis=0)
        miss = np.flatnonzero(~hit)
        if miss.size:
            rows[miss] = _decode(await client.mget(redis_keys(uids[miss])), dim)
        inv = inverse.reshape(block.shape)
        for r in range(block.shape[0]):
            pool_rows(np.take(rows, inv[r], axis=0), stream)

    return handle


def format_capacity(r: dict[str, Any]) -> list[str]:
    """The report's lines for C-high, memory, unloaded latency, the tiered run and the
    knees (a table of every probe's p99 by offered rate)."""

    def f(v: Any, spec: str = ",.0f") -> str:
        return "n/a" if v is None else format(v, spec)

    c = r["config"]
    lines: list[str] = []
    high = r.get("rows_per_s_c_high") or {}
    lines += [
        f"C={c.get('concurrency_high')}: client {f(high.get('feature_parallel'))} rows/s, redis per request {f(high.get('redis_mget'))}, redis dedup {f(high.get('redis_mget_dedup'))}",
        f"vs redis per request: C={c['concurrency']} {f(r.get('speedup_vs_redis_per_request_c64'), '.2f')}  C={c.get('concurrency_high')} {f(r.get('speedup_vs_redis_per_request_c256'), '.2f')}   "
        f"vs redis dedup: {f(r.get('speedup_vs_redis_dedup_c64'), '.2f')} / {f(r.get('speedup_vs_redis_dedup_c256'), '.2f')}",
        f"memory: redis used_memory {f(r.get('redis_used_memory'))} B (rss {f(r.get('redis_rss_bytes'))}), recserve data {f(r.get('recserve_data_bytes'))} B, shard rss {f(r.get('shard_rss_bytes'))} B",
        f"unloaded ({f(r.get('unloaded_rate_per_s'), 'g')} req/s): p50 {f(r.get('unloaded_p50_ms'), '.2f')} ms  p99 {f(r.get('unloaded_p99_ms'), '.2f')} ms",
        f"tiered ({c.get('tiered_fraction', 0.1):.0%} DRAM, RocksDB direct reads): {f(r.get('tiered_rows_per_s'))} rows/s; equal memory / tiered {f(r.get('equal_memory_vs_tiered'), '.2f')}",
    ]
    t = r.get("tiered") or {}
    if t.get("cold_reads_per_window") is not None:
        lines.append(
            f"  tiered disk: {f(t.get('cold_reads_per_window'))} RocksDB reads per window, disk {f(t.get('disk_direct_reads_per_s'))} direct 4 KiB reads/s "
            f"-> at most {f(t.get('io_floor_rows_per_s'))} rows/s (equal memory / that floor {f(t.get('equal_memory_vs_io_floor'), '.2f')})"
        )
    if r.get("knees"):
        lines.append(f"knees (>= 99% OK within {c.get('knee_slo_ms')} ms): " + "  ".join(f"{n} {f(v)}/s ({r['knees'][n]['status']})" for n, v in r["knee_per_s"].items())
                     + f"   ratio vs redis {f(r.get('knee_ratio_vs_redis'), '.2f')}, vs naive {f(r.get('knee_ratio_vs_naive'), '.2f')}")
        lines.append(f"{'offered/s':>10}  " + "  ".join(f"{n + ' p99 ms':>24}" for n in r["knees"]))
        rates = sorted({round(rate, 1) for k in r["knees"].values() for rate, _ in k["curve"]})
        for rate in rates:
            cells = []
            for k in r["knees"].values():
                p = [p99 for x, p99 in k["curve"] if round(x, 1) == rate]
                cells.append(f"{f(p[0] if p else None, '.2f'):>24}")
            lines.append(f"{rate:>10,.0f}  " + "  ".join(cells))
    return lines


class RedisContenders:
    """The Redis contenders of one run: MGET per request (the faster of the asyncio pool
    and sync clients on threads) and MGET per deduplicated window of the client's size
    with the client's near cache. Built once; each :meth:`measure` runs them all."""

    def __init__(self, port: int, weights: np.ndarray, stream: Any, plan: Any, max_concurrency: int, log: Callable[[str], None] = lambda _msg: None) -> None:
        """``stream``: the run's :class:`~recserve.bench.lookup_modes.Stream`; ``plan``: its
        sharding plan (the near cache holds its hot ids); the pool holds
        ``max_concurrency`` connections; ``log`` gets a line as each mode starts."""
        import redis.asyncio as aioredis

        from recserve.bench.lookup_modes import redis_handler

        self.port, self.log = port, log
        self.weights, self.stream = weights, stream
        self.client = aioredis.Redis(host="127.0.0.1", port=port, max_connections=max_concurrency)
        self.per_request_handler = redis_handler(self.client, stream, weights.shape[1])
        self.near_ids = np.sort(plan.table(stream.table).hot_ids)  # the client's near cache: the plan's hot ids

    async def warm_up(self, c: int, seconds: float) -> None:
        """Open the pool's connections before anything is timed, as the client's warm-up does."""
        from recserve.bench.lookup_modes import closed_loop

        await closed_loop(c, seconds, self.stream.ids.shape[0], self.per_request_handler)

    async def measure(self, c: int, seconds: float, window: int) -> dict[str, float]:
        """Rows/s of each mode at concurrency ``c`` for ``seconds`` each, the dedup mode on
        windows of ``window`` requests."""
        from recserve.bench.lookup_modes import closed_loop

        stream, k, total = self.stream, self.stream.ids_per_request, self.stream.ids.shape[0]
        self.log(f"redis MGET per request, C={c}: asyncio pool")
        pool = (await closed_loop(c, seconds, total, self.per_request_handler)).rows_per_s(k)
        self.log(f"redis MGET per request, C={c}: sync clients on threads")
        threads = await asyncio.to_thread(redis_threads_closed_loop, self.port, stream.ids, stream.lengths, self.weights.shape[1], c, seconds)
        self.log(f"redis MGET per window of {window} requests, near cache of {self.near_ids.size:,} rows, C={c}")
        wh = redis_near_window_handler(self.client, stream.ids, stream.lengths, self.weights, window, self.near_ids)
        res = await closed_loop(max(1, c // window), seconds, total // window, wh)
        return {"per_request_asyncio": pool, "per_request_threads": threads, "per_request": max(pool, threads),
                "dedup": res.requests * window * k / res.seconds}  # fmt: skip

    async def close(self) -> None:
        await self.client.aclose()
