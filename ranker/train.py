"""Training of the three models on a :class:`~ranker.scrubbed.ScrubbedCatalog`.

The scrubbed view is the only input: nothing here can reach the catalog's latent
vectors or click model (a test trains on a full catalog and on a copy without them
and compares the weights). Determinism: one ``torch.Generator`` per model for the
initial weights and one numpy ``Generator`` per epoch for the row order, all derived
from ``TrainConfig.seed``, so reruns on the same machine and device match.

- DLRM and L3: BCE on the train split's impressions, leave-one-out count features,
  one epoch (a second one memorises the id tables).
- Two-tower: in-batch sampled softmax over the train split's clicks and the users'
  history entries (leave-one-out inputs) with the logQ correction (subtract a share of
  the log of each item's frequency among the candidates, so popular items are not
  over-penalised for appearing as negatives more often), duplicate positives of the
  same item masked out of the negatives.
- Embedding tables get sparse gradients and :class:`~ranker.optim.RowSparseAdam`;
  dense layers plain Adam; both rates decay linearly to ``TrainConfig.lr_final`` of
  their base over the run (:func:`~ranker.optim.linear_decay`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ranker.config import TrainConfig
from ranker.features import ServingArrays, gather_jagged, serving_arrays, user_dense_features
from ranker.models.common import to_tensor
from ranker.models.dlrm import DlrmRanker, dlrm_table_rows
from ranker.models.l3 import L3Reranker
from ranker.models.two_tower import USER_TOWER_FEATURES, TwoTower
from ranker.optim import RowSparseAdam, linear_decay
from ranker.scoring import dlrm_logits, item_vectors, l3_logits, resolve_device, tables_of
from ranker.scrubbed import ScrubbedCatalog

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainedModels:
    """The three trained models (on ``device``), the serving arrays they were trained
    with, per-model wall seconds and final mean losses."""

    dlrm: DlrmRanker
    two_tower: TwoTower
    l3: L3Reranker
    arrays: ServingArrays
    device: torch.device
    seconds: dict[str, float]
    losses: dict[str, float]


def table_rows(catalog: ScrubbedCatalog) -> dict[str, int]:
    """Rows of every trained table (all three models)."""
    rows = dlrm_table_rows(catalog.num_users, catalog.num_items, catalog.num_categories, catalog.num_tags)
    for prefix in ("tt", "l3"):
        rows.update({f"{prefix}_item": catalog.num_items, f"{prefix}_category": catalog.num_categories, f"{prefix}_tag": catalog.num_tags})
    return rows


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's global RNG (``nn.Linear`` initialises from it) for one model's
    construction, restoring the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _batches(n: int, batch: int, rng: np.random.Generator, cap: int) -> Iterator[np.ndarray]:
    order = rng.permutation(n)
    if cap:
        order = order[:cap]
    for lo in range(0, len(order), batch):
        yield np.sort(order[lo : lo + batch])  # sorted rows read the memory-mapped log in order


Model = DlrmRanker | TwoTower | L3Reranker
# One random stream per model for the row order (the seed list [seed, epoch, stream]).
MODEL_STREAMS = {"dlrm": 0, "two_tower": 1, "l3": 2}


def _optimizers(model: Model, lr: float) -> list[torch.optim.Optimizer]:
    """SparseAdam for the embedding tables (sparse gradients: only looked-up rows move),
    Adam for the dense layers."""
    tables = list(tables_of(model).values())
    table_ids = {id(t) for t in tables}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    return [RowSparseAdam(tables, lr=lr), torch.optim.Adam(dense, lr=lr)]


def _fit(
    name: str,
    model: Model,
    n_rows: int,
    batch: int,
    epochs: int,
    config: TrainConfig,
    step: Callable[[np.ndarray], torch.Tensor],
) -> float:
    """Adam over ``epochs`` passes of ``n_rows`` rows; ``step(rows)`` returns the loss of
    a batch of row indices. Returns the last epoch's mean loss."""
    opts = _optimizers(model, config.tt_lr if name == "two_tower" else config.lr)
    total = min(n_rows, config.max_rows) if config.max_rows else n_rows
    schedules = linear_decay(opts, epochs * -(-total // batch), config.lr_final)
    model.train()
    mean = float("nan")
    for epoch in range(epochs):
        rng = np.random.default_rng([config.seed, epoch, MODEL_STREAMS[name]])
        bar = tqdm(total=total, desc=f"train {name} epoch {epoch + 1}/{epochs}", unit="row", file=sys.stderr, disable=not config.progress, leave=False)
        losses: list[float] = []
        with bar:
            for rows in _batches(n_rows, batch, rng, config.max_rows):
                loss = step(rows)
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                for opt in opts:
                    opt.step()
                for schedule in schedules:
                    schedule.step()
                losses.append(float(loss.detach()))
                bar.update(len(rows))
                if len(losses) % 10 == 0:
                    bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
        mean = float(np.mean(losses)) if losses else float("nan")
        log.info("%s epoch %d: mean loss %.4f", name, epoch + 1, mean)
    model.eval()
    return mean


def train_dlrm(catalog: ScrubbedCatalog, arrays: ServingArrays, config: TrainConfig, device: torch.device) -> tuple[DlrmRanker, float]:
    with _seeded(config.seed):
        model = DlrmRanker(config.dlrm, table_rows(catalog), generator=torch.Generator().manual_seed(config.seed)).to(device)
    users, items, labels = (np.asarray(a) for a in (catalog.train.user, catalog.train.item, catalog.train.label))

    def step(rows: np.ndarray) -> torch.Tensor:
        y = labels[rows]
        logits = dlrm_logits(model, arrays, users[rows], items[rows], y)
        return F.binary_cross_entropy_with_logits(logits, torch.from_numpy(y.astype(np.float32)).to(device))

    return model, _fit("dlrm", model, len(labels), config.batch_size, config.epochs, config, step)


def train_l3(catalog: ScrubbedCatalog, arrays: ServingArrays, config: TrainConfig, device: torch.device) -> tuple[L3Reranker, float]:
    with _seeded(config.seed + 2):
        model = L3Reranker(config.l3, table_rows(catalog), generator=torch.Generator().manual_seed(config.seed + 2)).to(device)
    users, items, labels = (np.asarray(a) for a in (catalog.train.user, catalog.train.item, catalog.train.label))

    def step(rows: np.ndarray) -> torch.Tensor:
        y = labels[rows]
        logits = l3_logits(model, arrays, users[rows], items[rows], y)
        return F.binary_cross_entropy_with_logits(logits, torch.from_numpy(y.astype(np.float32)).to(device))

    return model, _fit("l3", model, len(labels), config.batch_size, config.epochs, config, step)


def _user_tower_input(model: TwoTower, arrays: ServingArrays, users: np.ndarray, exclude: np.ndarray, device: torch.device) -> torch.Tensor:
    """``[B, out_dim]`` user vectors with each user's ``exclude`` history entry (an
    absolute index into the history values, -1 = none) left out of the input."""
    values, lengths = gather_jagged(arrays.user_history, users, exclude=exclude)
    lens = to_tensor(lengths, device)
    jag = {"tt_history_items": (to_tensor(values, device), lens), "tt_history_categories": (to_tensor(np.take(arrays.item_category, values), device), lens)}
    return model.user_from_pooled(model.pool(jag, USER_TOWER_FEATURES), to_tensor(user_dense_features(arrays, users), device))


def train_two_tower(catalog: ScrubbedCatalog, arrays: ServingArrays, config: TrainConfig, device: torch.device) -> tuple[TwoTower, float]:
    """Positives: every click of the train split, and every history entry with the user
    tower reading the rest of the history (leave-one-out: the target is never its own
    input). Histories are what a real system logs as engagement; they carry most of
    the signal (≈20× the clicks of the log)."""
    with _seeded(config.seed + 1):
        model = TwoTower(config.two_tower, table_rows(catalog), generator=torch.Generator().manual_seed(config.seed + 1)).to(device)
    clicked = np.flatnonzero(np.asarray(catalog.train.label) == 1)
    hist = arrays.user_history
    users = np.concatenate([np.asarray(catalog.train.user)[clicked], np.repeat(np.arange(hist.num_rows, dtype=np.int64), hist.lengths())])
    items = np.concatenate([np.asarray(catalog.train.item)[clicked], hist.values])
    exclude = np.concatenate([np.full(len(clicked), -1, dtype=np.int64), np.arange(len(hist.values), dtype=np.int64)])
    tt = config.two_tower
    n_items = catalog.num_items
    # Candidates of a batch: its B positives (drawn ∝ each item's share q of the
    # positives) plus K uniform items (mixed negative sampling: tail items, which
    # in-batch sampling almost never shows, get pushed down too). logQ: an item's
    # expected count among the candidates is B·q + K/N; subtract (a share of) its log.
    share = np.bincount(items, minlength=n_items) / max(1, len(items))
    b, k = config.tt_batch_size, tt.uniform_negatives
    # Items never positive and not sampled (k = 0) are never candidates: clamp their log.
    log_q = torch.from_numpy(np.log(np.maximum(b * share + k / n_items, 1e-30))).float().to(device)
    neg_rng = np.random.default_rng([config.seed, 1])

    def step(rows: np.ndarray) -> torch.Tensor:
        cand = np.concatenate([items[rows], neg_rng.integers(0, n_items, k)])
        u = _user_tower_input(model, arrays, users[rows], exclude[rows], device)
        v = item_vectors(model, arrays, cand)
        cand_t = torch.from_numpy(cand).to(device)
        logits = (u @ v.T) / tt.temperature - tt.logq_weight * log_q[cand_t][None, :]
        # Another candidate that is this row's own positive item is no negative.
        same = torch.from_numpy(items[rows][:, None] == cand[None, :]).to(device)
        same[:, : len(rows)].fill_diagonal_(False)
        logits = logits.masked_fill(same, float("-inf"))
        return F.cross_entropy(logits, torch.arange(len(rows), device=device))

    return model, _fit("two_tower", model, len(items), config.tt_batch_size, config.tt_epochs, config, step)


def train_all(catalog: ScrubbedCatalog, config: TrainConfig = TrainConfig()) -> TrainedModels:
    """Train the two-tower, DLRM and L3 (in that order) on ``catalog``."""
    device = resolve_device(config.device)
    arrays = serving_arrays(catalog)
    seconds: dict[str, float] = {}
    losses: dict[str, float] = {}
    t0 = time.perf_counter()
    tt, losses["two_tower"] = train_two_tower(catalog, arrays, config, device)
    seconds["two_tower"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dlrm, losses["dlrm"] = train_dlrm(catalog, arrays, config, device)
    seconds["dlrm"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    l3, losses["l3"] = train_l3(catalog, arrays, config, device)
    seconds["l3"] = time.perf_counter() - t0
    return TrainedModels(dlrm=dlrm, two_tower=tt, l3=l3, arrays=arrays, device=device, seconds=seconds, losses=losses)
