"""KV block bookkeeping: the allocator, reference counts and the prefix cache (no torch).

The physical K/V tensors live in :class:`generation.kv_cache.PagedKvCache`; this module
decides which block holds what. A sequence's :class:`BlockTable` maps its logical block
``i`` (tokens ``i*B .. i*B+B-1``) to a physical block id.

Prefix sharing (reference §10.7.4). A block whose ``B`` tokens are all computed and lie
in a sequence's known prefix can be *registered* under a key that chains, in order:
the tenant, the model version and every token up to the block's end. A later sequence
whose prompt hashes to the same keys takes those blocks by reference (refcount + 1)
instead of recomputing them. Keys start from (tenant, model version), so two tenants
never share a block, whatever their text; new weights never reuse old K/V.

Copy-on-write. A registered or multiply referenced block is never written; a sequence
that must write into one (the last prompt token of a fully cached prompt, recomputed to
get its logits) first gets a private copy (:meth:`BlockPool.make_private`), and the
engine copies the K/V rows before the step.

A block whose refcount drops to 0 but is registered stays cached and *evictable*; it is
reclaimed least-recently-freed first when the free list is empty, so the shared system
prompt survives between requests while the pool has room.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

from recserve.errors import InternalError, ResourceExhausted


@dataclasses.dataclass(slots=True, eq=False)
class BlockTable:
    """One sequence's KV blocks and progress (``Handle.policy_data`` of the decode policies).

    ``blocks``: physical ids of logical blocks 0..; ``computed``: tokens whose K/V is in
    the cache; ``step_tokens``: tokens the current step computes, starting at
    ``computed``; ``copies``: (src, dst) block copies to make before the step (CoW);
    ``keys``: prefix-cache keys of the known tokens' full blocks; ``registered``: how
    many leading blocks are registered (or were taken from the cache)."""

    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    step_tokens: int = 0
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)
    registered: int = 0
    prefix_hit_blocks: int = 0  # blocks taken from the cache at admission


def prefix_keys(tenant: str, model_version: str, tokens: np.ndarray, block_tokens: int) -> list[bytes]:
    """Keys of the full blocks of ``tokens`` ([T] int64): ``key_i`` = blake2b(key_{i-1} ‖
    bytes of block i), ``key_{-1}`` = blake2b(tenant ‖ model_version). One hash per block."""
    n_full = int(tokens.shape[0]) // block_tokens
    if n_full == 0:
        return []
    h = hashlib.blake2b(f"{len(tenant)}:{tenant}\x00{model_version}".encode(), digest_size=16).digest()
    body = np.ascontiguousarray(tokens[: n_full * block_tokens], dtype=np.int64).reshape(n_full, block_tokens)
    keys: list[bytes] = []
    for row in body:  # per block (16 tokens), not per token
        h = hashlib.blake2b(h + row.tobytes(), digest_size=16).digest()
        keys.append(h)
    return keys


class BlockPool:
    """``num_blocks`` blocks: a free list, per-block refcounts and the prefix cache.

    ``free_count`` counts blocks an allocation can get now: never-used or released ones
    plus cached blocks nobody references (evicted on demand)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int64)
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # block -> None, oldest first
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.hits = 0  # blocks handed out from the prefix cache
        self.evictions = 0
        self.cow_copies = 0

    @property
    def free_count(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def used_count(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.free_count

    @property
    def cached_count(self) -> int:
        return len(self._by_key)

    def allocate(self) -> int:
        """A private block (refcount 1); evicts the oldest unreferenced cached block when
        the free list is empty."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_key[self._key_of.pop(block)]
            self.evictions += 1
        else:
            raise ResourceExhausted(f"the KV pool's {self.num_blocks} blocks are all in use")
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.refcount[block] == 0:
            self._evictable.pop(block)  # KeyError = a freed, unregistered block: a bookkeeping bug
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        count = int(self.refcount[block])
        if count <= 0:
            raise InternalError(f"KV block {block} released with refcount {count}")
        self.refcount[block] = count - 1
        if count == 1:
            if block in self._key_of:
                self._evictable[block] = None  # newest at the end
            else:
                self._free.append(block)

    def release(self, table: BlockTable) -> None:
        """Drop every reference ``table`` holds (finish, cancel, expiry, preemption)."""
        for block in table.blocks:
            self.decref(block)
        table.blocks.clear()
        table.computed = table.step_tokens = table.registered = 0
        table.copies.clear()

    def match(self, keys: list[bytes]) -> list[int]:
        """Take the longest cached prefix of ``keys``: its blocks, each with one more reference."""
        found: list[int] = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            self.incref(block)
            found.append(block)
        self.hits += len(found)
        return found

    def peek_match(self, keys: list[bytes]) -> tuple[int, int]:
        """(cached prefix blocks of ``keys``, how many of them are evictable right now) —
        what :meth:`match` would take, without taking it."""
        n = evictable = 0
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            n += 1
            evictable += self.refcount[block] == 0
        return n, int(evictable)

    def register(self, key: bytes, block: int) -> None:
        """Publish a fully computed block under ``key``. If another sequence published the
        same key first (both computed it), the existing entry wins and ``block`` stays private."""
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key

    def forget(self, blocks: list[int]) -> None:
        """Unpublish ``blocks`` from the prefix cache (their K/V is suspect: a sequence
        that read them failed). Holders keep using them; no later sequence matches them,
        and each returns to the free list when its last holder lets go."""
        for block in blocks:
            key = self._key_of.pop(block, None)
            if key is None:
                continue
            del self._by_key[key]
            if self.refcount[block] == 0:
                del self._evictable[block]
                self._free.append(block)

    def is_shared(self, block: int) -> bool:
        """Must not be written in place: referenced twice or published in the cache."""
        return bool(self.refcount[block] > 1) or block in self._key_of

    def make_private(self, table: BlockTable, index: int) -> None:
        """Copy-on-write: give ``table`` its own copy of logical block ``index`` before it
        writes there; the engine copies the K/V rows (``table.copies``)."""
        old = table.blocks[index]
        new = self.allocate()
        table.copies.append((old, new))
        table.blocks[index] = new
        self.decref(old)
        self.cow_copies += 1
