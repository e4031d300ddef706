"""Process logging: every line carries the request id it was logged for, and no secret
reaches a log.

Every ``recserve`` command installs this (:func:`configure`, from
:func:`recserve.cli.main.main`), so the shard, ranker, cascade and gateway processes all
log as::

    2026-12-01 12:00:00,123 cascade.service INFO [4f1c…e2] added items 100..119 to index ix-7

* **Request ids.** :data:`REQUEST_ID` is a context variable; the gRPC server wrappers
  (:mod:`recserve.rpc.server`) bind it from ``RequestHeader.request_id`` of each request
  (:func:`bind_request`) and the gateway binds it per HTTP request
  (:func:`set_request_id`). grpc aio runs each RPC in its own task and asyncio copies
  the context into tasks that task creates, so every line logged on a request's behalf
  carries its id, and lines logged outside any request (start-up, a batch serving many
  requests) carry ``-``. Calls made while serving a request send its id on
  (:func:`inherited_request_id`, read by :func:`recserve.rpc.deadline.make_header`), so
  one id joins the lines of every hop.
* **Redaction.** :class:`LogContextFilter` masks every registered secret in a record's
  message, arguments, traceback and stack text before any handler formats it: the values
  of environment variables that hold secrets (:func:`secrets_from_environ`: the admin
  token ``RECSERVE_ADMIN_TOKEN`` and any ``*_TOKEN`` / ``*_KEY`` / ``*_SECRET`` /
  ``*PASSWORD*`` variable, which is how tenants' API keys reach the gateway), plus any
  value a component registers (:func:`register_secret`: the gateway each tenant's key,
  whatever its variable is called; a shard its ``--admin-token``). It is a safety net: code
  should not log secrets in the first place, but a key echoed in an error message must
  still not reach a log file.

Core module: the standard library only (the CLI imports it before anything heavy).
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Iterable, Mapping
from typing import IO, Any

__all__ = [
    "FORMAT",
    "MASK",
    "REQUEST_ID",
    "LogContextFilter",
    "bind_request",
    "configure",
    "inherited_request_id",
    "register_secret",
    "request_id",
    "secrets",
    "secrets_in",
    "secrets_from_environ",
    "set_request_id",
]

FORMAT = "%(asctime)s %(name)s %(levelname)s [%(request_id)s] %(message)s"
NO_REQUEST = "-"
MASK = "***"
# Shorter values are not treated as secrets: masking "1" or "on" would shred every line,
# and a value that short protects nothing anyway.
MIN_SECRET_CHARS = 8
ADMIN_TOKEN_ENV = "RECSERVE_ADMIN_TOKEN"
# Environment variable names whose values are secrets (tenants' api_key_env names
# included, by convention: ACME_API_KEY, RECSERVE_TENANT_ACME_KEY, ...).
SECRET_ENV_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|(^|_)API_?KEY|_KEY)($|_)", re.IGNORECASE)

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("recserve_request_id", default=NO_REQUEST)

_secrets: set[str] = set()
_pattern: re.Pattern[str] | None = None
_lock = threading.Lock()


# ---- request ids ------------------------------------------------------------------


def request_id() -> str:
    """The request id bound in the current context (``"-"``: none)."""
    return REQUEST_ID.get()


def inherited_request_id() -> str:
    """The bound request id, or ``""`` outside any request: what an outgoing call made
    on a request's behalf puts in its header (:func:`recserve.rpc.deadline.make_header`),
    so the next process's log lines carry the same id."""
    value = REQUEST_ID.get()
    return "" if value == NO_REQUEST else value


def set_request_id(value: str) -> contextvars.Token[str]:
    """Bind ``value`` (``""``: none) as the current context's request id; returns the
    token for :meth:`contextvars.ContextVar.reset` (a thread-pool worker resets it when
    its request ends, so the next request on that thread does not inherit it)."""
    return REQUEST_ID.set(value or NO_REQUEST)


def bind_request(message: Any) -> contextvars.Token[str]:
    """Bind the request id of a parsed request message's ``RequestHeader header`` field
    (every recserve RPC has one); ``"-"`` for a message without one (health,
    reflection), so a reused thread never shows the previous request's id. Called once
    per RPC by the server wrappers (:mod:`recserve.rpc.server`)."""
    value = getattr(getattr(message, "header", None), "request_id", None)
    return set_request_id(value if isinstance(value, str) else "")


