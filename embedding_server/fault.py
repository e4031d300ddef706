"""Test-only fault hook: injected latency or errors on one shard (off by default).

Enabled by ``recserve shard serve --fault-hook`` or ``RECSERVE_FAULT_HOOK=1``. When
enabled, faults can be set two ways:

- **persistently**, through a tiny admin RPC ``/recserve.test.ShardFault/Set`` whose
  request and reply are JSON bytes (no proto needed)::

      set_fault("127.0.0.1:50051", delay_ms=80)                 # every Lookup/Upsert
      set_fault(addr, code="UNAVAILABLE", count=3)              # the next 3 RPCs fail
      set_fault(addr, delay_ms=50, methods=["Lookup"])          # Lookups only
      set_fault(addr, disk_full=True)                           # RocksDB writes fail (Upserts)
      set_fault(addr)                                           # clear

- **per RPC**, with metadata ``x-recserve-fault: delay_ms=20;code=UNAVAILABLE``.

Faults apply to the data RPCs (Lookup, Upsert); ShardInfo, GetPlan and health are never
delayed, so tests and benchmarks can always observe the shard. When the hook is off
the admin method is not registered (UNIMPLEMENTED) and the metadata is ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import grpc

from recserve.errors import InvalidArgument
from recserve.rpc.status import error_from_code

ENV_FLAG = "RECSERVE_FAULT_HOOK"
METADATA_KEY = "x-recserve-fault"
SERVICE = "recserve.test.ShardFault"
SET_METHOD = f"/{SERVICE}/Set"
FAULT_METHODS = ("Lookup", "Upsert")


def hook_enabled_by_env() -> bool:
    return os.environ.get(ENV_FLAG, "") not in ("", "0", "false", "False")


@dataclasses.dataclass(frozen=True)
class Fault:
    """``delay_ms`` before answering, then fail with ``code`` (a grpc.StatusCode name)
    if set; for ``methods`` (empty = Lookup and Upsert); for the next ``count`` RPCs
    (-1 = until cleared). ``disk_full``: the shard's RocksDB write raises the error a
    full disk gives (:meth:`FaultInjector.store_write_error`), so an Upsert goes through
    the real failure path of the store, not an RPC-level stand-in."""

    delay_ms: float = 0.0
    code: str = ""
    methods: tuple[str, ...] = ()
    count: int = -1
    disk_full: bool = False

    def __post_init__(self) -> None:
        if not (self.delay_ms >= 0.0):
            raise InvalidArgument(f"fault delay_ms = {self.delay_ms!r}; use >= 0")
        if self.code and (self.code not in grpc.StatusCode.__members__ or self.code == "OK"):
            raise InvalidArgument(f"fault code {self.code!r} is not an error grpc.StatusCode name (e.g. 'UNAVAILABLE')")
        unknown = sorted(set(self.methods) - set(FAULT_METHODS))
        if unknown:
            raise InvalidArgument(f"fault methods {unknown} are not faultable; use a subset of {list(FAULT_METHODS)}")

    @property
    def active(self) -> bool:
        return self.count != 0 and (self.delay_ms > 0 or bool(self.code))

    @classmethod
    def from_json(cls, data: bytes) -> Fault:
        try:
            raw = json.loads(data.decode() or "{}")
            return cls(
                delay_ms=float(raw.get("delay_ms", 0.0)),
                code=str(raw.get("code", "")),
                methods=tuple(raw.get("methods", ())),
                count=int(raw.get("count", -1)),
                disk_full=bool(raw.get("disk_full", False)),
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise InvalidArgument(f"fault request is not valid JSON of delay_ms/code/methods/count: {exc}") from exc

    @classmethod
    def from_metadata(cls, value: str) -> Fault:
        """Parse ``delay_ms=20;code=UNAVAILABLE``."""
        fields: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in value.split(";"))):
            key, _, val = part.partition("=")
            fields[key.strip()] = val.strip()
        return cls(delay_ms=float(fields.get("delay_ms", 0.0)), code=str(fields.get("code", "")), count=1)


class FaultInjector:
    """The server side: holds the persistent fault and applies faults before an RPC."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.fault = Fault()

    def set(self, fault: Fault) -> None:
        self.fault = fault

    def store_write_error(self) -> str | None:
        """The message of the I/O error the store's next write must raise (None: write)."""
        if self.enabled and self.fault.disk_full:
            return "IO error: No space left on device (injected by the test fault hook)"
        return None

    def _take(self, method: str, metadata: Any) -> Fault | None:
        for key, value in metadata:
            if key == METADATA_KEY:
                return Fault.from_metadata(str(value))
        fault = self.fault
        if not fault.active or (fault.methods and method not in fault.methods):
            return None
        if fault.count > 0:
            self.fault = dataclasses.replace(fault, count=fault.count - 1)
        return fault

    async def before(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """Sleep the injected delay, then raise the injected error (if any)."""
        if not self.enabled:
            return
        fault = self._take(method, context.invocation_metadata() or ())
        if fault is None:
            return
        if fault.delay_ms > 0:
            await asyncio.sleep(fault.delay_ms / 1000.0)
        if fault.code:
            raise error_from_code(grpc.StatusCode[fault.code], f"injected fault on {method}: {fault.code}")

    def handler(self) -> grpc.GenericRpcHandler:
        """The admin RPC ``/recserve.test.ShardFault/Set`` (JSON in, JSON out)."""

        async def set_fault(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                self.set(Fault.from_json(request))
            except InvalidArgument as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            reply = dataclasses.asdict(self.fault)
            if not self.fault.disk_full:
                del reply["disk_full"]  # the reply callers knew before disk_full existed
            return json.dumps(reply).encode()

        return grpc.method_handlers_generic_handler(SERVICE, {"Set": grpc.unary_unary_rpc_method_handler(set_fault)})


def _request(delay_ms: float, code: str, methods: Sequence[str], count: int, disk_full: bool = False) -> bytes:
    Fault(delay_ms=delay_ms, code=code, methods=tuple(methods), count=count, disk_full=disk_full)  # validate client-side too
    return json.dumps({"delay_ms": delay_ms, "code": code, "methods": list(methods), "count": count, "disk_full": disk_full}).encode()


def set_fault(address: str, *, delay_ms: float = 0.0, code: str = "", methods: Sequence[str] = (), count: int = -1, disk_full: bool = False,
              timeout_s: float = 5.0) -> dict[str, Any]:  # fmt: skip
    """Set (or clear, with no arguments) the persistent fault of the shard at
    ``address``. Returns the fault now in effect."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(SET_METHOD, request_serializer=None, response_deserializer=None)
        reply = call(_request(delay_ms, code, methods, count, disk_full), timeout=timeout_s)
    return json.loads(reply)  # type: ignore[no-any-return]
