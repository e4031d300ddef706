"""Kubernetes deployment: ``recserve deploy render`` (docs/architecture.md §3, "On Kubernetes").

recserve grows no orchestrator of its own: a cluster spec and a sharding plan are
rendered into plain Kubernetes manifests, which the cluster's own controllers
run (README, "Deploying on Kubernetes"). Modules:

* ``spec_toml``: a :class:`~recserve.config.spec.ClusterConfig` back to TOML (the
  rendered spec the pods read, with the shards' stable DNS names as ``shard_addresses``);
* ``resources``: what one shard pod needs, from the planner's per-shard byte estimate;
* ``manifests``: the objects (StatefulSet, Deployments, Services, HPAs, PDBs,
  ConfigMap), as plain dicts: a pure function of (spec, plan, options), no I/O;
* ``render``: writes them to a directory as YAML.
"""

from recserve.deploy.manifests import DeployOptions, Rendered, render_manifests
from recserve.deploy.resources import ShardMemory, shard_memory
from recserve.deploy.spec_toml import dumps

__all__ = ["DeployOptions", "Rendered", "ShardMemory", "dumps", "render_manifests", "shard_memory"]
