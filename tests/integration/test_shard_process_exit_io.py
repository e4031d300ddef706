"""The fast exit of a shard process (``embedding_server.server.run_process``, which
ends in ``os._exit``) loses no output: a real child process, its stdout a pipe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import ctypes, logging, sys
    from embedding_server import server
    from embedding_server.config import ShardProcessConfig

    async def fake_serve(config, stop=None, **_):
        # C-level buffered output (a C/C++ library's printf) and a file handler off the root logger
        ctypes.CDLL(None).printf(b"c stdio tail\\n")
        handler = logging.FileHandler(sys.argv[1], delay=False)
        logging.getLogger("embedding_server.child").addHandler(handler)
        logging.getLogger("embedding_server.child").warning("log tail")
        print("python stdout tail", end="")

    server.serve = fake_serve
    server.run_process(ShardProcessConfig(shard_id=0, plan_path="plan.json", data_dir="data"))
    sys.exit(3)  # not reached: run_process exits 0 itself
    """
)


def test_the_fast_exit_keeps_c_stdio_python_stdout_and_log_tails(tmp_path: Path) -> None:
    log_file = tmp_path / "shard.log"
    # Buffered stdio, as a shard launched without PYTHONUNBUFFERED has (it also unbuffers C's stdout).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(log_file)], cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"c stdio tail" in done.stdout  # lost without fflush(NULL): os._exit skips C's exit-time flush
    assert b"python stdout tail" in done.stdout
    assert "log tail" in log_file.read_text()
