"""Shard server process main: gRPC server, health, reflection, tier loading, shutdown.

Start-up order, so readiness is observable and honest:

1. bind and start the grpc.aio server (:func:`recserve.rpc.server.make_server`: raised
   message limits, malformed request bytes answered INVALID_ARGUMENT); health reports
   NOT_SERVING for "" and ``recserve.v1.EmbeddingShard``; the port is written to
   ``port_file`` (atomically) for launchers that asked for port 0;
2. (test hook) wait for ``load_gate_file``; optionally bulk-load ``load_from``
   (idempotent via the load manifest);
3. open RocksDB and build the DRAM tiers from it (on the executor);
4. health -> SERVING.

SIGTERM / SIGINT stop the server gracefully and close RocksDB; the process then leaves
without interpreter teardown (:func:`run_process`). Thread counts are set explicitly
(``threads``, default 1): several shards share two cores here.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from embedding_server.bulk_load import bulk_load, open_source, source_model_version, source_model_versions, table_model_versions
from embedding_server.config import ShardProcessConfig
from embedding_server.fault import FaultInjector, hook_enabled_by_env
from embedding_server.layout import TableLayout, layouts_from_plan
from embedding_server.quant import RowDType, set_threads
from embedding_server.service import INLINE_LOOKUP_IDS, EmbeddingShardService
from embedding_server.shard import ShardCore
from embedding_server.store import RowStore
from recserve.errors import Unavailable
from recserve.metrics.collectors import SHARD as SHARD_METRICS
from recserve.metrics.serve import start_and_record
from recserve.rpc.auth import AdminAuth
from recserve.rpc.health import DeepCheck
from recserve.rpc.server import add_health_and_reflection, make_server
from recserve.rpc.tensors import pack
from recserve.rpc.serving import write_port_file
from recserve.sharding.plan import ShardingPlan
from recserve.v1 import embedding_pb2, embedding_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingShard"].full_name
GATE_POLL_S = 0.02
GRACE_S = 2.0
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def thread_env(threads: int) -> dict[str, str]:
    """Environment that pins BLAS/OpenMP pools to ``threads`` (set before numpy loads:
    the launcher passes it to every shard subprocess)."""
    return {name: str(threads) for name in THREAD_ENV}


def data_paths(data_dir: str | Path) -> Path:
    """The RocksDB directory inside a shard's data directory."""
    return Path(data_dir) / "rocksdb"


def open_store(config: ShardProcessConfig, layouts: dict[str, TableLayout]) -> RowStore:
    return RowStore(
        data_paths(config.data_dir),
        {name: layout.dim for name, layout in layouts.items()},
        block_cache_bytes=config.server.block_cache_bytes,
        sync_writes=config.sync_writes,
        background_jobs=max(2, config.server.threads),
    )


def load_core(config: ShardProcessConfig, plan: ShardingPlan, layouts: dict[str, TableLayout]) -> ShardCore:
    """Open RocksDB, bulk-load ``load_from`` if not recorded yet, build the tiers."""
    store = open_store(config, layouts)
    try:
        if config.load_from:
            source, source_id = open_source(config.load_from, sorted(layouts))
            report = bulk_load(
                store, layouts, source, source_id=source_id, plan_version=plan.version, shard_id=config.shard_id,
                overwrite=config.overwrite_upserts, progress=False, model_version=source_model_version(config.load_from),
                model_versions=source_model_versions(config.load_from),
            )  # fmt: skip
            log.info("shard %d bulk load %s: skipped=%s rows=%s", config.shard_id, report.key, report.skipped, report.rows_written)
        core = ShardCore(
            config.shard_id,
            plan.version,
            store,
            layouts,
            tier_dtype=None if config.tier_dtype == "plan" else RowDType(config.tier_dtype),
            row_cache_bytes=config.server.row_cache_bytes,
            max_ids_per_rpc=config.server.max_ids_per_rpc,
            max_bags_per_rpc=config.server.max_bags_per_rpc,
            default_value=config.default_value,
        )
        # What ShardInfo / GetPlan report: the export each table was last loaded from.
        core.model_versions = table_model_versions(store)
        return core
    except BaseException:
        store.close()
        raise


PROBE_IDS_PER_TABLE = 2


def probe_request(plan: ShardingPlan, shard_id: int, layouts: dict[str, TableLayout]) -> embedding_pb2.LookupRequest:
    """The deep check's fixed lookup: the first ``PROBE_IDS_PER_TABLE`` ids this shard
    owns whole (its cold ids, else its hot ones) of every table it serves, so a table
    that is not loaded fails it."""
    request = embedding_pb2.LookupRequest()
    for name in sorted(layouts):
        owned = plan.assignment(shard_id, name)
        ids = owned.cold_ids if len(owned.cold_ids) else owned.hot_ids
        if len(ids):
            request.tables.add(table=name, ids=pack(ids[:PROBE_IDS_PER_TABLE].astype("int64")))
    return request


def freeze_gc() -> None:
    """Move every object alive now (plan, layouts, tier index, imported modules: the
    start-up heap) out of the garbage collector's generations (``gc.freeze``), after a
    collection of the loading's garbage. Per-RPC objects still age through the young
    generations as before; the start-up objects are no longer traversed by the full
    collections the RPCs' allocations trigger, nor counted towards their trigger.
    Called by :func:`run_process` once the tiers are loaded (not by :func:`serve`,
    which tests run inside their own process)."""
    gc.collect()
    gc.freeze()


