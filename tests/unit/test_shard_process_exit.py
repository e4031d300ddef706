"""A stopped shard process leaves without interpreter teardown (which takes ≈0.55 s once
torch is loaded), but only after serve() has closed everything and logs are flushed
(no sockets, no processes: serve and the exit are fakes)."""

from __future__ import annotations

import logging
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


def config() -> ShardProcessConfig:
    return ShardProcessConfig(shard_id=0, plan_path="plan.json", data_dir="data")


def test_a_clean_stop_exits_zero_right_after_serve_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    async def fake_serve(cfg: ShardProcessConfig, stop: Any = None) -> None:
        events.append(f"serve shard {cfg.shard_id} returned")

    monkeypatch.setattr(server, "serve", fake_serve)
    handler = RecordingHandler(events)
    logging.getLogger().addHandler(handler)
    try:
        server.run_process(config(), exit_process=lambda code: events.append(f"exit {code}"))
    finally:
        logging.getLogger().removeHandler(handler)
    assert events == ["serve shard 0 returned", "log flushed", "exit 0"]


def test_a_failed_serve_propagates_and_does_not_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_serve(cfg: ShardProcessConfig, stop: Any = None) -> None:
        raise Unavailable("cannot listen on 127.0.0.1:1")

    monkeypatch.setattr(server, "serve", fake_serve)
    exits: list[int] = []
    with pytest.raises(Unavailable, match="cannot listen"):
        server.run_process(config(), exit_process=exits.append)
    assert exits == []  # the CLI reports the error and exits non-zero the normal way
