"""Launch, watch and stop the cascade process (the Recommender) on loopback.

:class:`CascadeCluster` starts one ``recserve cascade serve`` subprocess over an export,
a set of rankers and a set of shards, through :class:`recserve.cluster.group.ProcessGroup`
(orphan protection, ``--port 0 --port-file``, readiness on the health Watch stream of
``recserve.v1.Recommender``, which turns SERVING once the index, the export's arrays and
the ranker and shard clients are ready). Used by ``recserve serve`` (its stack,
:mod:`recserve.cluster.stack`), integration tests and benchmarks::

    with CascadeCluster(spec, models, rankers.addresses, shards.addresses, data_root=root / "cascade") as cascade:
        stub = RecommenderStub(grpc.insecure_channel(cascade.address))
        cascade.kill()      # SIGKILL, no goodbye
        cascade.restart()   # same port; waits for SERVING

It logs to ``data_root/cascade-0.log``. Its BLAS/OpenMP pools are pinned to
:data:`CASCADE_THREADS` (L1's one matmul per request and the FAISS search share the host's
cores with the rankers and shards). ``admin_token`` reaches the process as ``token_env``
(``[admin] token_env``; default ``RECSERVE_ADMIN_TOKEN``), guarding ``Admin.RefreshIndex``
and ``Admin.AddItems``; without one, ``insecure_admin`` passes ``--insecure-admin``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from recserve.cluster.group import ADMIN_TOKEN_ENV, ProcessGroup, health_watch, launch_env
from recserve.config.spec import TlsConfig
from recserve.errors import ConfigError

log = logging.getLogger(__name__)

# The health service the cascade marks SERVING when ready ("" turns SERVING with it).
# Named here rather than imported from cascade's server, which would load FAISS into the
# launcher.
RECOMMENDER_HEALTH_SERVICE = "recserve.v1.Recommender"
CASCADE_THREADS = 1


def _check_addresses(field: str, addresses: Sequence[str]) -> None:
    bad = [a for a in addresses if not a or "," in a]
    if not addresses or bad:
        raise ConfigError(f"{field} = {list(addresses)} is invalid: give at least one HOST:PORT string without commas (bad: {bad})")


class CascadeCluster:
    """The cascade process serving ``models_dir`` (its index and arrays), calling
    ``ranker_addresses`` for EmbedUser, L2 and L3 and ``shard_addresses`` for its
    lookups, configured by the spec at ``config_path``.

    ``host`` / ``port``: where it listens (0 = a free port, read from its port file).
    ``env``: process-start settings on top of this process's environment; given (even
    empty) they own the transport variables (``GRPC_EXPERIMENTS``, ``MALLOC_*``) as for
    :class:`~recserve.cluster.shards.ShardCluster`. ``extra_args`` are appended to the
    command line. ``metrics_port``: where it serves Prometheus ``/metrics`` (0 = a free
    port, -1 = none; :attr:`metrics_url`), passed as ``--metrics-port``.
    """

    def __init__(
        self,
        config_path: str | Path,
        models_dir: str | Path,
        ranker_addresses: Sequence[str],
        shard_addresses: Sequence[str],
        *,
        data_root: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        admin_token: str = "",
        insecure_admin: bool = False,
        token_env: str = ADMIN_TOKEN_ENV,
        start_timeout_s: float = 120.0,
        metrics_port: int = 0,
        python: str = sys.executable,
        tls: TlsConfig | None = None,  # the spec's [tls]: health is watched over TLS
    ) -> None:
        _check_addresses("ranker_addresses", ranker_addresses)
        _check_addresses("shard_addresses", shard_addresses)
        if not 0 <= port <= 65535:
            raise ConfigError(f"port = {port} is invalid: use a TCP port in 0..65535 (0 = pick a free one)")
        self.config_path = Path(config_path)
        self.models_dir = Path(models_dir)
        self.ranker_addresses = tuple(ranker_addresses)
        self.shard_addresses = tuple(shard_addresses)
        self.data_root = Path(data_root)
        self.host = host
        self.extra_env = dict(env or {})
        self._owns_transport_env = env is not None
        self.extra_args = tuple(extra_args)
        self.admin_token = admin_token
        self.insecure_admin = insecure_admin
        self.token_env = token_env
        self.start_timeout_s = start_timeout_s
        self.python = python
        self._group = ProcessGroup(
            "cascade", self.data_root, 1, command=self._command, env=self._env, start_timeout_s=start_timeout_s,
            health_service=RECOMMENDER_HEALTH_SERVICE, host=host, ports=(port,), metrics_port=metrics_port, health=health_watch(tls),
        )  # fmt: skip

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> CascadeCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, *, wait: bool = True) -> None:
        """Start the cascade; wait until it is SERVING unless ``wait`` is False (it is
        listening, with a known address, either way)."""
        self._group.start(wait=wait)

    def stop(self) -> None:
        """SIGTERM (graceful: in-flight Recommend calls drain), SIGKILL past the grace."""
        self._group.stop()

    def kill(self) -> None:
        """SIGKILL and reap; the port is kept for :meth:`restart`."""
        self._group.kill(0)

    def restart(self, *, wait: bool = True) -> None:
        """Start it again on its previous port (stopping it first if alive)."""
        self._group.restart(0, wait=wait)

    def wait_serving(self, timeout_s: float | None = None) -> None:
        """Block until it reports SERVING, raising Unavailable (with its log tail) if it
        exits first or the timeout (default ``start_timeout_s``) passes."""
        self._group.wait_serving(0, timeout_s)

    # -- address and helpers ---------------------------------------------------------

    @property
    def address(self) -> str:
        return self._group.address(0)

    @property
    def metrics_url(self) -> str | None:
        """Its Prometheus endpoint (``http://HOST:PORT/metrics``; None: metrics_port -1)."""
        return self._group.metrics_url(0)

    @property
    def pid(self) -> int:
        return self._group.pid(0)

    @property
    def log_path(self) -> Path:
        return self._group.log_path(0)

    # -- internals -------------------------------------------------------------------

    def _command(self, k: int, port: int, port_file: Path) -> list[str]:
        cmd = [
            self.python, "-m", "recserve", "cascade", "serve",
            "--config", str(self.config_path), "--models", str(self.models_dir),
            "--rankers", ",".join(self.ranker_addresses), "--shards", ",".join(self.shard_addresses),
            "--host", self.host, "--port", str(port), "--port-file", str(port_file),
        ]  # fmt: skip
        if self.insecure_admin:
            cmd += ["--insecure-admin"]
        return cmd + list(self.extra_args)

    def _env(self) -> dict[str, str]:
        return launch_env(self.extra_env, owns_transport=self._owns_transport_env, threads=CASCADE_THREADS, admin_token=self.admin_token, token_env=self.token_env)
