"""The launcher's environment contract (no processes: the children are tested in
tests/integration/test_cluster_orphans.py)."""

from __future__ import annotations

import inspect
import os
import threading

import pytest

from recserve.cli import main as cli_main
from recserve.cluster.process import LIFELINE_FD_ENV, PARENT_PID_ENV, PDEATHSIG_ENV, exit_with_parent, lifeline_env


def test_every_recserve_command_arms_the_lifeline_when_launched() -> None:
    # main() checks the variable by name (importing recserve.cluster would load grpc).
    assert f'"{LIFELINE_FD_ENV}" in os.environ' in inspect.getsource(cli_main.main)


def test_pdeathsig_is_only_requested_from_the_main_thread() -> None:
    main = lifeline_env({"KEEP": "1", PDEATHSIG_ENV: "1"}, 7)
    assert main == {"KEEP": "1", PARENT_PID_ENV: str(os.getpid()), LIFELINE_FD_ENV: "7", PDEATHSIG_ENV: "1"}
    box: list[dict[str, str]] = []
    worker = threading.Thread(target=lambda: box.append(lifeline_env({PDEATHSIG_ENV: "1"}, 7)))
    worker.start()
    worker.join()
    # A worker thread's exit would fire PDEATHSIG in a healthy parent: the lifeline alone.
    assert PDEATHSIG_ENV not in box[0] and box[0][LIFELINE_FD_ENV] == "7"


def test_exit_with_parent_is_a_no_op_unless_launched_and_consumes_its_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (PARENT_PID_ENV, LIFELINE_FD_ENV, PDEATHSIG_ENV):
        monkeypatch.delenv(name, raising=False)
    assert exit_with_parent() is False
    # A stale or foreign fd (not a pipe) is not watched, and the variables are removed so
    # this process's own children cannot inherit them.
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        monkeypatch.setenv(PARENT_PID_ENV, str(os.getppid()))
        monkeypatch.setenv(LIFELINE_FD_ENV, str(devnull))
        assert exit_with_parent() is False
        assert PARENT_PID_ENV not in os.environ and LIFELINE_FD_ENV not in os.environ
    finally:
        os.close(devnull)