# ---- secrets ----------------------------------------------------------------------


def secrets_from_environ(environ: Mapping[str, str] | None = None) -> set[str]:
    """The values of ``environ``'s secret-holding variables (see the module docstring)."""
    env = os.environ if environ is None else environ
    return {value for name, value in env.items() if (name == ADMIN_TOKEN_ENV or SECRET_ENV_NAME.search(name)) and len(value) >= MIN_SECRET_CHARS}


def register_secret(*values: str) -> None:
    """Mask ``values`` in every log record from now on (values shorter than
    :data:`MIN_SECRET_CHARS` are ignored). Thread-safe; cheap to call repeatedly."""
    global _pattern
    fresh = {v for v in values if len(v) >= MIN_SECRET_CHARS} - _secrets
    if not fresh:
        return
    with _lock:
        _secrets.update(fresh)
        # Longest first, so a secret containing another is masked whole.
        _pattern = re.compile("|".join(re.escape(s) for s in sorted(_secrets, key=len, reverse=True)))


def secrets() -> frozenset[str]:
    """Every registered secret (for tests)."""
    return frozenset(_secrets)


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by :data:`MASK`."""
    pattern = _pattern
    return text if pattern is None else pattern.sub(MASK, text)


def secrets_in(logs: Mapping[str, str], secrets: Mapping[str, str]) -> list[tuple[str, str]]:
    """The no-secrets log check, for any suite (tests, ``recserve bench faults``):
    ``(log, label)`` for every secret value (``secrets``: label -> value, e.g. API keys
    and admin tokens) found in any log's text (``logs``: name -> text). ``[]`` passes."""
    return [(name, label) for name, text in logs.items() for label, value in secrets.items() if value and value in text]


# ---- the filter and the handler ---------------------------------------------------


class LogContextFilter(logging.Filter):
    """Adds ``record.request_id`` (the bound :data:`REQUEST_ID`, unless the caller set
    one with ``extra=``) and masks registered secrets in the record. Install it on a
    handler (a logger's filter sees only records logged on that very logger), so it
    covers every record the handler writes, third-party libraries' included."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(getattr(record, "request_id", None), str):
            record.request_id = REQUEST_ID.get()
        pattern = _pattern
        if pattern is None:
            return True
        try:
            message = record.getMessage()  # renders msg % args once, as the formatter would
        except Exception:  # noqa: BLE001  (a bad format: logging's error report would print msg and args raw)
            message = f"{record.msg} {record.args!r}"
            record.msg, record.args = message, None
        masked = pattern.sub(MASK, message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            # Rendered here so the secret is masked in the text every formatter reuses.
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if record.exc_text:
            record.exc_text = pattern.sub(MASK, record.exc_text)
        if record.stack_info:
            record.stack_info = pattern.sub(MASK, record.stack_info)
        request = getattr(record, "request_id", None)
        if isinstance(request, str):  # a client-sent id is untrusted text too
            record.request_id = pattern.sub(MASK, request)
        return True


def configure(
    level: int = logging.WARNING,
    *,
    own_level: int = logging.INFO,
    own_loggers: Iterable[str] = ("recserve", "embedding_server", "ranker", "cascade", "generation"),
    stream: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> logging.Handler | None:
    """Install the process's log handler on the root logger: :data:`FORMAT` (with the
    request id), a :class:`LogContextFilter`, ``level`` for the root (third-party
    libraries such as fbgemm and torch chatter at INFO) and ``own_level`` for recserve's
    own packages. Secrets in ``environ`` (default ``os.environ``) are registered.
    Idempotent: a second call replaces the handler this module installed. Like
    :func:`logging.basicConfig`, it leaves a root logger that already has someone else's
    handlers alone (a command run in-process by pytest keeps pytest's capture), setting
    only ``own_level``. Returns the handler installed, or None."""
    register_secret(*secrets_from_environ(environ))
    for name in own_loggers:
        logging.getLogger(name).setLevel(own_level)
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "_recserve", False)]
    if len(ours) < len(root.handlers):
        return None
    for old in ours:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(LogContextFilter())
    handler._recserve = True  # type: ignore[attr-defined]  # marks ours, for idempotence
    root.addHandler(handler)
    root.setLevel(level)
    return handler
