"""The contenders of ``recserve bench lookup``, each driven by the same request stream.

Every mode answers the same question for request ``i`` (``stream.ids[i]``, K item ids in
B bags): the pooled ``[B, D]`` sums of those rows. Modes:

* ``feature_parallel`` — :class:`~recserve.lookup.client.LookupClient` (windows, dedup
  across callers, one RPC per shard per window, near cache);
* ``naive`` — one RPC per request per shard, no window, no cross-request dedup, same
  servers and channels (ids are unique within each message, as the wire contract
  requires, so repeats inside one request are sent once);
* ``redis_mget`` — one Redis ``MGET`` of the request's K keys (redis-py + hiredis);
* ``redis_mget_dedup`` — one ``MGET`` per window of requests, of the window's unique keys;
* ``torchrec_local`` — TorchRec ``EmbeddingBagCollection`` in process: the no-network limit.

Closed-loop drivers keep ``concurrency`` requests in flight; :func:`open_loop` issues
Poisson arrivals at a fixed rate that does not slow down when the system stalls;
:func:`rate_sweep` repeats it per offered rate and mode (``--sweep-rates``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from recserve.bench.arrivals import poisson_arrivals


@dataclasses.dataclass
class Stream:
    """``ids``: int64 [R, K] request ids; ``lengths``: int64 [B] bag lengths (sum K),
    the same for every request."""

    ids: np.ndarray
    lengths: np.ndarray
    table: str = "item"
    feature: str = "item_id"

    @property
    def ids_per_request(self) -> int:
        return int(self.ids.shape[1])

    def bag_starts(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.lengths)[:-1]))


@dataclasses.dataclass
class ModeResult:
    requests: int
    seconds: float

    def rows_per_s(self, ids_per_request: int) -> float:
        return self.requests * ids_per_request / self.seconds if self.seconds > 0 else 0.0


async def closed_loop(concurrency: int, seconds: float, total: int, handle: Callable[[int], Awaitable[None]]) -> ModeResult:
    """``concurrency`` workers take request indices in order until ``seconds`` pass or
    the stream ends; each awaits ``handle(i)`` before taking the next."""
    counter = itertools.count()
    stop = time.monotonic() + seconds

    async def worker() -> int:
        done = 0
        while time.monotonic() < stop:
            i = next(counter)
            if i >= total:
                break
            await handle(i)
            done += 1
        return done

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ModeResult(sum(counts), time.perf_counter() - t0)


@dataclasses.dataclass
class OpenLoopRun:
    """One open-loop run. ``latencies_s``: float [A], scheduled arrival to answer, for
    the A answered requests; ``good``: bool [A], False where the handler reported a
    degraded answer; ``requests``: arrivals scheduled; ``failures``: arrivals whose
    handler raised or ran out of time, or that were shed because the generator reached
    them after their deadline; ``span_s``: the arrival period, or until the last answer
    if later."""

    latencies_s: np.ndarray
    good: np.ndarray
    requests: int
    failures: int
    span_s: float


#: A sweep handler: ``handle(i, deadline)`` serves request i by ``deadline`` (monotonic
#: s); returns False for a degraded answer (None or True: a full one), raises for none.
TimedHandler = Callable[[int, float], Awaitable["bool | None"]]


async def open_loop_run(rate_per_s: float, seconds: float, total: int, handle: TimedHandler, seed: int = 0, timeout_s: float = math.inf) -> OpenLoopRun:
    """Poisson arrivals at ``rate_per_s`` for ``seconds``: request i (``handle(i,
    deadline)``, i = 0, 1, ...) starts at its scheduled time whether or not earlier ones
    finished. Its deadline is the scheduled arrival + ``timeout_s``; an arrival the
    generator reaches only after its deadline (the event loop is saturated) is shed and
    counted failed, so an overloaded run still ends about ``timeout_s`` after its
    arrivals. Same ``seed`` = same arrival times and requests."""
    arrivals = poisson_arrivals(rate_per_s, duration_s=seconds, count=total, rng=np.random.default_rng(seed))
    latencies = np.full(arrivals.size, np.nan)
    good = np.ones(arrivals.size, dtype=bool)
    failures = 0
    last = 0.0
    t0 = time.monotonic()

    async def one(i: int, deadline: float) -> None:
        nonlocal failures, last
        try:
            full = await handle(i, deadline)
        except Exception:  # counted, reported; the run goes on
            failures += 1
            return
        now = time.monotonic()
        latencies[i] = now - (t0 + arrivals[i])
        good[i] = full is not False
        last = max(last, now - t0)

    tasks = []
    for i, at in enumerate(arrivals.tolist()):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule itself, not synchronisation
        deadline = t0 + at + timeout_s
        if time.monotonic() >= deadline:
            failures += 1  # shed: starting it could not answer it in time
            continue
        tasks.append(asyncio.ensure_future(one(i, deadline)))
    await asyncio.gather(*tasks)
    answered = ~np.isnan(latencies)
    return OpenLoopRun(latencies[answered], good[answered], int(arrivals.size), failures, max(seconds, last))


async def open_loop(rate_per_s: float, seconds: float, total: int, handle: Callable[[int], Awaitable[None]], seed: int = 0) -> tuple[np.ndarray, int]:
    """:func:`open_loop_run` without deadlines, reduced to (latencies in seconds of
    completed requests, measured from the *scheduled* arrival; failures)."""

    async def untimed(i: int, deadline: float) -> None:
        await handle(i)

    run = await open_loop_run(rate_per_s, seconds, total, untimed, seed)
    return run.latencies_s, run.failures


async def rate_sweep(rates: Sequence[float], seconds: float, total: int, handlers: dict[str, TimedHandler], *, timeout_s: float, slo_ms: float, seed: int) -> list[dict[str, Any]]:
    """Every handler at every offered rate, in rate order; at one rate all handlers get
    the same arrival times and the same requests, each with ``timeout_s`` from its
    scheduled arrival. Returns the sweep list of :mod:`recserve.bench.sweep` (one dict
    per rate, one point per handler)."""
    from recserve.bench.sweep import summarise

    out: list[dict[str, Any]] = []
    for j, rate in enumerate(rates):
        point: dict[str, Any] = {"offered_per_s": float(rate)}
        for mode, handle in handlers.items():
            gc.collect()  # no garbage of the previous run is collected inside this one
            run = await open_loop_run(rate, seconds, total, handle, seed=seed + j, timeout_s=timeout_s)
            point[mode] = summarise(run.latencies_s, run.good, requests=run.requests, failures=run.failures, arrival_s=seconds, span_s=run.span_s, slo_ms=slo_ms)
        out.append(point)
    return out


async def client_vs_naive_sweep(client: Any, kjts: list[Any], plan: Any, stream: Stream, addresses: Sequence[str], rates: Sequence[float], *, seconds: float, timeout_s: float, slo_ms: float, seed: int) -> list[dict[str, Any]]:
    """:func:`rate_sweep` of the lookup client (``feature_parallel``; request i is
    ``kjts[i]`` when prebuilt) and ``naive`` (its own channels to ``addresses``). Each
    request must be answered ``timeout_s`` after its scheduled arrival: the client then
    answers degraded (default rows), naive is cancelled and fails."""
    from recserve.lookup.transport import GrpcShardTransport

    async def fp(i: int, deadline: float) -> bool:
        kjt = kjts[i] if i < len(kjts) else make_kjt(stream.ids[i], stream.lengths, stream.feature)
        return not (await client.lookup(kjt, pooled=True, deadline=deadline)).degraded

    transport = GrpcShardTransport(list(addresses))
    naive_untimed = naive_handler(transport, plan, stream, plan.table(stream.table).dim, timeout_s=timeout_s)

    async def naive(i: int, deadline: float) -> None:
        await asyncio.wait_for(naive_untimed(i), deadline - time.monotonic())

    try:
        return await rate_sweep(rates, seconds, stream.ids.shape[0], {"feature_parallel": fp, "naive": naive}, timeout_s=timeout_s, slo_ms=slo_ms, seed=seed)
    finally:
        await transport.close()


def pool_rows(rows: np.ndarray, stream: Stream) -> np.ndarray:
    """Rows [K, D] of one request -> bag sums [B, D] (empty bags: zeros)."""
    out = np.zeros((stream.lengths.shape[0], rows.shape[1]), dtype=np.float32)
    nonempty = stream.lengths > 0
    if nonempty.any():
        out[nonempty] = np.add.reduceat(rows, stream.bag_starts()[nonempty], axis=0)
    return out


# ---- naive: one RPC per request per shard ---------------------------------------------------


def naive_handler(transport: Any, plan: Any, stream: Stream, dim: int, timeout_s: float = 5.0) -> Callable[[int], Awaitable[None]]:
    """Per request: dedup within the request only, route with the client's router
    (hot replicas rotated per request), one RPC per destination shard in parallel
    (each with ``timeout_s``), decode, pool. Same pure parts as the client, no window."""
    from recserve.lookup.reassemble import TableAssembly
    from recserve.lookup.route import ShardState, route_window
    from recserve.lookup.wire import build_request, parse_response
    from recserve.v1 import common_pb2

    router = plan.router(stream.table)
    table_plan = plan.table(stream.table)
    state = ShardState.healthy(plan.num_shards)
    header = common_pb2.RequestHeader(request_id="naive", tenant="bench")

    async def handle(i: int) -> None:
        ids = stream.ids[i]
        uids, inverse = np.unique(ids, return_inverse=True)
        routed = route_window({stream.table: uids}, {stream.table: np.arange(uids.size)}, {stream.table: table_plan}, {stream.table: router}, state, rotation=i, min_ids_per_extra_rpc=0)
        from recserve.lookup.window import TableWindow

        w = TableWindow(stream.table, uids, inverse.reshape(-1), np.array([0, ids.size]), stream.lengths, np.array([0, stream.lengths.size]))
        windows = {stream.table: w}
        by_shard = routed.by_shard()
        shards = list(by_shard)
        requests = [build_request(by_shard[s], windows, row_dtype="float32", header=header, plan_version=plan.version) for s in shards]
        replies = await asyncio.gather(*(transport.lookup(s, r, timeout_s) for s, r in zip(shards, requests)))
        asm = TableAssembly(w, dim, np.ones(w.unique, np.int16))
        for s, reply in zip(shards, replies):
            for u, r in zip(by_shard[s], parse_response(reply, by_shard[s], {stream.table: dim}, row_dtype="float32", pooled=False)):
                assert r.rows is not None
                asm.put_rows(u.positions, r.rows, u.col_start, u.col_end, r.found, r.not_owned)
        pool_rows(np.take(asm.rows, inverse.reshape(-1), axis=0), stream)

    return handle


# ---- Redis ---------------------------------------------------------------------------------


def redis_keys(ids: np.ndarray) -> list[bytes]:
    """8-byte big-endian keys (no per-id Python formatting)."""
    return np.ascontiguousarray(ids, dtype=">i8").view("V8").tolist()  # type: ignore[no-any-return]


async def load_redis(client: Any, weights: np.ndarray, chunk: int = 20_000) -> None:
    """MSET every row (key = id, value = fp32 row bytes) in pipelined chunks."""
    for start in range(0, weights.shape[0], chunk):
        end = min(start + chunk, weights.shape[0])
        keys = redis_keys(np.arange(start, end, dtype=np.int64))
        values = np.ascontiguousarray(weights[start:end]).view(f"V{weights.shape[1] * 4}").ravel().tolist()
        await client.mset(dict(zip(keys, values)))


def _decode(values: list[bytes | None], dim: int) -> np.ndarray:
    if any(v is None for v in values):
        raise RuntimeError("redis is missing rows the benchmark loaded")
    return np.frombuffer(b"".join(values), dtype=np.float32).reshape(len(values), dim)  # type: ignore[arg-type]


def redis_handler(client: Any, stream: Stream, dim: int) -> Callable[[int], Awaitable[None]]:
    async def handle(i: int) -> None:
        values = await client.mget(redis_keys(stream.ids[i]))
        pool_rows(_decode(values, dim), stream)

    return handle


def redis_window_handler(client: Any, stream: Stream, dim: int, window: int) -> Callable[[int], Awaitable[None]]:
    """Handler of *window index* w: requests [w * window, (w + 1) * window) in one MGET
    of their unique keys, then every request's rows by ``np.take`` and pooled."""

    async def handle(w: int) -> None:
        block = stream.ids[w * window : (w + 1) * window]
        uids, inverse = np.unique(block, return_inverse=True)
        rows = _decode(await client.mget(redis_keys(uids)), dim)
        inv = inverse.reshape(block.shape)
        for r in range(block.shape[0]):
            pool_rows(np.take(rows, inv[r], axis=0), stream)

    return handle


