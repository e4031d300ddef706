"""cluster layer (see docs/architecture.md §2): launchers of server processes on loopback."""

from recserve.cluster.shards import ShardCluster

__all__ = ["ShardCluster"]
