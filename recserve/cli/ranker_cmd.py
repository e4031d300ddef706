"""``recserve ranker``: run the Ranking service.

- ``recserve ranker serve --models MODELS --config SPEC [--shards HOST:PORT,...] [--port P]``
  serves Rank, EmbedUser and Admin for every model in ``ranker.models``, reading its
  embeddings from the shards (``--shards``, else the spec's ``shard_addresses``), which
  must serve the export's tables at its ``model_version``; Prometheus ``/metrics`` on
  ``--metrics-port`` (default: the spec's ``ranker.metrics_port``; the flag wins).
- ``--with-generation`` (or ``[generation] co_locate = true``) also serves
  ``Generation.Generate`` from the same process, server and device: one
  :class:`~recserve.scheduling.device.DeviceExecutor` runs the ranker's forwards
  (critical lane: first) and the decode steps (best-effort lane: at least
  ``generation.min_device_share`` of device time while both have work);
  ``--generation-model DIR`` names the LM checkpoint (default: the spec's
  ``generation.checkpoint``, else seeded random weights).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from concurrent.futures import Executor

    import grpc

    from generation.service import GenerationCore
    from recserve.config.spec import ClusterConfig
    from recserve.rpc.serving import Slot


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("ranker", help="the Ranking service: batched Rank and EmbedUser over remote embeddings")
    sub = parser.add_subparsers(dest="ranker_command", metavar="SUBCOMMAND")
    serve = sub.add_parser("serve", help="run one ranker process")
    serve.add_argument("--models", type=Path, default=None, help="a `recserve train --out` directory (default: the spec's ranker.models_dir)")
    serve.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the embedded spec)")
    serve.add_argument("--shards", default="", help="comma-separated shard addresses (default: the spec's shard_addresses)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="listen port (0 = pick a free one; see --port-file)")
    serve.add_argument("--port-file", default="", help="write the bound port here (atomically) once listening")
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port (0 = a free one, -1 = none; default: the spec's ranker.metrics_port)")
    serve.add_argument("--metrics-port-file", default="", help="write the bound metrics port here (atomically) before listening for gRPC")
    serve.add_argument("--with-generation", action="store_true",
                       help="also serve Generation on this process's device, behind the priority bulkhead (= [generation] co_locate = true)")
    serve.add_argument("--generation-model", default="", help="the co-located LM checkpoint (default: the spec's generation.checkpoint, else random weights)")
    serve.add_argument("--insecure-admin", action="store_true",
                       help="serve admin operations without a token (only when the [admin] token_env variable is unset; never on a shared network)")
    serve.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from ranker.server import RankerProcessConfig, serve
    from recserve.config import load
    from recserve.errors import ConfigError

    cluster = load(args.config)
    shards = tuple(a for a in args.shards.split(",") if a) or cluster.shard_addresses
    if not shards:
        raise ConfigError("--shards = '' is invalid: give the shard addresses (HOST:PORT,...) or set shard_addresses in the spec")
    models = str(args.models) if args.models is not None else cluster.ranker.models_dir
    if not models:
        raise ConfigError("--models is missing: name a `recserve train --out` directory, or set ranker.models_dir in the spec")
    config = RankerProcessConfig(
        cluster=cluster, models_dir=models, shard_addresses=shards, host=args.host, port=args.port, port_file=args.port_file,
        admin_token=os.environ.get(cluster.admin.token_env, ""), insecure_admin=args.insecure_admin,
        metrics_port=cluster.ranker.metrics_port if args.metrics_port is None else args.metrics_port, metrics_port_file=args.metrics_port_file,
    )  # fmt: skip
    from recserve.logs import register_secret

    register_secret(config.admin_token)  # [admin] token_env may name any variable: masked in logs
    if not (args.with_generation or cluster.generation.co_locate):
        asyncio.run(serve(config))
        return 0
    from recserve.scheduling.bulkhead import BulkheadConfig, Lane
    from recserve.scheduling.device import DeviceExecutor

    device = DeviceExecutor(BulkheadConfig(min_device_share=cluster.generation.min_device_share))
    try:
        colocated = ColocatedGeneration(cluster, args.generation_model, device.lane(Lane.BEST_EFFORT))
        asyncio.run(serve(config, executor=device.lane(Lane.CRITICAL), colocated=colocated))
    finally:
        device.shutdown()  # both workloads have closed: what is queued has run
    return 0


class ColocatedGeneration:
    """The Generation service on a ranker's server and device (``ranker.server.Colocated``):
    composed here, since the ranker package never imports the generation one."""

    def __init__(self, cluster: ClusterConfig, checkpoint: str, executor: Executor) -> None:
        from generation.server import GENERATION_SERVICE
        from recserve.rpc.serving import Slot

        self.cluster = cluster
        self.checkpoint = checkpoint
        self.executor = executor
        self.services = (GENERATION_SERVICE,)
        self.slot: Slot[GenerationCore] = Slot("generation model")

    def register(self, server: grpc.aio.Server) -> None:
        from generation.server import GenerationServicer
        from recserve.v1 import generation_pb2_grpc

        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(self.slot), server)

    async def load(self) -> None:
        import asyncio

        from generation.service import GenerationCore, load_model

        gen = self.cluster.generation
        loaded = await asyncio.to_thread(load_model, gen, self.checkpoint)
        core = GenerationCore(gen, loaded, executor=self.executor)
        core.start()
        self.slot.value = core

    async def aclose(self) -> None:
        if self.slot.value is not None:
            await self.slot.value.aclose()