# ---- in-process TorchRec ---------------------------------------------------------------------


def torchrec_local(weights: np.ndarray, stream: Stream, batch: int, seconds: float, pooling: str = "sum") -> tuple[ModeResult, Any]:
    """EBC forward over batches of ``batch`` requests until ``seconds`` pass; returns the
    result and the EBC (reused as the correctness oracle)."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=stream.table,
                embedding_dim=weights.shape[1],
                num_embeddings=weights.shape[0],
                feature_names=[stream.feature],
                pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN,
            )
        ],
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        ebc.embedding_bags[stream.table].weight.copy_(torch.from_numpy(weights))
    done = 0
    stop = time.monotonic() + seconds
    t0 = time.perf_counter()
    with torch.no_grad():
        while time.monotonic() < stop and done < stream.ids.shape[0]:
            block = stream.ids[done : done + batch]
            kjt = make_kjt(block.reshape(-1), np.tile(stream.lengths, block.shape[0]), stream.feature)
            ebc(kjt)
            done += block.shape[0]
    return ModeResult(done, time.perf_counter() - t0), ebc


def make_kjt(values: np.ndarray, lengths: np.ndarray, feature: str) -> Any:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=[feature], values=torch.from_numpy(np.ascontiguousarray(values)), lengths=torch.from_numpy(lengths))


def safe_ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(b):
        return None
    return a / b
