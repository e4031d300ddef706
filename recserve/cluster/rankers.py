"""Launch, watch and stop N ranker processes on loopback.

:class:`RankerCluster` starts ``num_rankers`` ``recserve ranker serve`` subprocesses over
one export and one set of shards, through :class:`recserve.cluster.group.ProcessGroup`
(orphan protection, ``--port 0 --port-file``, readiness on the health Watch stream of
``recserve.v1.Ranking``, which turns SERVING once models, shard tables and the lookup
client are ready). Used by integration tests, benchmarks and the demo::

    with ShardCluster(plan, root / "shards", load_from=models) as shards:
        with RankerCluster(spec, models, shards.addresses, num_rankers=2, data_root=root / "rankers") as rankers:
            stub = RankingStub(grpc.insecure_channel(rankers.addresses[0]))
            rankers.kill(1)      # SIGKILL, no goodbye
            rankers.restart(1)   # same port; waits for SERVING

Ranker ``k`` logs to ``data_root/ranker-k.log``. Every ranker's BLAS/OpenMP pools are
pinned to 1 thread (rankers share the host's cores with the shards and each other;
``ranker.threads`` in the spec sets torch's intra-op threads). ``admin_token`` reaches
the process as ``token_env`` (``[admin] token_env``; default ``RECSERVE_ADMIN_TOKEN``),
guarding ``Admin.ReloadModels`` and ``AddItems``; without one, ``insecure_admin``
passes ``--insecure-admin`` (else those are refused).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from recserve.cluster.group import ADMIN_TOKEN_ENV, GroupLauncher, ProcessGroup, health_watch, launch_env
from recserve.config.spec import TlsConfig
from recserve.errors import ConfigError

log = logging.getLogger(__name__)

# The health service a ranker marks SERVING when ready ("" turns SERVING with it). Named
# here rather than imported from ranker.server, which would load torch into the launcher.
RANKING_HEALTH_SERVICE = "recserve.v1.Ranking"
RANKER_THREADS = 1


class RankerCluster(GroupLauncher):
    """``num_rankers`` ranker processes serving ``models_dir`` from ``shard_addresses``
    (empty: the spec's ``shard_addresses``), configured by the spec at ``config_path``.

    ``env``: process-start settings on top of this process's environment; given (even
    empty) they own the transport variables (``GRPC_EXPERIMENTS``, ``MALLOC_*``) as for
    :class:`~recserve.cluster.shards.ShardCluster`. ``extra_args`` are appended to every
    ranker's command line. ``host`` / ``ports``: where they listen (default: loopback,
    free ports; ranker ``k`` binds ``ports[k]``). ``metrics_port``: where each serves
    Prometheus ``/metrics`` (0 = free ports, N > 0 = ranker k binds N + k, -1 = none;
    :meth:`metrics_url`), passed as ``--metrics-port``, which wins over the spec's.
    """

    def __init__(
        self,
        config_path: str | Path,
        models_dir: str | Path,
        shard_addresses: Sequence[str],
        *,
        num_rankers: int = 1,
        data_root: str | Path,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        admin_token: str = "",
        insecure_admin: bool = False,
        token_env: str = ADMIN_TOKEN_ENV,
        start_timeout_s: float = 120.0,
        host: str = "127.0.0.1",
        ports: Sequence[int] = (),
        metrics_port: int = 0,
        python: str = sys.executable,
        tls: TlsConfig | None = None,  # the spec's [tls]: health is watched over TLS
    ) -> None:
        if num_rankers < 1:
            raise ConfigError(f"num_rankers = {num_rankers} is invalid: start at least one ranker")
        bad = [a for a in shard_addresses if not a or "," in a]
        if bad:
            raise ConfigError(f"shard_addresses = {list(shard_addresses)} is invalid: give HOST:PORT strings without commas (bad: {bad})")
        self.config_path = Path(config_path)
        self.models_dir = Path(models_dir)
        self.shard_addresses = tuple(shard_addresses)
        self.num_rankers = num_rankers
        self.data_root = Path(data_root)
        self.extra_env = dict(env or {})
        self._owns_transport_env = env is not None
        self.extra_args = tuple(extra_args)
        self.admin_token = admin_token
        self.insecure_admin = insecure_admin
        self.token_env = token_env
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.python = python
        self._group = ProcessGroup(
            "ranker", self.data_root, num_rankers, command=self._command, env=self._env,
            start_timeout_s=start_timeout_s, health_service=RANKING_HEALTH_SERVICE, host=host, ports=ports, metrics_port=metrics_port,
            health=health_watch(tls),
        )  # fmt: skip

    # -- internals -------------------------------------------------------------------

    def _command(self, k: int, port: int, port_file: Path) -> list[str]:
        cmd = [
            self.python, "-m", "recserve", "ranker", "serve",
            "--config", str(self.config_path), "--models", str(self.models_dir),
            "--host", self.host, "--port", str(port), "--port-file", str(port_file),
        ]  # fmt: skip
        if self.shard_addresses:
            cmd += ["--shards", ",".join(self.shard_addresses)]
        if self.insecure_admin:
            cmd += ["--insecure-admin"]
        return cmd + list(self.extra_args)

    def _env(self) -> dict[str, str]:
        return launch_env(self.extra_env, owns_transport=self._owns_transport_env, threads=RANKER_THREADS, admin_token=self.admin_token, token_env=self.token_env)
