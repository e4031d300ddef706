"""Launch, watch and stop a set of embedding shard processes on loopback.

:class:`ShardCluster` starts one ``recserve shard serve`` subprocess per shard of a plan
through :func:`recserve.cluster.process.spawn_child` (``subprocess``, never ``fork``:
gRPC and fork do not mix; the shards exit when this process dies, even by SIGKILL), each
on a free 127.0.0.1 port it binds itself (``--port 0 --port-file``: no race between
picking and binding), and waits until gRPC health reports SERVING. Used by integration
tests, benchmarks and the demo::

    with ShardCluster(plan_path, data_root, load_from=src) as cluster:
        stub = EmbeddingShardStub(grpc.insecure_channel(cluster.addresses[0]))
        cluster.kill(1)        # SIGKILL, no goodbye
        cluster.restart(1)     # same port, same data directory; waits for SERVING
        cluster.set_fault(2, delay_ms=50)   # needs fault_hook=True

Each shard logs to ``data_root/shard-K.log``; its RocksDB lives in ``data_root/shard-K``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.cluster.process import STOP_GRACE_S, ChildProcess, spawn_child
from recserve.config.spec import ShardServerConfig
from recserve.errors import Unavailable

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
PORT_POLL_S = 0.02


def shard_data_dir(data_root: str | Path, k: int) -> Path:
    """Shard ``k``'s data directory under a cluster's ``data_root`` (RocksDB in ``rocksdb/``)."""
    return Path(data_root) / f"shard-{k}"


@dataclasses.dataclass
class _Proc:
    child: ChildProcess
    port: int


class ShardCluster:
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
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        unix_sockets: bool = False,
        start_timeout_s: float = 60.0,
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
        self.admin_token = admin_token
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
        self.python = python
        self._procs: dict[int, _Proc] = {}

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> ShardCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, *, wait: bool = True) -> None:
        """Start every shard (in parallel); wait until all are SERVING unless ``wait``
        is False (they are listening, with known addresses, either way)."""
        self.data_root.mkdir(parents=True, exist_ok=True)
        try:
            for k in range(self.num_shards):  # all processes start (and load) concurrently
                self._spawn(k, port=0)
            for k in range(self.num_shards):
                self._procs[k].port = self._read_port(k, self._port_file(k))
            for k in range(self.num_shards if wait else 0):
                self.wait_serving(k)
        except BaseException:
            self.stop()
            raise

    def stop(self, k: int | None = None) -> None:
        """SIGTERM shard ``k`` (default: all), SIGKILL whatever outlives the grace."""
        ks = list(self._procs) if k is None else [k]
        for i in ks:  # signal all first, so they shut down in parallel
            self._procs[i].child.terminate()
        for i in ks:
            self._procs.pop(i).child.stop(STOP_GRACE_S)

    def kill(self, k: int) -> None:
        """SIGKILL shard ``k`` and reap it; its port and data directory are kept."""
        self._procs[k].child.kill()

    def restart(self, k: int, *, wait: bool = True) -> None:
        """Start shard ``k`` again on its previous port (stopping it first if alive)."""
        port = self._procs[k].port
        self.stop(k)  # a no-op signal if it is already dead; reaps it and closes its lifeline
        self._spawn(k, port=port)
        if wait:
            self.wait_serving(k)

    # -- addresses and helpers ---------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        return [self.address(k) for k in range(self.num_shards)]

    def address(self, k: int) -> str:
        return f"127.0.0.1:{self._procs[k].port}"

    @property
    def client_addresses(self) -> list[str]:
        """Addresses for clients in this host's processes: ``unix:`` sockets when the
        cluster was started with ``unix_sockets``, else :attr:`addresses`."""
        if not self.unix_sockets:
            return self.addresses
        return [f"unix:{self._socket_path(k)}" for k in range(self.num_shards)]

    def _socket_path(self, k: int) -> Path:
        return (self.data_root / f"shard-{k}.sock").resolve()

    def pid(self, k: int) -> int:
        return self._procs[k].child.pid

    def data_dir(self, k: int) -> Path:
        return shard_data_dir(self.data_root, k)

    def log_path(self, k: int) -> Path:
        return self.data_root / f"shard-{k}.log"

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
            "--port", str(port), "--port-file", str(port_file),
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
        return cmd + list(self.extra_args)

    def _env(self) -> dict[str, str]:
        from embedding_server.server import thread_env

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        env.update(thread_env(self.server.threads))
        if self._owns_transport_env:
            from recserve.lookup.transport import TRANSPORT_ENV_KEYS

            for key in TRANSPORT_ENV_KEYS:  # e.g. grpc_experiments = "": the event engine, not the parent's export
                env.pop(key, None)
        env.update(self.extra_env)
        if self.admin_token:
            env["RECSERVE_ADMIN_TOKEN"] = self.admin_token
        return env

    def _port_file(self, k: int) -> Path:
        return self.data_root / f"shard-{k}.port"

    def _spawn(self, k: int, port: int) -> None:
        """Start shard ``k``'s process (port 0: it picks one and writes the port file)."""
        port_file = self._port_file(k)
        port_file.unlink(missing_ok=True)
        # The log is appended to: a restart keeps the earlier log.
        child = spawn_child(self._command(k, port, port_file), env=self._env(), log_file=self.log_path(k), cwd=REPO_ROOT)
        self._procs[k] = _Proc(child=child, port=port)

    def _read_port(self, k: int, port_file: Path) -> int:
        deadline = time.monotonic() + self.start_timeout_s
        while not port_file.exists():
            self._check_alive(k)
            if time.monotonic() > deadline:
                raise Unavailable(f"shard {k} did not bind a port within {self.start_timeout_s:.0f} s; see {self.log_path(k)}")
            time.sleep(PORT_POLL_S)
        return int(port_file.read_text())

    def _check_alive(self, k: int) -> None:
        code = self._procs[k].child.poll()
        if code is not None:
            tail = self.log_path(k).read_bytes()[-3000:].decode(errors="replace")
            raise Unavailable(f"shard {k} exited with code {code} before SERVING; log tail:\n{tail}")

    def wait_serving(self, k: int, timeout_s: float | None = None) -> None:
        """Block until shard ``k``'s health is SERVING (health Watch stream, so no polling
        interval), raising Unavailable if the process dies or the timeout passes."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            self._check_alive(k)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"shard {k} not SERVING within {timeout_s or self.start_timeout_s:.0f} s; see {self.log_path(k)}")
            with grpc.insecure_channel(self.address(k)) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    # A short stream timeout lets us re-check that the process is alive.
                    for reply in stub.Watch(request, timeout=min(remaining, 2.0)):
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                        raise
                    if exc.code() is grpc.StatusCode.UNAVAILABLE:
                        time.sleep(PORT_POLL_S)  # not listening yet (restart): retry shortly
