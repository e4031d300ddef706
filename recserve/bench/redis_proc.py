"""A throwaway ``redis-server`` on a free loopback port, for benchmarks.

``redis-server`` comes from Debian's package (``make redis`` installs it). When the
binary is missing :func:`start_redis` returns ``(None, reason)`` and the benchmark
reports its Redis fields as null with that reason.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


class RedisProcess:
    """A running redis-server (no persistence) and how to stop it."""

    def __init__(self, popen: subprocess.Popen[bytes], port: int) -> None:
        self.popen = popen
        self.port = port

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path, *, timeout_s: float = 10.0) -> tuple[RedisProcess | None, str]:
    """Start ``redis-server`` on 127.0.0.1 (no RDB/AOF). Returns (process, "") or
    (None, reason)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None, "redis-server is not on PATH; install it with `make redis` (Debian package redis-server)"
    port = _free_port()
    log = open(workdir / "redis.log", "wb")
    popen = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--dir", str(workdir)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    proc = RedisProcess(popen, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            return None, f"redis-server exited with code {popen.returncode}; see {workdir / 'redis.log'}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, ""
        except OSError:
            time.sleep(0.05)  # not listening yet: this is process start-up, not a test
    proc.stop()
    return None, f"redis-server did not answer PING within {timeout_s:.0f} s"
