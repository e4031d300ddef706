"""recserve.logs: the request id on every log line, bound per RPC by the server
wrappers, and secrets masked whatever part of a record carries them (no sockets: the
handlers are called directly with a fake context)."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from recserve import logs
from recserve.rpc.server import checked_handler
from recserve.v1 import common_pb2, ranking_pb2

# Test-only values: registering them masks them in this process from now on, which is
# harmless because they appear nowhere else.
SECRET = "s3cr3t-admin-token-for-test-logs"
TENANT_KEY = "tenant-key-0f9e8d7c6b5a"


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger writing through recserve's filter and format to a string."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(logs.FORMAT))
    handler.addFilter(logs.LogContextFilter())
    logger = logging.getLogger("tests.unit.test_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_each_task_logs_its_own_request_id_and_lines_outside_requests_carry_a_dash(capture: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = capture

    async def request(rid: str, go: asyncio.Event) -> None:
        logs.set_request_id(rid)
        await go.wait()  # both tasks are bound before either logs: ids must not bleed
        logger.info("serving %s", rid)
        await asyncio.create_task(child())  # a task created by the request inherits its id

    async def child() -> None:
        logger.info("child line")

    async def main() -> None:
        go = asyncio.Event()
        tasks = [asyncio.create_task(request(rid, go)) for rid in ("rid-a", "rid-b")]
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(*tasks)
        logger.info("after the requests")

    asyncio.run(main())
    out = lines(stream)
    assert len(out) == 5
    assert sum("[rid-a] serving rid-a" in line for line in out) == 1 and sum("[rid-b] serving rid-b" in line for line in out) == 1
    assert sorted(line.split()[4] for line in out if "child line" in line) == ["[rid-a]", "[rid-b]"]
    assert out[-1].endswith("INFO [-] after the requests")


def test_bind_request_reads_the_header_and_binds_a_dash_without_one() -> None:
    async def body() -> list[str]:
        seen = []
        logs.bind_request(ranking_pb2.RankRequest(header=common_pb2.RequestHeader(request_id="h-1")))
        seen.append(logs.request_id())
        logs.bind_request(object())  # health, reflection: no header
        seen.append(logs.request_id())
        logs.bind_request(ranking_pb2.RankRequest())  # a header with no id
        seen.append(logs.request_id())
        return seen

    assert asyncio.run(body()) == ["h-1", "-", "-"]


class FakeContext:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"unexpected abort {code}: {details}")


def test_the_server_wrappers_bind_the_request_id_for_the_servicer() -> None:
    request = ranking_pb2.RankRequest(header=common_pb2.RequestHeader(request_id="rpc-7")).SerializeToString()

    async def async_servicer(req: Any, context: Any) -> str:
        return logs.request_id()

    def sync_servicer(req: Any, context: Any) -> str:
        return logs.request_id()

    wrapped_async: Any = checked_handler(grpc.unary_unary_rpc_method_handler(async_servicer, ranking_pb2.RankRequest.FromString), "/m/Async")
    wrapped_sync: Any = checked_handler(grpc.unary_unary_rpc_method_handler(sync_servicer, ranking_pb2.RankRequest.FromString), "/m/Sync")

    async def body() -> str:
        result: str = await wrapped_async.unary_unary(request, FakeContext())
        return result

    assert asyncio.run(body()) == "rpc-7"
    # A sync servicer runs on a reused pool thread: the id is bound for the call, then reset.
    assert logs.request_id() == "-"
    assert wrapped_sync.unary_unary(request, FakeContext()) == "rpc-7"
    assert logs.request_id() == "-"


def test_registered_secrets_are_masked_in_message_args_traceback_and_request_id(capture: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = capture
    logs.register_secret(SECRET, TENANT_KEY, "short")
    assert {SECRET, TENANT_KEY} <= logs.secrets() and "short" not in logs.secrets()
    logger.warning("token %s rejected", SECRET)
    logger.warning(f"key {TENANT_KEY} inline")
    try:
        raise ValueError(f"bad key {TENANT_KEY}")
    except ValueError:
        logger.exception("auth failed")
    logger.info("with stack", stack_info=True, extra={"request_id": f"client-sent-{SECRET}"})
    logger.info("a short value stays: short")
    text = stream.getvalue()
    assert SECRET not in text and TENANT_KEY not in text
    assert "token *** rejected" in text and "key *** inline" in text
    assert "ValueError: bad key ***" in text  # the traceback is there, masked
    assert "[client-sent-***] with stack" in text
    assert "a short value stays: short" in text


def test_secrets_from_environ_takes_the_admin_token_and_key_variables_only() -> None:
    env = {
        "RECSERVE_ADMIN_TOKEN": SECRET,
        "ACME_API_KEY": TENANT_KEY,
        "GLOBEX_KEY": "globex-key-123456",
        "SERVICE_PASSWORD": "hunter2hunter2",
        "HOME": "/home/someone-long",
        "MONKEY_BUSINESS": "bananas-everywhere",
        "EMPTY_TOKEN": "",
    }
    assert logs.secrets_from_environ(env) == {SECRET, TENANT_KEY, "globex-key-123456", "hunter2hunter2"}


def test_configure_installs_one_handler_with_the_format_and_registers_environment_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    saved_level = root.level
    own = "test_logs_own"  # stands in for recserve's packages: no global logger changes
    monkeypatch.setattr(root, "handlers", [])  # as in a fresh server process (restored after)
    stream = io.StringIO()
    key = "configure-test-key-77aa"
    try:
        handler = logs.configure(logging.WARNING, own_loggers=(own,), stream=stream, environ={"BETA_API_KEY": key})
        again = logs.configure(logging.WARNING, own_loggers=(own,), stream=stream, environ={})
        assert handler is not None and again is not None and root.handlers == [again]  # idempotent: ours replaced
        logs.set_request_id("cfg-1")
        logging.getLogger(own + ".child").info("key is %s", key)
        logging.getLogger("thirdparty.chatter").info("hidden at INFO")
        assert stream.getvalue().splitlines()[-1].endswith(f"{own}.child INFO [cfg-1] key is ***")
        assert "hidden" not in stream.getvalue()
        # A root that already has someone else's handler (pytest, an embedding app) is left alone.
        monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
        assert logs.configure(logging.WARNING, own_loggers=(own,), environ={}) is None and len(root.handlers) == 1
    finally:
        logs.set_request_id("")
        root.setLevel(saved_level)  # setLevel, not an attribute restore: it clears the loggers' level caches
        logging.getLogger(own).setLevel(logging.NOTSET)


def test_outgoing_headers_inherit_the_bound_request_id_so_every_hop_logs_one_id() -> None:
    from recserve.rpc.deadline import make_header

    async def body() -> tuple[str, str, str]:
        logs.set_request_id("hop-1")
        inherited = make_header(timeout_s=1.0).request_id  # e.g. the cascade calling a ranker for a Recommend
        explicit = make_header(request_id="own-id").request_id
        logs.set_request_id("")
        return inherited, explicit, make_header().request_id

    inherited, explicit, outside = asyncio.run(body())
    assert (inherited, explicit) == ("hop-1", "own-id")
    assert outside not in ("", "-", "hop-1") and len(outside) == 32  # outside any request: a fresh uuid
