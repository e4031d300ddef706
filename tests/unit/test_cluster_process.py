"""The launcher's environment contract (no processes: the children are tested in
tests/integration/test_cluster_orphans.py)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from recserve.cli import main as cli_main
from recserve.cluster.process import LIFELINE_FD_ENV, PARENT_PID_ENV, PDEATHSIG_ENV, exit_with_parent, lifeline_env


def test_every_recserve_command_arms_the_lifeline_when_launched(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # main() checks the variable by name (importing recserve.cluster would load grpc),
    # before parsing: even a command that only prints its help is armed.
    from recserve.cluster import process

    calls: list[int] = []

    def armed() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(process, "exit_with_parent", armed)
    monkeypatch.delenv(LIFELINE_FD_ENV, raising=False)
    levels = {name: logging.getLogger(name).level for name in ("recserve", "embedding_server")}
    try:
        assert cli_main.main([]) == 2  # no subcommand: help, exit 2
        assert calls == []  # not launched by spawn_child: nothing armed
        monkeypatch.setenv(LIFELINE_FD_ENV, "7")
        assert cli_main.main([]) == 2
        assert calls == [1]
    finally:
        for name, level in levels.items():  # main() sets them; other tests expect the defaults
            logging.getLogger(name).setLevel(level)
    capsys.readouterr()


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


def test_the_lifeline_watchdog_stops_the_child_when_the_parents_end_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process: this test plays the child; closing the write end is the parent dying.
    from recserve.cluster import process

    fired = threading.Event()
    monkeypatch.setattr(process, "_orphaned", lambda grace_s: fired.set())  # instead of SIGTERM to pytest
    read_fd, write_fd = os.pipe()
    try:
        monkeypatch.setenv(PARENT_PID_ENV, str(os.getpid()))
        monkeypatch.setenv(LIFELINE_FD_ENV, str(read_fd))
        monkeypatch.delenv(PDEATHSIG_ENV, raising=False)  # prctl would arm pytest itself
        assert exit_with_parent() is True
        assert not fired.wait(0.05)  # the parent is alive: no stop
        os.close(write_fd)
        write_fd = -1
        assert fired.wait(10.0)  # EOF on the lifeline: the child stops (a bound, not a speed goal)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
