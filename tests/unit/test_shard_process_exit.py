"""A stopped shard process leaves without interpreter teardown (which takes ≈0.55 s once
torch is loaded), but only after serve() has closed everything and logs are flushed
(no sockets, no processes: serve and the exit are fakes)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import pytest

from embedding_server import server
from embedding_server.config import ShardProcessConfig
from recserve.errors import Unavailable


class RecordingHandler(logging.Handler):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        pass

    def flush(self) -> None:
        self.events.append("log flushed")

    def close(self) -> None:
        self.events.append("log closed")
        super().close()


def config() -> ShardProcessConfig:
    return ShardProcessConfig(shard_id=0, plan_path="plan.json", data_dir="data")


def test_a_clean_stop_exits_zero_right_after_serve_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    async def fake_serve(cfg: ShardProcessConfig, stop: Any = None, **_: Any) -> None:  # on_ready=freeze_gc
        events.append(f"serve shard {cfg.shard_id} returned")

    monkeypatch.setattr(server, "serve", fake_serve)
    handler = RecordingHandler(events)
    only_handler(monkeypatch, handler)
    logging.getLogger().addHandler(handler)
    try:
        server.run_process(config(), exit_process=lambda code: events.append(f"exit {code}"))
    finally:
        logging.getLogger().removeHandler(handler)
    assert events == ["serve shard 0 returned", "log flushed", "log closed", "exit 0"]


def only_handler(monkeypatch: pytest.MonkeyPatch, handler: logging.Handler) -> None:
    """Make ``handler`` the only one logging.shutdown sees (it walks every live handler;
    pytest's own capture handlers stay untouched)."""
    monkeypatch.setattr(logging, "_handlerList", [weakref.ref(handler)])


def test_handlers_off_the_root_logger_are_flushed_before_the_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """os._exit skips logging's atexit hook, so run_process must flush every handler, not
    only the root logger's (a file handler on ``embedding_server`` would lose its tail)."""
    events: list[str] = []

    async def fake_serve(cfg: ShardProcessConfig, stop: Any = None, **_: Any) -> None:  # on_ready=freeze_gc
        events.append("serve returned")

    monkeypatch.setattr(server, "serve", fake_serve)
    handler = RecordingHandler(events)
    only_handler(monkeypatch, handler)
    child = logging.getLogger("embedding_server.test_exit_child")
    child.addHandler(handler)
    try:
        server.run_process(config(), exit_process=lambda code: events.append(f"exit {code}"))
    finally:
        child.removeHandler(handler)
    assert events == ["serve returned", "log flushed", "log closed", "exit 0"]


def test_a_failed_serve_propagates_and_does_not_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_serve(cfg: ShardProcessConfig, stop: Any = None, **_: Any) -> None:  # on_ready=freeze_gc
        raise Unavailable("cannot listen on 127.0.0.1:1")

    monkeypatch.setattr(server, "serve", fake_serve)
    exits: list[int] = []
    with pytest.raises(Unavailable, match="cannot listen"):
        server.run_process(config(), exit_process=exits.append)
    assert exits == []  # the CLI reports the error and exits non-zero the normal way
