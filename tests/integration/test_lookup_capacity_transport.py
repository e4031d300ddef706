"""Both gRPC I/O paths work: shards launched with the transport settings of
``LookupConfig`` (``GRPC_EXPERIMENTS`` off the event engine, glibc malloc thresholds,
reached over their Unix domain sockets) and with gRPC's defaults over TCP answer the
same lookups exactly, and the launcher really hands the settings to each child."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from recserve.cluster.shards import ShardCluster
from recserve.config.spec import POLL_IO_EXPERIMENTS, LookupConfig, ShardServerConfig
from recserve.lookup.client import LookupClient
from recserve.lookup.transport import transport_env
from tests.unit.test_lookup_client import item_kjt
from tests.unit.test_lookup_fakes import make_config, make_plan, make_weights

pytestmark = pytest.mark.integration

POLL_IO = POLL_IO_EXPERIMENTS


def child_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


@pytest.mark.parametrize("experiments, unix", [("", False), (POLL_IO, True)], ids=["grpc-default-tcp", "poll-io-unix"])
def test_lookups_are_exact_on_either_grpc_io_path(tmp_path: Path, experiments: str, unix: bool) -> None:
    plan, _ = make_plan(num_shards=2)
    plan.save(tmp_path / "plan.json")
    weights = make_weights()
    np.savez(tmp_path / "weights.npz", **weights)  # type: ignore[arg-type]
    lookup = LookupConfig(grpc_experiments=experiments, shard_malloc_mmap_threshold_bytes=(4 << 20) if experiments else 0, http2_max_frame_bytes=1 << 20)
    env = transport_env(lookup)
    ids = np.arange(0, 2000, 7)
    with ShardCluster(tmp_path / "plan.json", tmp_path / "data", load_from=tmp_path / "weights.npz", server=ShardServerConfig(threads=1), env=env, unix_sockets=unix) as cluster:
        addresses = cluster.client_addresses
        assert all(a.startswith("unix:") for a in addresses) == unix and (unix or addresses == cluster.addresses)
        for k in range(2):
            got = child_env(cluster.pid(k))
            assert got.get("GRPC_EXPERIMENTS") == (experiments or None)
            assert got.get("MALLOC_MMAP_THRESHOLD_") == (str(4 << 20) if experiments else None)

        async def body() -> np.ndarray:
            client = LookupClient.connect(make_config(lookup=lookup), plan, addresses)
            await client.start()
            try:
                result = await client.lookup(item_kjt(ids), pooled=False, timeout_s=10.0)
            finally:
                await client.aclose()
            assert not result.degraded
            return result.rows["item_id"].numpy()

        assert np.array_equal(asyncio.run(body()), weights["item"][ids])
