"""Where the servers of a running ``recserve serve`` listen, from its spec or its data dir.

``recserve serve --data DIR`` leaves each child's port file under DIR
(``shards/shard-K.port``, ``rankers/ranker-K.port``, ``cascade/cascade-0.port``,
``gateway/gateway-0.port``; written atomically by the servers). Without ``--data`` the
spec must fix the ports (``[topology]`` ``shard_ports`` / ``ranker_ports`` ranges,
``cascade_port``; ``[gateway] port``); with free ports ("0") nothing outside the serving
process knows them, and the error says what to pass.
"""

from __future__ import annotations

from pathlib import Path

from recserve.config.spec import ClusterConfig, parse_port_range
from recserve.errors import ConfigError
from recserve.loadtest.targets import TargetKind

#: target kind -> (the launcher's kind and data subdirectory, topology port field)
_SERVERS = {
    TargetKind.LOOKUP: ("shard", "shards", "shard_ports"),
    TargetKind.RANK: ("ranker", "rankers", "ranker_ports"),
    TargetKind.RECOMMEND: ("cascade", "cascade", "cascade_port"),
}


def _count(kind: TargetKind, cluster: ClusterConfig) -> int:
    if kind is TargetKind.LOOKUP:
        return cluster.sharding.num_shards
    if kind is TargetKind.RANK:
        return cluster.topology.rankers
    return 1


def grpc_addresses(kind: TargetKind, cluster: ClusterConfig, data: Path | None) -> list[str]:
    """``HOST:PORT`` of every server ``kind`` talks to (shards in shard order)."""
    proc, sub, field = _SERVERS[kind]
    host, n = cluster.topology.host, _count(kind, cluster)
    if data is not None:
        files = [data / sub / f"{proc}-{k}.port" for k in range(n)]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"--data {str(data)!r}: no port file {missing[0]}; pass the --data DIR of a running `recserve serve` (or --grpc HOST:PORT)")
        return [f"{host}:{int(f.read_text())}" for f in files]
    topo = cluster.topology
    if kind is TargetKind.RECOMMEND:
        if topo.cascade_port:
            return [f"{host}:{topo.cascade_port}"]
    else:
        rng = parse_port_range(f"topology.{field}", getattr(topo, field))
        if rng is not None:
            return [f"{host}:{rng[0] + k}" for k in range(n)]
    raise ConfigError(
        f"topology.{field} = {getattr(topo, field)!r}: the spec's {proc} ports are free ports, known only to the serving process; "
        f"pass --data DIR (the `recserve serve --data DIR` of the cluster) or --grpc HOST:PORT"
    )


def gateway_url(cluster: ClusterConfig, data: Path | None) -> str:
    """``http://HOST:PORT`` of the gateway of a running ``recserve serve``."""
    gateway = cluster.gateway
    if data is not None:
        f = data / "gateway" / "gateway-0.port"
        if f.is_file():
            return f"http://{gateway.host}:{int(f.read_text())}"
    if gateway.port:
        return f"http://{gateway.host}:{gateway.port}"
    raise ConfigError("--http: gateway.port = 0 (a free port) and no --data DIR with gateway/gateway-0.port; pass --http http://HOST:PORT or the --data DIR of the `recserve serve`")
