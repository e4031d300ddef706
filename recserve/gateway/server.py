"""The gateway process (``recserve gateway serve``): start, serve, drain.

1. Tenants' keys are read from the environment (a keyed tenant without its variable is
   a ConfigError naming both, before anything listens); the RecClient is opened on the
   recommenders and rankers, and a GenerationClient on the generation replicas when
   there are any (``POST /v1/generate``), lazily connecting: they may still be starting;
2. the aiohttp app listens on ``host:port`` with ``handler_cancellation`` on (a client
   that disconnects cancels its handler and so the downstream RPC); the bound port goes
   to the port file; ``/readyz`` says when the downstreams are SERVING;
3. SIGTERM / SIGINT: stop accepting, give in-flight requests :data:`GRACE_S`, close the
   client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from collections.abc import Mapping

from aiohttp import web

from recserve.config.spec import ClusterConfig
from recserve.errors import Unavailable
from recserve.logs import register_secret
from recserve.rpc.auth import server_ssl_context
from recserve.rpc.serving import stop_on_signals, write_port_file

log = logging.getLogger(__name__)
GRACE_S = 2.0
BACKLOG = 1024


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0 = a free port); Unavailable naming it
    when the port is taken or the address is not local."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Unavailable(f"gateway: cannot listen on {host}:{port} ({exc.strerror}); pick another --port or gateway.port") from None
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


@dataclasses.dataclass(frozen=True)
class GatewayProcessConfig:
    """What one gateway process serves: the spec, its downstreams (HOST:PORT each), the
    status page's scrape targets (name -> ``/metrics`` URL; this process's own is added
    as ``gateway``) and where it listens."""

    cluster: ClusterConfig
    recommenders: tuple[str, ...]
    rankers: tuple[str, ...] = ()
    generators: tuple[str, ...] = ()  # Generation replicas behind POST /v1/generate (none: it answers 503)
    scrape: tuple[tuple[str, str], ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str = ""


async def serve(config: GatewayProcessConfig, stop: asyncio.Event | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Run the gateway until ``stop`` (or SIGTERM / SIGINT)."""
    from recserve.client.generation import GenerationClient
    from recserve.client.rec import RecClient
    from recserve.gateway.app import make_app
    from recserve.gateway.tenants import TenantTable

    cluster = config.cluster
    env = os.environ if environ is None else environ
    tenants = TenantTable.from_env(cluster.tenants, env, header=cluster.gateway.api_key_header)
    # The keys' variables may have any name: mask their values in every log line (recserve.logs).
    register_secret(*(env[t.api_key_env] for t in cluster.tenants if t.api_key_env and env.get(t.api_key_env)))
    # [tls]: the gateway serves HTTPS and reaches the gRPC servers (which read the same
    # spec) over TLS; a bad certificate fails here, before anything listens.
    ssl_context = server_ssl_context(cluster.tls)
    client = RecClient(config.recommenders, config.rankers, cluster.routing, tls=cluster.tls)
    await client.start()
    generator = GenerationClient(config.generators, cluster.routing, tls=cluster.tls) if config.generators else None
    if generator is not None:
        await generator.start()
    runner: web.AppRunner | None = None
    try:
        # Bind first: the status page scrapes this process too, so its URL must be known
        # before the routes are built.
        sock = _bind(config.host, config.port)
        bound = int(sock.getsockname()[1])
        targets = dict(config.scrape)
        scheme = "https" if ssl_context is not None else "http"
        targets.setdefault("gateway", f"{scheme}://{config.host}:{bound}/metrics")
        app = make_app(cluster, client, tenants, scrape_targets=targets, generator=generator)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=GRACE_S)
        await runner.setup()
        await web.SockSite(runner, sock, ssl_context=ssl_context).start()
        if config.port_file:
            write_port_file(config.port_file, bound)
        log.info("HTTP gateway at %s://%s:%d (recommenders %s, rankers %s, generators %s, tenants %s)", scheme, config.host, bound,
                 ",".join(config.recommenders), ",".join(config.rankers) or "-", ",".join(config.generators) or "-",
                 [t.name for t in tenants.tenants])  # fmt: skip
        stop = stop or asyncio.Event()
        stop_on_signals(stop)
        await stop.wait()
        log.info("gateway stopping: draining in-flight requests (%.1f s)", GRACE_S)
    finally:
        if runner is not None:
            await runner.cleanup()
        await client.aclose()
        if generator is not None:
            await generator.aclose()
