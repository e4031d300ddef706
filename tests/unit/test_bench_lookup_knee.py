"""``recserve bench lookup``'s measurement rules (issue 9): each knee probe starts after
the previous one has drained, and the CLI parser does not load grpc (so the bench can
set the client's ``GRPC_EXPERIMENTS`` before grpc's core starts)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

from recserve.bench import lookup_capacity as cap


def test_each_knee_probe_starts_a_settle_pause_after_the_previous_one_ended() -> None:
    """A probe started right after an overloaded one measured that probe's backlog
    (naive at 500 req/s right after 10,000: 61-82 % OK, 90-92 % after a 1 s pause)."""
    capacity = 400.0  # req/s this fake serves in time; above it every answer is late
    rate_now = [0.0]
    spans: list[tuple[float, float]] = []  # (start, end) of every probe, all answers in

    async def handle(i: int, deadline: float) -> bool:
        if rate_now[0] > capacity:
            await asyncio.sleep(max(0.0, deadline - time.monotonic()) + 0.005)
        return True

    real_probe = cap.probe

    async def probe(rate: float, *args: Any, **kwargs: Any) -> Any:
        rate_now[0] = rate
        start = time.monotonic()
        out = await real_probe(rate, *args, **kwargs)
        spans.append((start, time.monotonic()))
        return out

    cap.probe = probe  # type: ignore[assignment]
    try:
        out = asyncio.run(cap.knee_of(handle, lo_rps=200.0, hi_rps=1600.0, seconds=0.1, total=10_000, slo_s=0.02, seed=1, settle_s=0.05,
                                      settle_after_fail_s=0.2))  # fmt: skip
    finally:
        cap.probe = real_probe  # type: ignore[assignment]
    assert len(out["probes"]) >= 3 and len(spans) == len(out["probes"])
    # Every probe after the first began at least settle_s after the previous one's last
    # answer, and settle_after_fail_s after one that failed (the overloaded hi_rps first).
    failed = [not p["passed"] for p in out["probes"]]
    assert failed[1] and any(not f for f in failed)
    gaps = [spans[k][0] - spans[k - 1][1] for k in range(1, len(spans))]
    assert all(g >= (0.2 if failed[k - 1] else 0.05) for k, g in enumerate(gaps, start=1))
    assert any(g < 0.2 for k, g in enumerate(gaps, start=1) if not failed[k - 1])  # a passed probe gets the short pause
    assert out["knee_per_s"] is not None and out["knee_per_s"] <= capacity  # rates above it answered late: failed


def test_building_the_cli_parser_does_not_load_grpc() -> None:
    code = "import sys; from recserve.cli.main import build_parser; build_parser(); print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
