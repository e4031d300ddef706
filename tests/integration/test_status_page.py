"""The gateway's status page (``GET /``) and its JSON (``GET /v1/status``).

- Over stand-in ``/metrics`` endpoints on loopback (live, refusing, hanging, failing):
  every dead target is shown down and the JSON still answers.
- The page in headless Debian Chromium against a real cluster (2 shards, a ranker, the
  cascade and the gateway process of tests/integration/gateway_world.py) after some
  ``POST /v1/recommendations`` traffic: the numbers fill in and match each process's own
  ``/metrics``; a screenshot PNG is saved under the test's tmp dir (its path printed).

The oracle is each process's own ``/metrics``, read and parsed here with
``prometheus_client.parser`` (not through recserve/gateway/status.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from recserve.gateway import status
from tests.integration.gateway_world import GatewayWorld, gateway_world

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 60.0  # a loaded 2-core box; the loops below end as soon as the numbers agree
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# -- loopback servers ------------------------------------------------------------------


class ThreadedApp:
    """``make_app()`` (built on the loop thread) served on 127.0.0.1 at a free port."""

    def __init__(self, make_app: Callable[[], web.Application]) -> None:
        self._make_app = make_app
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="status-test-app", daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    def __enter__(self) -> ThreadedApp:
        self._thread.start()
        self.port = self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            self._call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=30)

    async def _start(self) -> int:
        self._runner = web.AppRunner(self._make_app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return int(self._runner.addresses[0][1])


@contextmanager
def metrics_server(registry: CollectorRegistry) -> Iterator[str]:
    """prometheus_client's own HTTP server (what every recserve process runs) on ``registry``."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def refused_url() -> str:
    """A loopback URL nobody listens on (a free port, closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"


@contextmanager
def hanging_url() -> Iterator[str]:
    """A URL whose server accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/metrics"


def broken_targets_app() -> web.Application:
    """``/fail`` answers 500; ``/html`` answers 200 with a page that is not metrics."""
    app = web.Application()

    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>login</body></html>", content_type="text/html")

    app.router.add_get("/fail", fail)
    app.router.add_get("/html", html)
    return app


# -- the oracle: a process's own /metrics ------------------------------------------------


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and all(dict(labels).get(k) == w for k, w in match.items()))


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return json.loads(response.read())


def wait_for(what: str, check: Callable[[], str]) -> None:
    """Poll ``check`` (returns "" when satisfied, else what is still wrong) until it holds."""
    deadline = time.monotonic() + WAIT_S
    problem = check()
    while problem:
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {WAIT_S:.0f} s: {problem}")
        time.sleep(0.1)
        problem = check()


# -- stand-in processes ------------------------------------------------------------------


