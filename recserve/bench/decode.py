"""``recserve bench decode``: static vs continuous batching of the LLM decode engine.

One request mix (issue 15): every prompt is 64 tokens — a shared system prompt plus a
short per-request suffix — with ``max_new_tokens = 256``; the actual output length is
drawn from a geometric distribution (mean 32, capped at 256) and enforced with
``stop_after`` (the stand-in for an EOS the random-weight model would not emit; the
schedulers never see it). Measured on this machine, in one run:

- **saturation** (every request waiting at t = 0, more than fit): static batching —
  fixed membership until the longest finishes, each member reserving contiguous KV for
  prompt + ``max_new_tokens``, no prefix sharing — against ``tokens_per_s_continuous``
  (paged KV, prefix sharing, admission at every step); same maximum batch
  (``--max-seqs``), same KV bytes (a pool sized to hold ``--contiguous-seqs`` contiguous
  reservations); best of ``--repeats`` interleaved runs each. Two static baselines, both
  reported: ``tokens_per_s_static`` (= ``tokens_per_s_static_padded``) keeps computing
  finished rows as padding, as a fixed-width batch does (reference §10.6.5's waste
  model), and gives the headline ``speedup`` (= ``speedup_vs_static_padded``);
  ``tokens_per_s_static_skip_finished`` runs the same batches skipping finished rows —
  the stronger baseline on a CPU, where a row's cost is paid only if it is computed —
  and gives ``speedup_vs_static_skip_finished``. ``tokens_per_s_continuous_no_prefix_sharing``
  separates the scheduling gain from the prefix cache's. ``max_concurrent_paged`` /
  ``max_concurrent_contiguous`` = the most sequences live at once; ``prefix_blocks_saved``
  = blocks taken from the prefix cache instead of being recomputed and stored again.
- **latency** at half the continuous saturation rate (open-loop Poisson):
  ``ttft_p50_ms`` / ``ttft_p99_ms`` (arrival → first token) and ``tpot_p50_ms`` (mean gap
  between a request's tokens after the first).
- **chunked prefill**: ``--streams`` sequences decoding while ``--long-prompts`` prompts of
  ``--long-prompt-tokens`` (1,024) tokens arrive; ``tbt_p99_ms_chunked`` (chunks of
  ``--chunk`` tokens) vs ``tbt_p99_ms_unchunked`` (each prompt prefilled whole): the p99
  gap between consecutive tokens of the decoding streams.
- ``outputs_match_recompute``: a sample of the mix decoded through the continuous engine
  in float64, in a pool of one contiguous reservation (so it preempts:
  ``recompute_check_preemptions``), equals naive full-recompute decoding token for token.
- with ``--sweep-fractions``: both contenders open-loop at fractions of the continuous
  saturation request rate (``sweep``); ``--plot PATH`` draws tokens/s and TTFT against
  the offered rate.

Goals: ``speedup`` >= 3, ``max_concurrent_paged`` >= 2 × contiguous, ``tbt_p99_ms_chunked``
< ½ ``tbt_p99_ms_unchunked``. Prints a table, or one JSON object with ``--json``. torch is
imported inside ``run`` (``recserve --help`` stays light).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.bench.arrivals import poisson_arrivals
from recserve.bench.sweep import percentile_ms

if TYPE_CHECKING:
    from generation.engine import DecodeEngine
    from generation.model import TinyDecoder
    from generation.types import GenerationRequest
    from recserve.scheduling import Handle, Scheduler


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sweep-fractions {text!r}: {e}") from None
    if not values or not all(0 < v < 10 for v in values):
        raise argparse.ArgumentTypeError(f"--sweep-fractions {text!r}: give fractions in (0, 10), comma-separated (e.g. 0.25,0.5,1)")
    return tuple(sorted(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=192, help="requests in the saturation run (default 192)")
    parser.add_argument("--max-seqs", type=int, default=32, help="maximum batch size, both contenders (default 32)")
    parser.add_argument("--contiguous-seqs", type=int, default=8,
                        help="KV pool size, in contiguous (prompt + max_new_tokens) reservations; same bytes for both (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--system-tokens", type=int, default=48, help="shared system prompt, part of the prompt (default 48)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per-request budget (default 256)")
    parser.add_argument("--mean-output", type=float, default=32.0, help="mean of the geometric output length (default 32)")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk, tokens (default 64)")
    parser.add_argument("--token-budget", type=int, default=128, help="tokens per step, continuous (default 128)")
    parser.add_argument("--streams", type=int, default=16, help="decoding streams in the chunked-prefill run (default 16)")
    parser.add_argument("--long-prompts", type=int, default=8, help="long prompts mixed into that run (default 8)")
    parser.add_argument("--long-prompt-tokens", type=int, default=1024, help="their length (default 1024)")
    parser.add_argument("--checkpoint", default=None, metavar="DIR", help="a `recserve train --lm` checkpoint (default: random weights)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto = CUDA when available (default)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the tiny model's ops are too small to split)")
    parser.add_argument("--sweep-fractions", type=_fractions, default=None, metavar="F1,F2,...",
                        help="also run both contenders open-loop at these fractions of the continuous saturation rate")
    parser.add_argument("--sweep-requests", type=int, default=64, help="requests per sweep point and contender (default 64)")
    parser.add_argument("--plot", default=None, metavar="PATH", help="with --sweep-fractions: write a PNG of tokens/s and TTFT vs offered rate")
    parser.add_argument("--repeats", type=int, default=2, help="saturation runs per contender, interleaved; the best counts (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    for flag in ("requests", "max_seqs", "contiguous_seqs", "prompt_tokens", "max_new_tokens", "chunk", "token_budget",
                 "streams", "long_prompt_tokens", "threads", "sweep_requests", "repeats"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"--{flag.replace('_', '-')} = {getattr(args, flag)!r} is invalid: use a positive number")
    if not 0 <= args.system_tokens < args.prompt_tokens:
        raise SystemExit(f"--system-tokens = {args.system_tokens} is invalid: use 0..prompt-tokens-1 ({args.prompt_tokens - 1})")
    if not 1 <= args.mean_output <= args.max_new_tokens:
        raise SystemExit(f"--mean-output = {args.mean_output} is invalid: use 1..max-new-tokens ({args.max_new_tokens})")
    if args.plot is not None and args.sweep_fractions is None:
        raise SystemExit("--plot needs --sweep-fractions")
    result = bench(args)
    if args.plot is not None:
        plot(args.plot, result)
    if args.json:
        print(json.dumps(result, sort_keys=True, allow_nan=False))
    else:
        print(format_table(result))
    return 0


# ---------------------------------------------------------------------------- drive
class _Times:
    """ItemListener recording, per request, the wall time of every token (partials and
    the final one that comes with Done)."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.tokens: dict[str, list[float]] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self.errors: dict[str, str] = {}

    def on_partial(self, handle: Handle, output: Any) -> None:
        self.tokens.setdefault(handle.request_id, []).append(self.clock())

    def on_done(self, handle: Handle, output: Any) -> None:
        self.tokens.setdefault(handle.request_id, []).append(self.clock())
        self.outputs[handle.request_id] = output

    def on_error(self, handle: Handle, error: Any) -> None:
        self.errors[handle.request_id] = error.message


