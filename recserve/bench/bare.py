"""The bare ceiling: the lookup design with nothing but its physics, as a bench contender.

Issue 9 set its goals from a bare prototype: shard processes answering raw bytes over
grpc.aio, a numpy client batching every waiting caller into one window. Its rows/s on
this shared box moves 2x with the box's phase, and so does Redis's, so the prototype's
figure from another hour says little about this run's. ``recserve bench lookup``
therefore measures the prototype's design *in the same rounds* as the client and Redis
(``rows_per_s.bare_ceiling``, ``bare_vs_redis_per_request_c64``, ``client_vs_bare_c64``):
what a lookup path costs here with no validation, scheduler, deadlines, hedging, near
cache, tiers or protobuf. It is a ceiling, not a competitor: it holds every row in DRAM
(half the table per shard); a bad id still gets INVALID_ARGUMENT naming it.

* **Shards** (:func:`serve`, ``python -m recserve.bench.bare``): one process each, row
  ``i`` on shard ``i % S`` at local row ``i // S``; one generic unary method that takes
  int64 ids as raw bytes and answers their fp32 rows as raw bytes (one ``np.take``), on a
  Unix socket, with the launcher's transport environment (``transport_env``).
* **Client** (:class:`BareCeiling`): callers append their ids and a future; one window
  runs at a time and takes every caller waiting when it starts (closed at dispatch, no
  timer); per window one ``np.unique``, one RPC per shard in parallel, one scatter per
  reply, one ``np.add.reduceat`` over every caller's bags, one split.

Example::

    bare = BareCeiling(weights_path, num_shards=2, workdir=wd, env=transport_env(cfg))
    bare.start()
    async with bare.client(lengths) as client:
        pooled = await client.lookup(ids)          # fp32 [B, D]
    bare.stop()
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

METHOD = "/recserve.bench.Bare/Get"
_READY = b"ready\n"


def local_rows(weights: np.ndarray, shard: int, num_shards: int) -> np.ndarray:
    """fp32 [ceil((R - shard) / S), D]: the rows shard ``shard`` of ``num_shards`` holds
    (row ``i`` at local row ``i // S``), contiguous."""
    return np.ascontiguousarray(weights[shard::num_shards])


def serve(weights_path: str, shard: int, num_shards: int, socket_path: str) -> None:
    """Run one bare shard until killed: ids int64 bytes in, their fp32 rows out."""
    import grpc

    weights = np.load(weights_path, mmap_mode="r")
    rows = local_rows(weights, shard, num_shards)
    total = int(weights.shape[0])

    async def get(request: bytes, context: Any) -> bytes:
        # Bad input gets INVALID_ARGUMENT naming it, as from every server here, at the
        # cost of one remainder and two reductions: a ceiling that answered garbage (or
        # UNKNOWN) for a bad id would not be the design's.
        if len(request) % 8:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ids: {len(request)} bytes is not a whole number of int64 ids")
        ids = np.frombuffer(request, dtype=np.int64)
        if ids.size and (int(ids.view(np.uint64).max()) >= total or bool((ids % num_shards != shard).any())):
            bad = ids[(ids < 0) | (ids >= total) | (ids % num_shards != shard)][0]
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"id {int(bad)}: not a row of bare shard {shard} of {num_shards} (rows i % {num_shards} == {shard}, i < {total})")
        return np.take(rows, ids // num_shards, axis=0).tobytes()

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)])
        service, method = METHOD.strip("/").split("/")
        handler = grpc.method_handlers_generic_handler(service, {method: grpc.unary_unary_rpc_method_handler(get)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port("unix:" + socket_path)
        await server.start()
        sys.stdout.buffer.write(_READY)
        sys.stdout.flush()
        await server.wait_for_termination()

    asyncio.run(main())


class BareCeiling:
    """``num_shards`` bare shard processes over the table at ``weights_path`` (an .npy of
    fp32 [R, D]), and the bare client over them. ``env``: extra environment for the
    shard processes (the lookup path's transport settings)."""

    def __init__(self, weights_path: str | Path, *, num_shards: int, workdir: str | Path, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 60.0) -> None:  # fmt: skip
        self.weights_path = str(weights_path)
        self.num_shards = num_shards
        self.sockets = [str(Path(workdir) / f"bare-{k}.sock") for k in range(num_shards)]
        self.env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        """Start every shard and wait until each says it listens (RuntimeError if one
        exits or stays silent for ``start_timeout_s``)."""
        env = {**os.environ, **self.env}
        for k, sock in enumerate(self.sockets):
            cmd = [sys.executable, "-m", "recserve.bench.bare", "--weights", self.weights_path, "--shard", str(k), "--num-shards", str(self.num_shards), "--socket", sock]
            self._procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env))
        self._await_ready()

    def _await_ready(self) -> None:
        """Read each started shard's ready line within ``start_timeout_s`` in all; stop
        every shard and raise RuntimeError naming the first that is not ready."""
        deadline = time.monotonic() + self.start_timeout_s
        for k, proc in enumerate(self._procs):
            assert proc.stdout is not None
            # Wait for the line, the process's exit (EOF) or the deadline, whichever is first.
            ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0.0))
            line = proc.stdout.readline() if ready else b""
            if line != _READY:
                self.stop()
                raise RuntimeError(f"bare shard {k} did not start (exit code {proc.poll()}, said {line!r})")

    def stop(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()
        self._procs = []

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def client(self, lengths: np.ndarray) -> "_BareClient":
        """The bare client over these shards (``async with``) for requests of the bags
        ``lengths`` (int64 [B], each > 0)."""
        dim = int(np.load(self.weights_path, mmap_mode="r").shape[1])
        return _BareClient(self.sockets, lengths, dim)


class _BareClient:
    """The bare client: ``await lookup(ids)`` -> pooled [B, D] for a
    request of K ids in the bags ``lengths`` (int64 [B], each > 0: ``np.add.reduceat``
    reads an empty bag as its next row)."""

    def __init__(self, sockets: Sequence[str], lengths: np.ndarray, dim: int) -> None:
        self.sockets = list(sockets)
        self.num_shards = len(self.sockets)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or self.lengths.size == 0 or int(self.lengths.min()) <= 0:
            raise ValueError(f"bare client: bag lengths must be positive, got {self.lengths.tolist()}")
        self.k = int(self.lengths.sum())
        self.dim = dim
        self._bag_starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)
        self._pending: list[tuple[np.ndarray, asyncio.Future[np.ndarray]]] = []
        self._wake = asyncio.Event()

    async def __aenter__(self) -> "_BareClient":
        import grpc

        opts = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
        self._channels = [grpc.aio.insecure_channel("unix:" + s, options=opts) for s in self.sockets]
        self._calls = [ch.unary_unary(METHOD, None, None) for ch in self._channels]  # raw bytes both ways
        self._runner = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._runner.cancel()
        try:
            await self._runner
        except asyncio.CancelledError:
            pass
        for ch in self._channels:
            await ch.close(None)

    def lookup(self, ids: np.ndarray) -> "asyncio.Future[np.ndarray]":
        """``ids``: int64 [K], the request's bags back to back."""
        if ids.shape != (self.k,):
            raise ValueError(f"bare client: a request has {self.k} ids, got shape {list(ids.shape)}")
        fut: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._pending.append((ids, fut))
        self._wake.set()
        return fut

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            batch, self._pending = self._pending, []
            try:
                pooled = await self._window([ids for ids, _ in batch])
            except Exception as e:  # noqa: BLE001  (a failed window fails its callers)
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), result in zip(batch, pooled):
                if not fut.done():
                    fut.set_result(result)

    async def _window(self, per_caller: list[np.ndarray]) -> list[np.ndarray]:
        """Pooled [B, D] per caller: dedup, one RPC per shard, scatter, one reduceat."""
        s = self.num_shards
        ids = np.concatenate(per_caller)
        uniq, inverse = np.unique(ids, return_inverse=True)
        owner = uniq % s
        masks = [owner == k for k in range(s)]
        replies = await asyncio.gather(*(self._calls[k](uniq[masks[k]].tobytes()) for k in range(s)))
        dim = self.dim
        rows = np.empty((uniq.shape[0], dim), dtype=np.float32)
        for k in range(s):
            rows[masks[k]] = np.frombuffer(replies[k], dtype=np.float32).reshape(-1, dim)
        gathered = np.take(rows, inverse, axis=0)
        n = len(per_caller)
        bag_starts = (np.arange(n, dtype=np.int64)[:, None] * self.k + self._bag_starts[None, :]).ravel()
        pooled = np.add.reduceat(gathered, bag_starts, axis=0)
        return list(pooled.reshape(n, self.lengths.shape[0], dim))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one bare shard of `recserve bench lookup`'s ceiling contender")
    p.add_argument("--weights", required=True)
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--num-shards", type=int, required=True)
    p.add_argument("--socket", required=True)
    a = p.parse_args(argv)
    serve(a.weights, a.shard, a.num_shards, a.socket)


if __name__ == "__main__":
    main()
