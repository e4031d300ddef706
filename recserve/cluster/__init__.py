"""cluster layer (see docs/architecture.md §2): launchers of server processes on loopback."""

from recserve.cluster.group import ProcessGroup
from recserve.cluster.rankers import RankerCluster
from recserve.cluster.shards import ShardCluster

__all__ = ["ProcessGroup", "RankerCluster", "ShardCluster"]
