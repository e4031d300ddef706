"""A group of server processes on loopback: what every launcher in ``recserve.cluster`` shares.

:class:`ProcessGroup` runs members ``0..size-1`` of one kind (``shard``, ``ranker``),
each a ``recserve ... serve`` subprocess started by :func:`~recserve.cluster.process.spawn_child`
(so it exits when this process dies, even by SIGKILL). A member binds its own port
(``--port 0 --port-file``: no race between picking a free port and binding it) and is
ready when its gRPC health reports SERVING, watched on the health ``Watch`` stream
rather than polled. The launchers (:class:`~recserve.cluster.shards.ShardCluster`,
:class:`~recserve.cluster.rankers.RankerCluster`) only say how a member's command line
and environment look::

    group = ProcessGroup("ranker", root, 2, command=lambda k, port, port_file: [...], env=lambda: env)
    group.start()          # all spawned at once (they load concurrently), then all SERVING
    group.kill(1)          # SIGKILL, no goodbye; the port is kept
    group.restart(1)       # same port; waits for SERVING
    group.stop()           # SIGTERM to all, then reap each (SIGKILL past the grace)

Member ``k`` logs to ``root/<kind>-k.log`` (appended: a restart keeps the history) and
writes its port to ``root/<kind>-k.port``. Given a ``metrics_port`` (the spec's: 0 = free
ports, N > 0 = member k binds N + k, -1 = none), the group appends ``--metrics-port P
--metrics-port-file root/<kind>-k.metrics-port`` to every member's command line (every
``recserve ... serve`` takes them), reads the bound port once the process is up, and
:meth:`ProcessGroup.metrics_url` is its Prometheus endpoint. The spawner, the health
watch and the clock are injected, so the start-up logic is unit-tested without processes.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

from recserve.cluster.process import STOP_GRACE_S, spawn_child
from recserve.config.spec import NO_METRICS_PORT, TlsConfig, require_metrics_port
from recserve.errors import ConfigError, Unavailable

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
PORT_POLL_S = 0.02
HEALTH_STREAM_S = 2.0  # a health Watch is re-opened this often to re-check that the process lives
LOG_TAIL_BYTES = 3000
ADMIN_TOKEN_ENV = "RECSERVE_ADMIN_TOKEN"  # read by `recserve shard serve` and `recserve ranker serve`


class Child(Protocol):
    """What a group needs of a launched process (:class:`~recserve.cluster.process.ChildProcess`)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def stop(self, grace_s: float = ...) -> int: ...


class Spawner(Protocol):
    """:func:`~recserve.cluster.process.spawn_child`'s signature."""

    def __call__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = ..., log_file: str | Path | None = ..., cwd: str | Path | None = ...) -> Child: ...


class Health(enum.Enum):
    """What one health watch saw before its stream ended or timed out."""

    SERVING = "serving"
    NOT_SERVING = "not_serving"  # listening, not ready yet (still loading)
    UNREACHABLE = "unreachable"  # nothing listening (yet): a restarting process


# (address, service, timeout_s) -> what the watch saw within timeout_s
HealthWatch = Callable[[str, str, float], Health]
# (member k, port, port_file) -> argv
CommandFn = Callable[[int, int, Path], list[str]]


