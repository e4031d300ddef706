"""The generation process (``recserve generate serve``): ``Generation.Generate`` over
gRPC, health, reflection, ``/metrics``, start-up and shutdown.

Start-up, so readiness is honest (:func:`recserve.rpc.serving.serve_loaded`): listen
first (health NOT_SERVING for "" and ``recserve.v1.Generation``; calls get UNAVAILABLE
with a retry hint), load the model (a ``recserve train --lm`` checkpoint, or seeded
random weights: :func:`generation.service.load_model`), start the decode loop, then
SERVING. SIGTERM / SIGINT: health NOT_SERVING, a grace period for the streams in flight,
then the loop closes.

``Generate`` streams one :class:`~recserve.v1.generation_pb2.GenerateChunk` per token,
each stamped ``emitted_unix_us`` (wall clock, as it leaves the server). Bad input is
INVALID_ARGUMENT naming the field and the value, before any chunk; the server keeps
serving. The initial metadata carries the replica's load when the stream starts
(``recserve-active-tokens``: its live streams' budgets not yet generated, prompt +
``max_new_tokens`` - generated, summed;
``recserve-kv-occupancy``: the used fraction of its KV pool), for a router that reads it.

Readiness also needs the deep check (:func:`decode_baseline`, recserve/rpc/health.py): a
fixed greedy decode through the real engine must repeat its first tokens. A wedged
executor (no answer in time) or other tokens (a corrupted KV or prefix cache, changed
weights) turn it NOT_SERVING and ``Generate`` UNAVAILABLE; liveness stays SERVING.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc

from recserve.config.spec import ClusterConfig
from recserve.errors import RecserveError, ResourceExhausted
from recserve.metrics.serve import start_and_record
from recserve.rpc.deadline import context_from_header
from recserve.rpc.health import Baseline, DeepCheck, DeepCheckConfig
from recserve.rpc.server import add_health_and_reflection, make_server
from recserve.rpc.auth import TenantAuth
from recserve.rpc.serving import Slot, serve_loaded
from recserve.rpc.status import abort_with
from recserve.rpc.tensors import ids_from, pack_into
from recserve.v1 import generation_pb2, generation_pb2_grpc

from generation.service import FINISH_DEADLINE, GenerationChunk, GenerationCore, load_model

log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_MESSAGE_BYTES = 64 << 20
GRACE_S = 2.0
ACTIVE_TOKENS_KEY = "recserve-active-tokens"
KV_OCCUPANCY_KEY = "recserve-kv-occupancy"
PROBE_PROMPT = "recserve deep check: "  # the deep check's fixed prompt (byte tokens)
PROBE_TOKENS = 4  # greedy tokens it decodes
# Past DeepCheck's own timeout: a wedged executor fails the check by that timeout
# rather than ending the decode with a "deadline" chunk (which is no verdict).
PROBE_DEADLINE_S = 60.0


@dataclasses.dataclass(frozen=True)
class GenerationProcessConfig:
    """One generation process: the cluster spec (its ``[generation]``), the checkpoint
    ('' = the spec's ``generation.checkpoint``, else random weights), where to listen."""

    cluster: ClusterConfig
    checkpoint: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str = ""
    metrics_port: int = 0  # Prometheus /metrics on host (0 = a free port, -1 = none)
    metrics_port_file: str = ""  # the bound metrics port is written here before gRPC listens


def to_proto(chunk: GenerationChunk) -> generation_pb2.GenerateChunk:
    """One chunk on the wire: tokens as INT32 [n], stamped with the wall clock now."""
    out = generation_pb2.GenerateChunk(index=chunk.index, text=chunk.text, finished=chunk.finished, finish_reason=chunk.finish_reason)
    pack_into(out.tokens, chunk.tokens.astype("int32"))
    out.emitted_unix_us = time.time_ns() // 1000
    return out


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """``Generate`` on the core in ``slot`` (empty while loading: UNAVAILABLE)."""

    def __init__(self, slot: Slot[GenerationCore], tenants: TenantAuth | None = None) -> None:
        self.slot = slot
        self.tenants = tenants or TenantAuth(None)  # None: the header's tenant as it is

    async def Generate(  # type: ignore[override]
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        try:
            tenant = self.tenants.resolve(context.invocation_metadata(), request.header.tenant)  # first: who asks
            core = self.slot.get()
            ctx = context_from_header(request.header, context.time_remaining(), default_timeout_s=core.config.default_timeout_ms / 1e3)
            tokens = ids_from(request.prompt_tokens, "prompt_tokens")
            checked = core.request(prompt=request.prompt, prompt_tokens=tokens, max_new_tokens=request.max_new_tokens,
                                   temperature=request.temperature, seed=request.seed)  # fmt: skip
            active, occupancy = core.load()
            stream = core.submit(checked, deadline=ctx.deadline, tenant=tenant, priority=ctx.priority, request_id=ctx.request_id)
        except RecserveError as exc:
            await abort_with(context, exc)
            raise  # unreachable: abort raises
        try:
            await context.send_initial_metadata(((ACTIVE_TOKENS_KEY, str(active)), (KV_OCCUPANCY_KEY, f"{occupancy:.4f}")))
            async for chunk in stream:
                yield to_proto(chunk)
        except RecserveError as exc:  # mid-stream: a non-finite step, or the loop closing
            await abort_with(context, exc)
        finally:
            # The caller cancelled (grpc cancels this task) or the call ended: the
            # sequence is in no step after the one running.
            await stream.aclose()


def differing_tokens(expected: tuple[int, ...], got: tuple[int, ...]) -> str:
    return "" if got == expected else f"tokens {list(got)}, the baseline {list(expected)}"


def decode_baseline(core: GenerationCore) -> Baseline[tuple[int, ...]]:
    """The generation deep check: PROBE_PROMPT greedily decoded (PROBE_TOKENS tokens, or
    up to the stop token) through the real path (admission, the decode loop, the KV and
    prefix caches, the executor), whose tokens must repeat the first answer's. The
    weights never change while the process lives, so there is no epoch; a shed request
    or one that ran into its deadline is no verdict."""
    prompt = core.tokenizer.encode(PROBE_PROMPT, bos=False)[: max(1, core.context_limit - 1 - PROBE_TOKENS)]
    max_new = max(1, min(PROBE_TOKENS, core.context_limit - len(prompt), core.config.max_new_tokens_cap))

    async def answer() -> tuple[int, ...] | None:
        request = core.request(prompt_tokens=prompt, max_new_tokens=max_new, temperature=0.0)
        try:
            stream = core.submit(request, deadline=time.monotonic() + PROBE_DEADLINE_S, tenant="recserve-deep-check", priority="critical",
                                 request_id="recserve-deep-check")  # fmt: skip
        except ResourceExhausted:
            return None
        tokens: list[int] = []
        try:
            async for chunk in stream:
                if chunk.finish_reason == FINISH_DEADLINE:
                    return None
                tokens.extend(int(t) for t in chunk.tokens)
        finally:
            await stream.aclose()  # also when DeepCheck's timeout cancels us: the sequence stops
        return tuple(tokens)

    return Baseline(answer, differing_tokens, what="generation: the fixed greedy decode")


async def load_core(config: GenerationProcessConfig) -> GenerationCore:
    """Load the model (off the event loop: torch work) and build the core, not started."""
    gen = config.cluster.generation
    loaded = await asyncio.to_thread(load_model, gen, config.checkpoint)
    return GenerationCore(gen, loaded)


async def serve(config: GenerationProcessConfig, stop: asyncio.Event | None = None) -> None:
    """Run one generation replica until ``stop`` is set or SIGTERM / SIGINT arrives
    (listening, and NOT_SERVING, while it loads: :func:`serve_loaded`)."""
    # /metrics first: its port file is written before the gRPC one, which launchers wait for.
    start_and_record(config.host, config.metrics_port, config.metrics_port_file)
    server = make_server(max_message_bytes=MAX_MESSAGE_BYTES)
    slot: Slot[GenerationCore] = Slot("generation model")
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(slot, TenantAuth.from_cluster(config.cluster, os.environ)), server)
    health = await add_health_and_reflection(server, [GENERATION_SERVICE])
    deep: list[DeepCheck] = []
    deep_config = DeepCheckConfig.from_env(os.environ)  # before listening: a bad value fails the start

    def ready(core: GenerationCore, port: int) -> None:
        core.start()
        check = DeepCheck(health, [GENERATION_SERVICE], decode_baseline(core), config=deep_config,
                          on_change=slot.set_not_serving, what="generation")  # fmt: skip
        check.start()
        deep.append(check)
        log.info("generation SERVING on %s:%d: %s, model_version %s, context %d tokens, device %s", config.host, port, core.source,
                 core.model_version, core.context_limit, core.engine.device)  # fmt: skip

    try:
        await serve_loaded(server, health, [GENERATION_SERVICE], slot, lambda: load_core(config), what="generation", host=config.host,
                           port=config.port, port_file=config.port_file, on_ready=ready, stop=stop, grace_s=GRACE_S, tls=config.cluster.tls)  # fmt: skip
    finally:
        for check in deep:
            await check.aclose()


__all__ = ["GENERATION_SERVICE", "GenerationProcessConfig", "GenerationServicer", "decode_baseline", "load_core", "serve", "to_proto"]
