"""Session affinity: a consistent-hash ring of replicas, keyed by user or conversation.

Reference §10.11.6: a replica that keeps per-session state (a conversation's KV cache, a
user's recent-history cache) is worth reaching again, so a key should map to the same
replica every time, and a change of membership should move as few keys as possible.
Consistent hashing gives both: every replica owns ``virtual_nodes`` points on a 64-bit
ring and a key belongs to the first point clockwise of its hash. Adding a replica moves
only the keys that land on its new points (an expected ``1/(n+1)``), removing one moves
only its own keys (``1/n``); nobody else's keys move.

**Tokens from names, not from history.** The shard ring (:mod:`recserve.sharding.ring`)
carves tokens in the order shards were added and stores them in the sharding plan. A
replica set has no such plan: two gateways may list the same replicas in a different
order, and must still agree. So each replica's points are a hash of its name (its
address), independent of order and of which other replicas exist. The price is
balance: shares spread by about ``1/sqrt(virtual_nodes)`` (±9 % at 128).

**Fallback.** When the key's replica cannot take the call (breaker open, or it just
failed this call), the key goes to the next *distinct* replica clockwise, the one that
would own it if the preferred replica left the ring; other keys do not move. The lookup
reuses :class:`recserve.sharding.ring.Ring` (its bucketed vectorised search and its
``successors`` table), so many keys resolve with array operations only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from recserve.errors import ConfigError, require
from recserve.sharding.ring import Ring, hash_ids, table_salt

__all__ = ["AffinityRing"]


class AffinityRing:
    """Consistent-hash ring over named replicas.

    Args:
        replicas: distinct replica names (addresses); index ``r`` below is a position
            in this list.
        virtual_nodes: ring points per replica.
        seed: salts every hash, so two rings with different seeds place keys differently.

    Example::

        ring = AffinityRing(["ranker-0:7000", "ranker-1:7000", "ranker-2:7000"])
        r = ring.choose(user_id, eligible=np.array([True, False, True]))  # index or -1
    """

    def __init__(self, replicas: Sequence[str], *, virtual_nodes: int = 128, seed: int = 0) -> None:
        require(len(replicas) >= 1, "affinity.replicas", list(replicas), "name at least one replica")
        require(len(set(replicas)) == len(replicas), "affinity.replicas", list(replicas), "name each replica once")
        require(virtual_nodes >= 1, "affinity.virtual_nodes", virtual_nodes, "use at least 1 point per replica")
        self.replicas = tuple(replicas)
        self.seed = seed
        points = np.arange(virtual_nodes, dtype=np.int64)
        tokens = np.stack([hash_ids(points, table_salt(seed, f"replica:{name}")) for name in self.replicas])
        self.ring = Ring(tokens)  # uint64 [R, V]; raises ConfigError on a (2**-64-rare) token clash
        # int32 [T + 1, R]: for each ring position, every replica in clockwise order.
        self._order = self.ring.successors(len(self.replicas))
        self._key_salt = table_salt(seed, "affinity-key")

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def points(self, keys: np.ndarray | Sequence[int] | int | str) -> np.ndarray:
        """uint64 [N] ring points of int keys (an int64 array: vectorised) or of one str
        key (a conversation id: blake2b, stable across processes, unlike ``hash``)."""
        if isinstance(keys, str):
            digest = hashlib.blake2b(keys.encode(), digest_size=8, key=str(self.seed).encode()).digest()
            return np.array([int.from_bytes(digest, "little")], dtype=np.uint64)
        arr = np.atleast_1d(np.asarray(keys))
        if arr.dtype.kind not in "iu":
            raise ConfigError(f"affinity keys must be integers or one string, got dtype {arr.dtype}")
        return hash_ids(arr.astype(np.int64, copy=False), self._key_salt)

    def preference(self, keys: np.ndarray | Sequence[int] | int | str) -> np.ndarray:
        """int32 [N, R]: per key, every replica in ring order from its owner (column 0)."""
        return np.take(self._order, self.ring.positions(self.points(keys)), axis=0)

    def owners(self, keys: np.ndarray | Sequence[int] | int | str) -> np.ndarray:
        """int32 [N]: each key's preferred replica, ignoring breakers."""
        return self.preference(keys)[:, 0]

    def choose_many(self, keys: np.ndarray | Sequence[int] | int | str, eligible: np.ndarray) -> np.ndarray:
        """int64 [N]: per key, the first eligible replica in its ring order; -1 where
        none is eligible. ``eligible``: bool [R]."""
        if eligible.shape != (self.num_replicas,):
            raise ConfigError(f"eligible has shape {eligible.shape}; the ring has {self.num_replicas} replicas")
        pref = self.preference(keys)
        ok = np.take(eligible, pref)
        first = np.argmax(ok, axis=1)  # first True (0 where none: masked below)
        chosen = pref[np.arange(pref.shape[0]), first].astype(np.int64)
        return np.where(ok.any(axis=1), chosen, -1)

    def choose(self, key: int | str, eligible: np.ndarray) -> int:
        """One key's replica: its owner, or the next eligible one clockwise; -1 if none."""
        return int(self.choose_many(key, eligible)[0])
