"""Send an upsert to every owner of each id; acknowledge only when all have.

:func:`recserve.sharding.upsert.split_upsert` says which shard gets which ids and which
column slice (all hot replicas, each warm slice's shard, the cold owner(s)); this module
sends one ``Upsert`` RPC per shard, all in parallel, and succeeds only if every one
succeeds. A shard applies an upsert to its WAL and DRAM tier before it answers, so a
lookup sent after this returns sees the new row (the near cache is invalidated by the
client around the call, see :meth:`LookupClient.upsert`).
"""

from __future__ import annotations

import asyncio

import numpy as np

from recserve.errors import InternalError, RecserveError
from recserve.lookup.transport import ShardTransport
from recserve.rpc.auth import admin_metadata
from recserve.rpc.status import error_from_code, grpc_code
from recserve.rpc.tensors import pack
from recserve.sharding.plan import ShardingPlan
from recserve.sharding.upsert import split_upsert
from recserve.v1 import common_pb2, embedding_pb2

async def send_upsert(
    transport: ShardTransport,
    plan: ShardingPlan,
    table: str,
    ids: np.ndarray,
    rows: np.ndarray,
    *,
    header: common_pb2.RequestHeader,
    admin_token: str,
    timeout_s: float,
) -> dict[int, int]:
    """Upsert ``rows`` (fp32 [N, dim]) of ``ids`` (int64 [N]) into every owner.

    ``admin_token`` travels as ``authorization: Bearer`` call metadata (the shards'
    admin check, :class:`recserve.rpc.auth.AdminAuth`). Returns shard -> rows written. Raises the first failure as a RecserveError of the
    shard's status kind, naming every shard that did not acknowledge (the rows may then
    be applied on some owners and not others; upserts are idempotent, so retry).
    """
    parts = split_upsert(plan, table, ids, rows)
    requests = {
        shard: embedding_pb2.UpsertRequest(
            header=header,
            tables=[
                embedding_pb2.TableUpsert(table=table, ids=pack(p_ids), rows=pack(np.ascontiguousarray(p_rows, dtype=np.float32)), col_start=a, col_end=b)
                for p_ids, p_rows, a, b in shard_parts
            ],
        )
        for shard, shard_parts in parts.items()
    }
    shards = list(requests)
    metadata = admin_metadata(admin_token)
    replies = await asyncio.gather(*(transport.upsert(s, requests[s], timeout_s, metadata) for s in shards), return_exceptions=True)
    failed = [(s, r) for s, r in zip(shards, replies) if isinstance(r, BaseException)]
    if failed:
        first = failed[0][1]
        # A shard's status error names its shard already (transport.shard_call_error).
        names = ", ".join(str(e) if isinstance(e, RecserveError) else f"shard {s}: {e!r}" for s, e in failed)
        if isinstance(first, RecserveError):  # a shard's status: keep its kind
            raise error_from_code(grpc_code(first), f"upsert of {len(ids)} rows into table {table!r} not acknowledged by {len(failed)} of {len(shards)} owners ({names})")
        raise InternalError(f"upsert of {len(ids)} rows into table {table!r} failed: {names}")
    return {s: int(r.rows_written) for s, r in zip(shards, replies) if isinstance(r, embedding_pb2.UpsertResponse)}
