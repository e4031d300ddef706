"""A byte-level tokenizer: token ``b`` (0..255) is the UTF-8 byte ``b``; three specials
follow (BOS 256, EOS 257, PAD 258). Nothing to train and nothing is out of vocabulary."""

from __future__ import annotations

import numpy as np

from recserve.errors import InvalidArgument

BOS = 256
EOS = 257
PAD = 258
VOCAB_SIZE = 259


class ByteTokenizer:
    """``encode("hi") -> [256, 104, 105]`` (BOS first unless ``bos=False``);
    ``decode`` drops the specials and replaces invalid UTF-8 (a cut-off multi-byte char)."""

    bos = BOS
    eos = EOS
    pad = PAD
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
        """``[T]`` int64 token ids."""
        body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        parts = ([np.array([BOS], dtype=np.int64)] if bos else []) + [body] + ([np.array([EOS], dtype=np.int64)] if eos else [])
        return np.concatenate(parts)

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
            bad = int(ids[(ids < 0) | (ids >= VOCAB_SIZE)][0])
            raise InvalidArgument(f"token id {bad} is out of the byte vocabulary [0, {VOCAB_SIZE})")
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
