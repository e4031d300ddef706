"""``recserve serve`` as a user runs it: the whole cluster from one spec, ready, answering,
and gone on SIGTERM or with its parent.

The tiny trained world of :mod:`tests.integration.ranker_world` (no training here) is
served with ``--models DIR --config SPEC``; ``[topology] rankers`` sets the ranker count.
``recserve serve`` runs in its own session, so every process it (or a child of it)
starts shares its process group: the test reads the group from ``/proc`` to find
children nobody printed. Readiness and answers are read from the children themselves
(their gRPC health, a Rank, a Recommend), never from the launcher's word. Until the
cascade process exists (``recserve cascade serve``) the cluster runs with
``--no-cascade`` and the Recommend checks are skipped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.cli.main import COMMANDS
from recserve.cli.serve_cmd import READY_LINE
from recserve.cluster.group import REPO_ROOT, Health, watch_health
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import ranking_pb2, recommender_pb2
from recserve.v1.ranking_pb2_grpc import RankingStub
from recserve.v1.recommender_pb2_grpc import RecommenderStub
from tests.integration.ranker_world import RankerWorld, make_ranker_world, spec_text

pytestmark = pytest.mark.integration

READY_TIMEOUT_S = 300.0  # a loaded 2-core box: torch + torchrec imports alone take ≈9 s per ranker
RPC_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0
# An orphan gets SIGTERM, then SIGKILL after 1 s; one that outlived its parent would live
# for ever, so a generous bound cannot hide a bug.
ORPHAN_BOUND_S = 10.0
ENDPOINT = re.compile(r"^gRPC (\w+) at (\S+) \((\w+) (\d+), pid (\d+), log (.+)\)$")
GATEWAY_LINE = re.compile(r"^HTTP gateway at (http://\S+) \(pid (\d+), log (.+)\)$")
STAGES = "l0_out = 400\nl1_out = 256\nl2_out = 50\nl3_out = 10\n"  # L1 output and max_k fit one Rank (MAX_CANDIDATES)
HEALTH_SERVICE = {"EmbeddingShard": "", "Ranking": "recserve.v1.Ranking", "Recommender": "recserve.v1.Recommender", "Generation": "recserve.v1.Generation"}


def _cascade_built() -> bool:
    name = COMMANDS.get("cascade")
    return name is not None and importlib.util.find_spec(name) is not None


CASCADE = _cascade_built()


@dataclasses.dataclass(frozen=True)
class Endpoint:
    service: str
    address: str
    kind: str
    index: int
    pid: int


@dataclasses.dataclass
class Serve:
    """A running ``recserve serve`` and what it printed up to ``recserve: ready``."""

    proc: subprocess.Popen[str]
    lines: list[str]
    endpoints: list[Endpoint]
    stderr_path: Path
    rest: queue.Queue[str | None]  # stdout lines after ready (None: EOF)

    def of(self, service: str) -> list[Endpoint]:
        return [e for e in self.endpoints if e.service == service]

    def stderr_tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> RankerWorld:
    return make_ranker_world(tmp_path_factory.mktemp("serve-world"))


def _spec(world: RankerWorld, path: Path, rankers: int) -> Path:
    """The world's spec with ``rankers`` rankers and stage sizes for its 5,000 items (L1's
    output must fit one Rank: the world caps requests at MAX_CANDIDATES)."""
    text = spec_text(world.export.manifest, world.models, extra=f"\n[topology]\nrankers = {rankers}\n")
    text = text.replace("[cascade]\n", f"[cascade]\n{STAGES}", 1) if "[cascade]\n" in text else text + f"\n[cascade]\n{STAGES}"
    path.write_text(text)
    return path


def _start(world: RankerWorld, tmp: Path, rankers: int) -> Serve:
    """Start ``recserve serve`` in its own session; return once it printed ready."""
    argv = [sys.executable, "-m", "recserve", "serve", "--models", str(world.models), "--config", str(_spec(world, tmp / "spec.toml", rankers)),
            "--data", str(tmp / "run")] + ([] if CASCADE else ["--no-cascade"])  # fmt: skip
    stderr_path = tmp / "serve.stderr"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # a thread, so the test waits on a queue with a deadline, not on a blocking read
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                proc.wait(timeout=30)
                pytest.fail(f"recserve serve exited {proc.returncode} before ready:\n" + "\n".join(seen) + "\n" + stderr_path.read_text()[-3000:])
            seen.append(line)
            if line == READY_LINE:
                break
    except BaseException:
        _kill_group(proc)
        raise
    endpoints = [Endpoint(m[1], m[2], m[3], int(m[4]), int(m[5])) for m in map(ENDPOINT.match, seen) if m]
    return Serve(proc, seen, endpoints, stderr_path, lines)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Whatever happened, nothing the test started outlives it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _group_members(pgid: int) -> set[int]:
    """Live (non-zombie) processes of process group ``pgid``, from /proc."""
    members: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.add(int(entry))
    return members


def _exited(pidfds: dict[int, int], timeout_s: float) -> set[int]:
    """Pids (of ``pidfds``: pid -> pidfd, readable once the process exits) that exit within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    gone: set[int] = set()
    while len(gone) < len(pidfds):
        remaining = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd for pid, fd in pidfds.items() if pid not in gone], [], [], remaining)
        gone |= {pid for pid, fd in pidfds.items() if fd in ready}
        if remaining == 0.0:
            break  # checked once more at the deadline (timeout 0: checked once, no wait)
    return gone


