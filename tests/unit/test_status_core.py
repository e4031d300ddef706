"""The status page's aggregation core (recserve/gateway/status.py) on hand-written
Prometheus text and a fake clock: parsing, window deltas, histogram quantiles, tier and
cache ratios, the lookup dedup ratio, degraded reasons, and targets that are down."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import Counter, Histogram

from recserve.errors import ConfigError
from recserve.gateway.status import Snapshot, StatusCore, StatusScraper, delta, histogram_quantile, parse_metrics

BOUNDS = ("0.001", "0.005", "0.01", "0.05", "+Inf")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stage_text(counts: dict[str, tuple[int, int, int, int, int]], degraded: int = 0) -> str:
    """A cascade's /metrics: per stage, the cumulative bucket counts at BOUNDS."""
    lines = ["# TYPE recserve_cascade_stage_latency_seconds histogram"]
    for stage, cum in counts.items():
        lines += [f'recserve_cascade_stage_latency_seconds_bucket{{le="{le}",stage="{stage}"}} {c}' for le, c in zip(BOUNDS, cum)]
        lines += [f'recserve_cascade_stage_latency_seconds_count{{stage="{stage}"}} {cum[-1]}',
                  f'recserve_cascade_stage_latency_seconds_sum{{stage="{stage}"}} 0.5']  # fmt: skip
    lines += ["# TYPE recserve_degraded_responses_total counter",
              f'recserve_degraded_responses_total{{reason="deadline",service="Recommender"}} {degraded}',
              'recserve_degraded_responses_total{reason="shard_unavailable",service="Ranking"} 0']  # fmt: skip
    return "\n".join(lines) + "\n"


def shard_text(hot: int, warm: int, cold: int, hits: int, misses: int, evictions: int = 0, reads: int = 0) -> str:
    return f"""# TYPE recserve_shard_rows_total counter
recserve_shard_rows_total{{tier="hot"}} {hot}
recserve_shard_rows_total{{tier="warm"}} {warm}
recserve_shard_rows_total{{tier="cold"}} {cold}
# TYPE recserve_shard_row_cache_hits_total counter
recserve_shard_row_cache_hits_total {hits}
# TYPE recserve_shard_row_cache_misses_total counter
recserve_shard_row_cache_misses_total {misses}
# TYPE recserve_shard_row_cache_evictions_total counter
recserve_shard_row_cache_evictions_total {evictions}
# TYPE recserve_shard_rocksdb_reads_total counter
recserve_shard_rocksdb_reads_total {reads}
"""


def lookup_text(requested: int, unique: int, primary: int, hedge: int, sent: int, near_hits: int, near_lookups: int) -> str:
    return f"""# TYPE recserve_lookup_windows_total counter
recserve_lookup_windows_total 7
# TYPE recserve_lookup_ids_requested_total counter
recserve_lookup_ids_requested_total {requested}
# TYPE recserve_lookup_ids_unique_total counter
recserve_lookup_ids_unique_total {unique}
# TYPE recserve_lookup_rpcs_total counter
recserve_lookup_rpcs_total{{kind="primary"}} {primary}
recserve_lookup_rpcs_total{{kind="hedge"}} {hedge}
# TYPE recserve_lookup_ids_sent_total counter
recserve_lookup_ids_sent_total {sent}
# TYPE recserve_lookup_near_cache_hits_total counter
recserve_lookup_near_cache_hits_total {near_hits}
# TYPE recserve_lookup_near_cache_lookups_total counter
recserve_lookup_near_cache_lookups_total {near_lookups}
"""


def make_core(*names: str, window_s: float = 60.0) -> tuple[StatusCore, FakeClock]:
    clock = FakeClock()
    return StatusCore({n: f"http://127.0.0.1:{9000 + i}/metrics" for i, n in enumerate(names)}, window_s=window_s, clock=clock), clock


def by(rows: list[dict], key: str, value: str) -> dict:
    (row,) = [r for r in rows if r[key] == value]
    return row


# -- parsing and quantiles -------------------------------------------------------------


