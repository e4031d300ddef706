"""recserve as a feed service meets it, on one real cluster: 2 shards, a ranker, the
cascade and the gateway as processes on loopback (tests/integration/gateway_world.py),
with two keyed tenants and ``RECSERVE_ADMIN_TOKEN`` set. In file order:

1. :class:`~recserve.client.RecClient` (async) and :class:`~recserve.client.SyncRecClient`
   against the cluster, and around a dead replica;
2. ``examples/feed_service.py`` as a user runs it (a subprocess): in front of the
   cluster, in front of a Recommender that answers too late for the page's deadline,
   and — last in the module — with the cluster stopped;
3. the no-secrets log check: requests with the right keys, a wrong key and none; admin
   calls with the right and a wrong token to the shard, the ranker and the cascade; two
   client mistakes that would put a secret into a log line (a tenant key sent as the
   ``X-Request-Id``, the admin token sent as a gRPC request id); then every process's
   log file is grepped for every key and token value (again after every process has
   stopped), and the log lines of a request must carry its request id.

One cluster serves all three because starting one (training the tiny world, five
processes) is most of the module's time; the gRPC calls of parts 1 and 2 need no key.

Oracles from outside the code under test: the world's export (a user's own history is
never recommended), the caller's ``exclude_ids``, recserve's own answer through
SyncRecClient for the feed page's recserve items, the lists passed on the feed
service's command line, and fresh random key values that can only reach a log from
this run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from recserve.client import RecClient, SyncRecClient
from recserve.rpc.auth import admin_metadata
from recserve.errors import DeadlineExceeded, InvalidArgument, Unavailable
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack
from recserve.v1 import admin_pb2, admin_pb2_grpc, embedding_pb2, embedding_pb2_grpc, recommender_pb2, recommender_pb2_grpc
from tests.integration.gateway_world import GatewayWorld, gateway_world
from tests.integration.gateway_world import read_logs as gateway_world_logs
from tests.integration.gateway_world import secrets_in as secrets_in_logs

REPO = Path(__file__).resolve().parents[2]
START_S = 60.0  # guard on a subprocess's start-up line and on a stalled call only

# Fresh per run: a value found in a log can only have come from this run.
ALPHA_KEY = f"alpha-{secrets.token_hex(12)}"
BETA_KEY = f"beta-{secrets.token_hex(12)}"
ADMIN_TOKEN = f"admin-{secrets.token_hex(12)}"
WRONG_KEY = f"wrong-{secrets.token_hex(12)}"  # presented by a caller: no more loggable than a real key
WRONG_TOKEN = f"badtoken-{secrets.token_hex(12)}"
SECRETS = {"alpha key": ALPHA_KEY, "beta key": BETA_KEY, "admin token": ADMIN_TOKEN, "wrong key": WRONG_KEY, "wrong token": WRONG_TOKEN}
# ALPHA's variable name does not look like a secret's: the gateway must mask it because
# the spec names it, not because of its name.
TENANTS = """
[[tenants]]
name = "alpha"
api_key_env = "ALPHA_FEED_CREDENTIAL"

