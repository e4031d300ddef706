"""The embedding shard server (docs/architecture.md §4): one gRPC process per shard.

Modules, by concept: ``config`` (the process config), ``layout`` (what this shard holds,
from the plan), ``codec`` / ``store`` (RocksDB keys, values, column families),
``bulk_load`` (idempotent SST / batch loads), ``quant`` (fp32 / fp16 / int8 rowwise),
``cache`` (cold-row LRU), ``tiers`` (DRAM hot/warm + cold tiers), ``table`` (routing a
table's ids to its tiers), ``pooling`` (shard-side partial sums), ``shard`` (the
synchronous core), ``service`` (the grpc.aio servicer), ``stats``, ``fault`` (test-only
fault hook) and ``server`` (process main). Never imports torchrec; torch only for int8.
"""
