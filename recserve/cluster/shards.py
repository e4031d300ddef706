"""Launch, watch and stop a set of embedding shard processes on loopback.

:class:`ShardCluster` starts one ``recserve shard serve`` subprocess per shard of a plan
through :func:`recserve.cluster.process.spawn_child` (``subprocess``, never ``fork``:
gRPC and fork do not mix; the shards exit when this process dies, even by SIGKILL), each
on a free 127.0.0.1 port it binds itself (``--port 0 --port-file``: no race between
picking and binding), and waits until gRPC health reports SERVING; the process handling
is :class:`recserve.cluster.group.ProcessGroup`'s. Used by integration tests, benchmarks
and the demo::

    with ShardCluster(plan_path, data_root, load_from=src) as cluster:
        stub = EmbeddingShardStub(grpc.insecure_channel(cluster.addresses[0]))
        cluster.kill(1)        # SIGKILL, no goodbye
        cluster.restart(1)     # same port, same data directory; waits for SERVING
        cluster.set_fault(2, delay_ms=50)   # needs fault_hook=True

Each shard logs to ``data_root/shard-K.log``; its RocksDB lives in ``data_root/shard-K``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recserve.cluster.group import ADMIN_TOKEN_ENV, PORT_POLL_S, REPO_ROOT, GroupLauncher, ProcessGroup, launch_env
from recserve.config.spec import ShardServerConfig

log = logging.getLogger(__name__)

__all__ = ["PORT_POLL_S", "REPO_ROOT", "ShardCluster", "shard_data_dir"]


def shard_data_dir(data_root: str | Path, k: int) -> Path:
    """Shard ``k``'s data directory under a cluster's ``data_root`` (RocksDB in ``rocksdb/``)."""
    return Path(data_root) / f"shard-{k}"


class ShardCluster(GroupLauncher):
    """``num_shards`` shard processes serving ``plan_path`` (default: all of the plan's)."""

    def __init__(
        self,
        plan_path: str | Path,
        data_root: str | Path,
        *,
        num_shards: int | None = None,
        server: ShardServerConfig = ShardServerConfig(),
        load_from: str | Path | None = None,
        tier_dtype: str = "plan",
        fault_hook: bool = False,
        admin_token: str = "",
        insecure_admin: bool = False,
        token_env: str = ADMIN_TOKEN_ENV,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        unix_sockets: bool = False,
        start_timeout_s: float = 60.0,
        host: str = "127.0.0.1",
        ports: Sequence[int] = (),
        python: str = sys.executable,
    ) -> None:
        self.plan_path = Path(plan_path)
        self.data_root = Path(data_root)
        if num_shards is None:
            import json

            num_shards = int(json.loads(self.plan_path.read_text())["num_shards"])
        self.num_shards = num_shards
        self.server = server
        self.load_from = None if load_from is None else Path(load_from)
        self.tier_dtype = tier_dtype
        self.fault_hook = fault_hook
        self.admin_token = admin_token  # Upsert's; reaches the process as token_env
        self.insecure_admin = insecure_admin  # no token: --insecure-admin (else Upsert is refused)
        self.token_env = token_env
        self.extra_args = tuple(extra_args)
        # Process-start settings for every shard (e.g. GRPC_EXPERIMENTS, MALLOC_*: gRPC and
        # glibc read them only when the process starts), on top of this process's env.
        # Given (even empty), they own the transport variables: inherited ones are dropped.
        self.extra_env = dict(env or {})
        self._owns_transport_env = env is not None
        # Every shard also listens on data_root/shard-K.sock; client_addresses hands
        # out unix: addresses (same host, no TCP stack), addresses stay TCP.
        self.unix_sockets = unix_sockets
        self.start_timeout_s = start_timeout_s
        self.host = host  # listen address; shard k binds ports[k] (default: free ports)
        self.python = python
        # Prometheus /metrics: server.metrics_port (0 = free ports, N = shard k binds N + k, -1 = none).
        self._group = ProcessGroup("shard", self.data_root, num_shards, command=self._command, env=self._env, start_timeout_s=start_timeout_s,
                                   host=host, ports=ports, metrics_port=server.metrics_port)  # fmt: skip

    # -- addresses and helpers (start / stop / kill / restart: GroupLauncher) --------

    @property
    def addresses(self) -> list[str]:
        return [self.address(k) for k in range(self.num_shards)]

    @property
    def client_addresses(self) -> list[str]:
        """Addresses for clients in this host's processes: ``unix:`` sockets when the
        cluster was started with ``unix_sockets``, else :attr:`addresses`."""
        if not self.unix_sockets:
            return self.addresses
        return [f"unix:{self._socket_path(k)}" for k in range(self.num_shards)]

    def _socket_path(self, k: int) -> Path:
        return (self.data_root / f"shard-{k}.sock").resolve()

    def data_dir(self, k: int) -> Path:
        return shard_data_dir(self.data_root, k)

    def set_fault(self, k: int, *, delay_ms: float = 0.0, code: str = "", methods: Sequence[str] = (), count: int = -1) -> dict[str, Any]:
        """Set (no arguments: clear) the injected fault of shard ``k`` (needs fault_hook)."""
        from embedding_server.fault import set_fault

        return set_fault(self.address(k), delay_ms=delay_ms, code=code, methods=methods, count=count)

    # -- internals -------------------------------------------------------------------

    def _command(self, k: int, port: int, port_file: Path) -> list[str]:
        s = self.server
        cmd = [
            self.python, "-m", "recserve", "shard", "serve",
            "--plan", str(self.plan_path), "--shard-id", str(k), "--data", str(self.data_dir(k)),
            "--host", self.host, "--port", str(port), "--port-file", str(port_file),
            "--row-cache-bytes", str(s.row_cache_bytes), "--block-cache-bytes", str(s.block_cache_bytes),
            "--threads", str(s.threads), "--max-ids-per-rpc", str(s.max_ids_per_rpc),
            "--max-message-bytes", str(s.max_message_bytes), "--max-bags-per-rpc", str(s.max_bags_per_rpc),
            "--tier-dtype", self.tier_dtype,
        ]  # fmt: skip
        if self.unix_sockets:
            self._socket_path(k).unlink(missing_ok=True)  # a stale socket from a killed run
            cmd += ["--unix-socket", str(self._socket_path(k))]
        if self.load_from is not None:
            cmd += ["--load-from", str(self.load_from)]
        if self.fault_hook:
            cmd += ["--fault-hook"]
        if self.insecure_admin:
            cmd += ["--insecure-admin"]
        if self.token_env != ADMIN_TOKEN_ENV:
            cmd += ["--admin-token-env", self.token_env]
        return cmd + list(self.extra_args)

    def _env(self) -> dict[str, str]:
        return launch_env(self.extra_env, owns_transport=self._owns_transport_env, threads=self.server.threads, admin_token=self.admin_token, token_env=self.token_env)
