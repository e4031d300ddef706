"""The shard fault hook's ``disk_full`` switch that fault 6 of ``recserve bench faults``
uses: parsed from the Set RPC's JSON, only in effect with the hook enabled, cleared by an
empty fault."""

from __future__ import annotations

from embedding_server.fault import Fault, FaultInjector


def test_disk_full_makes_the_store_write_fail_only_with_the_hook_on() -> None:
    on = FaultInjector(enabled=True)
    assert on.store_write_error() is None
    on.set(Fault.from_json(b'{"disk_full": true}'))
    message = on.store_write_error()
    assert message is not None and "No space left on device" in message
    on.set(Fault.from_json(b"{}"))
    assert on.store_write_error() is None
    off = FaultInjector(enabled=False)
    off.set(Fault(disk_full=True))
    assert off.store_write_error() is None
