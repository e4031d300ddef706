"""Children launched by ``recserve.cluster`` exit when their parent is SIGKILLed.

A parent process (a small script, as CI's runner would be) starts a ShardCluster and
prints its shards' pids; the test SIGKILLs the parent and waits on pidfds (readable
when a process exits, no polling interval) for every shard to be gone within 2 s: a
correctness bound, not a speed goal. Whatever happens, the test kills what it started.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recserve.cluster.shards import REPO_ROOT
from tests.integration.conftest import ShardWorld

pytestmark = pytest.mark.integration

ORPHAN_BOUND_S = 2.0

PARENT = r"""
import json, sys
from recserve.cluster import ShardCluster
from tests.integration.conftest import server_config

plan, root, source, shards, wait = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
# wait=False: held before loading its tiers (a gate file nobody creates), not yet SERVING.
gate = [] if wait else ["--load-gate", root + "/never-created"]
cluster = ShardCluster(plan, root, num_shards=shards, server=server_config(), load_from=source, fault_hook=not wait, extra_args=gate)
cluster.start(wait=wait)
print(json.dumps([cluster.pid(k) for k in range(shards)]), flush=True)
sys.stdin.read()  # hold the cluster until killed
"""


def _exited(pidfds: dict[int, int], timeout_s: float) -> set[int]:
    """Pids (of ``pidfds``: pid -> pidfd) that exit within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    gone: set[int] = set()
    while len(gone) < len(pidfds):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd for pid, fd in pidfds.items() if pid not in gone], [], [], remaining)
        gone |= {pid for pid, fd in pidfds.items() if fd in ready}
    return gone


@pytest.mark.parametrize("serving", [True, False], ids=["serving", "loading"])
def test_shards_exit_when_their_parent_is_sigkilled(shard_world: ShardWorld, tmp_path: Path, serving: bool) -> None:
    shards = 2 if serving else 1
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    argv = [sys.executable, "-c", PARENT, str(shard_world.plan_path), str(tmp_path / "data"), str(shard_world.source_dir), str(shards), "1" if serving else "0"]
    parent = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pidfds: dict[int, int] = {}
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()  # EOF (b"") if the parent failed
        if not line:
            parent.wait(timeout=30)
            pytest.fail(f"parent exited {parent.returncode} before printing its shards' pids: {parent.stderr.read().decode()[-3000:] if parent.stderr else ''}")
        pids = json.loads(line)
        assert len(pids) == shards
        pidfds = {pid: os.pidfd_open(pid) for pid in pids}  # taken while alive: immune to pid reuse
        assert not _exited(pidfds, 0.0)  # all running before the parent dies

        parent.kill()  # SIGKILL: no cleanup code in the parent runs
        parent.wait(timeout=10)
        gone = _exited(pidfds, ORPHAN_BOUND_S)
        assert gone == set(pids), f"shards {sorted(set(pids) - gone)} outlived their SIGKILLed parent by {ORPHAN_BOUND_S} s"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        for fd in pidfds.values():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # no-op error if already gone
            except ProcessLookupError:
                pass
            os.close(fd)
        for stream in (parent.stdin, parent.stdout, parent.stderr):
            if stream is not None:
                stream.close()
