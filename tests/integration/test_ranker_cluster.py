"""RankerCluster launches real ``recserve ranker serve`` processes: a killed ranker leaves
its sibling serving and comes back on its port, and rankers die with their launcher.

A tiny model set is trained once and exported; two real shard processes serve its
tables. Readiness is read from each ranker's own gRPC health (``recserve.v1.Ranking``)
and a Rank call, never from the launcher's bookkeeping. The orphan check SIGKILLs a
parent script holding a RankerCluster and waits on pidfds (readable when a process
exits) for its ranker to be gone: a correctness bound, not a speed goal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ranker.export import export_models
from ranker.scrubbed import open_scrubbed
from ranker.spec import tables_and_features
from ranker.train import train_all
from recserve.cluster import ShardCluster
from recserve.cluster.group import REPO_ROOT
from recserve.cluster.rankers import RANKING_HEALTH_SERVICE, RankerCluster
from recserve.config.spec import ShardingConfig
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.sharding import plan_tables
from recserve.v1 import ranking_pb2
from recserve.v1.ranking_pb2_grpc import RankingStub
from tests.integration.ranker_world import TINY, spec_text
from tests.utils_catalog import make_catalog

pytestmark = pytest.mark.integration

TIMEOUT_S = 30.0
# Generous for a loaded 2-core box: an orphan gets SIGTERM, then SIGKILL after 1 s; a
# ranker that outlived its parent would live for ever, so the bound cannot hide a bug.
ORPHAN_BOUND_S = 5.0

PARENT = r"""
import json, sys
from recserve.cluster.rankers import RankerCluster

spec, models, shards, root = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
cluster = RankerCluster(spec, models, shards, num_rankers=1, data_root=root)
cluster.start()
print(json.dumps([cluster.pid(0)]), flush=True)
sys.stdin.read()  # hold the cluster until killed
"""


@dataclasses.dataclass(frozen=True)
class World:
    root: Path
    spec_path: Path
    models: Path
    model_version: str
    shards: ShardCluster


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("ranker-cluster")
    make_catalog(root / "catalog", items=2_000, users=200, impressions=4_000, categories=16, tags=64, history_len=12, candidates=64)
    view = open_scrubbed(root / "catalog")
    manifest = export_models(train_all(view, TINY), view, root / "models")
    tables, _ = tables_and_features(manifest)
    plan = plan_tables(list(tables), None, ShardingConfig(num_shards=2, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=2, column_splits=1)).plan
    plan.save(root / "plan.json")
    (root / "cluster.toml").write_text(spec_text(manifest, root / "models"))
    with ShardCluster(root / "plan.json", root / "shards", load_from=root / "models") as shards:
        yield World(root, root / "cluster.toml", root / "models", str(manifest["model_version"]), shards)


def _health(address: str) -> int | grpc.StatusCode:
    """The ranker's own answer for the Ranking service, or the RPC's error code."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=RANKING_HEALTH_SERVICE), timeout=5.0)
        except grpc.RpcError as exc:
            return exc.code()
    return int(reply.status)


def _rank(address: str, items: np.ndarray) -> ranking_pb2.RankResponse:
    with grpc.insecure_channel(address) as channel:
        request = ranking_pb2.RankRequest(header=make_header(timeout_s=TIMEOUT_S), user_id=3, candidate_ids=pack(items), model="dlrm")
        return RankingStub(channel).Rank(request, timeout=TIMEOUT_S)


def test_a_killed_ranker_leaves_its_sibling_serving_and_restarts_on_its_port(world: World, tmp_path: Path) -> None:
    items = np.arange(0, 40, dtype=np.int64)
    with RankerCluster(world.spec_path, world.models, world.shards.addresses, num_rankers=2, data_root=tmp_path / "rankers") as rankers:
        assert len(set(rankers.addresses)) == 2
        for address in rankers.addresses:
            assert _health(address) == health_pb2.HealthCheckResponse.SERVING
            reply = _rank(address, items)
            assert reply.model_version == world.model_version and sorted(unpack(reply.item_ids, "item_ids").tolist()) == items.tolist()
        victim, pid = rankers.address(1), rankers.pid(1)

        rankers.kill(1)
        assert _health(victim) == grpc.StatusCode.UNAVAILABLE  # really gone, not just marked
        assert _health(rankers.address(0)) == health_pb2.HealthCheckResponse.SERVING
        assert _rank(rankers.address(0), items).model_version == world.model_version

        rankers.restart(1)  # returns once SERVING
        assert rankers.address(1) == victim and rankers.pid(1) != pid
        assert _health(victim) == health_pb2.HealthCheckResponse.SERVING
        assert _rank(victim, items).model_version == world.model_version
        log_text = rankers.log_path(1).read_text()
        assert log_text.count("ranker listening") == 2, log_text[-2000:]  # appended: both runs' logs kept
        pids, addresses = [rankers.pid(k) for k in range(2)], rankers.addresses
    # The context manager stopped (and reaped) both: nothing left on their ports.
    assert [_health(a) for a in addresses] == [grpc.StatusCode.UNAVAILABLE] * 2
    for p in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)


def _exited(pidfds: dict[int, int], timeout_s: float) -> set[int]:
    """Pids (of ``pidfds``: pid -> pidfd) that exit within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    gone: set[int] = set()
    while len(gone) < len(pidfds):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd for pid, fd in pidfds.items() if pid not in gone], [], [], remaining)
        gone |= {pid for pid, fd in pidfds.items() if fd in ready}
    return gone


def test_rankers_exit_when_their_parent_is_sigkilled(world: World, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    argv = [sys.executable, "-c", PARENT, str(world.spec_path), str(world.models), ",".join(world.shards.addresses), str(tmp_path / "rankers")]
    parent = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pidfds: dict[int, int] = {}
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()  # EOF (b"") if the parent failed
        if not line:
            parent.wait(timeout=30)
            pytest.fail(f"parent exited {parent.returncode} before printing its rankers' pids: {parent.stderr.read().decode()[-3000:] if parent.stderr else ''}")
        pids = json.loads(line)
        pidfds = {pid: os.pidfd_open(pid) for pid in pids}  # taken while alive: immune to pid reuse
        assert not _exited(pidfds, 0.0)  # SERVING before the parent dies

        parent.kill()  # SIGKILL: no cleanup code in the parent runs
        parent.wait(timeout=10)
        gone = _exited(pidfds, ORPHAN_BOUND_S)
        assert gone == set(pids), f"rankers {sorted(set(pids) - gone)} outlived their SIGKILLed parent by {ORPHAN_BOUND_S} s"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        for fd in pidfds.values():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # no-op error if already gone
            except ProcessLookupError:
                pass
            os.close(fd)
        for stream in (parent.stdin, parent.stdout, parent.stderr):
            if stream is not None:
                stream.close()
