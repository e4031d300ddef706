"""The shard servicer runs small lookups inline only while no executor job is running,
also after an RPC whose job is still running was cancelled (no sockets: a fake core)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from embedding_server.fault import FaultInjector
from embedding_server.service import EmbeddingShardService
from embedding_server.shard import LookupOutcome
from recserve.rpc.tensors import pack
from recserve.sharding.plan import Tier
from recserve.v1 import embedding_pb2


class GatedCore:
    """Stands in for ShardCore: ``lookup`` of a request whose first id is 0 blocks until
    :meth:`release`; records how many calls ran at once and on which threads."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.threads: list[str] = []

    def release(self) -> None:
        self.gate.set()

    def check_size(self, n_ids: int, what: str) -> None:
        pass

    def lookup(self, request: embedding_pb2.LookupRequest, deadline: float) -> LookupOutcome:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.threads.append(threading.current_thread().name)
        try:
            if np.frombuffer(request.tables[0].ids.data, "<i8")[0] == 0:
                self.entered.set()
                assert self.gate.wait(10.0)
            return LookupOutcome(embedding_pb2.LookupResponse(), 0, {k: 0 for k in Tier}, 0, 0)
        finally:
            with self._lock:
                self.active -= 1


class Context:
    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"unexpected abort {code}: {details}")


def request(ids: list[int]) -> embedding_pb2.LookupRequest:
    return embedding_pb2.LookupRequest(tables=[embedding_pb2.TableLookup(table="t", ids=pack(np.array(ids, np.int64)))])


def test_a_cancelled_rpc_keeps_its_running_job_counted_so_no_lookup_runs_inline_beside_it() -> None:
    executor = ThreadPoolExecutor(1, thread_name_prefix="shard-test")
    core = GatedCore()
    service = EmbeddingShardService(shard_id=0, plan_version=1, plan_json="{}", executor=executor, faults=FaultInjector(enabled=False), inline_ids=4)
    service.set_ready(core)  # type: ignore[arg-type]

    async def go() -> None:
        big = asyncio.ensure_future(service.Lookup(request([0] * 8), Context()))  # type: ignore[arg-type]
        await asyncio.get_running_loop().run_in_executor(None, core.entered.wait, 10.0)
        big.cancel()  # the client went away; the executor keeps gathering
        try:
            await big
        except asyncio.CancelledError:
            pass
        small = asyncio.ensure_future(service.Lookup(request([1]), Context()))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # let it start: inline it would finish (or block the loop) here
        core.release()
        await small
        assert service._executor_jobs == 0
        idle = await service.Lookup(request([2]), Context())  # type: ignore[arg-type]
        assert idle is not None

    try:
        asyncio.run(asyncio.wait_for(go(), 20.0))
    finally:
        core.release()
        executor.shutdown(wait=True)
    assert core.max_active == 1  # never two core calls at once
    assert core.threads[:2] == ["shard-test_0", "shard-test_0"]  # the small one waited its turn on the executor
    assert core.threads[2] == "MainThread"  # with the executor idle again, small lookups run inline
