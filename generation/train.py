"""Training the small LM on templated text from a synthetic catalog, and checkpoints.

The corpus (:func:`catalog_corpus`) is one line per fact, built from a catalog's items,
categories, tags and user histories, e.g.::

    item 1042 is in category 12 with tags 77, 310.
    because you liked items in category 12, we picked item 1042.
    user 5 liked item 88 (category 3).

:func:`train_lm` fits :class:`TinyDecoder` on random windows of the byte-tokenized
corpus (AdamW, cosine decay, fixed seed) and :func:`save_checkpoint` /
:func:`load_checkpoint` write and read ``config.json`` + ``model.pt`` in a directory.
The checkpoint's ``model_version`` (a hash of its weights) is what prefix-cache keys
must use, so blocks computed by other weights are never reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from recserve.errors import InvalidArgument, NotFound

from generation.config import ModelConfig
from generation.model import TinyDecoder
from generation.tokenizer import ByteTokenizer

#: The LM ``recserve train --lm`` trains and ``recserve bench decode`` serves: small
#: enough to train in a few minutes on 2 CPU cores.
LM_CONFIG = ModelConfig(n_layers=4, n_heads=4, dim=128, max_seq_len=1536)

_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 400
    batch: int = 16
    seq_len: int = 96
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"train.{name} = {value!r} is invalid: use a positive integer")
        if not self.lr > 0:
            raise InvalidArgument(f"train.lr = {self.lr!r} is invalid: use a positive learning rate")


def catalog_corpus(item_category: np.ndarray, item_tags: Any, user_history: Any, *, rng: np.random.Generator,
                   items: int = 3000, users: int = 500) -> str:
    """Templated lines about ``items`` sampled items and ``users`` sampled users.

    ``item_category`` [N] int64; ``item_tags`` / ``user_history``: :class:`recserve.catalog.Csr`
    rows over items / users, as in :class:`recserve.catalog.Catalog`."""
    n_items = int(item_category.shape[0])
    lines: list[str] = []
    for item in rng.choice(n_items, size=min(items, n_items), replace=False):  # per corpus line: offline, not a request path
        cat = int(item_category[item])
        tags = item_tags.row(item)[:3]
        tag_text = ", ".join(str(int(t)) for t in tags)
        lines.append(f"item {item} is in category {cat} with tags {tag_text}.")
        lines.append(f"because you liked items in category {cat}, we picked item {item}.")
    n_users = user_history.num_rows
    for user in rng.choice(n_users, size=min(users, n_users), replace=False):
        hist = user_history.row(user)[:2]
        for item in hist:
            lines.append(f"user {user} liked item {int(item)} (category {int(item_category[item])}).")
    order = rng.permutation(len(lines))
    return "\n".join(lines[i] for i in order) + "\n"


def train_lm(corpus: str, model_config: ModelConfig = LM_CONFIG, train: TrainConfig = TrainConfig(), *,
             device: torch.device | None = None, progress: Callable[[int, float], None] | None = None) -> tuple[TinyDecoder, list[float]]:
    """Fit a fresh model on ``corpus``; returns it (eval mode, on CPU) and the loss of
    every step. ``progress(step, loss)`` is called after each step."""
    if train.seq_len + 1 > model_config.max_seq_len:
        raise InvalidArgument(f"train.seq_len = {train.seq_len} needs {train.seq_len + 1} positions; the model has {model_config.max_seq_len}")
    device = device or torch.device("cpu")
    torch.manual_seed(train.seed)
    rng = np.random.default_rng(train.seed)
    data = torch.from_numpy(ByteTokenizer().encode(corpus, bos=False))
    if data.numel() < train.seq_len + 2:
        raise InvalidArgument(f"the corpus has {data.numel()} tokens; training windows need {train.seq_len + 2}")
    model = TinyDecoder(model_config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay, betas=(0.9, 0.95))
    warmup = max(1, train.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, train.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    offsets = torch.arange(train.seq_len + 1)
    losses: list[float] = []
    for step in range(train.steps):
        starts = torch.from_numpy(rng.integers(0, data.numel() - train.seq_len - 1, size=train.batch))
        window = data[starts[:, None] + offsets[None, :]].to(device)  # [B, T+1]
        logits = model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    return model.cpu().eval(), losses


def save_checkpoint(path: str | Path, model: TinyDecoder, meta: dict[str, Any] | None = None) -> str:
    """Write ``config.json`` and ``model.pt`` into directory ``path``; returns the
    checkpoint's model version (a hash of the weights file)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.pt"
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, weights)
    version = "lm-" + hashlib.blake2b(weights.read_bytes(), digest_size=8).hexdigest()
    doc = {"format": _FORMAT, "model": dataclasses.asdict(model.config), "model_version": version, **(meta or {})}
    (out / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return version


def load_checkpoint(path: str | Path) -> tuple[TinyDecoder, dict[str, Any]]:
    """The model (eval mode, CPU) and the ``config.json`` document of a checkpoint dir."""
    root = Path(path)
    cfg_file, weights = root / "config.json", root / "model.pt"
    if not cfg_file.is_file() or not weights.is_file():
        raise NotFound(f"checkpoint {str(root)!r} needs config.json and model.pt (written by `recserve train --lm --out DIR`)")
    doc = json.loads(cfg_file.read_text())
    if doc.get("format") != _FORMAT:
        raise InvalidArgument(f"checkpoint {str(root)!r} has format {doc.get('format')!r}; this build reads format {_FORMAT}")
    model = TinyDecoder(ModelConfig(**doc["model"]))
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return model.eval(), doc


def greedy_text(model: TinyDecoder, prompt: str, max_new_tokens: int = 48, *, stop: str = "\n") -> str:
    """Greedy continuation of ``prompt`` (full recompute: a sample for humans, not serving)."""
    from generation.oracle import generate_recompute
    from generation.types import GenerationRequest

    tok = ByteTokenizer()
    ids = tok.encode(prompt, bos=False)
    budget = min(max_new_tokens, model.config.max_seq_len - len(ids))
    out = generate_recompute(model, GenerationRequest(ids, budget, stop_token=ord(stop)))
    return tok.decode(out).rstrip(stop)
