"""``recserve bench mixed``: a ranker and a decoder sharing one device behind the bulkhead.

The world is :func:`recserve.bench.rank.build_world`'s (a synthetic catalog, DLRM trained
and exported, its tables over ``--shards`` real shard processes), and one real
``recserve ranker serve`` process with ``[generation] co_locate = true``: Ranking and
Generation on one server, their forwards and decode steps on one
:class:`~recserve.scheduling.device.DeviceExecutor` (ranker batches first, decode at
least ``--min-device-share`` of device time while both have work; seeded random decoder
weights of ``--gen-layers`` x ``--gen-dim``, no stop token, so every stream decodes
exactly ``--gen-tokens`` tokens).

1. **knee**: the co-located process's ``Rank`` knee with no generation load
   (:func:`recserve.bench.rank.knee_of`, the shared knee finder; ``--knee-rps`` skips the
   search and takes the given rate);
2. open-loop Poisson ``Rank`` at ``--rank-fraction`` (0.7) of the knee for
   ``--measure-seconds``, **alone**: ``rank_p99_ms_alone``;
3. the generation load **alone**: ``--gen-streams`` closed-loop ``Generate`` streams
   (:class:`~recserve.client.GenerationClient`, random ``--gen-prompt-tokens``-token
   prompts) for ``--measure-seconds``: ``decode_tokens_per_s_alone`` (tokens received
   per second, counted by arrival time within the window);
4. both at once (**mixed**): the same ``Rank`` schedule while the streams run:
   ``rank_p99_ms_mixed`` and ``decode_tokens_per_s`` over the same window.

Before step 2 a warm-up runs both loads briefly (the first window must not be the cold
one). Steps 2-4 repeat ``--repeats`` (3) times, interleaved; the reported figures are
the medians (each round's in ``runs``). ``rank_p99_ratio`` = mixed / alone (goal <= 1.2) and
``decode_fraction`` = mixed / alone tokens/s (goal >= 0.3); ``goals`` says whether each
holds. ``device_share_mixed`` is the lanes' device time in the mixed window, read from
the process's ``recserve_device_*`` metrics, beside the configured share, and
``decode_paced_s_mixed`` the seconds the device idled holding decode back for ranker
batches in flight. Latency runs
from a request's scheduled arrival to its answer; its deadline is that arrival +
``--timeout-ms`` (a request answered after ``--slo-ms`` counts as late, not OK).

Prints a table, or one JSON object with ``--json``. On a 2-core machine the shards, the
load generator and the co-located process share the CPUs: the "device" there is a CPU
thread that also competes with the ranker's own event loop for the interpreter, which
no device scheduler can arbitrate; ``note`` repeats this beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from recserve.bench.rank import World

RANK_P99_GOAL = 1.2  # mixed p99 / alone p99 at most
DECODE_GOAL = 0.3  # mixed tokens/s / alone tokens/s at least
GEN_WARMUP_S = 0.5  # streams run this long before a window opens (every stream past its first prefill)
WARMUP_GEN_S = 1.0  # the generation load's part of the warm-up before the first round
SPEC_RANKER_HEAD = '[ranker]\nmodels = ["dlrm"]\ndevice = "cpu"\n'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--items", type=int, default=5_000, help="catalog items (default 5000)")
    p.add_argument("--users", type=int, default=500, help="catalog users (default 500)")
    p.add_argument("--impressions", type=int, default=20_000, help="click-log impressions (default 20000)")
    p.add_argument("--train-rows", type=int, default=10_000, help="training rows per epoch and model (default 10000)")
    p.add_argument("--candidates", type=int, default=200, help="candidates per Rank request (default 200)")
    p.add_argument("--user-zipf", type=float, default=1.05, help="Zipf exponent of the users sending requests (default 1.05)")
    p.add_argument("--request-pool", type=int, default=512, help="distinct Rank requests drawn before timing (default 512)")
    p.add_argument("--shards", type=int, default=2, help="shard processes (default 2)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="ranker.device and generation.device (default auto: CUDA when present)")
    p.add_argument("--max-wait-ms", type=float, default=None, help="ranker.max_wait_ms (default: RankerConfig's)")
    p.add_argument("--max-batch-candidates", type=int, default=None, help="ranker.max_batch_candidates (default: RankerConfig's)")
    p.add_argument("--slo-ms", type=float, default=50.0, help="a Rank is OK if answered, not degraded, within this (default 50 ms)")
    p.add_argument("--timeout-ms", type=float, default=250.0, help="each Rank's deadline after its scheduled arrival (default 250 ms)")
    p.add_argument("--rank-fraction", type=float, default=0.7, help="offered Rank rate as a fraction of the knee (default 0.7)")
    p.add_argument("--knee-rps", type=float, default=None, help="take this as the Rank knee instead of searching for it")
    p.add_argument("--lo-rps", type=float, default=10.0, help="knee search: lowest offered rate (default 10/s)")
    p.add_argument("--hi-rps", type=float, default=1_000.0, help="knee search: highest offered rate (default 1000/s)")
    p.add_argument("--tolerance", type=float, default=0.1, help="knee search: stop when the bracket is within this ratio (default 0.1)")
    p.add_argument("--fail-retries", type=int, default=1, help="knee search: re-probe a failed rate this many times (default 1)")
    p.add_argument("--probe-seconds", type=float, default=2.0, help="knee search: shortest probe (default 2 s)")
    p.add_argument("--min-probe-requests", type=int, default=200, help="knee search: a probe lasts about this many arrivals (default 200)")
    p.add_argument("--max-probe-seconds", type=float, default=8.0, help="knee search: longest probe (default 8 s)")
    p.add_argument("--max-probe-requests", type=int, default=1_500, help="knee search: most arrivals per probe (default 1500)")
    p.add_argument("--warmup-requests", type=int, default=100, help="closed-loop Rank requests before the search and before the rounds (default 100)")
    p.add_argument("--keep-rankers", action="store_true", help="knee search: do not restart the ranker after a failed probe")
    p.add_argument("--measure-seconds", type=float, default=4.0, help="length of each alone / mixed window (default 4 s)")
    p.add_argument("--repeats", type=int, default=3, help="alone / decode-alone / mixed rounds, interleaved; medians reported (default 3)")
    p.add_argument("--gen-streams", type=int, default=8, help="concurrent closed-loop Generate streams (default 8)")
    p.add_argument("--gen-tokens", type=int, default=64, help="max_new_tokens of each stream (default 64)")
    p.add_argument("--gen-prompt-tokens", type=int, default=32, help="random prompt tokens per stream (default 32)")
    p.add_argument("--gen-layers", type=int, default=2, help="decoder layers (random weights; default 2)")
    p.add_argument("--gen-dim", type=int, default=64, help="decoder width (default 64)")
    p.add_argument("--min-device-share", type=float, default=0.2, help="generation.min_device_share of the bulkhead (default 0.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep the catalog, models and shard data here (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--measure-seconds", args.measure_seconds), ("--gen-streams", args.gen_streams), ("--gen-tokens", args.gen_tokens),
                        ("--gen-prompt-tokens", args.gen_prompt_tokens), ("--repeats", args.repeats), ("--candidates", args.candidates),
                        ("--slo-ms", args.slo_ms)):  # fmt: skip
        if not value > 0:
            raise SystemExit(f"{flag} = {value!r} is invalid: use a positive number")
    if not 0 < args.rank_fraction <= 1.5:
        raise SystemExit(f"--rank-fraction = {args.rank_fraction!r} is invalid: use a fraction of the knee in (0, 1.5]")
    if args.knee_rps is not None and not args.knee_rps > 0:
        raise SystemExit(f"--knee-rps = {args.knee_rps!r} is invalid: use a positive rate, or leave it out to search")
    if args.timeout_ms < args.slo_ms:
        raise SystemExit(f"--timeout-ms = {args.timeout_ms!r} is invalid: use at least --slo-ms ({args.slo_ms:g})")


def run(args: argparse.Namespace) -> int:
    _check(args)
    import torch

    torch.set_num_threads(1)  # the shards and the co-located process share the cores
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="recserve-bench-mixed-")) if own_dir else Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = _run(args, workdir)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report, allow_nan=False) if args.json else format_report(report))
    return 0


def _log(msg: str) -> None:
    print(f"[bench mixed] {msg}", file=sys.stderr, flush=True)


def mixed_spec(world: World, args: argparse.Namespace) -> Path:
    """The batched spec of ``world`` with the device and a co-located ``[generation]``."""
    from recserve.config import loads

    text = world.specs[True].read_text()
    if SPEC_RANKER_HEAD not in text:
        raise SystemExit(f"bench mixed: the bench rank spec has no {SPEC_RANKER_HEAD!r} head to set the device in; update SPEC_RANKER_HEAD")
    text = text.replace(SPEC_RANKER_HEAD, f'[ranker]\nmodels = ["dlrm"]\ndevice = "{args.device}"\n', 1)
    heads = max(1, min(4, args.gen_dim // 16))
    context = args.gen_prompt_tokens + args.gen_tokens + 1
    blocks = -(-context // 16) * (args.gen_streams + 2)  # every stream's blocks, and a spare pair: KV never limits
    text += (
        "\n[generation]\nco_locate = true\n"
        f"min_device_share = {args.min_device_share}\ndevice = \"{args.device}\"\nthreads = 1\n"
        f"n_layers = {args.gen_layers}\nn_heads = {heads}\ndim = {args.gen_dim}\nmax_seq_len = {max(context, 64)}\n"
        f"num_blocks = {blocks}\nmax_seqs = {args.gen_streams}\ntoken_budget = {max(256, args.gen_prompt_tokens * args.gen_streams)}\n"
        f"prefill_chunk_tokens = {min(64, max(1, args.gen_prompt_tokens))}\nmax_new_tokens_cap = {args.gen_tokens}\nstop_token = -1\n"
    )
    loads(text)  # a bad flag fails here, naming the field, not in the child process
    path = world.specs[True].with_name("cluster-mixed.toml")
    path.write_text(text)
    return path


# ---- load -----------------------------------------------------------------------------


class GenerationLoad:
    """``streams`` closed-loop Generate streams until :meth:`stop`; every received
    chunk's arrival time and token count is logged, so any window's tokens/s can be
    read afterwards (:meth:`tokens_per_s`)."""

    def __init__(self, address: str, args: argparse.Namespace, seed: int) -> None:
        self.address = address
        self.args = args
        self.rng = np.random.default_rng(seed)
        self.times: list[float] = []
        self.counts: list[int] = []
        self.streams_done = 0
        self.errors: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._client: Any = None

    async def start(self) -> None:
        from recserve.client.generation import GenerationClient

        self._client = GenerationClient([self.address])
        await self._client.start()
        self._tasks = [asyncio.ensure_future(self._worker()) for _ in range(self.args.gen_streams)]

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()  # a stream mid-way is cancelled: the server stops it at its next step
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    async def _worker(self) -> None:
        from recserve.errors import RecserveError

        a = self.args
        while not self._stop.is_set():
            prompt = self.rng.integers(0, 256, size=a.gen_prompt_tokens, dtype=np.int32)
            try:
                async for chunk in self._client.generate(prompt_tokens=prompt, max_new_tokens=a.gen_tokens, timeout_s=60.0, priority="best_effort"):
                    self.times.append(time.monotonic())
                    self.counts.append(int(chunk.tokens.shape[0]))
                self.streams_done += 1
            except RecserveError as exc:  # counted for the report; the stream is restarted
                self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.05)  # do not spin on a failing server

    def tokens_per_s(self, start: float, end: float) -> float:
        t = np.asarray(self.times)
        c = np.asarray(self.counts)
        inside = (t >= start) & (t < end)
        return float(c[inside].sum()) / (end - start) if end > start else 0.0


async def _rank_window(address: str, world: World, args: argparse.Namespace, rate: float, seed: int, routing: Any) -> dict[str, Any]:
    """One open-loop Rank window at ``rate``: its probe figures and span (monotonic s)."""
    from recserve.bench.rank import probe, warm
    from recserve.client import RankingClient

    users, cands = world.users, world.candidates
    pool = users.shape[0]
    async with RankingClient([address], routing, rng=np.random.default_rng(seed)) as client:

        async def send(i: int, deadline: float) -> bool:
            k = i % pool
            return (await client.rank(int(users[k]), cands[k], model="dlrm", deadline=deadline, priority="critical")).degraded

        await warm(send, 8, 1)
        start = time.monotonic()
        result, figures = await probe(rate, send, seconds=args.measure_seconds, max_requests=1 << 30, slo_s=args.slo_ms / 1e3,
                                      timeout_s=args.timeout_ms / 1e3, seed=seed)  # fmt: skip
        end = time.monotonic()
    return {**dataclasses.asdict(result), "ok_fraction": result.ok_fraction, **figures, "start": start, "end": end}


def _device_seconds(url: str | None) -> dict[str, float]:
    """lane -> device busy seconds so far (the process's recserve_device_busy_seconds),
    and ``paced`` -> the seconds decode was held back (recserve_device_paced_seconds)."""
    from prometheus_client.parser import text_string_to_metric_families

    if url is None:
        return {}
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "recserve_device_busy_seconds_total":
                out[sample.labels["lane"]] = sample.value
            elif sample.name == "recserve_device_paced_seconds_total":
                out["paced"] = sample.value
    return out


async def _warm_up(address: str, world: World, args: argparse.Namespace, routing: Any) -> None:
    """Before the first window: ``--warmup-requests`` closed-loop Rank calls, then the
    generation load with Rank beside it for a second (channels, first forwards and
    decode steps, the lookup client's caches), so the first window is not the cold one."""
    from recserve.bench.rank import warm
    from recserve.client import RankingClient

    users, cands = world.users, world.candidates
    async with RankingClient([address], routing, rng=np.random.default_rng(args.seed)) as client:

        async def send(i: int, deadline: float) -> bool:
            k = i % users.shape[0]
            return (await client.rank(int(users[k]), cands[k], model="dlrm", deadline=deadline)).degraded

        await warm(send, args.warmup_requests, 1)
        gen = GenerationLoad(address, args, args.seed + 99_999)  # prompts none of the rounds draws
        await gen.start()
        try:
            await warm(send, max(8, args.warmup_requests // 4), 1)
            await asyncio.sleep(WARMUP_GEN_S)  # the warm-up's length, not synchronisation
        finally:
            await gen.stop()


async def _round(address: str, metrics_url: str | None, world: World, args: argparse.Namespace, rate: float, k: int, routing: Any) -> dict[str, Any]:
    """One interleaved round: Rank alone, decode alone, both."""
    seed = args.seed + 100 * k
    alone = await _rank_window(address, world, args, rate, seed, routing)
    gen = GenerationLoad(address, args, seed)
    await gen.start()
    try:
        await asyncio.sleep(GEN_WARMUP_S)  # the schedule of the window below, not synchronisation
        t0 = time.monotonic()
        await asyncio.sleep(args.measure_seconds)
        decode_alone = gen.tokens_per_s(t0, time.monotonic())
        before = await asyncio.to_thread(_device_seconds, metrics_url)
        mixed = await _rank_window(address, world, args, rate, seed, routing)
        after = await asyncio.to_thread(_device_seconds, metrics_url)
        decode_mixed = gen.tokens_per_s(mixed["start"], mixed["end"])
    finally:
        await gen.stop()
    busy = {lane: after.get(lane, 0.0) - before.get(lane, 0.0) for lane in ("critical", "best_effort")}
    total = sum(busy.values())
    out = {
        "rank_alone": {key: v for key, v in alone.items() if key not in ("start", "end")},
        "rank_mixed": {key: v for key, v in mixed.items() if key not in ("start", "end")},
        "rank_p99_ms_alone": alone["p99_ms"], "rank_p99_ms_mixed": mixed["p99_ms"],
        "decode_tokens_per_s_alone": decode_alone, "decode_tokens_per_s": decode_mixed,
        "device_busy_s_mixed": busy, "device_share_mixed": {lane: (b / total if total > 0 else None) for lane, b in busy.items()},
        "decode_paced_s_mixed": after.get("paced", 0.0) - before.get("paced", 0.0),
        "streams_finished": gen.streams_done, "generation_errors": gen.errors,
    }  # fmt: skip
    _log(f"round {k}: Rank p99 {_ms(alone['p99_ms'])} alone -> {_ms(mixed['p99_ms'])} mixed; "
         f"decode {decode_alone:,.0f} tokens/s alone -> {decode_mixed:,.0f} mixed")  # fmt: skip
    return out


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return float(np.median(got)) if got else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- the run --------------------------------------------------------------------------


def _run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from recserve.bench.rank import build_world, knee_of
    from recserve.cluster import ShardCluster
    from recserve.cluster.rankers import RankerCluster
    from recserve.config import load

    started = time.perf_counter()
    world = build_world(args, root)
    spec = mixed_spec(world, args)
    cluster = load(spec)
    with ShardCluster(world.plan_path, root / "shards", load_from=world.models, server=cluster.shard_server) as shards:
        _log(f"{args.shards} shards SERVING at {shards.addresses}")
        with RankerCluster(spec, world.models, shards.addresses, num_rankers=1, data_root=root / "ranker") as ranker:
            address = ranker.address(0)
            _log(f"co-located ranker + generation SERVING at {address}")
            knee: dict[str, Any] | None = None
            if args.knee_rps is None:
                search = argparse.Namespace(**{**vars(args), "saturation_seconds": 0.0})

                def restart() -> None:
                    ranker.restart(0)

                knee = asyncio.run(knee_of("co-located", [address], world, search, cluster.routing, None if args.keep_rankers else restart))
                knee_rps = knee["knee_per_s"]
                if knee_rps is None:
                    raise SystemExit(f"bench mixed: no Rank knee found in {args.lo_rps:g}..{args.hi_rps:g}/s ({knee['reason']}); lower --lo-rps")
            else:
                knee_rps = float(args.knee_rps)
            rate = args.rank_fraction * knee_rps
            _log(f"Rank knee {knee_rps:,.1f}/s; measuring at {rate:,.1f}/s ({args.rank_fraction:.0%})")
            asyncio.run(_warm_up(address, world, args, cluster.routing))
            rounds = [asyncio.run(_round(address, ranker.metrics_url(0), world, args, rate, k, cluster.routing)) for k in range(args.repeats)]
    return summarise(args, rounds, knee_rps=knee_rps, rate=rate, knee=knee, seconds=time.perf_counter() - started, device=_device_name(args.device))


def _device_name(device: str) -> str:
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return f"cuda ({torch.cuda.get_device_name(0)})"


def summarise(args: argparse.Namespace, rounds: list[dict[str, Any]], *, knee_rps: float, rate: float, knee: dict[str, Any] | None,
              seconds: float, device: str) -> dict[str, Any]:  # fmt: skip
    """The report: medians over the rounds, the ratios and whether the goals hold."""
    keys = ("rank_p99_ms_alone", "rank_p99_ms_mixed", "decode_tokens_per_s", "decode_tokens_per_s_alone")
    med = {key: _median([r[key] for r in rounds]) for key in keys}
    p99_ratio = _ratio(med["rank_p99_ms_mixed"], med["rank_p99_ms_alone"])
    decode_fraction = _ratio(med["decode_tokens_per_s"], med["decode_tokens_per_s_alone"])
    share = _median([r["device_share_mixed"]["best_effort"] for r in rounds])
    return {
        **med,
        "rank_p99_ratio": p99_ratio,
        "decode_fraction": decode_fraction,
        "goals": {"rank_p99_ratio_max": RANK_P99_GOAL, "decode_fraction_min": DECODE_GOAL,
                  "rank_p99_met": p99_ratio is not None and p99_ratio <= RANK_P99_GOAL,
                  "decode_met": decode_fraction is not None and decode_fraction >= DECODE_GOAL},
        "knee_per_s": knee_rps, "knee_searched": knee is not None, "rank_rate_per_s": rate,
        "device_share_best_effort_mixed": share, "min_device_share": args.min_device_share,
        "runs": rounds, "knee": knee,
        "config": {"items": args.items, "candidates": args.candidates, "shards": args.shards, "slo_ms": args.slo_ms, "timeout_ms": args.timeout_ms,
                   "rank_fraction": args.rank_fraction, "measure_seconds": args.measure_seconds, "repeats": args.repeats,
                   "gen_streams": args.gen_streams, "gen_tokens": args.gen_tokens, "gen_prompt_tokens": args.gen_prompt_tokens,
                   "gen_layers": args.gen_layers, "gen_dim": args.gen_dim, "device": device, "cpus": os.cpu_count()},
        "loadavg_1m": os.getloadavg()[0],
        "seconds": seconds,
        "note": ("one process serves Rank and Generate; its forwards and decode steps share one device thread behind the bulkhead. "
                 "On a CPU-only host that thread, the process's event loop, the shards and this load generator share the same cores "
                 "(and the interpreter), which the device bulkhead cannot arbitrate: compare figures from one run only."),
    }  # fmt: skip


def format_report(r: dict[str, Any]) -> str:
    def f(value: float | None, unit: str = "") -> str:
        return "n/a" if value is None else f"{value:,.2f}{unit}"

    g = r["goals"]
    lines = [
        f"recserve bench mixed: Rank at {r['rank_rate_per_s']:,.1f}/s ({r['config']['rank_fraction']:.0%} of the knee {r['knee_per_s']:,.1f}/s), "
        f"{r['config']['gen_streams']} Generate streams, device {r['config']['device']}",
        f"  Rank p99            alone {f(r['rank_p99_ms_alone'], ' ms'):>12}   mixed {f(r['rank_p99_ms_mixed'], ' ms'):>12}   "
        f"ratio {f(r['rank_p99_ratio'])} (goal <= {g['rank_p99_ratio_max']}: {'met' if g['rank_p99_met'] else 'NOT met'})",
        f"  decode tokens/s     alone {f(r['decode_tokens_per_s_alone']):>12}   mixed {f(r['decode_tokens_per_s']):>12}   "
        f"fraction {f(r['decode_fraction'])} (goal >= {g['decode_fraction_min']}: {'met' if g['decode_met'] else 'NOT met'})",
        f"  decode's device share while mixed: {f(r['device_share_best_effort_mixed'])} (guaranteed minimum {r['min_device_share']})",
        f"  note: {r['note']}",
    ]  # fmt: skip
    return "\n".join(lines)

