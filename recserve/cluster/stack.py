"""The whole serving cluster from one spec: shards, N rankers, the cascade, the generation replicas and the HTTP gateway.

:class:`ServingStack` is what ``recserve serve`` runs (docs/architecture.md §3): the
spec's ``sharding.num_shards`` shard processes loaded from an export's tables, its
``[topology] rankers`` ranker processes over them and one cascade process (the
Recommender) over both, each a :mod:`recserve.cluster` launcher (so every child dies with
this process, even when it is SIGKILLed). Start order follows the dependencies:

1. shards are spawned; their ports are known once they bind (before they load);
2. rankers are spawned on those addresses right away: a ranker waits for its shards to
   be SERVING by itself, so torch's import and the model load overlap the shards'
   table loads; so are the ``[topology] generators`` generation replicas (they depend
   on nothing; only with the gateway, which is what serves them);
3. shards, then rankers, are awaited (health SERVING), each reported as it comes up;
4. the cascade is spawned on the rankers' and shards' addresses and awaited;
5. the generation replicas are awaited; the HTTP gateway is spawned last on the
   cascade's, rankers' and generation replicas' addresses, scraping
   every child's ``/metrics`` for its status page (:meth:`ServingStack.metrics_urls`),
   and awaited (``/readyz`` 200). Tenants' keys reach it through this process's
   environment (``[[tenants]] api_key_env``).

:meth:`ServingStack.stop` goes the other way: the gateway first, then the cascade (it
drains its in-flight Recommend calls while the rankers still answer them), then the
generation replicas, the rankers, then the shards. A failed start stops whatever was started before the error propagates::

    stack = ServingStack(cluster, spec_path=spec, models_dir=models, plan_path=plan, data_root=run,
                         on_endpoint=lambda e: print(e.line()))
    stack.start()   # every child SERVING
    ...
    stack.stop()
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from recserve.cluster.cascade import CascadeCluster
from recserve.cluster.gateway import GatewayCluster
from recserve.cluster.generation import GenerationCluster
from recserve.cluster.rankers import RankerCluster
from recserve.cluster.shards import ShardCluster
from recserve.cluster.supervise import SUPERVISOR_STATE_ENV, Supervised, Supervisor, SupervisorConfig, SupervisorThread
from recserve.config.spec import ClusterConfig, ShardServerConfig
from recserve.lookup.transport import transport_env

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One SERVING child: the gRPC service (or, for the gateway, the HTTP API) a client
    calls at ``address``."""

    service: str  # "EmbeddingShard", "Ranking", "Recommender", "Generation", "gateway"
    kind: str  # "shard", "ranker", "cascade", "generation", "gateway"
    index: int  # member k of its kind
    address: str  # HOST:PORT
    pid: int
    log_path: Path

    def line(self) -> str:
        """``gRPC Ranking at 127.0.0.1:40123 (ranker 0, pid 4242, log /run/ranker-0.log)``;
        the gateway: ``HTTP gateway at http://127.0.0.1:8080 (pid 4243, log ...)``."""
        if self.kind == "gateway":
            return f"HTTP gateway at http://{self.address} (pid {self.pid}, log {self.log_path})"
        return f"gRPC {self.service} at {self.address} ({self.kind} {self.index}, pid {self.pid}, log {self.log_path})"


def _ignore(endpoint: Endpoint) -> None:
    pass