def _pidfds(pids: set[int]) -> dict[int, int]:
    out = {}
    for pid in pids:
        try:
            out[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            pass  # already gone
    return out


def _health(address: str, service: str) -> int | grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S).status)
        except grpc.RpcError as exc:
            return exc.code()


@pytest.fixture
def serving(world: RankerWorld, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Serve]:
    serve = _start(world, tmp_path, rankers=request.param)
    try:
        yield serve
    finally:
        _kill_group(serve.proc)


@pytest.mark.parametrize("serving", [2], indirect=True)
def test_serve_reports_ready_answers_and_leaves_no_child_on_sigterm(world: RankerWorld, serving: Serve) -> None:
    services = [e.service for e in serving.endpoints]
    # [topology] generators = 1 (the default): one generation replica, awaited before the gateway that serves it.
    want = ["EmbeddingShard"] * 2 + ["Ranking"] * 2 + (["Recommender", "Generation"] if CASCADE else [])
    assert services == want, serving.lines  # every endpoint printed, in start order
    assert serving.lines[-1] == READY_LINE and serving.lines.count(READY_LINE) == 1
    pids = {e.pid for e in serving.endpoints}
    assert len(pids) == len(want) and pids <= _group_members(serving.proc.pid)  # live children of this serve
    gateways = [m for m in map(GATEWAY_LINE.match, serving.lines) if m]
    if CASCADE:  # the HTTP gateway starts last, on the cascade: printed, a child, answering
        assert len(gateways) == 1 and serving.lines.index(gateways[0][0]) == len(serving.lines) - 2, serving.lines
        assert int(gateways[0][2]) in _group_members(serving.proc.pid)
        http_ask = urllib.request.Request(gateways[0][1] + "/v1/recommendations", data=json.dumps({"user_id": 3, "k": 5}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(http_ask, timeout=RPC_TIMEOUT_S) as reply:
            http_answer = json.loads(reply.read())
        assert len(set(http_answer["item_ids"])) == 5 and http_answer["model_version"] == world.export.model_version
    # Ready means every child says SERVING itself.
    for e in serving.endpoints:
        assert _health(e.address, HEALTH_SERVICE[e.service]) == health_pb2.HealthCheckResponse.SERVING, e

    # Supervision (issue 17): a SIGKILLed shard is restarted on its port, and says so.
    shard = serving.of("EmbeddingShard")[0]
    os.kill(shard.pid, signal.SIGKILL)
    said: list[str] = []
    while not any("shard-0 restarted" in line for line in said):
        line = serving.rest.get(timeout=READY_TIMEOUT_S)
        assert line is not None, said  # not EOF: serve itself must live on
        said.append(line)
    assert said[0].startswith(f"recserve: shard-0 exited with code {-signal.SIGKILL}; restarting in "), said
    end = time.monotonic() + READY_TIMEOUT_S
    while (seen := watch_health(shard.address, HEALTH_SERVICE[shard.service], max(0.1, end - time.monotonic()))) is Health.UNREACHABLE:
        assert time.monotonic() < end, "the restarted shard never listened"
        time.sleep(0.05)  # not listening yet: the restart is still importing
    assert seen is Health.SERVING  # loaded again, on its old port

    items = np.arange(10, 50, dtype=np.int64)
    for e in serving.of("Ranking"):
        with grpc.insecure_channel(e.address) as channel:
            request = ranking_pb2.RankRequest(header=make_header(timeout_s=RPC_TIMEOUT_S), user_id=3, candidate_ids=pack(items), model="dlrm")
            reply = RankingStub(channel).Rank(request, timeout=RPC_TIMEOUT_S)
        assert reply.model_version == world.export.model_version
        assert sorted(unpack(reply.item_ids, "item_ids").tolist()) == items.tolist()
    if CASCADE:
        (cascade,) = serving.of("Recommender")
        with grpc.insecure_channel(cascade.address) as channel:
            ask = recommender_pb2.RecommendRequest(header=make_header(timeout_s=RPC_TIMEOUT_S), user_id=3, k=5)
            answer = RecommenderStub(channel).Recommend(ask, timeout=RPC_TIMEOUT_S)
        got = unpack(answer.item_ids, "item_ids")
        assert len(set(got.tolist())) == 5 and answer.model_version == world.export.model_version  # k distinct items, through the rankers

    members = _group_members(serving.proc.pid) - {serving.proc.pid}
    fds = _pidfds(members)  # taken while alive: immune to pid reuse
    try:
        serving.proc.send_signal(signal.SIGTERM)
        assert serving.proc.wait(timeout=STOP_TIMEOUT_S) == 0, serving.stderr_tail()
        rest = []
        while (line := serving.rest.get(timeout=RPC_TIMEOUT_S)) is not None:
            rest.append(line)
        assert rest[-1] == "recserve: stopped", rest
        # serve reaped its children before exiting: every one is gone already, and so is
        # anything they started (still in the group otherwise).
        assert _exited(fds, 0.0) == set(fds), f"children {sorted(set(fds) - _exited(fds, 0.0))} outlived recserve serve"
        assert _group_members(serving.proc.pid) == set()
    finally:
        for fd in fds.values():
            os.close(fd)
    for e in serving.endpoints:
        assert _health(e.address, HEALTH_SERVICE[e.service]) == grpc.StatusCode.UNAVAILABLE, e  # nothing listens there


@pytest.mark.parametrize("serving", [1], indirect=True)
def test_children_exit_when_serve_is_sigkilled(serving: Serve) -> None:
    members = _group_members(serving.proc.pid) - {serving.proc.pid}
    assert {e.pid for e in serving.endpoints} <= members
    fds = _pidfds(members)
    try:
        serving.proc.kill()  # SIGKILL: none of serve's own shutdown runs
        serving.proc.wait(timeout=10)
        gone = _exited(fds, ORPHAN_BOUND_S)
        assert gone == set(fds), f"children {sorted(set(fds) - gone)} outlived their SIGKILLed recserve serve by {ORPHAN_BOUND_S} s"
        assert _group_members(serving.proc.pid) == set()  # nor anything they started
    finally:
        for fd in fds.values():
            os.close(fd)