[[tenants]]
name = "beta"
api_key_env = "BETA_API_KEY"
"""
ENV = {"ALPHA_FEED_CREDENTIAL": ALPHA_KEY, "BETA_API_KEY": BETA_KEY}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayWorld]:
    with gateway_world(tmp_path_factory.mktemp("feed-integration"), extra=TENANTS, env=ENV, admin_token=ADMIN_TOKEN) as world:
        yield world


# ---- 1. RecClient and SyncRecClient ---------------------------------------------------


def dead_address() -> str:
    """A loopback port nothing listens on (bound, then freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def seen_by(gw: GatewayWorld, user: int) -> set[int]:
    history = gw.world.export.arrays.user_history
    return set(np.asarray(history.values)[history.offsets[user] : history.offsets[user + 1]].tolist())


def test_async_client_recommends_ranks_and_reports_readiness(gw: GatewayWorld) -> None:
    async def body() -> None:
        async with RecClient(gw.recommenders, gw.ranker_addresses, api_key=ALPHA_KEY) as client:
            ready = await client.check_ready(timeout_s=5.0)
            assert ready == {address: True for address in [*gw.recommenders, *gw.ranker_addresses]}
            rec = await client.recommend(5, 10, timeout_s=10.0, request_id="it-async-1")
            items = rec.item_ids.tolist()
            assert len(items) == len(set(items)) == 10 and rec.scores.shape == (10,) and rec.scores.dtype == np.float32
            assert [s.stage for s in rec.stages] == ["L0", "L1", "L2", "L3"] and [s.out_count for s in rec.stages] == [400, 200, 50, 10]
            assert rec.model_version == gw.world.export.model_version and rec.index_version
            assert (rec.replica, rec.attempts) == (gw.recommenders[0], 1)
            assert not seen_by(gw, 5) & set(items)
            again = await client.recommend(5, 10, timeout_s=10.0, exclude_ids=rec.item_ids[:4], recent_item_ids=rec.item_ids[4:6])
            assert not set(again.item_ids.tolist()) & set(items[:6])
            ranked = await client.rank(5, rec.item_ids, timeout_s=10.0)
            assert sorted(ranked.item_ids.tolist()) == sorted(items) and np.all(np.diff(ranked.scores) <= 0)
            # The server's own validation comes back as the same error kind, naming the field.
            with pytest.raises(InvalidArgument, match="user_id = -3"):
                await client.recommend(-3, 5, timeout_s=10.0)
            # The deadline reaches the cascade: its stage budgets are cut from the 3 s given
            # here, where the first call's were cut from its 10 s.
            short = await client.recommend(5, 10, timeout_s=3.0)
            assert 0 < max(s.budget_ms for s in short.stages) <= 3000 < max(s.budget_ms for s in rec.stages)
            # A deadline already behind the client's clock: refused before any RPC.
            with pytest.raises(DeadlineExceeded, match="before the first attempt"):
                await client.recommend(5, 10, deadline=client.clock() - 0.001)

    asyncio.run(body())


def test_a_dead_recommender_is_retried_on_the_live_one(gw: GatewayWorld) -> None:
    dead = dead_address()

    async def body() -> None:
        async with RecClient([dead, *gw.recommenders], rng=np.random.default_rng(0), api_key=ALPHA_KEY) as client:
            for user in range(8):
                rec = await client.recommend(user, 5, timeout_s=10.0)
                assert rec.replica == gw.recommenders[0] and rec.item_ids.shape == (5,)
            assert client.stats.retries >= 1, "two choices never picked the dead replica: the test proves nothing"
            assert client.stats.attempts == 8 + client.stats.retries
            assert (await client.check_ready(timeout_s=2.0))[dead] is False
        async with RecClient([dead]) as only_dead:
            with pytest.raises(Unavailable, match=dead):
                await only_dead.recommend(1, 5, timeout_s=10.0)

    asyncio.run(body())


def test_sync_client_from_plain_code(gw: GatewayWorld) -> None:
    with SyncRecClient(gw.recommenders, gw.ranker_addresses, api_key=ALPHA_KEY) as client:
        assert all(client.check_ready(timeout_s=5.0).values())
        rec = client.recommend(9, 8, timeout_s=10.0, request_id="it-sync-1")
        assert rec.item_ids.shape == (8,) and len(set(rec.item_ids.tolist())) == 8 and not seen_by(gw, 9) & set(rec.item_ids.tolist())
        ranked = client.rank(9, rec.item_ids[::-1].copy(), model="l3", timeout_s=10.0)
        assert ranked.model == "l3" and sorted(ranked.item_ids.tolist()) == sorted(rec.item_ids.tolist())
        with pytest.raises(InvalidArgument, match="k = "):
            client.recommend(9, 10**6, timeout_s=10.0)


# ---- 2. examples/feed_service.py (the stopped-cluster case is last) -------------------

EDITORIAL = [7, 42]
POPULAR = list(range(1, 31))
SIZE = 10  # editorial at slots 0 and 5; 8 slots for recserve (the tiny world's l3_out is 10)


@contextlib.contextmanager
def feed_service(recommender: str, deadline_ms: float) -> Iterator[str]:
    """The example, started as its README says; yields its /feed URL (read from the line
    it prints once listening: no polling). Stopped (SIGTERM, then reaped) on exit."""
    argv = [sys.executable, str(REPO / "examples" / "feed_service.py"), "--recommender", recommender, "--port", "0",
            "--deadline-ms", str(deadline_ms), "--editorial", ",".join(map(str, EDITORIAL)), "--popular", ",".join(map(str, POPULAR)),
            "--api-key-env", "ALPHA_FEED_CREDENTIAL"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, **ENV})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("feed service at "):
            proc.kill()
            _, err = proc.communicate(timeout=START_S)
            raise AssertionError(f"feed service did not start: {line!r}\n{err}")
        yield line.removeprefix("feed service at ").strip()
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=START_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def get_page(url: str, user: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}?user_id={user}&size={SIZE}", timeout=30) as response:
        assert response.status == 200
        page: dict[str, Any] = json.loads(response.read())
    return page


def split(page: dict[str, Any]) -> tuple[list[int], list[str]]:
    return [i["item_id"] for i in page["items"]], [i["source"] for i in page["items"]]