def watch_health(address: str, service: str, timeout_s: float, tls: TlsConfig | None = None) -> Health:
    """Follow ``address``'s gRPC health ``Watch`` for ``service`` for at most ``timeout_s``;
    SERVING as soon as it is reported (no polling interval). Other RPC errors than
    UNAVAILABLE / DEADLINE_EXCEEDED are raised: a server without health is a bug.
    ``tls``: the server listens with TLS (``[tls]``)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls is not None and tls.enabled:
        from recserve.rpc.auth import channel_credentials

        opened = grpc.secure_channel(address, channel_credentials(tls))
    else:
        opened = grpc.insecure_channel(address)
    with opened as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for reply in stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s):
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return Health.SERVING
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                return Health.UNREACHABLE
            if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
    return Health.NOT_SERVING


def health_watch(tls: TlsConfig | None) -> HealthWatch:
    """:func:`watch_health` over TLS when ``tls`` is enabled (a launcher of servers that
    read a spec with ``[tls]``), else plaintext."""
    if tls is None or not tls.enabled:
        return watch_health
    return lambda address, service, timeout_s: watch_health(address, service, timeout_s, tls)


def launch_env(extra: Mapping[str, str], *, owns_transport: bool, threads: int, admin_token: str = "", token_env: str = ADMIN_TOKEN_ENV) -> dict[str, str]:
    """The environment of a server child: this process's, with the repository on
    ``PYTHONPATH``, BLAS/OpenMP pools pinned to ``threads`` (read once, when numpy and
    torch load, so it must be set at launch), then ``extra`` and the admin token (as
    ``token_env``, the variable ``[admin] token_env`` names).

    ``owns_transport``: ``extra`` holds the process-start transport settings
    (``GRPC_EXPERIMENTS``, ``MALLOC_*``; :func:`recserve.lookup.transport.transport_env`),
    so inherited ones are dropped, not passed on: an empty ``extra`` means gRPC's and
    glibc's defaults, not the parent's exports.
    """
    from embedding_server.server import thread_env

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env.update(thread_env(threads))
    if owns_transport:
        from recserve.lookup.transport import TRANSPORT_ENV_KEYS

        for key in TRANSPORT_ENV_KEYS:
            env.pop(key, None)
    env.update(extra)
    if admin_token:
        env[token_env] = admin_token
    return env


@dataclasses.dataclass
class _Member:
    child: Child
    port: int  # 0 until the port file is read
    metrics_port: int = 0  # 0 until the metrics port file is read; -1 = no metrics server


class ProcessGroup:
    """``size`` server processes of one ``kind``; member ``k`` runs ``command(k, port, port_file)``
    (``ports[k]`` the first time, default 0: it picks one) with ``env()`` (built at each spawn).
    ``metrics_port`` None: the group passes no metrics flags (the command's own choice)."""

    def __init__(
        self,
        kind: str,
        root: str | Path,
        size: int,
        *,
        command: CommandFn,
        env: Callable[[], Mapping[str, str]],
        start_timeout_s: float = 60.0,
        health_service: str = "",
        host: str = "127.0.0.1",
        ports: Sequence[int] = (),
        metrics_port: int | None = None,
        cwd: str | Path = REPO_ROOT,
        spawn: Spawner = spawn_child,
        health: HealthWatch = watch_health,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.kind = kind
        self.root = Path(root)
        self.size = size
        self.start_timeout_s = start_timeout_s
        self.health_service = health_service
        self.host = host
        # Member k's port on its first start (0 = it picks one); a restart keeps its port.
        self.first_ports = tuple(ports) or (0,) * size
        if len(self.first_ports) != size:
            raise ConfigError(f"ports = {list(ports)} is invalid: give one port per {kind} ({size}), or none for free ports")
        if metrics_port is not None:
            require_metrics_port(f"{kind} metrics_port", metrics_port)
            if metrics_port > 0 and metrics_port + size - 1 > 65535:
                raise ConfigError(f"metrics_port = {metrics_port} is invalid for {size} {kind}s: member k binds {metrics_port} + k, past 65535")
        self.metrics_port = metrics_port
        self._command = command
        self._env = env
        self._cwd = cwd
        self._spawn_fn = spawn
        self._health = health
        self._clock = clock
        self._sleep = sleep
        self._members: dict[int, _Member] = {}

    # -- lifecycle -----------------------------------------------------------------

    def start(self, *, wait: bool = True) -> None:
        """Start every member, all before waiting on any (they load concurrently); then
        read their ports and, unless ``wait`` is False, wait until all are SERVING. On
        any failure every member started is stopped before the error propagates."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            for k in range(self.size):
                self.spawn(k, port=self.first_ports[k])
            for k in range(self.size):
                self._read_ports(k)
            for k in range(self.size if wait else 0):
                self.wait_serving(k)
        except BaseException:
            self.stop()
            raise

    def spawn(self, k: int, *, port: int, metrics_port: int | None = None) -> None:
        """Launch member ``k`` on ``port`` (0: it picks one and writes its port file) and,
        when the group passes metrics flags, ``metrics_port`` (default: the group's rule)."""
        port_file = self.port_file(k)
        port_file.unlink(missing_ok=True)  # a stale file from an earlier run must not be read as this one's
        argv = self._command(k, port, port_file)
        metrics = self._first_metrics_port(k) if metrics_port is None else metrics_port
        if self.metrics_port is not None:
            self.metrics_port_file(k).unlink(missing_ok=True)
            argv = [*argv, "--metrics-port", str(metrics), "--metrics-port-file", str(self.metrics_port_file(k))]
        child = self._spawn_fn(argv, env=self._env(), log_file=self.log_path(k), cwd=self._cwd)
        self._members[k] = _Member(child=child, port=port, metrics_port=metrics if self.metrics_port is not None else NO_METRICS_PORT)

    def stop(self, k: int | None = None) -> None:
        """SIGTERM member ``k`` (default: all), SIGKILL whatever outlives the grace; reaped."""
        ks = list(self._members) if k is None else [k]
        for i in ks:  # signal all first, so they shut down in parallel
            self._members[i].child.terminate()
        for i in ks:
            self._members.pop(i).child.stop(STOP_GRACE_S)

    def kill(self, k: int) -> None:
        """SIGKILL member ``k`` and reap it; its port is kept for :meth:`restart`."""
        self._members[k].child.kill()

    def restart(self, k: int, *, wait: bool = True) -> None:
        """Start member ``k`` again on its previous port (stopping it first if alive)."""
        port, metrics_port = self._members[k].port, self._members[k].metrics_port
        self.stop(k)  # a no-op signal if it is already dead; reaps it and closes its lifeline
        self.spawn(k, port=port, metrics_port=metrics_port if self.metrics_port is not None else None)  # both ports kept
        if wait:
            self.wait_serving(k)

    def wait_serving(self, k: int, timeout_s: float | None = None) -> None:
        """Block until member ``k``'s health is SERVING, raising Unavailable (with its log
        tail) if the process exits first, or once ``timeout_s`` (default: the start
        timeout) passes."""
        limit_s = timeout_s or self.start_timeout_s
        deadline = self._clock() + limit_s
        while True:
            self.check_alive(k)
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise Unavailable(f"{self.kind} {k} not SERVING within {limit_s:.0f} s; see {self.log_path(k)}")
            # A bounded stream lets the loop re-check that the process is alive.
            seen = self._health(self.address(k), self.health_service, min(remaining, HEALTH_STREAM_S))
            if seen is Health.SERVING:
                return
            if seen is Health.UNREACHABLE:
                self._sleep(PORT_POLL_S)  # not listening yet (restart): retry shortly

    # -- members -------------------------------------------------------------------

    def __contains__(self, k: object) -> bool:
        return k in self._members

    @property
    def addresses(self) -> list[str]:
        return [self.address(k) for k in range(self.size)]

    def address(self, k: int) -> str:
        return f"{self.host}:{self.port(k)}"

    def port(self, k: int) -> int:
        return self._members[k].port

    def pid(self, k: int) -> int:
        return self._members[k].child.pid

    def log_path(self, k: int) -> Path:
        return self.root / f"{self.kind}-{k}.log"

    def port_file(self, k: int) -> Path:
        return self.root / f"{self.kind}-{k}.port"

    def metrics_port_file(self, k: int) -> Path:
        return self.root / f"{self.kind}-{k}.metrics-port"

    def metrics_url(self, k: int) -> str | None:
        """Member ``k``'s Prometheus endpoint, ``http://HOST:PORT/metrics``; None when it
        serves none (``metrics_port`` -1, or the group passes no metrics flags)."""
        port = self._members[k].metrics_port
        return None if port <= 0 else f"http://{self.host}:{port}/metrics"

    def exit_code(self, k: int) -> int | None:
        """Member ``k``'s exit code, None while it runs (what a supervisor polls:
        :mod:`recserve.cluster.supervise`)."""
        return self._members[k].child.poll()

    def check_alive(self, k: int) -> None:
        """Raise Unavailable, quoting the end of its log, if member ``k`` has exited."""
        code = self._members[k].child.poll()
        if code is not None:
            raise Unavailable(f"{self.kind} {k} exited with code {code} before SERVING; log tail:\n{self._log_tail(k)}")

    # -- internals -------------------------------------------------------------------

    def _log_tail(self, k: int) -> str:
        try:
            return self.log_path(k).read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"

    def _first_metrics_port(self, k: int) -> int:
        base = NO_METRICS_PORT if self.metrics_port is None else self.metrics_port
        return base + k if base > 0 else base

    def _read_ports(self, k: int) -> None:
        """Member ``k``'s gRPC port and, when it serves metrics, its metrics port (written
        before the gRPC one, so it is there by then; still waited for, not assumed)."""
        member = self._members[k]
        member.port = self._read_port(k, self.port_file(k))
        if member.metrics_port != NO_METRICS_PORT:
            member.metrics_port = self._read_port(k, self.metrics_port_file(k))

    def _read_port(self, k: int, port_file: Path) -> int:
        deadline = self._clock() + self.start_timeout_s
        while not port_file.exists():
            self.check_alive(k)
            if self._clock() > deadline:
                raise Unavailable(f"{self.kind} {k} did not bind a port within {self.start_timeout_s:.0f} s; see {self.log_path(k)}")
            self._sleep(PORT_POLL_S)
        # Written atomically (tmp + rename) by the server: an existing file is whole.
        return int(port_file.read_text())


class GroupLauncher:
    """What the multi-member launchers (shards, rankers, generation replicas) share: the
    lifecycle and addresses of their :class:`ProcessGroup` ``_group``, member ``k`` by
    member. A subclass builds ``_group`` with its own command line and environment (and
    may add its own helpers, e.g. the shards' data directories). Usable as a context
    manager: every member started on entry, all stopped on exit."""

    _group: ProcessGroup

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, *, wait: bool = True) -> None:
        """Start every member (they load concurrently); wait until all are SERVING unless
        ``wait`` is False (they are listening, with known addresses, either way)."""
        self._group.start(wait=wait)

    def stop(self, k: int | None = None) -> None:
        """SIGTERM member ``k`` (default: all): graceful, in-flight calls drain; SIGKILL
        whatever outlives the grace."""
        self._group.stop(k)

    def kill(self, k: int) -> None:
        """SIGKILL member ``k`` and reap it; its port (and data) are kept for :meth:`restart`."""
        self._group.kill(k)

    def restart(self, k: int, *, wait: bool = True) -> None:
        """Start member ``k`` again on its previous port (stopping it first if alive)."""
        self._group.restart(k, wait=wait)

    def wait_serving(self, k: int, timeout_s: float | None = None) -> None:
        """Block until member ``k`` reports SERVING (health Watch stream, no polling),
        raising Unavailable (with its log tail) if it exits first or the timeout
        (default: the group's start timeout) passes."""
        self._group.wait_serving(k, timeout_s)

    @property
    def addresses(self) -> list[str]:
        return self._group.addresses

    def address(self, k: int) -> str:
        return self._group.address(k)

    def metrics_url(self, k: int) -> str | None:
        """Member ``k``'s Prometheus endpoint (``http://HOST:PORT/metrics``; None: metrics_port -1)."""
        return self._group.metrics_url(k)

    def pid(self, k: int) -> int:
        return self._group.pid(k)

    def log_path(self, k: int) -> Path:
        return self._group.log_path(k)
