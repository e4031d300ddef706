"""``recserve bench recall``: what the L0-L3 cascade keeps, and what it costs, in one run.

The world: a synthetic catalog (``--items``, ``--users``, ``--zipf``, ``--seed``) and the
three models trained on its scrubbed view and exported (``ranker.pipeline``), or an
existing export (``--models DIR`` with its ``--catalog DIR``). The cluster spec is the
export's own (default ``CascadeConfig``; ``--set [SECTION.]KEY=VALUE`` overrides a key,
section ``cascade`` by default, to measure another setting; ``config.default_config``
says whether any was given). The L0 index is built once here (progress bar) and saved,
so the served cascade (``--index``) and the in-process one search the same index. Every
Recommend carries ``--deadline-ms`` (default: ``cascade.default_deadline_ms``); the
warm-up calls get more (:mod:`recserve.bench.recall_calls`).

Measured over ``--queries`` sampled users (figures are means over them):

* ``l0_recall_vs_exact``: the default index's recall@k0 (k0 = L0's output size) against
  FAISS ``IndexFlatIP`` on the same item vectors and user vectors;
* ``stage_recall``: per stage, the fraction of the user's ground-truth top-10 (the
  catalog's click model, history excluded) in that stage's output; the stages run in
  this process with the cascade's own code (:class:`cascade.service.CascadeCore`, its
  ``trace``), calling the real rankers over gRPC for EmbedUser, L2 and L3;
* ``l2_recall_vs_exhaustive``: L2's top-10 against DLRM's top-10 over the whole catalog
  minus seen items (:class:`~recserve.bench.recall_oracles.ExhaustiveDlrm`, in process,
  batched, item side precomputed once; timed as ``exhaustive_l2_ms_p50``);
* ``final_recall_vs_reference``: the final top-10 against in-process L3 over exhaustive
  DLRM's top-100;
* ``cascade_ms_p50`` / ``cascade_ms_p99``: real ``Recommend`` calls over gRPC to the
  served stack (shards, ``[topology] rankers`` rankers, the cascade; ``ServingStack``),
  sequential and unloaded, after a warm-up; ``speedup`` = exhaustive / cascade p50;
* ``lost_at``: for each missed item of the two comparisons above, the first stage whose
  output lacks it (L0 losses split into ``L0_degraded``: L0 skipped or shrank for that
  request, ``L0_index``: in the exact top-k0, lost by the approximate index, and
  ``L0_two_tower``: not even in the exact top-k0);
* ``sweep``: L0 recall@k0 against per-query search time over nprobe / efSearch values
  (:mod:`recserve.bench.recall_sweep`), and its PNG (``OUT/recall_curve.png``).

The report also goes to ``OUT/recall.json``, and every id matrix behind it (users, truth,
exhaustive top-100, reference, exact top-k0, each stage's output) to ``OUT/traces.npz``
for offline analysis, e.g. what another L1 size would have kept.

Goals (issue 12), all at the default CascadeConfig: the three recalls >= 0.95, and
``speedup`` >= 20 at 200k items (>= 100 at 1M). Human table, or one JSON object with
``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from recserve.bench.recall_calls import TOP, WARMUP_DEADLINE_S, served_calls, traced_calls

GOAL_RECALL = 0.95
REFERENCE_POOL = 100  # exhaustive DLRM's top-100 feeds the L3 reference


def _speedup_goal(items: int) -> float:
    return 100.0 if items >= 1_000_000 else 20.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--items", type=int, default=1_000_000, help="catalog items when generating (default 1000000)")
    p.add_argument("--users", type=int, default=100_000, help="catalog users when generating (default 100000)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of item popularity when generating (default 1.05)")
    p.add_argument("--queries", type=int, default=200, help="sampled users measured (default 200)")
    p.add_argument("--warmup", type=int, default=50,
                   help=f"Recommend calls before measuring, on other users, with a deadline of at least {WARMUP_DEADLINE_S:g} s, so the stage "
                        "cost models are a long-running server's (default 50)")  # fmt: skip
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads of the in-process exhaustive DLRM (default 1: two spin against the other processes on a busy 2-core box)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", type=Path, default=None, help="reuse this trained export (default: generate and train into OUT)")
    p.add_argument("--catalog", type=Path, default=None, help="the catalog --models was trained on (default: MODELS/../catalog)")
    p.add_argument("--train-rows", type=int, default=0, help="training rows per epoch and model when training (default 0 = all)")
    p.add_argument("--deadline-ms", type=float, default=0.0, help="each Recommend's deadline (default 0 = the spec's cascade.default_deadline_ms)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="[SECTION.]KEY=VALUE",
                   help="a spec key (section default: cascade), TOML value, e.g. nprobe=64, index_factory='\"HNSW32\"', "
                        "topology.rankers=1; repeatable")  # fmt: skip
    p.add_argument("--knobs", default="1,2,4,8,16,32,64,128,256,512,1024", help="nprobe / efSearch values of the sweep (comma-separated)")
    p.add_argument("--out", type=Path, default=Path("out/bench-recall"), help="catalog, models, index, plot and report go here (default out/bench-recall)")
    p.add_argument("--keep-run", action="store_true", help="keep OUT/run (shard data, logs) after the run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--items", args.items), ("--users", args.users), ("--queries", args.queries)):
        if value < 1:
            raise SystemExit(f"{flag} = {value!r} is invalid: use a positive number")
    try:
        knobs = tuple(sorted({int(x) for x in args.knobs.split(",") if x.strip()}))
    except ValueError:
        knobs = ()
    if not knobs or knobs[0] < 1:
        raise SystemExit(f"--knobs {args.knobs!r} is invalid: give positive integers, comma-separated")
    args.out.mkdir(parents=True, exist_ok=True)
    report = _run(args, knobs)
    (args.out / "recall.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print(json.dumps(report, allow_nan=False) if args.json else format_report(report))
    return 0


def _log(msg: str) -> None:
    print(f"[bench recall] {msg}", file=sys.stderr, flush=True)


def _world(args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]]:
    """(catalog dir, models dir, timings): generate and train into OUT unless --models."""
    times: dict[str, Any] = {}
    if args.models is not None:
        catalog = args.catalog if args.catalog is not None else args.models.parent / "catalog"
        if not (catalog / "manifest.json").is_file():
            raise SystemExit(f"--catalog {str(catalog)!r} is not a catalog dir: give the catalog --models {str(args.models)!r} was trained on")
        return catalog, args.models, times
    from ranker.config import TrainConfig
    from ranker.pipeline import train_and_export
    from recserve.catalog import CatalogConfig, generate_catalog

    catalog, models = args.out / "catalog", args.out / "models"
    t0 = time.perf_counter()
    generate_catalog(CatalogConfig(items=args.items, users=args.users, zipf=args.zipf, seed=args.seed), out_dir=catalog, progress=True)
    times["catalog_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    train_and_export(catalog, models, TrainConfig(seed=args.seed, threads=1, max_rows=args.train_rows, progress=True))
    times["train_s"] = time.perf_counter() - t0
    return catalog, models, times


def _spec(models: Path, overrides: list[str], run_dir: Path) -> tuple[Path, Any]:
    """The export's cluster spec with the ``--set`` overrides, parsed. A key goes at the
    top of its section (the spec's parser rejects a key given twice, so an override of
    a key the export writes, such as ``default_deadline_ms``, fails loudly), or into a
    new section appended when the export has none."""
    from ranker.spec import cluster_spec_toml
    from recserve.config import loads

    manifest = json.loads((models / "manifest.json").read_text())
    text = cluster_spec_toml(manifest, models, num_shards=2)
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().rpartition(".")
        section = section if dot else "cascade"
        if not sep or not name or not section.isidentifier():
            raise SystemExit(f"--set {item!r} is invalid: use [SECTION.]KEY=VALUE, e.g. nprobe=64 or topology.rankers=1")
        header = f"[{section}]\n"
        line = f"{name} = {value.strip()}\n"
        text = text.replace(header, header + line, 1) if header in text else text + f"\n{header}{line}"
    cluster = loads(text)  # a bad override fails here, naming the field
    path = run_dir / "cluster.toml"
    path.write_text(text)
    return path, cluster


def _run(args: argparse.Namespace, knobs: tuple[int, ...]) -> dict[str, Any]:
    import faiss
    import torch

    from cascade.budget import stage_sizes_for
    from cascade.export_view import open_export_view
    from cascade.index import build_index
    from cascade.service import index_config
    from ranker.models.dlrm import DlrmRanker
    from ranker.models.l3 import L3Reranker
    from ranker.models.two_tower import TwoTower
    from ranker.scoring import user_vectors
    from ranker.serving import load_model, open_export
    from ranker.spec import tables_and_features
    from recserve.bench.recall_oracles import ExhaustiveDlrm, overlap_fraction, rerank_l3, truth_top_k
    from recserve.bench.recall_sweep import exact_top_k, plot_sweep, sweep
    from recserve.catalog import load_catalog
    from recserve.sharding import plan_tables

    torch.set_num_threads(max(1, args.torch_threads))
    catalog_dir, models, times = _world(args)
    run_dir = args.out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec_path, cluster = _spec(models, args.overrides, run_dir)
    cfg = cluster.cascade
    export = open_export(models)
    arrays = export.arrays
    n = arrays.num_items
    sizes = stage_sizes_for(cfg, n, TOP)
    users = np.sort(np.random.default_rng(args.seed + 11).choice(arrays.num_users, size=min(args.queries, arrays.num_users), replace=False)).astype(np.int64)
    warm_users = np.setdiff1d(np.arange(min(arrays.num_users, users.size + args.warmup + 1)), users)[: args.warmup]

    # ---- the index, built once and shared by the served and the in-process cascade
    view = open_export_view(models)
    t0 = time.perf_counter()
    index = build_index(np.asarray(view.item_vectors), None, index_config(cfg), model_version=view.model_version, progress=True)
    times["index_build_s"] = time.perf_counter() - t0
    index.save(run_dir / "index")
    _log(f"{index.factory} over {n:,} items built in {times['index_build_s']:.1f} s; stage sizes {sizes}")

    # ---- oracles (before the stack starts: nothing else runs on the cores)
    faiss.omp_set_num_threads(1)  # the cascade process searches with one thread
    two_tower, dlrm_model, l3_model = (load_model(export, name, device="cpu", with_tables=True) for name in ("two_tower", "dlrm", "l3"))
    assert isinstance(two_tower, TwoTower) and isinstance(dlrm_model, DlrmRanker) and isinstance(l3_model, L3Reranker)
    with torch.no_grad():
        uvec = user_vectors(two_tower, arrays, users).float().numpy()
    exact_l0, exact_s = exact_top_k(np.asarray(view.item_vectors), uvec, sizes.l0)
    points = sweep(index, uvec, exact_l0, exact_s, sizes.l0, knobs)
    approx_l0, _ = index.search(uvec, sizes.l0)
    l0_recall = float(overlap_fraction(approx_l0, exact_l0).mean())
    catalog = load_catalog(catalog_dir)
    truth = truth_top_k(catalog, arrays, users, TOP)
    dlrm = ExhaustiveDlrm(dlrm_model, arrays)
    check = dlrm.check(users[:4])
    exhaustive, exhaustive_s = dlrm.top_k(users, REFERENCE_POOL)
    reference = rerank_l3(l3_model, arrays, users, exhaustive, TOP)
    _log(f"oracles ready: exhaustive DLRM p50 {np.percentile(exhaustive_s, 50) * 1e3:.1f} ms/user ({torch.get_num_threads()} torch threads), |Δ| vs score_pairs {check:.1e}")

    # ---- the served stack and the in-process cascade
    from recserve.cluster.cascade import CascadeCluster
    from recserve.cluster.stack import ServingStack

    tables, _ = tables_and_features(export.manifest)
    # The item table's access frequency: its training-log impressions (rows past the catalog,
    # headroom for items added later, get the floor of 1).
    item_rows = next(t.rows for t in tables if t.name == "dlrm_item")
    freq = {"dlrm_item": np.ones(item_rows, dtype=np.float64)}
    freq["dlrm_item"][:n] += np.asarray(arrays.counts.item[:, 0], dtype=np.float64)
    plan_tables(list(tables), freq, cluster.sharding, seed=args.seed).plan.save(run_dir / "plan.json")
    deadline_s = (args.deadline_ms or cfg.default_deadline_ms) / 1e3
    try:
        with ServingStack(cluster, spec_path=spec_path, models_dir=models, plan_path=run_dir / "plan.json", data_root=run_dir, cascade=False) as stack:
            assert stack.rankers is not None
            with CascadeCluster(spec_path, models, stack.rankers.addresses, stack.shards.client_addresses, data_root=run_dir / "cascade",
                                extra_args=["--index", str(run_dir / "index")]) as cascade:  # fmt: skip
                served = served_calls(cascade.address, warm_users, users, deadline_s)
                traced = asyncio.run(traced_calls(cluster, view, index, stack.rankers.addresses, warm_users, users, deadline_s, exhaustive, reference))
    finally:
        if not args.keep_run:
            shutil.rmtree(run_dir / "shards", ignore_errors=True)

    stages: dict[str, np.ndarray] = traced["stages"]
    l0_degraded = traced["l0_degraded"]
    l2_top = stages["L2"][:, :TOP]
    final = stages["L3"][:, :TOP]
    exhaustive_top = exhaustive[:, :TOP]
    cascade_p50 = float(np.percentile(served["ms"], 50))
    exhaustive_p50 = float(np.percentile(exhaustive_s, 50) * 1e3)
    report: dict[str, Any] = {
        "config": {"items": n, "users": arrays.num_users, "queries": int(users.size), "seed": args.seed, "models": str(models), "catalog": str(catalog_dir),
                   "model_version": export.model_version, "index": index.factory, "index_knob": index.knob.value, "index_knob_default": index.default_knob(sizes.l0),
                   "stage_sizes": [sizes.l0, sizes.l1, sizes.l2, sizes.l3], "deadline_ms": deadline_s * 1e3, "rankers": cluster.topology.rankers,
                   "overrides": list(args.overrides), "default_config": not args.overrides, "torch_threads": torch.get_num_threads(), **times},  # fmt: skip
        "l0_recall_vs_exact": l0_recall,
        "stage_recall": {name: float(overlap_fraction(ids, truth).mean()) for name, ids in stages.items()},
        "l2_recall_vs_exhaustive": float(overlap_fraction(l2_top, exhaustive_top).mean()),
        "l2_top100_vs_exhaustive_top100": float(overlap_fraction(stages["L2"], exhaustive).mean()),
        "served_l3_vs_reference": traced["served_l3_vs_reference"],
        "final_recall_vs_reference": float(overlap_fraction(final, reference).mean()),
        "exhaustive_recall_vs_truth": float(overlap_fraction(exhaustive_top, truth).mean()),
        "reference_recall_vs_truth": float(overlap_fraction(reference, truth).mean()),
        "lost_at": {
            "l2_vs_exhaustive": _lost_at(exhaustive_top, stages, exact_l0, l0_degraded, until="L2"),
            "final_vs_reference": _lost_at(reference, stages, exact_l0, l0_degraded, until="L3"),
            "truth": _lost_at(truth, stages, exact_l0, l0_degraded, until="L3"),
        },
        "cascade_ms_p50": cascade_p50,
        "cascade_ms_p99": float(np.percentile(served["ms"], 99)),
        "exhaustive_l2_ms_p50": exhaustive_p50,
        "speedup": exhaustive_p50 / cascade_p50,
        "stage_ms_p50": served["stage_ms_p50"],
        "degraded_responses": served["degraded"],
        "failed_responses": served["failed"],
        "degraded_reasons": served["reasons"],
        "inprocess_degraded_reasons": traced["reasons"],
        "inprocess_stage_ran_ms_p50": traced["ran_ms_p50"],
        "served_vs_inprocess_overlap": float(overlap_fraction(served["items"], final).mean()),
        "exhaustive_check_max_abs_diff": check,
        "sweep": [dataclasses.asdict(p) for p in points],
    }
    report["goals"] = {
        "l0_recall_vs_exact": _goal(report["l0_recall_vs_exact"], GOAL_RECALL),
        "l2_recall_vs_exhaustive": _goal(report["l2_recall_vs_exhaustive"], GOAL_RECALL),
        "final_recall_vs_reference": _goal(report["final_recall_vs_reference"], GOAL_RECALL),
        "speedup": _goal(report["speedup"], _speedup_goal(n)),
    }
    # Everything the figures came from, for analysis offline (e.g. other stage sizes or priors).
    saved: dict[str, np.ndarray] = {"users": users, "truth": truth, "exhaustive": exhaustive, "reference": reference, "exact_l0": exact_l0,
                                    "l0_degraded": l0_degraded, "served": served["items"], **{f"stage_{k}": v for k, v in stages.items()}}  # fmt: skip
    np.savez_compressed(args.out / "traces.npz", **saved)  # type: ignore[arg-type]  # numpy's stub types **kwds as its bool flag
    plot = args.out / "recall_curve.png"
    plot_sweep(plot, points, k0=sizes.l0, title=f"recserve bench recall: L0 {index.factory}, {n:,} items, k0 = {sizes.l0:,}, {users.size} users")
    report["plot"] = str(plot)
    return report


def _goal(value: float, target: float) -> dict[str, Any]:
    return {"value": value, "target": target, "met": bool(value >= target)}


def _lost_at(wanted: np.ndarray, stages: dict[str, np.ndarray], exact_l0: np.ndarray, l0_degraded: np.ndarray, *, until: str) -> dict[str, int]:
    """Count each item of ``wanted`` ``[B, k]`` missing from the ``until`` stage's top-k by
    the first stage whose output lacks it (``kept_but_outranked``: in every stage's output
    up to ``until`` but below its top k). L0's losses are split three ways: ``L0_degraded``
    (L0 skipped or shrank for that request, ``l0_degraded`` ``[B]``), ``L0_index`` (in the
    exact top-k0: the approximate index lost it) and ``L0_two_tower`` (not even there)."""
    from recserve.bench.recall_oracles import contains

    names = ["L0", "L1", "L2", "L3"][: ["L0", "L1", "L2", "L3"].index(until) + 1]
    k = wanted.shape[1]
    present = {s: contains(stages[s], wanted) for s in names}  # [B, k] each
    in_top = contains(stages[until][:, :k], wanted)
    in_exact = contains(exact_l0, wanted)
    out: dict[str, int] = {"missed": int((~in_top).sum()), "of": int(wanted.size)}
    alive = ~in_top
    for s in names:
        lost = alive & ~present[s]
        if s == "L0":
            degraded = np.broadcast_to(l0_degraded[:, None], lost.shape)
            out["L0_degraded"] = int((lost & degraded).sum())
            out["L0_index"] = int((lost & ~degraded & in_exact).sum())
            out["L0_two_tower"] = int((lost & ~degraded & ~in_exact).sum())
        else:
            out[s] = int(lost.sum())
        alive &= present[s]
    out["kept_but_outranked"] = int(alive.sum())
    return out


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"recserve bench recall: {c['items']:,} items, {c['queries']} users, index {c['index']} ({c['index_knob']} {c['index_knob_default']}), "
        f"stages {' -> '.join(f'{s:,}' for s in c['stage_sizes'])}, deadline {c['deadline_ms']:g} ms, {c['rankers']} rankers",
        "default CascadeConfig" if c["default_config"] else f"overrides (not the default config): {' '.join(c['overrides'])}",
        "",
        f"{'metric':<28} {'value':>10} {'goal':>8}  met",
    ]
    for key, g in r["goals"].items():
        lines.append(f"{key:<28} {g['value']:>10.3f} {g['target']:>8g}  {'yes' if g['met'] else 'NO'}")
    lines += [
        f"{'cascade_ms_p50 / p99':<28} {r['cascade_ms_p50']:>10.1f} {r['cascade_ms_p99']:>8.1f}",
        f"{'exhaustive_l2_ms_p50':<28} {r['exhaustive_l2_ms_p50']:>10.1f}",
        f"{'degraded / failed calls':<28} {r['degraded_responses']:>10d} {r['failed_responses']:>8d}  {r['degraded_reasons'] or ''}",
        f"{'served vs in-process top-10':<28} {r['served_vs_inprocess_overlap']:>10.3f}",
        f"{'served L3 vs reference L3':<28} {r['served_l3_vs_reference']:>10.3f}",
        f"{'L2 top-100 vs exhaustive':<28} {r['l2_top100_vs_exhaustive_top100']:>10.3f}",
        "",
        "stage    out  recall@10 of truth   p50 ms served   p50 ms when run (in-process)",
    ]
    for (name, rec), size in zip(r["stage_recall"].items(), c["stage_sizes"]):
        ran = r["inprocess_stage_ran_ms_p50"].get(name, math.nan)
        lines.append(f"{name:<5} {size:>6,}  {rec:>18.3f}   {r['stage_ms_p50'].get(name, math.nan):>13.2f}   {ran:>28.2f}")
    lines.append(f"in-process degraded stages: {r['inprocess_degraded_reasons'] or 'none'}")
    lines += [f"exhaustive DLRM top-10 vs truth {r['exhaustive_recall_vs_truth']:.3f}; L3 reference vs truth {r['reference_recall_vs_truth']:.3f}", ""]
    for key, lost in r["lost_at"].items():
        lines.append(f"lost ({key}): " + ", ".join(f"{k} {v}" for k, v in lost.items()))
    lines += ["", f"{'L0 knob':<10} {'value':>6} {'recall@k0':>10} {'p50 ms':>8} {'p99 ms':>8}"]
    for p in r["sweep"]:
        lines.append(f"{p['knob']:<10} {p['value']:>6} {p['recall']:>10.3f} {p['ms_p50']:>8.3f} {p['ms_p99']:>8.3f}{'  (default)' if p['default'] else ''}")
    lines.append(f"plot: {r['plot']}")
    return "\n".join(lines)
