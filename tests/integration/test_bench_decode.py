"""``recserve bench decode`` end to end as a user runs it: a subprocess on a tiny
checkpoint and a small mix, with ``--json``, a sweep and a PNG. Checks the report's
shape and the structural results (paged concurrency, prefix sharing, exactness), not
speeds: speed goals are the benchmark's own output, on a quiet machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generation.config import ModelConfig
from generation.model import TinyDecoder
from generation.train import save_checkpoint

ROOT = Path(__file__).resolve().parents[2]

KEYS = {
    "tokens_per_s_static", "tokens_per_s_continuous", "speedup", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
    "tbt_p99_ms_chunked", "tbt_p99_ms_unchunked", "max_concurrent_paged", "max_concurrent_contiguous",
    "prefix_blocks_saved", "outputs_match_recompute",
}


@pytest.mark.integration
def test_bench_decode_reports_every_key_and_draws_the_plot(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "lm", TinyDecoder(ModelConfig(n_layers=1, n_heads=2, dim=16, max_seq_len=512)))
    png = tmp_path / "decode.png"
    out = subprocess.run(
        [sys.executable, "-m", "recserve", "bench", "decode", "--checkpoint", str(tmp_path / "lm"), "--device", "cpu",
         "--requests", "24", "--max-seqs", "8", "--contiguous-seqs", "2", "--max-new-tokens", "64", "--mean-output", "8",
         "--streams", "3", "--long-prompts", "2", "--long-prompt-tokens", "256", "--repeats", "1",
         "--sweep-fractions", "0.5,1", "--sweep-requests", "8", "--plot", str(png), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert KEYS <= set(doc)
    assert doc["outputs_match_recompute"] is True
    assert doc["recompute_check_preemptions"] > 0  # the exactness sample really went through preemption
    assert doc["max_concurrent_contiguous"] == 2  # the pool holds 2 contiguous reservations
    assert doc["max_concurrent_paged"] >= 2 * doc["max_concurrent_contiguous"]
    assert doc["prefix_blocks_saved"] > 0  # the shared system prompt
    assert doc["tokens_per_s_static"] > 0 and doc["speedup"] == pytest.approx(doc["tokens_per_s_continuous"] / doc["tokens_per_s_static"])
    # Both static baselines are reported under their own names; the headline is the padded one.
    assert doc["tokens_per_s_static_padded"] == doc["tokens_per_s_static"] and doc["speedup_vs_static_padded"] == doc["speedup"]
    assert doc["speedup_vs_static_skip_finished"] == pytest.approx(doc["tokens_per_s_continuous"] / doc["tokens_per_s_static_skip_finished"])
    assert doc["steps_static_skip_finished"] == doc["steps_static"]  # same membership: only the rows computed differ
    assert doc["tokens_per_s_continuous_no_prefix_sharing"] > 0
    assert [p["fraction_of_saturation"] for p in doc["sweep"]] == [0.5, 1.0]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