async def serve(config: ShardProcessConfig, stop: asyncio.Event | None = None, *, on_ready: Callable[[], None] | None = None) -> None:
    """Run one shard until ``stop`` is set or SIGTERM / SIGINT arrives. ``on_ready``
    runs once the tiers are loaded, before health reports SERVING (the process main
    passes :func:`freeze_gc`)."""
    set_threads(config.server.threads)
    plan = ShardingPlan.load(config.plan_path)
    layouts = layouts_from_plan(plan, config.shard_id)
    fault_hook = config.fault_hook or hook_enabled_by_env()
    # /metrics first: its port file is written before the gRPC one, which launchers wait for.
    start_and_record(config.host, config.server.metrics_port, config.metrics_port_file)
    executor = ThreadPoolExecutor(max_workers=config.server.threads, thread_name_prefix=f"shard{config.shard_id}")
    faults = FaultInjector(enabled=fault_hook)
    service = EmbeddingShardService(
        shard_id=config.shard_id,
        plan_version=plan.version,
        plan_json=plan.to_json(),
        executor=executor,
        faults=faults,
        admin=AdminAuth(config.admin_token, token_env=config.admin_token_env, insecure=config.insecure_admin),
        inline_ids=INLINE_LOOKUP_IDS if config.server.threads == 1 else 0,
    )
    SHARD_METRICS.track(service, service.metrics_reading)  # recserve_shard_*, read at scrape time
    # make_server: malformed request bytes answer INVALID_ARGUMENT on every method.
    server = make_server(max_message_bytes=config.server.max_message_bytes)
    embedding_pb2_grpc.add_EmbeddingShardServicer_to_server(service, server)
    health = await add_health_and_reflection(server, [SERVICE_NAME])  # NOT_SERVING until loaded
    if fault_hook:
        server.add_generic_rpc_handlers((faults.handler(),))
        log.warning("shard %d: test fault hook ENABLED", config.shard_id)
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError:  # grpc's "Failed to bind": a clear error, not a traceback
        executor.shutdown(wait=False)
        raise Unavailable(f"shard {config.shard_id}: cannot listen on {config.host}:{config.port} (port in use or address not local); pick another --port") from None
    if config.unix_socket:
        # A second listener for clients on this host: a unix: channel skips the TCP
        # stack (about 10% on loopback lookups). The TCP port stays for everyone else.
        try:
            server.add_insecure_port(f"unix:{config.unix_socket}")
        except RuntimeError:
            executor.shutdown(wait=False)
            raise Unavailable(f"shard {config.shard_id}: cannot listen on unix:{config.unix_socket}; pick another --unix-socket path") from None
    await server.start()
    if config.port_file:
        write_port_file(config.port_file, port)
    log.info("shard %d listening on %s:%d (loading tiers)", config.shard_id, config.host, port)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    core: ShardCore | None = None
    deep: DeepCheck | None = None
    try:
        if config.load_gate_file:
            while not os.path.exists(config.load_gate_file) and not stop.is_set():
                await asyncio.sleep(GATE_POLL_S)
        if not stop.is_set():
            core = await loop.run_in_executor(executor, load_core, config, plan, layouts)
            service.set_ready(core)
            if on_ready is not None:
                on_ready()
            for name in ("", SERVICE_NAME):
                await health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("shard %d SERVING plan v%d tables %s", config.shard_id, plan.version, sorted(layouts))
            # Readiness from here on also needs the deep check: a fixed lookup on the executor.
            service.set_probe(probe_request(plan, config.shard_id, layouts))
            deep = DeepCheck(health, [SERVICE_NAME], service.deep_probe, on_change=service.set_not_serving, what=f"shard {config.shard_id}")
            await deep.check_once()  # the baseline rows
            deep.start()
        await stop.wait()
    finally:
        if deep is not None:
            await deep.aclose()
        # Watchers get NOT_SERVING and their streams end (recserve.rpc.server.Health), so
        # the grace below waits only for in-flight Lookup/Upsert RPCs, not for watchers.
        await health.enter_graceful_shutdown()
        await server.stop(GRACE_S)
        executor.shutdown(wait=True)
        if core is not None:
            core.close()
        SHARD_METRICS.retire(service)


def run_process(config: ShardProcessConfig, *, exit_process: Callable[[int], Any] = os._exit) -> None:
    """The shard process's main (``recserve shard serve``): serve until SIGTERM / SIGINT,
    then exit 0 at once, skipping Python's finalisation.

    When :func:`serve` returns, the gRPC server is stopped, the executor joined and
    RocksDB closed: nothing is left to clean up. What finalisation would still do is
    tear down the imported modules, and a shard with int8 tiers has imported torch and
    fbgemm for the quantiser: measured here, ≈0.45 s of module teardown and ≈0.1 s of
    their C++ static destructors — nearly all of such a shard's 0.6–0.75 s stop (a
    numpy-only shard stops in ≈0.06 s). So do by hand the two exit-time jobs whose
    loss would show: :func:`logging.shutdown` (the atexit hook that flushes and closes
    *every* handler, not only the root logger's) and flushing stdio, Python's and C's
    (``fflush(NULL)``: a C/C++ library's buffered printf to a redirected stdout would
    otherwise vanish); then ``os._exit(0)``: the int8 shard stops in ≈0.065 s (SIGTERM
    to reaped). The other atexit hooks of a shard process (torch's and pybind11's
    library deregistration, multiprocessing's child reaping: a shard has no children)
    have nothing to keep. An error from :func:`serve` propagates as before (the CLI
    prints it and exits non-zero the normal way). ``exit_process`` is injectable for tests.
    """
    asyncio.run(serve(config, on_ready=freeze_gc))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    _flush_c_stdio()
    exit_process(0)


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: flush every C stdio stream (``os._exit`` does not)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no libc symbols in this process: nothing buffered there
        pass
