"""``recserve train``: train models.

``recserve train --lm`` trains the small decode LM (:mod:`generation.train`) on templated
text from a synthetic catalog — a small one generated in memory, or ``--catalog DIR`` —
with a progress bar and a fixed seed, writes a checkpoint directory, reloads it from
disk and prints greedy samples from the reloaded model.

``recserve train --catalog DIR --out MODELS [--device auto|cpu|cuda]`` (no ``--lm``)
trains the ranker models — DLRM, two-tower, L3 (:mod:`ranker.pipeline`) — on the
catalog's scrubbed view, evaluates them against its ground truth, exports them to
MODELS with one model_version, writes ``MODELS/metrics.json`` and a cluster spec sized
to the catalog (``MODELS/cluster.toml``), and prints the metrics table. With
``--serving-log PATH`` it first reads the cascade's serving log (``cascade.log_path``
and its rotated files, :mod:`cascade.serving_log`) and appends its impressions to the
train split: label 1 where the log holds a click for that request and item, else 0.

Argparse only at import time; torch loads inside :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

SAMPLE_PROMPTS = ("because you liked items in category 12,", "item 42 is in category", "user 7 liked item")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train the ranker models (DLRM, two-tower, L3) on a catalog; --lm: the decode LM")
    p.add_argument("--lm", action="store_true", help="train the small decode LM on templated catalog text")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: models for the rankers, checkpoints/lm for --lm)")
    p.add_argument("--catalog", type=Path, default=None, help="catalog directory (default: a small one generated in memory)")
    p.add_argument("--serving-log", type=Path, default=None, metavar="PATH",
                   help="rankers: append the impressions of this serving log (cascade.log_path, rotated files included) to the train split")
    p.add_argument("--epochs", type=int, default=None, help="rankers: DLRM / L3 passes over the train split (default 1)")
    p.add_argument("--shards", type=int, default=2, help="rankers: num_shards of the written cluster spec (default 2)")
    p.add_argument("--threads", type=int, default=1, help="rankers: torch threads (default 1: two spin against other processes on a busy 2-core box, 7x slower here; 0 = torch's default)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 400: a few minutes on 2 CPU cores)")
    p.add_argument("--batch", type=int, default=None, help="windows per step (default 16)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default 96)")
    p.add_argument("--seed", type=int, default=0, help="seed of the catalog, corpus, init and batches (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto = CUDA when available (default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run_rankers(args: argparse.Namespace) -> int:
    """The ranker path: train, evaluate, export, print the metrics table."""
    import dataclasses

    from recserve.errors import ConfigError

    if args.catalog is None:  # before torch loads: a usage error should be instant
        raise ConfigError("recserve train needs --catalog DIR (create one with `recserve catalog generate --out DIR`), or --lm for the decode LM")
    from ranker.config import TrainConfig
    from ranker.evaluate import format_metrics
    from ranker.pipeline import train_and_export

    config = TrainConfig(seed=args.seed, device=args.device, progress=not args.no_progress, threads=args.threads)
    if args.epochs is not None:
        config = dataclasses.replace(config, epochs=args.epochs)
    out = args.out if args.out is not None else Path("models")
    logged: dict[str, Any] = {}
    extra = None
    if args.serving_log is not None:
        from cascade.serving_log import read_serving_log

        contents = read_serving_log(args.serving_log)
        extra = contents.impressions
        logged = {"files": [str(f) for f in contents.files], "requests": len(contents.requests), "impressions": len(extra),
                  "clicks": int(extra.label.sum()), "unmatched_clicks": contents.unmatched_clicks, "torn_records": contents.torn_records,
                  "model_versions": contents.model_versions()}  # fmt: skip
        if not args.json:
            print(f"serving log {args.serving_log}: {logged['requests']} responses, {logged['impressions']} impressions, {logged['clicks']} clicked "
                  f"({len(contents.files)} files, {contents.torn_records} torn records skipped)")  # fmt: skip
    report = train_and_export(args.catalog, out, config, num_shards=args.shards, extra_impressions=extra)
    if extra is not None:
        logged.update(appended=report.extra_rows, dropped_outside_tables=report.extra_dropped)
    if args.json:
        body = {"models": str(out), "model_version": report.manifest["model_version"], "device": report.device, **report.metrics, "seconds": report.seconds}
        if extra is not None:
            body["serving_log"] = logged
        print(json.dumps(body, sort_keys=True))
        return 0
    if extra is not None:
        print(f"train split: +{report.extra_rows} logged impressions ({report.extra_dropped} dropped: user or item outside the tables)")
    print(f"trained DLRM, two-tower and L3 on {report.device} in {report.seconds['train_total']:.0f} s; model_version {report.manifest['model_version']}")
    print(format_metrics(report.metrics, report.seconds))
    print(f"export: {out}/ (embeddings/, dense/, index/, serving/, metrics.json, cluster.toml)")
    return 0


def run(args: argparse.Namespace) -> int:
    if not args.lm:
        return run_rankers(args)
    if args.out is None:
        args.out = Path("checkpoints/lm")
    import dataclasses

    import numpy as np
    import torch
    from tqdm import tqdm

    from generation.model import resolve_device
    from generation.train import LM_CONFIG, TrainConfig, catalog_corpus, greedy_text, load_checkpoint, save_checkpoint, train_lm
    from recserve.catalog import CatalogConfig, generate_catalog, load_catalog

    overrides = {k: v for k, v in (("steps", args.steps), ("batch", args.batch), ("seq_len", args.seq_len)) if v is not None}
    train_cfg = dataclasses.replace(TrainConfig(seed=args.seed), **overrides)
    device = resolve_device(args.device)
    started = time.perf_counter()
    if args.catalog is not None:
        catalog = load_catalog(args.catalog)
    else:
        catalog = generate_catalog(CatalogConfig(items=5000, users=1000, impressions=1000, categories=32, tags=256, seed=args.seed),
                                   None, progress=False)
    corpus = catalog_corpus(catalog.item_category, catalog.item_tags, catalog.user_history, rng=np.random.default_rng(args.seed))
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    bar = tqdm(total=train_cfg.steps, desc="train --lm", unit="step", disable=args.no_progress, file=sys.stderr)

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")

    model, losses = train_lm(corpus, LM_CONFIG, train_cfg, device=device, progress=progress)
    bar.close()
    elapsed = time.perf_counter() - started
    tail = float(np.mean(losses[-20:]))
    meta = {"train": dataclasses.asdict(train_cfg), "corpus_bytes": len(corpus.encode()), "final_loss": tail,
            "train_seconds": round(elapsed, 1), "device": str(device)}
    version = save_checkpoint(args.out, model, meta)
    loaded, doc = load_checkpoint(args.out)  # the samples come from the checkpoint on disk
    samples = {p: greedy_text(loaded, p) for p in SAMPLE_PROMPTS}
    if args.json:
        print(json.dumps({"checkpoint": str(args.out), "model_version": version, "steps": train_cfg.steps, "first_loss": losses[0],
                          "final_loss": tail, "train_seconds": elapsed, "device": str(device), "samples": samples}, sort_keys=True))
        return 0
    print(f"trained the decode LM: {train_cfg.steps} steps in {elapsed:.0f} s on {device}; "
          f"loss {losses[0]:.2f} -> {tail:.2f} (bits/byte {tail / np.log(2):.2f})")
    print(f"checkpoint: {args.out}/ (config.json, model.pt), model_version {doc['model_version']}")
    print("greedy samples from the reloaded checkpoint:")
    for prompt, text in samples.items():
        print(f"  {prompt!r} -> {text!r}")
    return 0
