"""A slow, pure-Python reference of the sharding plan's routing, and its own checks.

It reads only the plan's *data* (ring tokens, tier id lists, counts, seed) and
re-derives every destination one id at a time with Python ints, ``bisect`` and a
literal clockwise walk, so it shares no code with :mod:`recserve.sharding.router`.
Other ``test_sharding_*`` modules import :class:`RefRouter` from here.
"""

from __future__ import annotations

import bisect
import hashlib

import numpy as np

from recserve.sharding.plan import ShardingPlan

M64 = (1 << 64) - 1


def splitmix64_py(x: int) -> int:
    """The splitmix64 output function (Steele, Lea, Flood 2014) on one 64-bit int."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class RefRouter:
    """Per-id routing of one table, the obvious way."""

    def __init__(self, plan: ShardingPlan, table: str) -> None:
        t = plan.tables[table]
        self.t = t
        pairs = sorted((int(tok), slot) for slot, row in enumerate(plan.tokens) for tok in row)
        self.tokens = [tok for tok, _ in pairs]
        self.owners = [slot for _, slot in pairs]
        self.num_shards = plan.num_shards
        digest = hashlib.blake2b(f"{plan.seed}:{table}".encode(), digest_size=8).digest()
        self.salt = int.from_bytes(digest, "little")
        self.hot = {int(i) for i in t.hot_ids}
        self.warm = {int(i) for i in t.warm_ids}

    def tier(self, i: int) -> int:
        return 0 if i in self.hot else 1 if i in self.warm else 2

    def walk(self, i: int, k: int) -> list[int]:
        """The first k distinct shards clockwise from the first token >= hash(i)."""
        h = splitmix64_py(i ^ self.salt)
        j = bisect.bisect_left(self.tokens, h)
        out: list[int] = []
        for step in range(len(self.tokens)):
            s = self.owners[(j + step) % len(self.tokens)]
            if s not in out:
                out.append(s)
                if len(out) == k:
                    break
        return out

    def next_slots(self, i: int, k: int) -> list[int]:
        """The ring owner of i, then the next k - 1 shard slots, wrapping."""
        owner = self.walk(i, 1)[0]
        return [(owner + r) % self.num_shards for r in range(k)]

    def hot_replicas(self, i: int) -> list[int]:
        return self.next_slots(i, self.t.hot_replicas) if self.tier(i) == 0 else [-1] * self.t.hot_replicas

    def warm_shards(self, i: int) -> list[int]:
        return self.next_slots(i, self.t.column_splits) if self.tier(i) == 1 else [-1] * self.t.column_splits

    def cold_owners(self, i: int) -> list[int]:
        return self.walk(i, self.t.cold_replicas) if self.tier(i) == 2 else [-1] * self.t.cold_replicas

    def owns(self, shard: int, i: int, slice_index: int | None) -> bool:
        tier = self.tier(i)
        if tier == 0:
            return shard in self.hot_replicas(i)
        if tier == 2:
            return shard in self.cold_owners(i)
        if slice_index is None:
            return self.t.column_splits == 1 and self.warm_shards(i)[0] == shard
        return self.warm_shards(i)[slice_index] == shard


def test_splitmix64_py_matches_published_vector() -> None:
    # First output of the splitmix64 generator seeded with 0 (the published test value).
    assert splitmix64_py(0) == 0xE220A8397B1DCDAF


def test_numpy_hash_matches_reference() -> None:
    from recserve.sharding.ring import splitmix64

    xs = [0, 1, 2, 12345, (1 << 63) - 1, M64]
    got = splitmix64(np.array(xs, dtype=np.uint64)).tolist()
    assert got == [splitmix64_py(x) for x in xs]


def make_plan(
    *,
    rows: int = 5_000,
    dim: int = 10,
    hot: int = 50,
    warm: int = 500,
    hot_replicas: int = 2,
    column_splits: int = 3,
    cold_replicas: int = 1,
    num_shards: int = 5,
    virtual_nodes: int = 16,
    seed: int = 0,
    table: str = "item",
    dtype: str = "float32",
) -> ShardingPlan:
    """A one-table plan whose hot / warm ids are a seeded random choice of ids."""
    from recserve.sharding.plan import TablePlan

    perm = np.random.default_rng(seed + 1).permutation(rows)
    tp = TablePlan(
        name=table,
        rows=rows,
        dim=dim,
        dtype=dtype,
        hot_ids=np.sort(perm[:hot]),
        warm_ids=np.sort(perm[hot : hot + warm]),
        hot_replicas=hot_replicas,
        column_splits=column_splits,
        cold_replicas=cold_replicas,
    )
    return ShardingPlan(version=1, num_shards=num_shards, tables={table: tp}, virtual_nodes=virtual_nodes, seed=seed)
