"""The measured calls of ``recserve bench recall``: served Recommends over gRPC, and the
same cascade in process with each stage's output traced.

Both passes are sequential and unloaded, and both start with ``--warmup`` calls on other
users whose deadline is at least :data:`WARMUP_DEADLINE_S`: a cold process's first calls
(channel connects, the rankers' first forwards) take 10-100x a warm one's, the stage cost
models learn from them, and with a tight deadline every stage would then skip (a skip
measures nothing) until ``probe_after_skips``. With room to run, the EWMA forgets those
first samples within the warm-up, and the measured calls see a warm server's models.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

TOP = 10  # items per Recommend; ground truth and final sizes compared
WARMUP_DEADLINE_S = 2.0
L3_CHECK_USERS = 20


def _log(msg: str) -> None:
    print(f"[bench recall] {msg}", file=sys.stderr, flush=True)


def served_calls(address: str, warm_users: np.ndarray, users: np.ndarray, deadline_s: float) -> dict[str, Any]:
    """Sequential Recommend calls over gRPC: per-call ms, the items, stage timings."""
    import grpc

    from recserve.rpc.deadline import make_header
    from recserve.rpc.tensors import unpack
    from recserve.v1 import recommender_pb2
    from recserve.v1.recommender_pb2_grpc import RecommenderStub

    items = np.full((users.size, TOP), -1, dtype=np.int64)
    ms = np.empty(users.size)
    stage_ms: dict[str, list[float]] = {}
    reasons: dict[str, int] = {}
    degraded = failed = 0
    with grpc.insecure_channel(address) as channel:
        stub = RecommenderStub(channel)

        def call(user: int, timeout_s: float) -> Any:
            req = recommender_pb2.RecommendRequest(header=make_header(timeout_s=timeout_s), user_id=user, k=TOP)
            return stub.Recommend(req, timeout=timeout_s)

        for user in warm_users.tolist():  # warm-up: channels, shard caches, cost models (see WARMUP_DEADLINE_S)
            call(int(user), max(deadline_s, WARMUP_DEADLINE_S))
        for i, user in enumerate(users.tolist()):  # sequential and unloaded: one call at a time
            t0 = time.perf_counter()
            try:
                resp = call(int(user), deadline_s)
            except grpc.RpcError as exc:  # counted; its time (about the deadline) stays in the percentiles
                ms[i] = (time.perf_counter() - t0) * 1e3
                code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
                reasons[f"error:{code}"] = reasons.get(f"error:{code}", 0) + 1
                failed += 1
                continue
            ms[i] = (time.perf_counter() - t0) * 1e3
            got = unpack(resp.item_ids, "item_ids")
            items[i, : got.size] = got[:TOP]
            degraded += int(resp.degraded)
            for s in resp.stages:
                stage_ms.setdefault(s.stage, []).append(s.elapsed_ms)
                if s.degraded:
                    reasons[f"{s.stage}:{s.degraded_reason}"] = reasons.get(f"{s.stage}:{s.degraded_reason}", 0) + 1
    _log(f"served: p50 {np.percentile(ms, 50):.1f} ms, p99 {np.percentile(ms, 99):.1f} ms over {users.size} sequential Recommend calls; {degraded} degraded, {failed} failed")
    return {"ms": ms, "items": items, "degraded": degraded, "failed": failed, "reasons": reasons,
            "stage_ms_p50": {s: float(np.percentile(v, 50)) for s, v in stage_ms.items()}}  # fmt: skip


async def traced_calls(cluster: Any, view: Any, index: Any, rankers: list[str], warm_users: np.ndarray, users: np.ndarray, deadline_s: float,
                  exhaustive: np.ndarray, reference: np.ndarray) -> dict[str, Any]:  # fmt: skip
    """Each stage's output for every user, from an in-process CascadeCore on the same
    index and rankers: ``stages`` name -> ``[B, n_stage]`` int64 (-1 padded where a stage
    output fewer); ``l0_degraded`` ``[B]`` bool; ``reasons`` degraded stage counts;
    ``ran_ms_p50`` each stage's p50 elapsed over the requests where it was not skipped;
    ``served_l3_vs_reference``: the served ``Rank(model="l3")`` over exhaustive DLRM's
    top-100 (``exhaustive`` ``[B, 100]``) against the in-process ``reference`` top-10, on
    up to :data:`L3_CHECK_USERS` users (1.0 = the reference is what the rankers compute)."""
    from cascade.budget import Stage, stage_sizes_for
    from cascade.index import IndexHolder
    from cascade.service import CascadeCore
    from recserve.client import RankingClient

    client = RankingClient(rankers, cluster.routing)
    await client.start()
    core = CascadeCore(cluster.cascade, view, IndexHolder(index), client)
    sizes = stage_sizes_for(cluster.cascade, view.num_items, TOP)
    out = {s: np.full((users.size, sizes.out(s)), -1, dtype=np.int64) for s in Stage}
    empty = np.zeros(0, dtype=np.int64)
    l0_degraded = np.zeros(users.size, dtype=bool)
    reasons: dict[str, int] = {}
    ran_ms: dict[str, list[float]] = {}
    try:
        for i, user in enumerate([*warm_users.tolist(), *users.tolist()]):  # sequential, like the served pass
            trace: dict[Stage, np.ndarray] = {}
            j = i - warm_users.size
            q = core.query(int(user), TOP, empty, empty, deadline=time.monotonic() + (deadline_s if j >= 0 else max(deadline_s, WARMUP_DEADLINE_S)))
            rec = await core.recommend(q, trace=trace)
            if j >= 0:
                for s, ids in trace.items():
                    out[s][j, : min(ids.size, out[s].shape[1])] = ids[: out[s].shape[1]]
                for r in rec.reports:  # four stages
                    if r.degraded:
                        reasons[f"{r.stage}:{r.degraded_reason.value}"] = reasons.get(f"{r.stage}:{r.degraded_reason.value}", 0) + 1
                    if r.scored > 0:
                        ran_ms.setdefault(r.stage, []).append(r.elapsed_ms)
                l0_degraded[j] = rec.reports[0].degraded
        l3_hits = []
        for j in range(min(L3_CHECK_USERS, users.size)):  # a few RPCs: is the in-process reference what the rankers compute?
            res = await client.rank(int(users[j]), exhaustive[j], model="l3", timeout_s=10.0)
            l3_hits.append(float(np.isin(reference[j], np.asarray(res.item_ids)[:TOP]).mean()))
    finally:
        await core.aclose()
    return {"stages": {s.name: a for s, a in out.items()}, "l0_degraded": l0_degraded, "reasons": reasons, "served_l3_vs_reference": float(np.mean(l3_hits)),
            "ran_ms_p50": {s: float(np.percentile(v, 50)) for s, v in ran_ms.items()}}  # fmt: skip
