"""The validated configs of the three models and of one training run.

Each model config is what its checkpoint's ``<model>.json`` holds (plus the
``model_version``), so serving rebuilds the exact module shape from the export.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from recserve.errors import ConfigError, require

T = TypeVar("T")


def _from_dict(cls: type[T], data: dict[str, Any]) -> T:
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{cls.__name__} has unknown fields {unknown}: re-export the models with this version")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


@dataclasses.dataclass(frozen=True)
class DlrmConfig:
    """``torchrec.models.dlrm.DLRM`` sizes: every table ``embedding_dim`` wide (DLRM's
    interaction needs one width), dense arch ending at ``embedding_dim``.

    32 wide rather than 16: with the crossed category table and a decaying rate,
    held-out AUC 0.8414 vs 0.8404 on a 50k-item catalog (default users and log), 0.8175
    vs 0.8163 on a 200k-item one. Not taken: 64 wide (0.8419 on 50k, slower), an over
    arch of (128, 64, 1) (0.8418 on 50k but 0.8170 on 200k).
    """

    embedding_dim: int = 32
    dense_arch: tuple[int, ...] = (64, 32)
    over_arch: tuple[int, ...] = (64, 32, 1)

    def __post_init__(self) -> None:
        require(self.embedding_dim > 0, "dlrm.embedding_dim", self.embedding_dim, "use a positive width")
        require(len(self.dense_arch) > 0 and self.dense_arch[-1] == self.embedding_dim, "dlrm.dense_arch", list(self.dense_arch), f"end the dense arch at embedding_dim ({self.embedding_dim})")
        require(len(self.over_arch) > 0 and self.over_arch[-1] == 1, "dlrm.over_arch", list(self.over_arch), "end the over arch at 1 (one logit)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DlrmConfig:
        return _from_dict(cls, data)


@dataclasses.dataclass(frozen=True)
class TwoTowerConfig:
    """Towers map ``embedding_dim``-wide pooled rows through one ``hidden`` layer to
    ``out_dim`` unit vectors; softmax temperature ``temperature``.

    Defaults from a sweep on a 50k-item catalog (25k users, 500k impressions; recall@100
    vs the ground truth): 16-wide rows 0.21 (8: 0.18, 32: 0.17), τ 0.05 ≈ 0.1, logQ
    weight 0.25 (0.5: 0.15; 1.0 about half of 0.25's recall on a 20k-item catalog: the
    click model keeps a popularity term),
    batch 1,024 (2,048: 0.16), one epoch (two: 0.17, the id rows overfit).

    Then, on a 50k-item catalog with default users and log (1,000 users, not the
    evaluation sample): 0.266 with the above; 128-wide ``tt_category`` rows 0.338 (the
    user's category mix is what the ground truth mostly ranks by, and 16 wide rows pool
    128 categories into 16 numbers); ``out_dim`` 64 0.342; a linearly decaying rate
    (:attr:`TrainConfig.lr_final`) 0.349.
    """

    embedding_dim: int = 16
    hidden: int = 128
    out_dim: int = 64
    temperature: float = 0.05
    # Fraction of log q subtracted (1 = the full logQ correction; < 1 leaves part of the
    # popularity prior in the scores, as the click model's own popularity term does).
    logq_weight: float = 0.25
    # Uniformly sampled extra negatives per batch (0 = in-batch negatives only; 1,024
    # measured 0.02 lower recall@100 on a 50k-item catalog).
    uniform_negatives: int = 0
    # Width of the ``tt_category`` rows (0 = ``embedding_dim``): one row per category,
    # so width costs nothing in memorisation (see the class docstring).
    category_dim: int = 128

    @property
    def category_width(self) -> int:
        return self.category_dim or self.embedding_dim

    def __post_init__(self) -> None:
        require(0.0 <= self.logq_weight <= 1.0, "two_tower.logq_weight", self.logq_weight, "use a fraction in [0, 1]")
        require(self.category_dim >= 0, "two_tower.category_dim", self.category_dim, "use >= 0 (0 = embedding_dim)")
        require(self.uniform_negatives >= 0, "two_tower.uniform_negatives", self.uniform_negatives, "use >= 0 sampled negatives")
        require(self.embedding_dim > 0 and self.hidden > 0 and self.out_dim > 0, "two_tower.dims", (self.embedding_dim, self.hidden, self.out_dim), "use positive widths")
        require(0 < self.temperature <= 1, "two_tower.temperature", self.temperature, "use a temperature in (0, 1]")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TwoTowerConfig:
        return _from_dict(cls, data)


@dataclasses.dataclass(frozen=True)
class L3Config:
    """The candidate attends over the user's last ``history`` items (unpooled
    ``embedding_dim`` rows); an MLP of ``hidden`` units scores the result."""

    embedding_dim: int = 16
    history: int = 20
    hidden: int = 64

    def __post_init__(self) -> None:
        require(self.embedding_dim > 0 and self.hidden > 0, "l3.dims", (self.embedding_dim, self.hidden), "use positive widths")
        require(1 <= self.history <= 1024, "l3.history", self.history, "attend over 1..1024 history items")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> L3Config:
        return _from_dict(cls, data)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One ``recserve train`` run: model sizes, optimisation, evaluation sample.

    Epochs are passes over the training rows (DLRM, L3: every impression of the train
    split; two-tower: every click plus every history entry). One epoch for DLRM and L3:
    a second one memorises the id tables (train loss falls, held-out AUC drops by
    ≈0.07 on a 20k-item catalog). ``max_rows`` caps the rows per epoch (0 = all; tests
    use a few thousand). ``lr`` is DLRM's and L3's Adam rate, ``tt_lr`` the two-tower's.
    """

    dlrm: DlrmConfig = DlrmConfig()
    two_tower: TwoTowerConfig = TwoTowerConfig()
    l3: L3Config = L3Config()
    seed: int = 0
    device: str = "auto"
    batch_size: int = 256
    tt_batch_size: int = 1024
    epochs: int = 1
    tt_epochs: int = 1
    lr: float = 1e-2
    tt_lr: float = 3e-3
    # Learning rate at the last step as a fraction of the base rate (linear decay; 1 =
    # constant). 0 measured +0.002 DLRM AUC and +0.006 two-tower recall@100 on a
    # 50k-item catalog.
    lr_final: float = 0.0
    max_rows: int = 0
    eval_users: int = 1000
    recall_k: int = 100
    progress: bool = True
    # torch intra-op threads (0 = torch's default). On a shared 2-core box 1 is faster:
    # two OpenMP threads spin against other processes (a DLRM step measured 4 ms with one
    # thread, 130+ ms with two under load).
    threads: int = 0

    def __post_init__(self) -> None:
        require(self.device in ("auto", "cpu", "cuda"), "train.device", self.device, "use 'auto', 'cpu' or 'cuda'")
        require(self.batch_size > 0 and self.tt_batch_size > 1, "train.batch_size", (self.batch_size, self.tt_batch_size), "use positive batch sizes (two-tower needs >= 2 for in-batch negatives)")
        require(self.epochs >= 0 and self.tt_epochs >= 0, "train.epochs", (self.epochs, self.tt_epochs), "use >= 0 epochs")
        require(self.lr > 0 and self.tt_lr > 0, "train.lr", (self.lr, self.tt_lr), "use positive learning rates")
        require(0.0 <= self.lr_final <= 1.0, "train.lr_final", self.lr_final, "use a fraction of the base rate in [0, 1] (1 = constant)")
        require(self.max_rows >= 0, "train.max_rows", self.max_rows, "use >= 0 (0 = every row)")
        require(self.threads >= 0, "train.threads", self.threads, "use >= 0 threads (0 = torch's default)")
        require(self.eval_users > 0 and self.recall_k > 0, "train.eval_users", (self.eval_users, self.recall_k), "use positive counts")
