"""A process's ``/metrics`` endpoint: prometheus_client's HTTP server on a daemon thread."""

from __future__ import annotations

import logging

from recserve.config.spec import NO_METRICS_PORT, require_metrics_port
from recserve.errors import Unavailable

log = logging.getLogger(__name__)


def start_metrics_server(host: str, port: int) -> int:
    """Serve the default registry at ``http://host:port/metrics`` (any path answers)
    from a daemon thread; return the bound port (``port`` 0 = a free one), or -1 without
    starting anything when ``port`` is -1 (no metrics server).

    The server lives as long as the process (its thread is a daemon): a serve command
    starts it once, before it listens for gRPC, so a launcher that has read the gRPC
    port file finds the metrics port file already written. A taken port is Unavailable
    naming it.
    """
    require_metrics_port("metrics_port", port)
    if port == NO_METRICS_PORT:
        return NO_METRICS_PORT
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as exc:  # EADDRINUSE / EADDRNOTAVAIL: a clear error, not a traceback
        raise Unavailable(f"metrics_port = {port}: cannot listen on {host}:{port} ({exc.strerror}); pick another --metrics-port or use 0") from None
    bound = int(server.server_port)
    log.info("metrics at http://%s:%d/metrics", host, bound)
    return bound


def start_and_record(host: str, port: int, port_file: str | None) -> int:
    """:func:`start_metrics_server`, then write the bound port to ``port_file`` (atomically,
    like the gRPC port file) when one is given and a server was started."""
    from recserve.rpc.serving import write_port_file

    bound = start_metrics_server(host, port)
    if port_file and bound != NO_METRICS_PORT:
        write_port_file(port_file, bound)
    return bound