def test_the_page_merges_recserve_items_with_editorial_ones(gw: GatewayWorld) -> None:
    user = 5
    with SyncRecClient(gw.recommenders, api_key=ALPHA_KEY) as client:
        expected = client.recommend(user, SIZE - len(EDITORIAL), timeout_s=30.0, exclude_ids=EDITORIAL).item_ids.tolist()
    with feed_service(gw.recommenders[0], deadline_ms=30_000) as url:
        page = get_page(url, user)
    assert (page["source"], page["fallback_reason"]) == ("recserve", "")
    items, sources = split(page)
    assert sources == ["editorial", "recserve", "recserve", "recserve", "recserve", "editorial", "recserve", "recserve", "recserve", "recserve"]
    assert [items[0], items[5]] == EDITORIAL
    assert [i for i, s in zip(items, sources, strict=True) if s == "recserve"] == expected  # recserve's order, nothing from the fallback
    assert expected != [p for p in POPULAR if p not in EDITORIAL][: len(expected)]  # the two sources are distinguishable
    assert all(isinstance(i["score"], float) for i in page["items"] if i["source"] == "recserve")


class StalledRecommender(recommender_pb2_grpc.RecommenderServicer):
    """A Recommender that answers only when released: "recserve is late", for sure."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()

    def Recommend(self, request: recommender_pb2.RecommendRequest, context: grpc.ServicerContext) -> recommender_pb2.RecommendResponse:
        self.arrived.set()
        self.release.wait(START_S)
        return recommender_pb2.RecommendResponse()


@contextlib.contextmanager
def stalled_recommender() -> Iterator[tuple[str, StalledRecommender]]:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = StalledRecommender()
    recommender_pb2_grpc.add_RecommenderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        servicer.release.set()
        server.stop(None)


def test_a_recserve_answer_later_than_the_deadline_falls_back_to_the_popularity_list() -> None:
    with stalled_recommender() as (address, recommender), feed_service(address, deadline_ms=200) as url:
        page = get_page(url, 5)
    assert recommender.arrived.is_set()  # the call reached recserve, which did not answer in time
    assert (page["source"], page["fallback_reason"]) == ("popular", "deadline_exceeded")
    items, sources = split(page)
    assert items == [7, 1, 2, 3, 4, 42, 5, 6, 8, 9] and sources.count("editorial") == 2


# ---- 3. no secrets in any log; request ids on log lines -----------------------------

# <date> <time> <logger> <LEVEL> [<request id>] <message>
LINE = re.compile(r"^\S+ \S+ (?P<logger>\S+) (?P<level>[A-Z]+) \[(?P<rid>[^\]]*)\] (?P<message>.*)$")
ADMIN_RID = "nosecret-admin-additems"


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def admin_calls(gw: GatewayWorld) -> None:
    """Admin RPCs with the right token, a wrong one and the token as a request id."""
    arrays = gw.world.export.arrays
    tags = np.asarray(arrays.item_tags.values)[arrays.item_tags.offsets[1] : arrays.item_tags.offsets[2]].astype(np.int64)
    new_item = admin_pb2.AddItemsRequest(
        header=make_header(timeout_s=60, request_id=ADMIN_RID), item_ids=pack(np.array([arrays.num_items], np.int64)),
        categories=pack(np.array([0], np.int64)), tag_ids=pack(tags), tag_lengths=pack(np.array([tags.size], np.int64)),
    )  # fmt: skip
    with grpc.insecure_channel(gw.cascade.address) as ch:
        cascade = admin_pb2_grpc.AdminStub(ch)
        assert cascade.AddItems(new_item, timeout=60, metadata=admin_metadata(ADMIN_TOKEN)).added == 1
        cascade.ModelStatus(admin_pb2.ModelStatusRequest(header=make_header(timeout_s=30, request_id=ADMIN_TOKEN)), timeout=30)
        with pytest.raises(grpc.RpcError) as denied:
            cascade.RefreshIndex(admin_pb2.RefreshIndexRequest(header=make_header(timeout_s=30)), timeout=30, metadata=admin_metadata(WRONG_TOKEN))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with grpc.insecure_channel(gw.ranker_addresses[0]) as ch:
        with pytest.raises(grpc.RpcError) as denied:
            admin_pb2_grpc.AdminStub(ch).ReloadModels(admin_pb2.ReloadModelsRequest(header=make_header(timeout_s=30)), timeout=30, metadata=admin_metadata(WRONG_TOKEN))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with grpc.insecure_channel(gw.shard_addresses[0]) as ch:
        with pytest.raises(grpc.RpcError) as denied:
            embedding_pb2_grpc.EmbeddingShardStub(ch).Upsert(embedding_pb2.UpsertRequest(header=make_header(timeout_s=30)), timeout=30, metadata=admin_metadata(WRONG_TOKEN))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def logs_after_traffic(gw: GatewayWorld) -> dict[str, str]:
    """Every process's log, by name, after the traffic (each log line is flushed as it
    is written; the last test greps them again once every process has exited)."""
    rec, rank = gw.url + "/v1/recommendations", gw.url + "/v1/rank"
    good = {"user_id": 5, "k": 5}
    statuses = {
        "alpha": post(rec, good, {"X-API-Key": ALPHA_KEY, "X-Request-Id": "nosecret-alpha-ok"}),
        "beta": post(rec, good, {"X-API-Key": BETA_KEY, "X-Request-Id": "nosecret-beta-ok"}),
        "rank": post(rank, {"user_id": 5, "candidate_ids": [1, 2, 3]}, {"X-API-Key": BETA_KEY, "X-Request-Id": "nosecret-rank-ok"}),
        "wrong key": post(rec, good, {"X-API-Key": WRONG_KEY, "X-Request-Id": "nosecret-wrong-key"}),
        "no key": post(rec, good, {"X-Request-Id": "nosecret-no-key"}),
        "bad k": post(rec, {"user_id": 5, "k": 0}, {"X-API-Key": ALPHA_KEY, "X-Request-Id": "nosecret-bad-k"}),
        # A client mistake: its key as the request id, on a request the gateway logs (k out of range).
        "key as id": post(rec, {"user_id": 5, "k": 0}, {"X-API-Key": ALPHA_KEY, "X-Request-Id": ALPHA_KEY}),
    }
    assert statuses["alpha"] == statuses["beta"] == statuses["rank"] == 200, statuses
    assert statuses["wrong key"] == statuses["no key"] == 401, statuses
    assert statuses["bad k"] in (400, 422) and statuses["key as id"] in (400, 422), statuses
    admin_calls(gw)
    return read_logs(gw)


def read_logs(gw: GatewayWorld) -> dict[str, str]:
    return gateway_world_logs(gw.log_paths)


def secrets_in(logs: dict[str, str]) -> list[tuple[str, str]]:
    return secrets_in_logs(logs, SECRETS)  # the shared check (tests/integration/gateway_world.py)


def test_no_key_or_token_appears_in_any_process_log(logs_after_traffic: dict[str, str]) -> None:
    assert set(logs_after_traffic) >= {"shard-0", "shard-1", "ranker-0", "cascade-0", "gateway"}
    assert all(logs_after_traffic.values()), "a process wrote no log at all: the grep would prove nothing"
    assert secrets_in(logs_after_traffic) == []
    # The key sent as a request id did reach a log line, masked: the safety net was exercised.
    assert "[***] POST /v1/recommendations -> " in logs_after_traffic["gateway"]


def test_every_log_line_of_a_request_carries_its_request_id(logs_after_traffic: dict[str, str]) -> None:
    parsed = {name: [m for m in map(LINE.match, text.splitlines()) if m] for name, text in logs_after_traffic.items()}
    assert all(parsed.values()), "no line in the recserve format: the logging setup was not installed"
    # The gateway's line about each request it refused carries that request's id.
    refused = {m["rid"]: m["message"] for m in parsed["gateway"] if re.match(r"(GET|POST) /\S* -> \d{3}", m["message"])}
    assert {"nosecret-wrong-key", "nosecret-no-key", "nosecret-bad-k", "***"} <= set(refused) and "-" not in refused, refused
    assert " -> 401" in refused["nosecret-wrong-key"] and " -> 401" in refused["nosecret-no-key"] and "k = 0" in refused["nosecret-bad-k"]
    # The cascade's admin line was logged on the AddItems request's behalf, with its id, and
    # so was the ranker's, one hop further down (the cascade's call inherits the id).
    added = [m for m in parsed["cascade-0"] if m["message"].startswith("added items")]
    learned = [m for m in parsed["ranker-0"] if m["message"].startswith("ranker learned")]
    assert [m["rid"] for m in added] == [m["rid"] for m in learned] == [ADMIN_RID]


# ---- last: it stops the cluster ---------------------------------------------------


def test_with_the_cluster_stopped_the_feed_serves_the_popularity_list_and_no_log_holds_a_secret(gw: GatewayWorld) -> None:
    """Last in the module: it stops the cluster (every process exits, so its log is
    complete), then greps every log once more."""
    with feed_service(gw.recommenders[0], deadline_ms=5_000) as url:
        assert get_page(url, 5)["source"] == "recserve"
        gw.stop()
        page = get_page(url, 5)
        again = get_page(url, 6)
    assert (page["source"], page["fallback_reason"]) == ("popular", "unavailable")
    assert again["source"] == "popular"
    items, sources = split(page)
    assert items == [7, 1, 2, 3, 4, 42, 5, 6, 8, 9]  # 7 is pinned, so not repeated from the popularity list
    assert sources == ["editorial", "popular", "popular", "popular", "popular", "editorial", "popular", "popular", "popular", "popular"]
    assert all(i["score"] is None for i in page["items"])
    final = read_logs(gw)
    assert secrets_in(final) == []