@dataclasses.dataclass
class RunResult:
    arrivals_s: np.ndarray  # [R] intended arrival offsets
    times: _Times
    span_s: float
    generated: int
    peak_live: int
    prefix_hit_blocks: int
    steps: int
    ids: list[str]


def serve(sched: Scheduler, engine: DecodeEngine, requests: list[GenerationRequest], arrivals_s: np.ndarray, *, prefix: str = "r") -> RunResult:
    """Run ``requests`` arriving open-loop at ``arrivals_s`` (seconds from start, sorted)
    through ``sched`` + ``engine`` on the wall clock, one step at a time."""
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    times = _Times(clock)
    ids = [f"{prefix}{i}" for i in range(len(requests))]
    items = [engine.item(rid, req) for rid, req in zip(ids, requests)]
    n, i, steps = len(items), 0, 0
    while i < n or not sched.idle:
        now = clock()
        while i < n and arrivals_s[i] <= now:
            sched.add(items[i], now, times)
            i += 1
        batch = sched.schedule(now)
        if batch is None:
            if i < n:
                time.sleep(max(0.0, float(arrivals_s[i]) - clock()))
            continue
        sched.complete(batch, engine.run_batch(batch), clock())
        steps += 1
    span = clock()
    gauges = sched.stats().policy
    generated = sum(len(times.tokens.get(rid, ())) for rid in ids)
    return RunResult(arrivals_s, times, span, generated, int(gauges["peak_live_seqs"]), int(gauges["prefix_hit_blocks"]), steps, ids)


