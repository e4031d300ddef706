"""A "feed service" in front of recserve: how a product integrates it (README, "Feed
integration").

``GET /feed?user_id=U[&size=N]`` builds one feed page: recserve's recommendations for the
user (:class:`recserve.client.RecClient`, under a tight deadline), with the editorial
team's pinned items at fixed slots. When recserve is unavailable, late or refuses the
call, the page is built from the service's own popularity list instead: a feed page
must render, recommendations or not. The answer says which source it used::

    {"user_id": 5, "source": "recserve", "fallback_reason": "",
     "items": [{"item_id": 7, "source": "editorial", "score": null},
               {"item_id": 4254, "source": "recserve", "score": 3.1}, ...],
     "request_id": "…", "recserve_ms": 41.2}

Run it against a running cluster (``recserve serve`` prints the Recommender address)::

    python examples/feed_service.py --recommender 127.0.0.1:7300 --port 8080
    curl 'http://127.0.0.1:8080/feed?user_id=5'

Options: ``--deadline-ms`` (recserve's share of the page's latency budget, default 150),
``--editorial`` / ``--popular`` (comma-separated item ids), ``--size`` (items per page),
``--port-file`` (write the bound port there: ``--port 0`` picks a free one).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
from aiohttp import web

if __package__ in (None, ""):  # run as a script from a checkout: make `recserve` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recserve.client import RecClient  # noqa: E402
from recserve.errors import RecserveError  # noqa: E402

log = logging.getLogger("feed_service")

DEFAULT_EDITORIAL = "7,42"
DEFAULT_POPULAR = ",".join(str(i) for i in range(1, 41))
EDITORIAL_EVERY = 5  # an editorial item at slots 0, 5, 10, ... while they last
MAX_SIZE = 100


@dataclasses.dataclass(frozen=True)
class FeedConfig:
    recommenders: tuple[str, ...]
    deadline_s: float  # recserve's budget within the page's
    editorial: np.ndarray  # int64 [E], pinned items in order
    popular: np.ndarray  # int64 [P], the fallback ranking, best first
    size: int  # items per page
    api_key: str = dataclasses.field(default="", repr=False)  # the tenant's key, sent as x-api-key metadata ("" = the key-less tenant)


@dataclasses.dataclass(frozen=True)
class Page:
    item_ids: np.ndarray  # int64 [n]
    sources: np.ndarray  # object [n]: "editorial" | "recserve" | "popular"
    scores: np.ndarray  # float64 [n]; NaN where the item has no recserve score


def merge(ranked: np.ndarray, scores: np.ndarray | None, editorial: np.ndarray, size: int, source: str) -> Page:
    """One page of ``size`` items: ``editorial`` (int64 [E]) at slots 0, EDITORIAL_EVERY,
    ... and the ``ranked`` items (int64 [R], best first, with ``scores`` float32 [R] or
    None) in the other slots, each item once. Fewer items than slots: a shorter page.

    Example: ``merge([9, 7, 8], None, [7], 3, "popular")`` -> items ``[7, 9, 8]``.
    """
    slots = np.arange(0, size, EDITORIAL_EVERY)[: editorial.shape[0]]
    pinned = editorial[: slots.shape[0]]
    keep = ~np.isin(ranked, pinned)  # an item pinned by the editors is not repeated below
    fill_ids = ranked[keep]
    fill_scores = np.full(fill_ids.shape[0], np.nan) if scores is None else scores[keep].astype(np.float64)
    free = np.setdiff1d(np.arange(size), slots, assume_unique=True)  # the other slots, in order
    n = min(free.shape[0], fill_ids.shape[0])
    positions = np.concatenate([slots, free[:n]])
    order = np.argsort(positions, kind="stable")
    item_ids = np.concatenate([pinned, fill_ids[:n]])[order]
    sources = np.concatenate([np.full(pinned.shape[0], "editorial", dtype=object), np.full(n, source, dtype=object)])[order]
    page_scores = np.concatenate([np.full(pinned.shape[0], np.nan), fill_scores[:n]])[order]
    return Page(item_ids, sources, page_scores)


async def feed(request: web.Request) -> web.Response:
    config: FeedConfig = request.app[CONFIG_KEY]
    client: RecClient = request.app[CLIENT_KEY]
    try:
        user_id = int(request.query["user_id"])
        size = int(request.query.get("size", config.size))
    except (KeyError, ValueError):
        return web.json_response({"error": "give ?user_id=<int>[&size=<int>]"}, status=400)
    if user_id < 0 or not 1 <= size <= MAX_SIZE:
        return web.json_response({"error": f"user_id = {user_id} must be >= 0 and size = {size} in 1..{MAX_SIZE}"}, status=400)
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    started = time.monotonic()
    source, reason = "recserve", ""
    try:
        # Ask for the slots the editors left; their items are excluded, so recserve fills
        # the page with items not already placed.
        pinned = min(config.editorial.shape[0], -(-size // EDITORIAL_EVERY))  # editorial slots on this page
        rec = await client.recommend(user_id, max(1, size - pinned), timeout_s=config.deadline_s, exclude_ids=config.editorial, request_id=request_id)
        ranked, scores = rec.item_ids, rec.scores
    except RecserveError as exc:  # unavailable, late (deadline_exceeded), overloaded, ...: the page still renders
        source, reason = "popular", exc.kind.value
        ranked, scores = config.popular, None
        log.info("feed %s: recserve %s (%s); serving the popularity list", request_id, reason, exc.message)
    recserve_ms = (time.monotonic() - started) * 1e3
    page = merge(ranked, scores, config.editorial, size, source)
    items = [
        {"item_id": item, "source": src, "score": None if np.isnan(score) else score}
        for item, src, score in zip(page.item_ids.tolist(), page.sources.tolist(), page.scores.tolist(), strict=True)
    ]  # the JSON body: one dict per item on the page (size <= 100)
    body = {"user_id": user_id, "source": source, "fallback_reason": reason, "items": items, "request_id": request_id, "recserve_ms": recserve_ms}
    return web.json_response(body, headers={"X-Request-Id": request_id})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


CONFIG_KEY = web.AppKey("config", FeedConfig)
CLIENT_KEY = web.AppKey("client", RecClient)


def make_app(config: FeedConfig) -> web.Application:
    app = web.Application()
    app[CONFIG_KEY] = config

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        # The client's channels belong to this loop: open them here, close them at exit.
        async with RecClient(config.recommenders, api_key=config.api_key) as client:
            app[CLIENT_KEY] = client
            yield

    app.cleanup_ctx.append(client_ctx)
    app.router.add_get("/feed", feed)
    app.router.add_get("/healthz", healthz)
    return app


def _ids(text: str, flag: str) -> np.ndarray:
    try:
        return np.array([int(x) for x in text.split(",") if x.strip()], dtype=np.int64)
    except ValueError:
        raise SystemExit(f"{flag} = {text!r}: give comma-separated integer item ids") from None


async def serve(config: FeedConfig, host: str, port: int, port_file: str) -> None:
    runner = web.AppRunner(make_app(config))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = int(runner.addresses[0][1])
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(str(bound))
        tmp.replace(port_file)  # atomic: a reader never sees a half-written port
    print(f"feed service at http://{host}:{bound}/feed", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A feed service that merges recserve's recommendations with editorial items.")
    parser.add_argument("--recommender", required=True, help="recserve Recommender address(es), HOST:PORT[,HOST:PORT]")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0 = a free port (see --port-file)")
    parser.add_argument("--port-file", default="", help="write the bound port here")
    parser.add_argument("--deadline-ms", type=float, default=150.0, help="recserve's budget per page (default 150)")
    parser.add_argument("--editorial", default=DEFAULT_EDITORIAL, help="pinned item ids, in order")
    parser.add_argument("--popular", default=DEFAULT_POPULAR, help="the fallback ranking: item ids, best first")
    parser.add_argument("--size", type=int, default=20, help="items per page")
    parser.add_argument("--api-key-env", default="", help="read this tenant's API key from this environment variable (not a flag: flags show in ps)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.deadline_ms > 0:
        raise SystemExit(f"--deadline-ms = {args.deadline_ms}: give a positive number of milliseconds")
    config = FeedConfig(
        recommenders=tuple(a for a in args.recommender.split(",") if a), deadline_s=args.deadline_ms / 1e3,
        editorial=_ids(args.editorial, "--editorial"), popular=_ids(args.popular, "--popular"), size=args.size,
        api_key=os.environ.get(args.api_key_env, "") if args.api_key_env else "",
    )  # fmt: skip
    asyncio.run(serve(config, args.host, args.port, args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
