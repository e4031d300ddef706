"""The figures and the table of ``recserve bench rank`` (:mod:`recserve.bench.rank`).

:func:`summarise` turns the per-config knee searches and closed-loop runs into the
report's top-level figures: knees and their ratios, the forward-only batching cap
(:mod:`recserve.bench.rank_costs`), the closed-loop ceilings and the whole system's
cost per batch and per request solved from them (:func:`system_cost`), the goals and a
note that says what the figures mean on this host. :func:`format_report` prints it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["CONFIGS", "GOAL_BATCHING_GAIN", "GOAL_SCALING_2", "LABELS", "format_report", "summarise", "system_cost"]

CONFIGS: dict[str, tuple[bool, int]] = {  # name -> (batching, rankers)
    "batched": (True, 1),
    "unbatched": (False, 1),
    "batched_2_rankers": (True, 2),
}
LABELS = {"batched": "batched, 1 ranker", "unbatched": "unbatched, 1 ranker", "batched_2_rankers": "batched, 2 rankers"}
GOAL_BATCHING_GAIN = 3.0
GOAL_SCALING_2 = 1.6


def system_cost(unbatched_per_s: float | None, batched_per_s: float | None, batched_mean: float | None) -> dict[str, float] | None:
    """The whole box's cost per request as ``per_batch / B + per_request`` ms, solved
    from the two closed-loop ceilings: unbatched ``1 / r_u = F + v`` (B = 1), batched
    ``1 / r_b = F / B + v``. It prices everything a batch shares (lookup windows and
    RPCs, Python per batch, the forward's fixed part) against what each request adds,
    on these cores with these neighbours. None without both runs or with B <= 1."""
    if not unbatched_per_s or not batched_per_s or not batched_mean or batched_mean <= 1.0:
        return None
    t_u, t_b = 1e3 / unbatched_per_s, 1e3 / batched_per_s
    per_batch = (t_u - t_b) / (1.0 - 1.0 / batched_mean)
    return {"per_batch_ms": per_batch, "per_request_ms": t_u - per_batch, "mean_batch_requests": batched_mean}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarise(args: argparse.Namespace, configs: dict[str, dict[str, Any]], costs: dict[str, Any], *, cap_formula: str,
              cap: Callable[..., float], seconds: float) -> dict[str, Any]:
    """The report: per-config knees and probes plus the top-level figures and goals."""
    knee = {n: (configs[n]["knee_per_s"] if n in configs else None) for n in CONFIGS}
    batched = configs.get("batched", {})
    b_mean = batched.get("mean_batch_requests_at_knee")
    gain, scaling = _ratio(knee["batched"], knee["unbatched"]), _ratio(knee["batched_2_rankers"], knee["batched"])
    cpus = os.cpu_count() or 1
    theoretical = cap(costs["cpu"], candidates=args.candidates, mean_batch_requests=max(1.0, b_mean)) if b_mean else None
    sat = {n: (c.get("saturation") or {}).get("requests_per_s") for n, c in configs.items()}
    sat_b = (batched.get("saturation") or {}).get("mean_batch_requests")
    system = system_cost(sat.get("unbatched"), sat.get("batched"), sat_b)
    note = (f"{cpus} CPUs shared by {args.shards} shard processes, the ranker processes and this load generator: "
            f"a second ranker adds a process, not a CPU, so 2-ranker scaling is bounded by the CPU one ranker leaves idle")  # fmt: skip
    if scaling is not None:
        note += f"; measured {scaling:.2f}x (goal {GOAL_SCALING_2}x)"
    sat_gain = _ratio(sat.get("batched"), sat.get("unbatched"))
    if b_mean is not None and b_mean < 1.5:
        note += (f"; at the batched knee a forward held {b_mean:.2f} requests: below the SLO the arrivals rarely meet in one window "
                 f"(max_wait_ms {args.max_wait_ms if args.max_wait_ms is not None else 'default'}), so the knee is set by per-request latency "
                 f"(p50 {batched.get('p50_ms_at_knee') or 0:.1f} ms, p99 {batched.get('p99_ms_at_knee') or 0:.1f} ms against {args.slo_ms:g} ms) "
                 f"and batching shows in capacity instead (closed loop {f'{sat_gain:.2f}x' if sat_gain else 'n/a'})")  # fmt: skip
    loads = [p["loadavg_1m"] for c in configs.values() for p in c["probes"]]
    if loads:
        note += f"; mean 1-min load average during the probes {np.mean(loads):.1f} on {cpus} CPUs (other work on the host competes)"
    bounds = [n for n, c in configs.items() if c["status"] != "found"]
    if bounds:
        listed = ", ".join(f"{n} {configs[n]['status']}" for n in bounds)
        note += f"; knees not bracketed (a ratio using them is a bound): {listed}"
    return {
        "config": {"items": args.items, "users": args.users, "impressions": args.impressions, "train_rows": args.train_rows, "candidates": args.candidates,
                   "user_zipf": args.user_zipf, "request_pool": args.request_pool, "shards": args.shards, "configs": list(args.configs),
                   "slo_ms": args.slo_ms, "timeout_ms": args.timeout_ms, "probe_seconds": args.probe_seconds, "min_probe_requests": args.min_probe_requests,
                   "max_probe_seconds": args.max_probe_seconds, "max_probe_requests": args.max_probe_requests, "warmup_requests": args.warmup_requests,
                   "saturation_seconds": args.saturation_seconds, "saturation_concurrency": args.saturation_concurrency,
                   "keep_rankers": args.keep_rankers,
                   "lo_rps": args.lo_rps, "hi_rps": args.hi_rps,
                   "tolerance": args.tolerance, "max_wait_ms": args.max_wait_ms, "max_batch_candidates": args.max_batch_candidates, "seed": args.seed, "cpus": cpus},
        "knee_batched": knee["batched"],
        "knee_unbatched": knee["unbatched"],
        "knee_batched_2_rankers": knee["batched_2_rankers"],
        "batching_gain": gain,
        "scaling_2_rankers": scaling,
        "candidates_per_s_at_knee": {n: c["candidates_per_s_at_knee"] for n, c in configs.items()},
        "forward_cost": {k: v for k, v in costs["cpu"].to_dict().items() if k in ("fixed_ms", "per_candidate_us", "device")},
        "forward_costs": {dev: c.to_dict() for dev, c in costs.items()},
        "forward_cost_cuda": costs["cuda"].to_dict() if "cuda" in costs else None,
        "dedup_ratio": batched.get("dedup_ratio_at_knee"),
        "dedup_ratio_unbatched": configs.get("unbatched", {}).get("dedup_ratio_at_knee"),
        "mean_batch_requests_at_knee": b_mean,
        "theoretical_batching_cap": theoretical,
        # The same cap at the closed-loop run's batches, beside the closed-loop gain:
        # what batching does to capacity when latency is no constraint.
        "saturation_requests_per_s": sat,
        "saturation_gain": sat_gain,
        "saturation_scaling_2_rankers": _ratio(sat.get("batched_2_rankers"), sat.get("batched")),
        "mean_batch_requests_at_saturation": sat_b,
        "theoretical_batching_cap_at_saturation": cap(costs["cpu"], candidates=args.candidates, mean_batch_requests=max(1.0, sat_b)) if sat_b else None,
        "system_cost": system,
        "system_batching_cap_at_knee": (None if system is None or not b_mean else
                                        (system["per_batch_ms"] + system["per_request_ms"]) / (system["per_batch_ms"] / b_mean + system["per_request_ms"])),
        "theoretical_batching_cap_formula": f"forward only: {cap_formula}",
        "goals": {"batching_gain_ge_3": None if gain is None else gain >= GOAL_BATCHING_GAIN,
                  "scaling_2_rankers_ge_1_6": None if scaling is None else scaling >= GOAL_SCALING_2},
        "note": note,
        "configs": configs,
        "seconds": seconds,
    }


def format_report(r: dict[str, Any]) -> str:
    """The human table: knees and ratios, then every probe."""

    def f(v: Any, spec: str = ",.0f") -> str:
        return "n/a" if v is None else format(v, spec)

    c, fc = r["config"], r["forward_cost"]
    lines = [
        f"recserve bench rank: {c['items']:,} items, {c['users']:,} users, {c['candidates']} candidates/request, {c['shards']} shards, SLO {c['slo_ms']:g} ms, {c['cpus']} CPUs",
        f"{'config':<22}{'knee req/s':>11}  {'status':<18}{'cand/s at knee':>15}{'req/forward':>12}{'dedup':>7}{'p99 ms':>8}",
    ]
    for n, k in r["configs"].items():
        lines.append(f"{LABELS[n]:<22}{f(k['knee_per_s'], ',.1f'):>11}  {k['status']:<18}{f(k['candidates_per_s_at_knee']):>15}"
                     f"{f(k['mean_batch_requests_at_knee'], '.1f'):>12}{f(k['dedup_ratio_at_knee'], '.2f'):>7}{f(k['p99_ms_at_knee'], '.1f'):>8}")
    sc = r["system_cost"]
    system = "system cost from the closed-loop ceilings: n/a (needs both closed-loop runs, batched above 1 request/forward)"
    if sc is not None:
        system = (f"system cost from the closed-loop ceilings: {sc['per_batch_ms']:.2f} ms per batch + {sc['per_request_ms']:.2f} ms per request; "
                  f"its cap at the knee's {f(r['mean_batch_requests_at_knee'], '.2f')} requests/forward: {f(r['system_batching_cap_at_knee'], '.2f')}x")
    lines += [
        f"batching gain {f(r['batching_gain'], '.2f')}x (goal >= {GOAL_BATCHING_GAIN:g}x); theoretical cap {f(r['theoretical_batching_cap'], '.2f')}x = {r['theoretical_batching_cap_formula']}",
        f"2-ranker scaling {f(r['scaling_2_rankers'], '.2f')}x (goal >= {GOAL_SCALING_2:g}x)",
        "closed loop (throughput ceiling, latency unbounded): "
        + ", ".join(f"{LABELS[n]} {f(v, ',.1f')} req/s" for n, v in r["saturation_requests_per_s"].items())
        + f"; gain {f(r['saturation_gain'], '.2f')}x at {f(r['mean_batch_requests_at_saturation'], '.1f')} requests/forward "
        f"(forward-only cap {f(r['theoretical_batching_cap_at_saturation'], '.2f')}x), 2-ranker scaling {f(r['saturation_scaling_2_rankers'], '.2f')}x",
        system,
        "forward cost (DLRM score_pooled): " + "; ".join(f"{d['device']} {d['fixed_ms']:.3f} ms + {d['per_candidate_us']:.3f} us/candidate" for d in r["forward_costs"].values())
        + f"  (CPU: {fc['fixed_ms'] + fc['per_candidate_us'] * 1e-3 * c['candidates']:.2f} ms per {c['candidates']}-candidate request)",
        f"lookup dedup ratio (ids / unique ids) at the knee: batched {f(r['dedup_ratio'], '.2f')}, unbatched {f(r['dedup_ratio_unbatched'], '.2f')}",
        f"note: {r['note']}",
        "probes in search order; rate = the rate the knee search asked for, offered = the realised rate of its Poisson schedule, load = the host's 1-min load average",
        f"{'config':<22}{'rate/s':>8}{'offered/s':>10}{'achieved/s':>11}{'OK':>8}{'goodput/s':>10}{'p50 ms':>8}{'p99 ms':>8}{'req/fwd':>8}{'dedup':>7}{'load':>6}  passed",
    ]
    for n, k in r["configs"].items():
        for p in k["probes"]:
            lines.append(f"{LABELS[n]:<22}{f(p['rate_per_s'], ',.1f'):>8}{f(p['offered_per_s']):>10}{f(p['achieved_per_s']):>11}{p['ok_fraction']:>8.1%}{f(p['goodput_per_s']):>10}"
                         f"{f(p['p50_ms'], '.1f'):>8}{f(p['p99_ms'], '.1f'):>8}{f(p['mean_batch_requests'], '.1f'):>8}{f(p['dedup_ratio'], '.2f'):>7}{p['loadavg_1m']:>6.1f}  {p['passed']}")
    return "\n".join(lines)