def test_parse_metrics_flattens_samples_and_drops_created() -> None:
    text = """# TYPE recserve_x counter
recserve_x_total{tier="hot",b="2"} 3
recserve_x_created{tier="hot",b="2"} 1.7e9
# TYPE recserve_g gauge
recserve_g 4.5
"""
    assert parse_metrics(text) == {
        ("recserve_x_total", (("b", "2"), ("tier", "hot"))): 3.0,
        ("recserve_g", ()): 4.5,
    }


def test_parse_metrics_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_metrics("<html>502 Bad Gateway</html>")


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    inf = math.inf
    assert histogram_quantile(0.75, [(0.1, 10), (0.2, 20), (inf, 20)]) == pytest.approx(0.15)
    # Rank 5 of 20 lies in the first bucket: interpolated from 0.
    assert histogram_quantile(0.25, [(0.2, 10), (inf, 20)]) == pytest.approx(0.1)
    # The quantile in +Inf: the largest finite bound (the most the histogram can say).
    assert histogram_quantile(0.99, [(0.2, 10), (inf, 20)]) == pytest.approx(0.2)
    assert histogram_quantile(0.5, [(0.2, 0), (inf, 0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_delta_counts_a_reset_counter_from_zero() -> None:
    old = Snapshot(t_s=10.0, samples={("a_total", ()): 50.0, ("b_total", ()): 5.0})
    new = Snapshot(t_s=25.0, samples={("a_total", ()): 70.0, ("b_total", ()): 2.0, ("c_total", ()): 4.0})
    d = delta(new, old)
    assert d.t_s == 15.0
    assert dict(d.samples) == {("a_total", ()): 20.0, ("b_total", ()): 2.0, ("c_total", ()): 4.0}


# -- targets ---------------------------------------------------------------------------


def test_unscraped_and_failed_targets_are_down_and_a_good_scrape_is_up() -> None:
    core, clock = make_core("shard-0", "ranker-1", "gateway")
    procs = core.status()["processes"]
    assert [(p["name"], p["kind"], p["up"], p["scraped_s_ago"]) for p in procs] == [
        ("shard-0", "shard", False, None), ("ranker-1", "ranker", False, None), ("gateway", "gateway", False, None),
    ]  # fmt: skip
    core.record("shard-0", shard_text(1, 2, 3, 4, 5))
    core.record_down("ranker-1", "GET http://127.0.0.1:9001/metrics failed: ClientConnectorError")
    core.record("gateway", "<html>oops</html>")
    clock.now += 1.5
    procs = {p["name"]: p for p in core.status()["processes"]}
    assert procs["shard-0"]["up"] is True and procs["shard-0"]["error"] == ""
    assert procs["shard-0"]["scraped_s_ago"] == pytest.approx(1.5)
    assert procs["ranker-1"]["up"] is False and "ClientConnectorError" in procs["ranker-1"]["error"]
    assert procs["gateway"]["up"] is False and "unparseable" in procs["gateway"]["error"]


def test_a_target_that_goes_down_keeps_its_totals_but_shows_down() -> None:
    core, clock = make_core("shard-0")
    core.record("shard-0", shard_text(10, 0, 0, 3, 1))
    clock.now += 2
    core.record_down("shard-0", "timeout")
    status = core.status()
    assert status["processes"][0]["up"] is False
    assert by(status["shards"], "name", "shard-0")["rows"]["hot"] == 10


# -- cascade stages over the window ----------------------------------------------------


def test_stage_rate_and_percentiles_come_from_bucket_deltas_over_the_window() -> None:
    core, clock = make_core("cascade-0")
    # Before the window: 100 slow L0 requests that must not count.
    core.record("cascade-0", stage_text({"L0": (0, 0, 0, 100, 100), "L1": (0, 0, 0, 0, 0)}))
    clock.now += 10
    # 10 s later: +40 L0 requests, 30 under 1 ms and 10 in (5, 10] ms; +4 L1 ones in (1, 5] ms.
    core.record("cascade-0", stage_text({"L0": (30, 30, 40, 140, 140), "L1": (0, 4, 4, 4, 4)}))
    stages = core.status()["stages"]
    l0, l1 = by(stages, "stage", "L0"), by(stages, "stage", "L1")
    assert l0["count"] == 40 and l0["rate_per_s"] == pytest.approx(4.0)
    assert l0["p50_ms"] == pytest.approx(1.0 * 20 / 30)  # rank 20 of 30 in [0, 1] ms
    assert l0["p99_ms"] == pytest.approx(5 + 5 * (39.6 - 30) / 10)  # rank 39.6 in (5, 10] ms
    assert l1["count"] == 4 and l1["rate_per_s"] == pytest.approx(0.4)
    assert l1["p50_ms"] == pytest.approx(1 + 4 * 0.5)
    # A stage nobody measured is listed with nothing to say.
    l3 = by(stages, "stage", "L3")
    assert l3["count"] == 0 and l3["p50_ms"] is None


def test_a_single_snapshot_has_no_rate_yet() -> None:
    core, _ = make_core("cascade-0")
    core.record("cascade-0", stage_text({"L0": (1, 1, 1, 1, 1)}))
    l0 = by(core.status()["stages"], "stage", "L0")
    assert l0["rate_per_s"] is None and l0["count"] == 0


def test_the_window_drops_snapshots_older_than_window_s() -> None:
    core, clock = make_core("cascade-0", window_s=60.0)
    for k in range(10):  # one scrape every 10 s, 10 more requests each time
        core.record("cascade-0", stage_text({"L0": (10 * k,) * 5}))
        clock.now += 10
    clock.now -= 10  # the clock stands at the last scrape
    status = core.status()
    assert status["window_s"] == pytest.approx(60.0)
    assert by(status["stages"], "stage", "L0")["count"] == 60  # 6 intervals, not 9
    assert by(status["stages"], "stage", "L0")["rate_per_s"] == pytest.approx(1.0)


def test_stages_sum_over_several_cascade_processes() -> None:
    core, clock = make_core("cascade-0", "cascade-1")
    core.record("cascade-0", stage_text({"L2": (0,) * 5}))
    core.record("cascade-1", stage_text({"L2": (0,) * 5}))
    clock.now += 5
    core.record("cascade-0", stage_text({"L2": (0, 0, 10, 10, 10)}))
    core.record("cascade-1", stage_text({"L2": (0, 0, 0, 0, 5)}))
    l2 = by(core.status()["stages"], "stage", "L2")
    assert l2["count"] == 15 and l2["rate_per_s"] == pytest.approx(3.0)
    assert l2["p99_ms"] == pytest.approx(50.0)  # 5 of 15 beyond the last finite bound


# -- shards, lookup, degraded ----------------------------------------------------------


def test_shard_tiers_and_row_cache_per_shard_and_in_total() -> None:
    core, _ = make_core("shard-0", "shard-1", "shard-2", "cascade-0")
    core.record("shard-0", shard_text(hot=60, warm=30, cold=10, hits=8, misses=2, evictions=1, reads=10))
    core.record("shard-1", shard_text(hot=0, warm=5, cold=15, hits=0, misses=0))
    shards = core.status()["shards"]
    assert [r["name"] for r in shards] == ["shard-0", "shard-1", "shard-2", "total"]
    s0 = by(shards, "name", "shard-0")
    assert s0["rows"] == {"hot": 60, "warm": 30, "cold": 10}
    assert s0["tier_fraction"] == pytest.approx({"hot": 0.6, "warm": 0.3, "cold": 0.1})
    assert s0["row_cache"] == {"hits": 8, "misses": 2, "evictions": 1, "hit_rate": pytest.approx(0.8)}
    assert s0["rocksdb_reads"] == 10
    assert by(shards, "name", "shard-1")["row_cache"]["hit_rate"] is None  # no lookups: no rate, not 0 %
    assert by(shards, "name", "shard-2")["rows"] is None  # never scraped
    total = by(shards, "name", "total")
    assert total["rows"] == {"hot": 60, "warm": 35, "cold": 25}
    assert total["tier_fraction"]["cold"] == pytest.approx(25 / 120)


def test_lookup_dedup_ratio_ids_per_rpc_hedges_and_near_cache() -> None:
    core, _ = make_core("ranker-0", "cascade-0", "shard-0")
    core.record("ranker-0", lookup_text(requested=1000, unique=400, primary=18, hedge=2, sent=400, near_hits=30, near_lookups=120))
    core.record("cascade-0", lookup_text(requested=200, unique=200, primary=10, hedge=0, sent=200, near_hits=0, near_lookups=0))
    core.record("shard-0", shard_text(1, 1, 1, 1, 1))
    lookup = core.status()["lookup"]
    assert [r["name"] for r in lookup] == ["ranker-0", "cascade-0", "total"]
    r0 = by(lookup, "name", "ranker-0")
    assert r0["dedup_ratio"] == pytest.approx(2.5)
    assert r0["rpcs"] == 20 and r0["hedges"] == 2 and r0["ids_per_rpc"] == pytest.approx(20.0)
    assert r0["near_cache_hit_rate"] == pytest.approx(0.25)
    assert by(lookup, "name", "cascade-0")["near_cache_hit_rate"] is None
    total = by(lookup, "name", "total")
    assert total["dedup_ratio"] == pytest.approx(1200 / 600)
    assert total["ids_per_rpc"] == pytest.approx(600 / 30)


def test_degraded_responses_by_reason_total_and_last_window() -> None:
    core, clock = make_core("cascade-0", "ranker-0")
    core.record("cascade-0", stage_text({}, degraded=5))
    clock.now += 10
    core.record("cascade-0", stage_text({}, degraded=12))
    core.record("ranker-0", 'recserve_degraded_responses_total{reason="deadline",service="Recommender"} 1\n')
    degraded = core.status()["degraded"]
    # Reasons that never happened are left out; the window of a lone snapshot is empty.
    assert degraded == [{"service": "Recommender", "reason": "deadline", "total": 13.0, "last_window": 7.0}]


def test_bad_settings_are_refused_naming_the_field_and_value() -> None:
    with pytest.raises(ConfigError, match="window_s = 0 is invalid"):
        StatusCore({}, window_s=0)
    with pytest.raises(ConfigError, match="timeout_s = -1 is invalid"):
        StatusScraper(StatusCore({}), timeout_s=-1)


def test_the_page_ships_as_one_self_contained_file() -> None:
    """No build step, no CDN (a deployment may have no internet): nothing is loaded from
    another origin, and the JS reads the JSON endpoint the gateway serves."""
    from recserve.gateway.status import page_html

    html = page_html()
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert "/v1/status" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, flags=re.I), "the page loads something from another origin"
    assert not re.search(r"""@import|url\(\s*["']?(https?:)?//""", html, flags=re.I)


def test_every_metric_the_page_reads_is_in_the_catalogue() -> None:
    """The names are the contract with recserve/metrics/catalog.py: a rename there must
    not leave the page silently showing zeros."""
    from recserve.gateway import status
    from recserve.metrics import catalog

    defined = {f.name for f in vars(catalog).values() if isinstance(f, catalog.Family)}
    defined |= {d.name for m in vars(catalog).values() if isinstance(m, (Counter, Histogram)) for d in m.describe()}
    read = [v for k, v in vars(status).items() if k.isupper() and isinstance(v, str) and v.startswith("recserve_")]
    assert len(read) >= 15
    missing = [name for name in read if name.removesuffix("_total") not in defined]
    assert not missing, f"status.py reads metrics the catalogue does not define: {missing}"


def test_openapi_paths_are_valid_and_describe_the_real_body() -> None:
    from jsonschema.exceptions import ValidationError
    from openapi_schema_validator import OAS30Validator
    from openapi_spec_validator import validate

    from recserve.gateway.status import openapi_paths

    paths = openapi_paths()
    validate({"openapi": "3.0.3", "info": {"title": "t", "version": "1"}, "paths": paths})
    core, clock = make_core("shard-0", "shard-1", "ranker-0", "cascade-0")
    core.record("shard-0", shard_text(1, 2, 3, 4, 5))
    core.record("ranker-0", lookup_text(10, 5, 2, 1, 5, 1, 4))
    core.record("cascade-0", stage_text({"L0": (0,) * 5}, degraded=1))
    clock.now += 2
    core.record("cascade-0", stage_text({"L0": (1, 2, 3, 4, 5)}, degraded=2))
    schema = paths["/v1/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    body = core.status()
    OAS30Validator(schema).validate(body)  # shard-1 never scraped: its nulls are allowed
    body["processes"][0]["up"] = "yes"
    with pytest.raises(ValidationError, match="is not of type 'boolean'"):
        OAS30Validator(schema).validate(body)
