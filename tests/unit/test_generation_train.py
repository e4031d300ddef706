"""The byte tokenizer, the templated catalog corpus, a few training steps of a tiny LM
and checkpoints that load back from disk with the same weights and the same outputs.
(The real training run is ``recserve train --lm``; here a tiny model for seconds.)"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from generation.config import ModelConfig
from generation.tokenizer import BOS, EOS, ByteTokenizer
from generation.train import TrainConfig, catalog_corpus, greedy_text, load_checkpoint, save_checkpoint, train_lm
from recserve.catalog.storage import Csr
from recserve.errors import InvalidArgument, NotFound
from tests.generation_utils import one_torch_thread

TINY = ModelConfig(n_layers=1, n_heads=2, dim=16, max_seq_len=64)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def test_byte_tokenizer_round_trips_utf8_and_marks_bos_eos() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo", eos=True)
    assert ids[0] == BOS and ids[-1] == EOS and ids.dtype == np.int64 and len(ids) == 2 + len("héllo".encode())
    assert tok.decode(ids) == "héllo"
    with pytest.raises(InvalidArgument, match="token id 300"):
        tok.decode([300])


def toy_catalog() -> tuple[np.ndarray, Csr, Csr]:
    item_category = np.array([3, 1, 3, 2], dtype=np.int64)
    tags = Csr(values=np.array([7, 8, 9, 4, 5], dtype=np.int64), offsets=np.array([0, 2, 3, 4, 5], dtype=np.int64))
    history = Csr(values=np.array([0, 2, 1], dtype=np.int64), offsets=np.array([0, 2, 3], dtype=np.int64))
    return item_category, tags, history


def test_the_corpus_is_templated_text_about_the_catalog() -> None:
    cats, tags, hist = toy_catalog()
    text = catalog_corpus(cats, tags, hist, rng=np.random.default_rng(0))
    lines = set(text.splitlines())
    assert "item 0 is in category 3 with tags 7, 8." in lines
    assert "because you liked items in category 3, we picked item 2." in lines
    assert "user 1 liked item 1 (category 1)." in lines
    assert len(lines) == 4 * 2 + 3
    assert text == catalog_corpus(cats, tags, hist, rng=np.random.default_rng(0))  # fixed seed, same text


def test_training_lowers_the_loss_and_the_checkpoint_loads_back(tmp_path: Path) -> None:
    cats, tags, hist = toy_catalog()
    corpus = catalog_corpus(cats, tags, hist, rng=np.random.default_rng(0)) * 20
    cfg = TrainConfig(steps=30, batch=8, seq_len=32, lr=1e-2, seed=1)
    model, losses = train_lm(corpus, TINY, cfg)
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    again, losses2 = train_lm(corpus, TINY, cfg)
    assert losses2 == losses  # fixed seed: the same run
    version = save_checkpoint(tmp_path / "ckpt", model, {"final_loss": losses[-1]})
    loaded, doc = load_checkpoint(tmp_path / "ckpt")
    assert doc["model_version"] == version and doc["final_loss"] == losses[-1] and loaded.config == TINY
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert greedy_text(loaded, "item 0 is", 12) == greedy_text(model, "item 0 is", 12)
    assert save_checkpoint(tmp_path / "other", again) == version  # same weights, same version


def test_a_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="needs config.json and model.pt"):
        load_checkpoint(tmp_path / "nothing")