class ServingStack:
    """Shards + ``cluster.topology.rankers`` rankers + the cascade, configured by
    ``cluster`` (parsed from ``spec_path``, which every child reads too) and serving the
    export ``models_dir`` with the sharding plan at ``plan_path``. Children keep their
    data (shards' RocksDB), logs and port files under ``data_root``.

    ``cascade=False`` stops at the rankers (the Ranking service alone); ``gateway=False``
    at the cascade (no HTTP gateway, and no generation replicas, which only the gateway
    calls). ``shard_server``
    overrides the spec's per-shard settings (e.g. the row cache a budget plan leaves).
    ``on_endpoint`` is called once per child as it turns SERVING, in start order.
    """

    def __init__(
        self,
        cluster: ClusterConfig,
        *,
        spec_path: str | Path,
        models_dir: str | Path,
        plan_path: str | Path,
        data_root: str | Path,
        cascade: bool = True,
        gateway: bool = True,
        shard_server: ShardServerConfig | None = None,
        admin_token: str = "",
        insecure_admin: bool = False,
        on_endpoint: Callable[[Endpoint], None] = _ignore,
        start_timeout_s: float = 300.0,
        python: str = sys.executable,
    ) -> None:
        self.cluster = cluster
        self.spec_path = Path(spec_path)
        self.models_dir = Path(models_dir)
        self.plan_path = Path(plan_path)
        self.data_root = Path(data_root)
        self.with_cascade = cascade
        self.with_gateway = cascade and gateway  # the gateway calls the cascade
        self.admin_token = admin_token  # every child's, as the variable [admin] token_env names
        self.insecure_admin = insecure_admin  # no token: children run --insecure-admin
        self._on_endpoint = on_endpoint
        topo = cluster.topology
        # The lookup path's measured transport settings: the shards get all of them, the
        # rankers and the cascade (lookup clients) the gRPC I/O path; gRPC and glibc read
        # them only when a process starts.
        shard_env = transport_env(cluster.lookup)
        client_env = {k: v for k, v in shard_env.items() if k == "GRPC_EXPERIMENTS"}
        self.shards = ShardCluster(
            self.plan_path, self.data_root / "shards", num_shards=cluster.sharding.num_shards,
            server=shard_server or cluster.shard_server, load_from=self.models_dir, admin_token=admin_token, env=shard_env,
            insecure_admin=insecure_admin, token_env=cluster.admin.token_env,
            unix_sockets=topo.unix_sockets, start_timeout_s=start_timeout_s, host=topo.host,
            ports=topo.ports("shard_ports", cluster.sharding.num_shards), python=python,
        )  # fmt: skip
        self._client_env = client_env
        self._start_timeout_s = start_timeout_s
        self._python = python
        self.rankers: RankerCluster | None = None
        self.cascade: CascadeCluster | None = None
        self.generation: GenerationCluster | None = None
        self.gateway: GatewayCluster | None = None
        self.supervisor: SupervisorThread | None = None
        # The supervisor's report, read by the gateway for /readyz and its status page.
        self.supervisor_state_file = self.data_root / "supervisor.json"

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> ServingStack:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Start every child in dependency order (module docstring); return once all
        are SERVING. On any failure (or KeyboardInterrupt) everything started is
        stopped before the error propagates."""
        topo = self.cluster.topology
        try:
            self.shards.start(wait=False)  # bound, still loading
            shard_addresses = self.shards.client_addresses  # unix: sockets when the processes share the host
            self.rankers = RankerCluster(
                self.spec_path, self.models_dir, shard_addresses, num_rankers=topo.rankers, data_root=self.data_root / "rankers",
                env=self._client_env, admin_token=self.admin_token, insecure_admin=self.insecure_admin, token_env=self.cluster.admin.token_env,
                tls=self.cluster.tls, start_timeout_s=self._start_timeout_s, host=topo.host,
                ports=topo.ports("ranker_ports", topo.rankers), metrics_port=self.cluster.ranker.metrics_port, python=self._python,
            )  # fmt: skip
            self.rankers.start(wait=False)
            if self.with_gateway and topo.generators:
                self.generation = GenerationCluster(
                    self.spec_path, num_replicas=topo.generators, data_root=self.data_root / "generation",
                    start_timeout_s=self._start_timeout_s, host=topo.host, ports=topo.ports("generator_ports", topo.generators),
                    metrics_port=self.cluster.generation.metrics_port, python=self._python, tls=self.cluster.tls,
                )  # fmt: skip
                self.generation.start(wait=False)
            for k in range(self.shards.num_shards):
                self.shards.wait_serving(k)
                self._report("EmbeddingShard", "shard", k, self.shards.address(k), self.shards.pid(k), self.shards.log_path(k))
            for k in range(topo.rankers):
                self.rankers.wait_serving(k)
                self._report("Ranking", "ranker", k, self.rankers.address(k), self.rankers.pid(k), self.rankers.log_path(k))
            if self.with_cascade:
                self.cascade = CascadeCluster(
                    self.spec_path, self.models_dir, self.rankers.addresses, shard_addresses, data_root=self.data_root / "cascade",
                    host=topo.host, port=topo.cascade_port, env=self._client_env, admin_token=self.admin_token,
                    insecure_admin=self.insecure_admin, token_env=self.cluster.admin.token_env, tls=self.cluster.tls,
                    start_timeout_s=self._start_timeout_s, metrics_port=self.cluster.cascade.metrics_port, python=self._python,
                )  # fmt: skip
                self.cascade.start()
                self._report("Recommender", "cascade", 0, self.cascade.address, self.cascade.pid, self.cascade.log_path)
            generators: list[str] = []
            if self.generation is not None:
                for k in range(topo.generators):
                    self.generation.wait_serving(k)
                    self._report("Generation", "generation", k, self.generation.address(k), self.generation.pid(k), self.generation.log_path(k))
                generators = self.generation.addresses
            if self.with_gateway:
                assert self.cascade is not None
                gw = self.cluster.gateway
                self.gateway = GatewayCluster(
                    self.spec_path, [self.cascade.address], self.rankers.addresses, generators=generators, data_root=self.data_root / "gateway",
                    scrape=self.metrics_urls(), host=gw.host, port=gw.port, start_timeout_s=self._start_timeout_s, python=self._python,
                    env={SUPERVISOR_STATE_ENV: str(self.supervisor_state_file)}, tls=self.cluster.tls,
                )  # fmt: skip
                self.gateway.start()
                self._report("gateway", "gateway", 0, self.gateway.address, self.gateway.pid, self.gateway.log_path)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the gateway, the cascade, the generation replicas, then the rankers, then the
        shards (each SIGTERM, graceful; SIGKILL past the grace; reaped). Safe to call more than once.
        The supervisor stops first: nothing is restarted while the children stop."""
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        for launcher in (self.gateway, self.cascade, self.generation, self.rankers, self.shards):
            if launcher is None:
                continue
            try:
                launcher.stop()
            except Exception:  # one launcher's failure must not leave the others running
                log.exception("stopping %s failed", type(launcher).__name__)
        self.gateway = None
        self.cascade = None
        self.generation = None
        self.rankers = None

    def wait_serving(self, timeout_s: float | None = None) -> None:
        """Block until every running child reports SERVING (at once when they do),
        raising Unavailable, with its log tail, for one that has exited."""
        for k in range(self.shards.num_shards):
            self.shards.wait_serving(k, timeout_s)
        if self.rankers is not None:
            for k in range(self.rankers.num_rankers):
                self.rankers.wait_serving(k, timeout_s)
        if self.cascade is not None:
            self.cascade.wait_serving(timeout_s)
        if self.generation is not None:
            for k in range(self.generation.num_replicas):
                self.generation.wait_serving(k, timeout_s)
        if self.gateway is not None:
            self.gateway.wait_serving(timeout_s)

    def supervise(self, config: SupervisorConfig = SupervisorConfig(), *, on_event: Callable[[str], None] | None = None) -> SupervisorThread:
        """Restart every child that exits on its own, with backoff, from now until
        :meth:`stop` (:mod:`recserve.cluster.supervise`); call once :meth:`start` has
        returned. Its report goes to :attr:`supervisor_state_file` (the gateway's
        ``/readyz`` and status page show crash-looping children); ``on_event`` gets a line
        per exit and restart."""
        if self.supervisor is not None:
            return self.supervisor
        launchers = (self.shards, self.rankers, self.cascade, self.generation, self.gateway)
        # Each launcher's ProcessGroup: a restart keeps the member's port and data directory.
        groups: list[Supervised] = [launcher._group for launcher in launchers if launcher is not None]
        self.supervisor = SupervisorThread(Supervisor(groups, config, now=time.monotonic()), state_file=self.supervisor_state_file, on_event=on_event)
        self.supervisor.start()
        return self.supervisor

    # -- what is running ---------------------------------------------------------------

    def metrics_urls(self) -> dict[str, str]:
        """Every running child's Prometheus endpoint by name (``"shard-0"``, ``"ranker-1"``,
        ``"cascade-0"``, ``"generation-0"``) -> ``http://HOST:PORT/metrics``, in start order; a child whose
        section sets ``metrics_port = -1`` is left out."""
        urls = {f"shard-{k}": self.shards.metrics_url(k) for k in range(self.shards.num_shards)}
        if self.rankers is not None:
            urls.update({f"ranker-{k}": self.rankers.metrics_url(k) for k in range(self.rankers.num_rankers)})
        if self.cascade is not None:
            urls["cascade-0"] = self.cascade.metrics_url
        if self.generation is not None:
            urls.update({f"generation-{k}": self.generation.metrics_url(k) for k in range(self.generation.num_replicas)})
        return {name: url for name, url in urls.items() if url is not None}

    @property
    def pids(self) -> list[int]:
        """Every child's pid (shards, rankers, cascade, generation replicas, gateway)."""
        pids = [self.shards.pid(k) for k in range(self.shards.num_shards)]
        if self.rankers is not None:
            pids += [self.rankers.pid(k) for k in range(self.rankers.num_rankers)]
        if self.cascade is not None:
            pids.append(self.cascade.pid)
        if self.generation is not None:
            pids += [self.generation.pid(k) for k in range(self.generation.num_replicas)]
        if self.gateway is not None:
            pids.append(self.gateway.pid)
        return pids

    def _report(self, service: str, kind: str, k: int, address: str, pid: int, log_path: Path) -> None:
        endpoint = Endpoint(service=service, kind=kind, index=k, address=address, pid=pid, log_path=log_path)
        log.debug("%s", endpoint.line())
        self._on_endpoint(endpoint)