def shard_registry(hot: int, warm: int, cold: int, hits: int, misses: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    rows = Counter("recserve_shard_rows", "rows served by tier", ["tier"], registry=registry)
    for tier, n in (("hot", hot), ("warm", warm), ("cold", cold)):
        rows.labels(tier).inc(n)
    Counter("recserve_shard_row_cache_hits", "row-cache hits", registry=registry).inc(hits)
    Counter("recserve_shard_row_cache_misses", "row-cache misses", registry=registry).inc(misses)
    Counter("recserve_shard_row_cache_evictions", "row-cache evictions", registry=registry)
    Counter("recserve_shard_rocksdb_reads", "RocksDB reads", registry=registry).inc(misses)
    return registry


def gateway_app(targets: dict[str, str]) -> Callable[[], web.Application]:
    def make() -> web.Application:
        app = web.Application()
        status.add_routes(app, targets, interval_s=0.1, timeout_s=0.5)
        return app

    return make


# -- tests -------------------------------------------------------------------------------


def test_status_json_shows_dead_targets_as_down_never_an_error_page() -> None:
    with (
        metrics_server(shard_registry(hot=7, warm=2, cold=1, hits=5, misses=3)) as live,
        hanging_url() as hanging,
        ThreadedApp(broken_targets_app) as broken,
    ):
        targets = {"shard-0": live, "shard-1": refused_url(), "shard-2": hanging, "ranker-0": f"{broken.url}/fail",
                   "ranker-1": f"{broken.url}/html"}  # fmt: skip
        with ThreadedApp(gateway_app(targets)) as gateway:

            def every_target_scraped() -> str:
                pending = [p["name"] for p in get_json(f"{gateway.url}/v1/status")["processes"] if p["scraped_s_ago"] is None]
                return f"not scraped yet: {pending}" if pending else ""

            wait_for("every target scraped once", every_target_scraped)
            body = get_json(f"{gateway.url}/v1/status")
            procs = {p["name"]: p for p in body["processes"]}
            assert {n: p["up"] for n, p in procs.items()} == {"shard-0": True, "shard-1": False, "shard-2": False, "ranker-0": False, "ranker-1": False}
            assert "Connect" in procs["shard-1"]["error"]
            assert "Timeout" in procs["shard-2"]["error"]
            assert "HTTP 500" in procs["ranker-0"]["error"]
            assert "unparseable" in procs["ranker-1"]["error"]
            shard0 = next(r for r in body["shards"] if r["name"] == "shard-0")
            assert shard0["rows"] == {"hot": 7, "warm": 2, "cold": 1}
            assert shard0["row_cache"]["hit_rate"] == pytest.approx(5 / 8)
            with urllib.request.urlopen(f"{gateway.url}/", timeout=10) as response:
                assert response.status == 200 and response.headers["Content-Type"].startswith("text/html")
                assert "/v1/status" in response.read().decode()


# -- the page in a browser ---------------------------------------------------------------


@contextmanager
def chromium(width: int = 1400, height: int = 1250) -> Iterator[Any]:
    """Headless Debian Chromium under chromedriver (``make browser`` installs both)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: `make browser` installs Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


READ_CELLS = """const out = {};
document.querySelectorAll("[data-k]").forEach(e => { out[e.dataset.k] = [e.dataset.value, e.textContent]; });
return out;"""


def cells(driver: Any) -> dict[str, tuple[str, str]]:
    """Every cell of the page carrying ``data-k``: key -> (its data-value, its text), read
    in one script call (the page re-renders its tables on each refresh)."""
    return {k: (str(v), str(t)) for k, (v, t) in driver.execute_script(READ_CELLS).items()}


def page_disagreements(driver: Any, targets: dict[str, str], compared: set[str] | None = None) -> list[str]:
    """Where the page's numbers differ from each process's own /metrics, read now (the
    keys compared are added to ``compared``)."""
    wrong: list[str] = []
    page = cells(driver)
    compared = set() if compared is None else compared

    def want(key: str, value: float, text: str) -> None:
        compared.add(key)
        got = page.get(key, ("", ""))
        if got[0] == "" or float(got[0]) != value or got[1] != text:
            wrong.append(f"{key}: page shows {got}, /metrics says {value} ({text!r})")

    for name, url in targets.items():
        own = scrape(url)
        if page.get(f"{name}.up") != ("true", "up"):
            wrong.append(f"{name}.up: page shows {page.get(f'{name}.up')}")
        if any(n == "recserve_shard_rows_total" for n, _ in own):
            for tier in status.TIERS:
                n = total(own, "recserve_shard_rows_total", tier=tier)
                want(f"{name}.rows.{tier}", n, str(round(n)))
            hits, misses = total(own, "recserve_shard_row_cache_hits_total"), total(own, "recserve_shard_row_cache_misses_total")
            want(f"{name}.row_cache.hits", hits, str(round(hits)))
            if hits + misses:
                want(f"{name}.row_cache.hit_rate", hits / (hits + misses), f"{100 * hits / (hits + misses):.1f}%")
        requested, unique = total(own, "recserve_lookup_ids_requested_total"), total(own, "recserve_lookup_ids_unique_total")
        if unique:
            want(f"{name}.ids_requested", requested, str(round(requested)))
            want(f"{name}.dedup_ratio", requested / unique, f"{requested / unique:.2f}")
    return wrong


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayWorld]:
    with gateway_world(tmp_path_factory.mktemp("status-page")) as world:
        yield world


def post_json(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read())


def bucket_bounds(samples: Samples, stage: str, q: float) -> tuple[float, float]:
    """The (lower, upper] bucket bounds, in ms, that hold the ``q`` quantile of ``stage``'s
    latency histogram in ``samples`` (cumulative counts read straight from /metrics)."""
    name = "recserve_cascade_stage_latency_seconds_bucket"
    cum = sorted((float(dict(labels)["le"]), v) for (n, labels), v in samples.items() if n == name and dict(labels).get("stage") == stage)
    rank, lower = q * cum[-1][1], 0.0
    for le, count in cum:
        if count >= rank:
            return lower * 1e3, le * 1e3
        lower = le
    raise AssertionError(f"no bucket holds rank {rank} of {cum}")


def test_status_page_in_headless_chromium(
    gw: GatewayWorld, tmp_path: Path, capsys: pytest.CaptureFixture[str], record_property: Callable[[str, object], None]
) -> None:
    targets = gw.metrics_urls
    assert {"shard-0", "shard-1", "ranker-0", "cascade-0", "gateway"} <= set(targets)

    def every_target_up() -> str:
        down = [p["name"] for p in get_json(f"{gw.url}/v1/status")["processes"] if not p["up"]]
        return f"down: {down}" if down else ""

    # The gateway's first scrape of every process is the window's baseline (no Recommend yet).
    wait_for("every process scraped up by the gateway", every_target_up)
    cascade_before = scrape(targets["cascade-0"])
    assert total(cascade_before, "recserve_cascade_stage_latency_seconds_count", stage="L0") == 0
    requests = 12
    for user in range(requests):
        body = post_json(f"{gw.url}/v1/recommendations", {"user_id": user, "k": 5})
        assert len(body["item_ids"]) == 5
    cascade_after = scrape(targets["cascade-0"])
    assert total(cascade_after, "recserve_cascade_stage_latency_seconds_count", stage="L0") == requests

    with chromium() as driver:
        driver.get(f"{gw.url}/?refresh_ms=250")

        compared: set[str] = set()

        def page_matches() -> str:
            wrong = page_disagreements(driver, targets, compared)
            if cells(driver).get("L0.count") != (str(requests), str(requests)):  # JS prints 12.0 as "12"
                wrong.append(f"L0.count: page shows {cells(driver).get('L0.count')}, want {requests}")
            return "; ".join(wrong)

        wait_for("the page agrees with every process's /metrics", page_matches)
        page = cells(driver)  # the numbers stand still now: no more traffic
        assert {"shard-0.rows.cold", "shard-1.rows.hot", "shard-1.row_cache.hits", "ranker-0.dedup_ratio"} <= compared, sorted(compared)
        # Shards served rows and lookup clients deduplicated: the compared numbers are not zeros.
        assert sum(float(page[f"total.rows.{tier}"][0]) for tier in status.TIERS) > 0
        assert float(page["total.ids_requested"][0]) > 0
        # p50 / p99 per stage over the window: inside the bucket /metrics puts them in.
        for stage in ("L0", "L2"):
            for q, key in ((0.5, "p50_ms"), (0.99, "p99_ms")):
                lower, upper = bucket_bounds(cascade_after, stage, q)
                shown = float(page[f"{stage}.{key}"][0])
                assert lower <= shown <= upper, f"{stage} {key} = {shown} outside its bucket ({lower}, {upper}] ms"
        reasons = {(dict(labels)["service"], dict(labels)["reason"]): v for (n, labels), v in cascade_after.items()
                   if n == "recserve_degraded_responses_total" and v > 0}  # fmt: skip
        for (service, reason), n in reasons.items():
            assert float(page.get(f"{service}.{reason}.total", ("nan", ""))[0] or "nan") == n, (service, reason)
        screenshot = tmp_path / "status-page.png"
        # The whole page in one picture: the window as tall as the document (plus the frame).
        driver.set_window_size(1400, driver.execute_script("return document.documentElement.scrollHeight") + 200)
        assert driver.save_screenshot(str(screenshot))
        assert screenshot.stat().st_size > 10_000
        record_property("screenshot", str(screenshot))
        with capsys.disabled():  # shown in `make test`'s output, not only on failure
            print(f"\nstatus page screenshot: {screenshot}")