def _latency(r: RunResult) -> dict[str, float | None]:
    ttft = np.array([r.times.tokens[rid][0] - r.arrivals_s[k] for k, rid in enumerate(r.ids) if r.times.tokens.get(rid)])
    spans = [r.times.tokens[rid] for rid in r.ids if len(r.times.tokens.get(rid, [])) > 1]
    tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for t in spans])
    return {"ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p99_ms": percentile_ms(ttft, 99), "tpot_p50_ms": percentile_ms(tpot, 50)}


def _tbt_p99_ms(r: RunResult, rids: list[str]) -> float | None:
    gaps = [np.diff(np.asarray(r.times.tokens[rid])) for rid in rids if len(r.times.tokens.get(rid, ())) > 1]
    return percentile_ms(np.concatenate(gaps), 99) if gaps else None


# ---------------------------------------------------------------------------- bench
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def tune_malloc(mmap_threshold: int = 256 << 20) -> bool:
    """Keep glibc from mmap-ing (and page-faulting afresh) every large temporary: a decode
    step allocates a few MB of attention temporaries, and above the default threshold each
    one is a fresh mapping (docs/architecture.md §12; measured here: a 32-sequence step 10.8 -> 5.9 ms).
    Process-wide, so it is done by the composition root (this bench), not by the engine.
    Returns False where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold))
    except (OSError, AttributeError):
        return False


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from generation.config import ContinuousBatchConfig, GenerationConfig, KvCacheConfig
    from generation.engine import build
    from generation.model import resolve_device
    from generation.oracle import generate_recompute
    from generation.static_policy import StaticBatchPolicy
    from generation.train import LM_CONFIG, load_checkpoint
    from generation.types import GenerationRequest
    from recserve.scheduling import Scheduler

    torch.set_num_threads(args.threads)
    malloc_tuned = tune_malloc()
    device = resolve_device(args.device)
    if args.checkpoint is not None:
        model, _ = load_checkpoint(args.checkpoint)
        model_cfg = model.config
    else:
        from generation.model import TinyDecoder

        model_cfg = dataclasses.replace(LM_CONFIG, max_seq_len=max(LM_CONFIG.max_seq_len, args.long_prompt_tokens + args.max_new_tokens))
        torch.manual_seed(args.seed)
        model = TinyDecoder(model_cfg)
    model = model.to(device).eval()
    rng = np.random.default_rng(args.seed)
    bt = 16
    per_seq_blocks = -(-(args.prompt_tokens + args.max_new_tokens) // bt)
    kv = KvCacheConfig(num_blocks=args.contiguous_seqs * per_seq_blocks, block_tokens=bt)
    cont_cfg = ContinuousBatchConfig(kv=kv, max_seqs=args.max_seqs, token_budget=args.token_budget, prefill_chunk_tokens=min(args.chunk, args.token_budget))
    static_cfg = dataclasses.replace(cont_cfg, kv=dataclasses.replace(kv, prefix_sharing=False), prefill_chunk_tokens=None)
    gen_cfg = GenerationConfig(model=model_cfg, batching=cont_cfg, device=str(device))

    system = rng.integers(0, 256, size=args.system_tokens).astype(np.int64)

    def mix(count: int) -> list[GenerationRequest]:
        lengths = np.minimum(rng.geometric(1.0 / args.mean_output, size=count), args.max_new_tokens)
        suffixes = rng.integers(0, 256, size=(count, args.prompt_tokens - args.system_tokens)).astype(np.int64)
        return [GenerationRequest(np.concatenate([system, s]), args.max_new_tokens, stop_after=int(n)) for s, n in zip(suffixes, lengths)]

    def contender(kind: str, batching: ContinuousBatchConfig = cont_cfg) -> tuple[Scheduler, DecodeEngine]:
        """``continuous``, ``static`` (fixed width: finished rows computed as padding) or
        ``static_skip`` (finished rows skipped)."""
        sched, engine = build(dataclasses.replace(gen_cfg, batching=batching), model)
        if kind.startswith("static"):
            policy = StaticBatchPolicy(batching, padded=kind == "static")
            sched = Scheduler(policy)
            engine.padding = policy.padding_rows
        return sched, engine

    # Warm-up (allocator, kernels) so the first contender is not charged for it.
    serve(*contender("continuous"), mix(8), np.zeros(8))

    sat = mix(args.requests)
    zeros = np.zeros(len(sat))
    # Interleaved repeats, the best (shortest) run of each contender: on a shared
    # machine the least-disturbed run is the closest to the machine's capability.
    no_sharing_cfg = dataclasses.replace(cont_cfg, kv=dataclasses.replace(kv, prefix_sharing=False))
    configs = {"static": static_cfg, "static_skip": static_cfg, "continuous": cont_cfg, "continuous_no_sharing": no_sharing_cfg}
    best: dict[str, RunResult] = {}
    for _ in range(args.repeats):
        for kind, batching in configs.items():
            r = serve(*contender(kind.removesuffix("_no_sharing"), batching), sat, zeros)
            if kind not in best or r.span_s < best[kind].span_s:
                best[kind] = r
    static, skip, cont, unshared = best["static"], best["static_skip"], best["continuous"], best["continuous_no_sharing"]
    tps_static, tps_cont = static.generated / static.span_s, cont.generated / cont.span_s
    tps_skip, tps_unshared = skip.generated / skip.span_s, unshared.generated / unshared.span_s
    result: dict[str, Any] = {
        "device": str(device), "model": dataclasses.asdict(model_cfg), "kv_pool_blocks": kv.num_blocks, "block_tokens": bt,
        "kv_pool_bytes": kv.capacity_tokens * model_cfg.kv_bytes_per_token(model.dtype.itemsize),
        "requests": args.requests, "max_seqs": args.max_seqs, "generated_tokens": cont.generated, "repeats": args.repeats,
        "malloc_tuned": malloc_tuned,
        "tokens_per_s_static": tps_static, "tokens_per_s_continuous": tps_cont, "speedup": tps_cont / tps_static,
        "static_baseline": "padded: fixed membership until the longest finishes; finished rows computed as padding (fixed width)",
        "tokens_per_s_static_padded": tps_static, "speedup_vs_static_padded": tps_cont / tps_static,
        "tokens_per_s_static_skip_finished": tps_skip, "speedup_vs_static_skip_finished": tps_cont / tps_skip,
        "tokens_per_s_continuous_no_prefix_sharing": tps_unshared,
        "speedup_no_prefix_sharing_vs_static_skip_finished": tps_unshared / tps_skip,
        "max_concurrent_paged": cont.peak_live, "max_concurrent_contiguous": static.peak_live,
        "prefix_blocks_saved": cont.prefix_hit_blocks, "steps_static": static.steps, "steps_static_skip_finished": skip.steps,
        "steps_continuous": cont.steps,
    }
    if (not static.generated == skip.generated == cont.generated == unshared.generated
            or not static.times.outputs.keys() == skip.times.outputs.keys() == cont.times.outputs.keys() == unshared.times.outputs.keys()):
        raise SystemExit("the static and continuous runs did not finish the same requests")

    # Latency at half the continuous saturation request rate, open loop.
    sat_rate = args.requests / cont.span_s
    lat_requests = mix(args.sweep_requests)
    lat = serve(*contender("continuous"), lat_requests, poisson_arrivals(0.5 * sat_rate, count=len(lat_requests), rng=rng))
    result.update(_latency(lat))
    result["latency_rate_per_s"] = 0.5 * sat_rate

    # Chunked vs unchunked prefill with long prompts mixed in.
    result.update(_chunked_vs_unchunked(args, cont.span_s / max(1, cont.steps), rng, contender))

    # Exactness on a sample of the mix, float64, through the smallest pool on_add accepts
    # (one contiguous reservation): 8 live sequences outgrow it, so it preempts and recomputes.
    model64 = type(model)(model_cfg).to(device)
    model64.load_state_dict(model.state_dict())
    model64 = model64.double().eval()
    sample = [dataclasses.replace(r, stop_after=min(r.stop_after or 1, 24)) for r in mix(8)]
    small = dataclasses.replace(cont_cfg, kv=dataclasses.replace(kv, num_blocks=per_seq_blocks))
    sched64, eng64 = build(dataclasses.replace(gen_cfg, batching=small), model64)
    check = serve(sched64, eng64, sample, np.zeros(len(sample)))
    result["outputs_match_recompute"] = all(
        np.array_equal(check.times.outputs.get(rid, np.empty(0)), generate_recompute(model64, req)) for rid, req in zip(check.ids, sample)
    )
    result["recompute_check_requests"] = len(sample)
    result["recompute_check_preemptions"] = int(sched64.stats().policy["preemptions"])

    if args.sweep_fractions is not None:
        result["sweep"] = _sweep(args, sat_rate, mix, contender, static_cfg, rng)
    result["goals"] = {
        "speedup_ge_3": result["speedup"] >= 3.0,
        "speedup_vs_static_skip_finished_ge_3": result["speedup_vs_static_skip_finished"] >= 3.0,
        "paged_ge_2x_contiguous": result["max_concurrent_paged"] >= 2 * result["max_concurrent_contiguous"],
        "tbt_chunked_lt_half_unchunked": (result["tbt_p99_ms_chunked"] or math.inf) < 0.5 * (result["tbt_p99_ms_unchunked"] or 0.0),
    }
    return result


def _chunked_vs_unchunked(args: argparse.Namespace, step_s: float, rng: np.random.Generator, contender: Any) -> dict[str, Any]:
    """``--streams`` sequences decode 160 tokens each (at most ``--max-new-tokens``) from
    t = 0; ``--long-prompts`` long prompts arrive uniformly over the streams' first ~120
    decode steps (``step_s``: the saturation run's mean step, so the arrivals land while
    the streams run on any machine). Same arrivals, chunked then unchunked; TBT counts
    the streams' gaps."""
    from generation.config import ContinuousBatchConfig, KvCacheConfig
    from generation.types import GenerationRequest

    bt = 16
    stream_len = min(160, args.max_new_tokens)
    n_long = args.long_prompts
    blocks = args.streams * -(-(args.prompt_tokens + stream_len) // bt) + (n_long + 1) * -(-(args.long_prompt_tokens + 8) // bt)
    base = ContinuousBatchConfig(kv=KvCacheConfig(num_blocks=blocks, block_tokens=bt, prefix_sharing=False),
                                 max_seqs=args.streams + n_long, token_budget=args.token_budget,
                                 prefill_chunk_tokens=min(args.chunk, args.token_budget))
    streams = [GenerationRequest(rng.integers(0, 256, size=args.prompt_tokens).astype(np.int64), stream_len) for _ in range(args.streams)]
    longs = [GenerationRequest(rng.integers(0, 256, size=args.long_prompt_tokens).astype(np.int64), 8) for _ in range(n_long)]
    arrivals = np.concatenate([np.zeros(len(streams)), np.sort(rng.uniform(10, 120, size=n_long)) * step_s])
    out: dict[str, Any] = {"long_prompt_tokens": args.long_prompt_tokens, "long_prompts": n_long, "streams": args.streams}
    for name, chunk in (("chunked", base.prefill_chunk_tokens), ("unchunked", None)):
        sched, engine = contender("continuous", dataclasses.replace(base, prefill_chunk_tokens=chunk))
        r = serve(sched, engine, streams + longs, arrivals)
        out[f"tbt_p99_ms_{name}"] = _tbt_p99_ms(r, r.ids[: len(streams)])
    return out


def _sweep(args: argparse.Namespace, sat_rate: float, mix: Any, contender: Any, static_cfg: Any, rng: np.random.Generator) -> list[dict[str, Any]]:
    points = []
    reqs = mix(args.sweep_requests)  # one mix for every rate: only the offered rate varies
    for frac in args.sweep_fractions:
        rate = frac * sat_rate
        arrivals = poisson_arrivals(rate, count=len(reqs), rng=rng)
        point: dict[str, Any] = {"offered_per_s": rate, "fraction_of_saturation": frac}
        for kind in ("static", "continuous"):
            sched, engine = contender(kind, static_cfg) if kind == "static" else contender(kind)
            r = serve(sched, engine, reqs, arrivals)
            point[kind] = {"tokens_per_s": r.generated / r.span_s, "achieved_per_s": len(r.times.outputs) / r.span_s, **_latency(r)}
        points.append(point)
    return points


# ---------------------------------------------------------------------------- output
def _f(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_table(r: dict[str, Any]) -> str:
    m = r["model"]
    g = r["goals"]

    def ok(flag: bool) -> str:
        return "met" if flag else "NOT met"

    lines = [
        f"recserve bench decode  ({r['device']}; {m['n_layers']} layers × {m['dim']} wide, {m['n_heads']} heads; "
        f"KV pool {r['kv_pool_blocks']} blocks × {r['block_tokens']} tokens = {r['kv_pool_bytes'] / 2**20:.1f} MiB)",
        f"  saturation: {r['requests']} requests at t=0, max batch {r['max_seqs']}, {r['generated_tokens']:,} tokens generated",
        f"  {'':<34}{'static':>12}{'continuous':>12}",
        f"  {'tokens/s (static: padded rows)':<34}{r['tokens_per_s_static']:>12,.0f}{r['tokens_per_s_continuous']:>12,.0f}   "
        f"speedup {r['speedup']:.2f}x (goal >= 3: {ok(g['speedup_ge_3'])})",
        f"  {'max concurrent sequences':<34}{r['max_concurrent_contiguous']:>12}{r['max_concurrent_paged']:>12}   "
        f"(goal paged >= 2x contiguous: {ok(g['paged_ge_2x_contiguous'])})",
        f"  {'steps':<34}{r['steps_static']:>12,}{r['steps_continuous']:>12,}",
        f"  {'tokens/s (static: skip finished)':<34}{r['tokens_per_s_static_skip_finished']:>12,.0f}{r['tokens_per_s_continuous']:>12,.0f}   "
        f"speedup {r['speedup_vs_static_skip_finished']:.2f}x (>= 3: {ok(g['speedup_vs_static_skip_finished_ge_3'])})",
        f"  continuous without prefix sharing: {r['tokens_per_s_continuous_no_prefix_sharing']:,.0f} tokens/s, "
        f"{r['speedup_no_prefix_sharing_vs_static_skip_finished']:.2f}x static skipping finished rows",
        f"  prefix blocks saved (shared system prompt): {r['prefix_blocks_saved']:,}",
        f"  latency at {r['latency_rate_per_s']:.1f} req/s (half the continuous saturation rate): TTFT p50 {_f(r['ttft_p50_ms'], '.1f')} ms, "
        f"p99 {_f(r['ttft_p99_ms'], '.1f')} ms; TPOT p50 {_f(r['tpot_p50_ms'], '.2f')} ms",
        f"  TBT p99 with {r['long_prompt_tokens']}-token prompts mixed in: chunked {_f(r['tbt_p99_ms_chunked'], '.1f')} ms, "
        f"unchunked {_f(r['tbt_p99_ms_unchunked'], '.1f')} ms (goal chunked < half: {ok(g['tbt_chunked_lt_half_unchunked'])})",
        f"  outputs match full recompute (float64, {r['recompute_check_requests']} requests, "
        f"{r['recompute_check_preemptions']} preemptions): {r['outputs_match_recompute']}",
    ]
    if "sweep" in r:
        lines.append(f"\n  open-loop sweep (Poisson){'':<8}{'offered/s':>10}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}")
        for p in r["sweep"]:
            for kind in ("static", "continuous"):
                c = p[kind]
                lines.append(f"  {kind:<33}{p['offered_per_s']:>10.1f}{c['tokens_per_s']:>10,.0f}{_f(c['ttft_p50_ms'], '.1f'):>10}{_f(c['ttft_p99_ms'], '.1f'):>10}")
    return "\n".join(lines)


def plot(path: str, r: dict[str, Any]) -> None:
    """PNG: tokens/s and TTFT (p50, p99; log) against the offered request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = r["sweep"]
    offered = np.array([p["offered_per_s"] for p in sweep])
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for kind, color in (("static", "tab:blue"), ("continuous", "tab:orange")):
        label = "static (finished rows padded)" if kind == "static" else kind
        ax_t.plot(offered, [p[kind]["tokens_per_s"] for p in sweep], marker="o", color=color, label=label)
        for q, style in (("p50", "-"), ("p99", "--")):
            vals = [np.nan if p[kind][f"ttft_{q}_ms"] is None else p[kind][f"ttft_{q}_ms"] for p in sweep]
            ax_l.plot(offered, vals, marker="o", color=color, linestyle=style, label=f"{label} TTFT {q}")
    ax_t.set_xlabel("offered load (requests/s, Poisson)")
    ax_t.set_ylabel("generated tokens/s")
    ax_t.set_title("throughput")
    ax_l.set_yscale("log")
    ax_l.set_xlabel("offered load (requests/s, Poisson)")
    ax_l.set_ylabel("time to first token (ms, log)")
    ax_l.set_title("TTFT")
    for ax in (ax_t, ax_l):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"recserve bench decode ({r['device']}): static vs continuous batching, same batch size and KV bytes")
    fig.savefig(path, dpi=110)
    plt.close(fig)
