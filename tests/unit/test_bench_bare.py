"""The bench's bare ceiling contender: its layout, its input checks, its start-up error,
and the oracle check the bench applies to what it served (the timed run itself is in
``tests/integration/test_lookup_cluster.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recserve.bench.bare import BareCeiling, _BareClient, local_rows
from recserve.bench.lookup import _bare_check
from recserve.bench.lookup_modes import Stream


def test_local_rows_hold_every_sth_row_contiguously() -> None:
    w = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    for shard in range(2):
        local = local_rows(w, shard, 2)
        assert local.flags.c_contiguous
        ids = np.arange(shard, 7, 2)
        np.testing.assert_array_equal(local[ids // 2], w[ids])  # the server's np.take(rows, ids // S)


@pytest.mark.parametrize("lengths", [[4, 0, 4], [], [[2, 2]]])
def test_bare_client_rejects_bags_reduceat_cannot_pool(lengths: list[int]) -> None:
    with pytest.raises(ValueError, match="bag lengths must be positive"):
        _BareClient(["x.sock"], np.asarray(lengths, dtype=np.int64), dim=4)


def test_bare_client_rejects_a_request_of_the_wrong_size() -> None:
    client = _BareClient(["x.sock"], np.array([2, 2]), dim=4)
    with pytest.raises(ValueError, match="a request has 4 ids, got shape \\[3\\]"):
        client.lookup(np.arange(3, dtype=np.int64))


def test_a_bare_shard_that_cannot_start_is_named(tmp_path: Path) -> None:
    bare = BareCeiling(tmp_path / "missing.npy", num_shards=1, workdir=tmp_path)
    with pytest.raises(RuntimeError, match="bare shard 0 did not start"):
        bare.start()
    assert bare.pids() == []  # nothing left running


def test_bare_check_compares_against_the_bags_own_sums() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((50, 4), dtype=np.float32)
    stream = Stream(ids=rng.integers(0, 50, size=(3, 6)), lengths=np.array([2, 4]))
    good = {i: np.stack([w[stream.ids[i, :2]].sum(0), w[stream.ids[i, 2:]].sum(0)]) for i in range(3)}
    assert _bare_check(w, stream, good) is True
    assert _bare_check(w, stream, {}) is None
    bad = dict(good)
    bad[1] = good[1] + np.array([0, 0, 0, 1e-2], dtype=np.float32)
    assert _bare_check(w, stream, bad) is False
    assert _bare_check(w, stream, {0: good[0][:1]}) is False  # a bag short


async def _call(sock: str, payload: bytes) -> bytes:
    import grpc

    from recserve.bench.bare import METHOD

    async with grpc.aio.insecure_channel("unix:" + sock) as channel:
        return await channel.unary_unary(METHOD, None, None)(payload, timeout=10)  # type: ignore[no-any-return]


def test_a_bare_shard_answers_its_rows_and_names_bad_input(tmp_path: Path) -> None:
    """One real bare shard process: its own rows come back exactly; a torn id, an id out
    of range and an id another shard holds each get INVALID_ARGUMENT naming it, and the
    shard keeps serving."""
    import asyncio

    import grpc

    w = np.random.default_rng(1).standard_normal((10, 4), dtype=np.float32)
    np.save(tmp_path / "w.npy", w)
    bare = BareCeiling(tmp_path / "w.npy", num_shards=2, workdir=tmp_path)
    bare.start()
    try:
        sock = bare.sockets[1]
        ids = np.array([9, 1, 5], dtype=np.int64)
        got = np.frombuffer(asyncio.run(_call(sock, ids.tobytes())), dtype=np.float32).reshape(3, 4)
        np.testing.assert_array_equal(got, w[ids])
        for payload, message in [(b"\x01" * 9, "9 bytes is not a whole number"), (np.array([1, 11]).tobytes(), "id 11: not a row of bare shard 1"),
                                 (np.array([-3]).tobytes(), "id -3"), (np.array([3, 4]).tobytes(), "id 4: not a row")]:  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as err:
                asyncio.run(_call(sock, payload))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (err.value.details() or "")
        assert np.frombuffer(asyncio.run(_call(sock, np.array([7]).tobytes())), dtype=np.float32).tolist() == w[7].tolist()
    finally:
        bare.stop()


def test_a_bare_shard_silent_past_its_start_timeout_is_named(tmp_path: Path) -> None:
    """A shard that neither says it listens nor exits is given up on at the timeout,
    not waited for forever."""
    import subprocess
    import sys
    import time

    bare = BareCeiling(tmp_path / "w.npy", num_shards=1, workdir=tmp_path, start_timeout_s=0.5)
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    bare._procs = [silent]  # what start() waits on, without a real shard's start-up
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="bare shard 0 did not start"):
        bare._await_ready()
    assert time.monotonic() - t0 < 5 and silent.poll() is not None  # killed, not left behind
