"""Launch, watch and stop the HTTP gateway process on loopback.

:class:`GatewayCluster` starts one ``recserve gateway serve`` subprocess in front of a
set of recommenders (cascades) and rankers, through
:class:`recserve.cluster.group.ProcessGroup` (orphan protection, ``--port 0
--port-file``). It is ready when ``GET /readyz`` answers 200, i.e. every downstream
reports SERVING. Used by ``recserve serve`` (its stack, :mod:`recserve.cluster.stack`)
and the integration tests (tests/integration/gateway_world.py)::

    with GatewayCluster(spec, [cascade.address], rankers.addresses, data_root=root / "gateway",
                        env={"FEED_API_KEY": key}) as gateway:
        requests.post(gateway.url + "/v1/recommendations", json={"user_id": 7, "k": 10})

It logs to ``data_root/gateway-0.log``. ``env`` is added to this process's environment:
where the tenants' keys (``[[tenants]] api_key_env``) reach the gateway.
"""

from __future__ import annotations

import http.client
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from recserve.cluster.group import Health, ProcessGroup, launch_env
from recserve.config.spec import TlsConfig
from recserve.errors import ConfigError

log = logging.getLogger(__name__)

READY_POLL_S = 0.05  # /readyz is re-asked this often while a downstream is not SERVING
GATEWAY_THREADS = 1


def watch_ready(address: str, service: str, timeout_s: float, tls: TlsConfig | None = None) -> Health:
    """:data:`~recserve.cluster.group.HealthWatch` over HTTP: ``GET /readyz`` at
    ``address`` until it answers 200 (SERVING) or ``timeout_s`` passes (NOT_SERVING);
    UNREACHABLE while nothing listens. ``service`` is unused (one readiness). ``tls``:
    HTTPS, verifying the gateway against ``ca_file``."""
    host, _, port = address.rpartition(":")
    end = time.monotonic() + timeout_s
    while True:
        conn = http.client.HTTPConnection(host, int(port), timeout=max(0.1, min(2.0, timeout_s)))
        if tls is not None and tls.enabled:
            from recserve.rpc.auth import client_ssl_context

            conn = http.client.HTTPSConnection(host, int(port), timeout=max(0.1, min(2.0, timeout_s)), context=client_ssl_context(tls))
        try:
            conn.request("GET", "/readyz")
            status = conn.getresponse().status
        except OSError:
            return Health.UNREACHABLE
        finally:
            conn.close()
        if status == 200:
            return Health.SERVING
        if time.monotonic() + READY_POLL_S >= end:
            return Health.NOT_SERVING
        time.sleep(READY_POLL_S)


def _check_addresses(field: str, addresses: Sequence[str], *, allow_empty: bool = False) -> None:
    bad = [a for a in addresses if not a or "," in a]
    if (not addresses and not allow_empty) or bad:
        raise ConfigError(f"{field} = {list(addresses)} is invalid: give HOST:PORT strings without commas (bad: {bad})")


class GatewayCluster:
    """The gateway process calling ``recommenders`` (Recommend), ``rankers`` (Rank) and
    ``generators`` (Generate, behind ``POST /v1/generate``), configured by the spec at
    ``config_path`` (its ``[gateway]``, ``[generation]`` and ``[[tenants]]``).

    ``scrape``: the status page's targets, name -> ``/metrics`` URL (``shard-0``,
    ``ranker-1``, ``cascade-0``; the gateway adds itself). ``host`` / ``port``: where it
    listens (0 = a free port). ``env``: added to this process's environment.
    """

    def __init__(
        self,
        config_path: str | Path,
        recommenders: Sequence[str],
        rankers: Sequence[str] = (),
        *,
        generators: Sequence[str] = (),
        data_root: str | Path,
        scrape: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = 60.0,
        python: str = sys.executable,
        tls: TlsConfig | None = None,  # the spec's [tls]: readiness is checked over HTTPS
    ) -> None:
        _check_addresses("recommenders", recommenders)
        _check_addresses("rankers", rankers, allow_empty=True)
        _check_addresses("generators", generators, allow_empty=True)
        if not 0 <= port <= 65535:
            raise ConfigError(f"port = {port} is invalid: use a TCP port in 0..65535 (0 = pick a free one)")
        bad = [n for n, u in (scrape or {}).items() if not n or "," in n or "=" in n or "," in u]
        if bad:
            raise ConfigError(f"scrape names {bad} are invalid: use names and URLs without ',' or '='")
        self.config_path = Path(config_path)
        self.recommenders = tuple(recommenders)
        self.rankers = tuple(rankers)
        self.generators = tuple(generators)
        self.scrape = dict(scrape or {})
        self.data_root = Path(data_root)
        self.host = host
        self.extra_env = dict(env or {})
        self.extra_args = tuple(extra_args)
        self.python = python
        self._group = ProcessGroup(
            "gateway", self.data_root, 1, command=self._command, env=self._env, start_timeout_s=start_timeout_s, host=host, ports=(port,),
            health=watch_ready if tls is None or not tls.enabled else lambda a, s, t: watch_ready(a, s, t, tls),
        )  # fmt: skip

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> GatewayCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, *, wait: bool = True) -> None:
        """Start the gateway; wait until ``/readyz`` is 200 unless ``wait`` is False (it
        is listening, with a known URL, either way)."""
        self._group.start(wait=wait)

    def stop(self) -> None:
        """SIGTERM (in-flight requests drain), SIGKILL past the grace."""
        self._group.stop()

    def kill(self) -> None:
        self._group.kill(0)

    def restart(self, *, wait: bool = True) -> None:
        self._group.restart(0, wait=wait)

    def wait_serving(self, timeout_s: float | None = None) -> None:
        """Block until ``/readyz`` is 200, raising Unavailable (with the log tail) if the
        process exits first or the timeout passes."""
        self._group.wait_serving(0, timeout_s)

    # -- address and helpers ---------------------------------------------------------

    @property
    def address(self) -> str:
        return self._group.address(0)

    @property
    def url(self) -> str:
        """``http://HOST:PORT``."""
        return f"http://{self.address}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    @property
    def pid(self) -> int:
        return self._group.pid(0)

    @property
    def log_path(self) -> Path:
        return self._group.log_path(0)

    # -- internals -------------------------------------------------------------------

    def _command(self, k: int, port: int, port_file: Path) -> list[str]:
        cmd = [
            self.python, "-m", "recserve", "gateway", "serve", "--config", str(self.config_path),
            "--recommenders", ",".join(self.recommenders), "--host", self.host, "--port", str(port), "--port-file", str(port_file),
        ]  # fmt: skip
        if self.rankers:
            cmd += ["--rankers", ",".join(self.rankers)]
        if self.generators:
            cmd += ["--generators", ",".join(self.generators)]
        if self.scrape:
            cmd += ["--scrape", ",".join(f"{n}={u}" for n, u in self.scrape.items())]
        return cmd + list(self.extra_args)

    def _env(self) -> dict[str, str]:
        return launch_env(self.extra_env, owns_transport=False, threads=GATEWAY_THREADS)
