"""Launch, watch and stop N generation processes on loopback.

:class:`GenerationCluster` starts ``num_replicas`` ``recserve generate serve``
subprocesses through :class:`recserve.cluster.group.ProcessGroup` (orphan protection,
``--port 0 --port-file``, readiness on the health Watch stream of
``recserve.v1.Generation``, which turns SERVING once the model is loaded). Used by
``recserve serve``, integration tests and benchmarks::

    with GenerationCluster(spec, num_replicas=2, data_root=root / "generation") as gen:
        stub = GenerationStub(grpc.insecure_channel(gen.addresses[0]))
        gen.kill(1)      # SIGKILL, no goodbye
        gen.restart(1)   # same port; waits for SERVING

Replica ``k`` logs to ``data_root/generation-k.log``. BLAS/OpenMP pools are pinned to one
thread (replicas share the host's cores; ``generation.threads`` sets torch's intra-op
threads). ``checkpoint``: a ``recserve train --lm`` directory passed as ``--model``
('' = the spec's ``generation.checkpoint``, else seeded random weights).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from recserve.cluster.group import GroupLauncher, ProcessGroup, health_watch, launch_env
from recserve.config.spec import TlsConfig
from recserve.errors import ConfigError

# Named here rather than imported from generation.server, which would load torch into the launcher.
GENERATION_HEALTH_SERVICE = "recserve.v1.Generation"
GENERATION_THREADS = 1


class GenerationCluster(GroupLauncher):
    """``num_replicas`` generation processes configured by the spec at ``config_path``.

    ``env``: extra environment on top of this process's; ``extra_args``: appended to every
    replica's command line. ``host`` / ``ports``: where they listen (default: loopback,
    free ports; replica ``k`` binds ``ports[k]``). ``metrics_port``: Prometheus
    ``/metrics`` (0 = free ports, N > 0 = replica k binds N + k, -1 = none;
    :meth:`metrics_url`), passed as ``--metrics-port``, which wins over the spec's.
    """

    def __init__(
        self,
        config_path: str | Path,
        *,
        num_replicas: int = 1,
        data_root: str | Path,
        checkpoint: str | Path = "",
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = 120.0,
        host: str = "127.0.0.1",
        ports: Sequence[int] = (),
        metrics_port: int = 0,
        python: str = sys.executable,
        tls: TlsConfig | None = None,  # the spec's [tls]: health is watched over TLS
    ) -> None:
        if num_replicas < 1:
            raise ConfigError(f"num_replicas = {num_replicas} is invalid: start at least one generation replica")
        self.config_path = Path(config_path)
        self.num_replicas = num_replicas
        self.data_root = Path(data_root)
        self.checkpoint = str(checkpoint)
        self.extra_env = dict(env or {})
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.python = python
        self._group = ProcessGroup(
            "generation", self.data_root, num_replicas, command=self._command, env=self._env,
            start_timeout_s=start_timeout_s, health_service=GENERATION_HEALTH_SERVICE, host=host, ports=ports, metrics_port=metrics_port,
            health=health_watch(tls),
        )  # fmt: skip

    # -- internals -------------------------------------------------------------------

    def _command(self, k: int, port: int, port_file: Path) -> list[str]:
        cmd = [
            self.python, "-m", "recserve", "generate", "serve", "--config", str(self.config_path),
            "--host", self.host, "--port", str(port), "--port-file", str(port_file),
        ]  # fmt: skip
        if self.checkpoint:
            cmd += ["--model", self.checkpoint]
        return cmd + list(self.extra_args)

    def _env(self) -> dict[str, str]:
        return launch_env(self.extra_env, owns_transport=False, threads=GENERATION_THREADS)
