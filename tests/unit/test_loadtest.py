"""recserve.loadtest without sockets: the open-loop schedule and its lag accounting, the
outcome recorder (hdrh against a numpy oracle), requests drawn from a catalog, the
window-sweep arms, and the driver on virtual time against a stalled fake server — the
stall shows in the open loop's p99 (measured from the scheduled send time) and hides in
a closed loop's."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
from pathlib import Path

import numpy as np
import pytest

from recserve.config.spec import ClusterConfig
from recserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from recserve.loadtest.driver import run_closed_loop, run_open_loop
from recserve.loadtest.record import LoadRecorder, LoadSummary
from recserve.loadtest.schedule import LAG_WARN_MS, OpenLoopSchedule
from recserve.loadtest.sweeps import DISPATCH_ARM, window_arm_config, window_arms, window_result
from recserve.loadtest.targets import Target, TargetKind, status_name

# ---- the schedule ----------------------------------------------------------------------


def test_due_hands_out_each_request_once_at_its_time_and_records_the_lag() -> None:
    s = OpenLoopSchedule(np.array([0.010, 0.020, 0.030, 0.040]), start_s=100.0)
    assert s.next_send_s() == pytest.approx(100.010)
    assert list(s.due(100.005)) == []  # nothing due yet
    assert list(s.due(100.025)) == [0, 1]  # late: both at once, a burst, not a stretched schedule
    assert list(s.due(100.025)) == []  # never twice
    assert list(s.due(100.030)) == [2]
    assert not s.done
    assert list(s.due(100.040)) == [3]
    assert s.done and s.next_send_s() is None
    lag = s.lag()
    assert lag.sent == 4 and lag.max_ms == pytest.approx(15.0)
    assert lag.mean_ms == pytest.approx((15.0 + 5.0 + 0.0 + 0.0) / 4)
    assert lag.offered_rps == pytest.approx(4 / 0.040)
    assert s.scheduled(1) == pytest.approx(100.020)


def test_a_generator_on_time_is_not_behind_and_a_late_one_says_by_how_much() -> None:
    offsets = np.arange(1, 101) * 0.01  # 100/s for 1 s
    on_time = OpenLoopSchedule(offsets, start_s=0.0)
    for t in offsets:
        on_time.due(float(t))
    assert not on_time.lag().behind
    assert on_time.lag().sent_rps == pytest.approx(100.0)

    late = OpenLoopSchedule(offsets, start_s=0.0)
    late.due(0.5)  # stalled until 0.5 s: 50 requests sent in one burst, the first 490 ms late
    for t in offsets[50:]:
        late.due(float(t))
    lag = late.lag()
    assert lag.max_ms == pytest.approx(490.0)
    assert lag.p99_ms > LAG_WARN_MS and lag.behind
    # The rate held (the burst caught up by 1 s), so the report says late, not slow.
    assert lag.sent_rps == pytest.approx(100.0)
    assert "490 ms late" in lag.describe() and "the rate held" in lag.describe()


def test_a_generator_that_sent_at_a_lower_rate_is_behind_even_with_small_p99() -> None:
    offsets = np.arange(1, 101) * 0.01
    s = OpenLoopSchedule(offsets, start_s=0.0)
    for t in offsets:
        s.due(float(t))
    s.sent_at_s[-1] = 1.2  # the last send 200 ms late: 100 / 1.2 s < 98% of 100/s
    lag = s.lag()
    assert lag.sent_rps < 0.98 * lag.offered_rps and lag.p99_ms <= LAG_WARN_MS and lag.behind
    assert "fell behind" in lag.describe() and "83% of the offered rate" in lag.describe()


def test_unsorted_offsets_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="ascending"):
        OpenLoopSchedule(np.array([0.2, 0.1]), start_s=0.0)


# ---- the recorder ----------------------------------------------------------------------


def test_outcomes_follow_the_knee_precedence_and_errors_are_counted_by_status() -> None:
    r = LoadRecorder(slo_s=0.050)
    for _ in range(7):
        r.on_send()
    r.on_answer(0.010, degraded=False, done_s=1.0)  # ok
    r.on_answer(0.060, degraded=False, done_s=1.0)  # late
    r.on_answer(0.070, degraded=True, done_s=1.0)  # late beats degraded
    r.on_answer(0.020, degraded=True, done_s=1.0)  # degraded in time
    r.on_error("RESOURCE_EXHAUSTED", done_s=1.0)  # shed
    r.on_error("DEADLINE_EXCEEDED", done_s=1.0)
    r.on_error("DEADLINE_EXCEEDED", done_s=1.5)
    lag = OpenLoopSchedule(np.linspace(0.1, 1.0, 7), start_s=0.0)
    lag.due(1.0)
    s = r.summary(lag.lag(), start_s=0.0, duration_s=1.0)
    assert (s.ok, s.late, s.degraded, s.shed, s.failed) == (1, 2, 1, 1, 2)
    assert s.errors == {"DEADLINE_EXCEEDED": 2, "RESOURCE_EXHAUSTED": 1}
    assert s.degraded_fraction == pytest.approx(2 / 4)
    assert s.span_s == pytest.approx(1.5)  # the last answer came after the schedule's end
    assert s.goodput_rps == pytest.approx(1 / 1.5) and s.completed_rps == pytest.approx(4 / 1.5)
    assert s.in_flight == 0 and s.sent == 7
    probe = s.probe()
    assert (probe.ok, probe.late, probe.degraded, probe.shed, probe.failed, probe.requests) == (1, 2, 1, 1, 2, 7)
    d = s.to_dict()
    for key in ("offered_rps", "completed_rps", "goodput_rps", "shed", "late", "degraded_fraction", "errors", "p50_ms", "p99_ms", "p999_ms", "generator_lag_ms"):
        assert key in d, key


def test_hdr_percentiles_match_numpy_within_the_histograms_precision() -> None:
    rng = np.random.default_rng(3)
    lat = rng.lognormal(mean=np.log(0.005), sigma=0.8, size=20_000)  # seconds, ~5 ms median
    r = LoadRecorder(slo_s=1.0)
    for v in lat.tolist():
        r.on_send()
        r.on_answer(v, degraded=False, done_s=1.0)
    ranked = np.sort(lat) * 1e3
    for q in (50, 99, 99.9):
        k = int(np.ceil(q / 100 * lat.size))  # the k-th smallest sample (1-based), give or take one rank of rounding
        got = r.percentile_ms(q)
        assert got is not None and ranked[k - 2] * (1 - 1e-3) <= got <= ranked[k] * (1 + 1e-3), (q, got, ranked[k - 2 : k + 1])


def test_status_names() -> None:
    assert status_name(ResourceExhausted("queue full")) == "RESOURCE_EXHAUSTED"
    assert status_name(Unavailable("down")) == "UNAVAILABLE"
    assert status_name(asyncio.TimeoutError()) == "DEADLINE_EXCEEDED"
    assert status_name(ValueError("x")) == "INTERNAL"


# ---- requests from the catalog ---------------------------------------------------------


@dataclasses.dataclass
class _Csr:
    values: np.ndarray
    offsets: np.ndarray


@dataclasses.dataclass
class _Log:
    user: np.ndarray
    item: np.ndarray


@dataclasses.dataclass
class _View:
    num_users: int
    num_items: int
    train: _Log
    user_history: _Csr


def test_request_pool_draws_zipf_users_with_their_own_impressions_and_histories() -> None:
    from recserve.loadtest.requests import RequestPool

    rng = np.random.default_rng(0)
    users, items = 200, 1000
    log_users = rng.integers(0, users, 5000)
    log_items = rng.integers(0, items, 5000)
    lengths = rng.integers(0, 20, users)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    hist = rng.integers(0, items, int(offsets[-1]))
    view = _View(users, items, _Log(log_users, log_items), _Csr(hist, offsets))
    pool = RequestPool.from_catalog(view, size=3000, candidates=8, history=5, zipf_a=1.2, seed=1)  # type: ignore[arg-type]
    assert pool.candidates.shape == (3000, 8) and pool.user_ids.dtype == np.int64
    # Zipf: the most drawn user takes far more than a uniform share (1/200).
    counts = np.bincount(pool.user_ids, minlength=users)
    assert counts.max() / 3000 > 0.1
    for e in range(0, 3000, 97):  # the oracle: a per-user scan of the log, outside the code
        u = int(pool.user_ids[e])
        shown = log_items[log_users == u][:8]
        np.testing.assert_array_equal(pool.candidates[e, : shown.size], shown)
        np.testing.assert_array_equal(pool.history(e), hist[offsets[u] : offsets[u + 1]][-5:])
    assert pool.entry(3001) == 1


# ---- window-sweep arms -----------------------------------------------------------------


def test_window_arms_fix_the_window_turn_dispatch_close_off_and_the_near_cache_off() -> None:
    from recserve.config import load
    from recserve.lookup.config import LookupClientConfig

    cluster: ClusterConfig = load(None)
    base = LookupClientConfig.from_cluster(cluster)
    base = dataclasses.replace(base, lookup=dataclasses.replace(base.lookup, near_cache_rows=1000, max_inflight_batches=3))
    arms = window_arms([0, 0.5, 1])
    assert [a.name for a in arms] == ["0 ms", "0.5 ms", "1 ms", DISPATCH_ARM]
    for arm in arms:
        cfg = window_arm_config(base, arm.window_ms, close_at_dispatch=arm.close_at_dispatch)
        lk = cfg.lookup
        assert lk.window_ms == lk.max_window_ms == arm.window_ms  # adaptive off: the window is W
        assert lk.close_at_dispatch is (arm.name == DISPATCH_ARM)
        assert lk.near_cache_rows == 0 and lk.max_inflight_batches == 3
    assert base.lookup.near_cache_rows == 1000  # the caller's config is not touched


def test_window_result_ratio_is_1ms_over_0_at_half_the_knee() -> None:
    def arm(w: float, ids_per_cpu: list[float], dispatch: bool = False) -> dict[str, object]:
        return {"arm": f"{w}", "window_ms": w, "close_at_dispatch": dispatch,
                "points": [{"rate_fraction": f, "ids_per_shard_cpu_s": v, "p99_ms": 10.0} for f, v in zip((0.25, 0.5, 0.75), ids_per_cpu)]}

    arms = [arm(0.0, [1.0, 2.0, 3.0]), arm(1.0, [5.0, 12.0, 20.0]), arm(0.0, [100.0, 100.0, 100.0], dispatch=True)]
    r = window_result(arms, {"knee_per_s": 400.0, "status": "found"}, [100, 200, 300], slo_ms=50.0, max_inflight_batches=4)
    assert r["ids_per_shard_cpu_s_ratio_1ms_vs_0"] == pytest.approx(6.0)  # not the dispatch arm's 100
    assert r["goal_met"] is True


# ---- the driver on virtual time, against a stalled fake server --------------------------


class VirtualTime:
    """A clock that moves only when the generator sleeps (open loop) or, in ``auto``
    mode, when a request waits (a closed loop has no generator to move it)."""

    def __init__(self, *, auto: bool = False) -> None:
        self.t = 0.0
        self.auto = auto
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.t

    async def _release(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.t:
            _, _, fut = heapq.heappop(self._waiters)
            fut.set_result(None)
        for _ in range(3):  # let the released requests finish on this tick
            await asyncio.sleep(0)

    async def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)
        await self._release()

    async def until(self, t: float) -> None:
        if self.auto:
            self.t = max(self.t, t)
            return
        if t <= self.t:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (t, next(self._seq), fut))
        await fut


class StalledServer(Target):
    """Answers at once, except that from ``stall_at`` the server stalls ``stall_s``:
    every request arriving in that interval is answered when it ends."""

    kind = TargetKind.RECOMMEND

    def __init__(self, vt: VirtualTime, *, stall_at: float, stall_s: float, service_s: float = 0.0) -> None:
        self.vt, self.stall_at, self.stall_end, self.service_s = vt, stall_at, stall_at + stall_s, service_s
        self.arrived_in_stall = 0

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def call(self, i: int, deadline_s: float) -> bool:
        now = self.vt.t
        if self.stall_at <= now < self.stall_end:
            self.arrived_in_stall += 1
            await self.vt.until(self.stall_end)
        elif self.service_s:
            await self.vt.until(now + self.service_s)
        return False


def test_a_200ms_stall_shows_in_the_open_loop_p99_and_hides_in_a_closed_loop() -> None:
    async def open_loop() -> tuple[LoadSummary, int]:
        vt = VirtualTime()
        server = StalledServer(vt, stall_at=1.0, stall_s=0.200)
        s = await run_open_loop(server, rate_rps=200.0, duration_s=3.0, slo_s=0.050, timeout_s=1.0, seed=0, clock=vt.clock, sleep=vt.sleep)
        return s, server.arrived_in_stall

    s, in_stall = asyncio.run(open_loop())
    # The open loop kept sending through the stall (~40 requests at 200/s), on time.
    assert in_stall >= 20
    assert s.generator_lag_ms == pytest.approx(0.0, abs=1e-6)
    assert s.p99_ms is not None and s.p99_ms >= 150.0  # ~7% of requests waited up to 200 ms
    assert s.late >= 20 and s.answered == s.requests

    async def closed_loop() -> tuple[LoadSummary, int]:
        vt = VirtualTime(auto=True)
        server = StalledServer(vt, stall_at=1.0, stall_s=0.200, service_s=0.005)
        s = await run_closed_loop(server, concurrency=1, requests=600, slo_s=0.050, timeout_s=1.0, clock=vt.clock)
        return s, server.arrived_in_stall

    c, c_in_stall = asyncio.run(closed_loop())
    assert c_in_stall == 1  # the one request out when it began; the loop then waited with it
    assert c.max_ms is not None and c.max_ms >= 200.0 - 5.0  # that request did see the stall...
    assert c.p99_ms is not None and c.p99_ms < 10.0  # ...and the closed loop's p99 hides it


# ---- addresses of a running `recserve serve` -------------------------------------------


def test_addresses_come_from_the_serve_data_dir_or_fixed_topology_ports(tmp_path: Path) -> None:
    from recserve.errors import ConfigError
    from recserve.loadtest.discover import grpc_addresses

    cluster = load_default()
    for sub, kind, n, base in (("shards", "shard", 2, 7000), ("rankers", "ranker", 2, 7100), ("cascade", "cascade", 1, 7200)):
        (tmp_path / sub).mkdir()
        for k in range(n):
            (tmp_path / sub / f"{kind}-{k}.port").write_text(str(base + k))
    assert grpc_addresses(TargetKind.LOOKUP, cluster, tmp_path) == ["127.0.0.1:7000", "127.0.0.1:7001"]
    assert grpc_addresses(TargetKind.RANK, cluster, tmp_path) == ["127.0.0.1:7100", "127.0.0.1:7101"]
    assert grpc_addresses(TargetKind.RECOMMEND, cluster, tmp_path) == ["127.0.0.1:7200"]
    with pytest.raises(ConfigError, match="--data DIR"):  # free ports: only the serving process knows them
        grpc_addresses(TargetKind.RANK, cluster, None)
    fixed = dataclasses.replace(cluster, topology=dataclasses.replace(cluster.topology, ranker_ports="7200-7209", cascade_port=7300))
    assert grpc_addresses(TargetKind.RANK, fixed, None) == ["127.0.0.1:7200", "127.0.0.1:7201"]
    assert grpc_addresses(TargetKind.RECOMMEND, fixed, None) == ["127.0.0.1:7300"]


def load_default() -> ClusterConfig:
    from recserve.config import load

    return load(None)
