"""The serving log (cascade/serving_log.py): responses written by the background writer
read back as click-log rows plus metadata; rotation keeps at most ``backups`` old files
and reads oldest first; a torn or corrupt record is skipped, not raised; click records
label their impressions; the train side appends the rows (ranker.scrubbed, the CLI).

Synchronised with ``flush()`` / ``close()`` (events), never sleeps. The oracle is the
list of responses the test wrote."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cascade.report import DegradedReason, StageReport
from cascade.serving_log import HEADER, ServingLog, log_files, read_serving_log
from recserve.catalog.storage import ClickLog, Csr
from recserve.errors import FailedPrecondition, NotFound
from ranker.scrubbed import ScrubbedCatalog, with_impressions


@dataclasses.dataclass(frozen=True)
class Response:
    """What cascade.service.Recommendation carries, for the log."""

    item_ids: np.ndarray
    scores: np.ndarray
    reports: list[StageReport]
    degraded: bool = False
    degraded_reason: str = ""
    index_version: str = "ix-1"
    model_version: str = "m-1"


def stage(name: str, reason: DegradedReason = DegradedReason.NONE) -> StageReport:
    return StageReport(name, 10.0, 1.0, 100, 10, 100, 100 if reason is DegradedReason.NONE else 50, reason)


def response(rng: np.random.Generator, k: int = 10, **kw: Any) -> Response:
    items = rng.choice(100_000, k, replace=False).astype(np.int64)
    return Response(items, rng.standard_normal(k).astype(np.float32), [stage(s) for s in ("L0", "L1", "L2", "L3")], **kw)


def started(path: Path, **kw: Any) -> ServingLog:
    return ServingLog(path, wall_clock=lambda: 1_700_000_000.5, **kw).start()


def test_round_trip_rows_metadata_and_click_labels(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "impressions.log"
    slog = started(path)
    degraded = Response(np.array([7, 3, 9], np.int64), np.array([0.5, 0.25, -1.0], np.float32),
                        [stage("L0"), stage("L1"), stage("L2", DegradedReason.LOOKUP_MISSING), stage("L3", DegradedReason.TIMEOUT)],
                        degraded=True, degraded_reason="timeout", index_version="ix-2", model_version="m-2")  # fmt: skip
    sent = [("r0", 11, response(rng)), ("r1", 12, degraded), ("r2", 11, response(rng, k=4))]
    for rid, user, res in sent:
        slog.append(rid, user, res)
    slog.append_clicks("r1", 12, np.array([3, 9]))
    slog.append_clicks("r0", 11, np.array([sent[0][2].item_ids[2]]))
    slog.append_clicks("nope", 5, np.array([1]))  # a request the log never saw: counted, unused
    slog.close()

    got = read_serving_log(path)
    want_items = np.concatenate([r.item_ids for _, _, r in sent])
    assert got.impressions.item.tolist() == want_items.tolist()
    assert got.impressions.user.tolist() == [11] * 10 + [12] * 3 + [11] * 4
    assert got.score.tolist() == np.concatenate([r.scores for _, _, r in sent]).tolist()
    assert got.position.tolist() == list(range(10)) + [0, 1, 2] + [0, 1, 2, 3]
    assert got.request.tolist() == [0] * 10 + [1] * 3 + [2] * 4
    label = np.zeros(17, np.uint8)
    label[[2, 11, 12]] = 1
    assert got.impressions.label.dtype == np.uint8 and got.impressions.label.tolist() == label.tolist()
    assert (got.clicks, got.unmatched_clicks, got.torn_records) == (4, 1, 0)
    r1 = got.requests[1]
    assert (r1.request_id, r1.user_id, r1.model_version, r1.index_version, r1.degraded, r1.degraded_reason) == ("r1", 12, "m-2", "ix-2", True, "timeout")
    assert r1.degraded_stages == ("L2:lookup_missing", "L3:timeout") and got.requests[0].degraded_stages == ()
    assert r1.unix_ms == 1_700_000_000_500
    assert got.model_versions() == {"m-1": 14, "m-2": 3}
    # Appending after a restart continues the same file.
    again = started(path)
    again.append("r3", 13, response(rng, k=2))
    again.close()
    assert [r.request_id for r in read_serving_log(path).requests] == ["r0", "r1", "r2", "r3"]


def test_rotation_keeps_at_most_backups_and_reads_oldest_first(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    path = tmp_path / "log" / "serving.log"  # the directory is created
    slog = started(path, max_bytes=4096, backups=2)
    n = 60  # ~280 B each: ~14 per file, so the oldest files fall off
    for i in range(n):
        slog.append(f"req-{i}", i, response(rng))
        if i % 7 == 0:
            assert slog.flush(timeout_s=30)  # several write batches, not one
    slog.close()
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["serving.log", "serving.log.1", "serving.log.2"]
    assert all(p.stat().st_size <= 4096 for p in path.parent.iterdir())
    assert log_files(path) == [path.with_name("serving.log.2"), path.with_name("serving.log.1"), path]
    got = read_serving_log(path)
    ids = [int(r.request_id.split("-")[1]) for r in got.requests]
    # A contiguous, ordered suffix of what was written: nothing lost inside the kept files.
    assert ids == list(range(n - len(ids), n)) and 20 < len(ids) < n
    assert got.impressions.user.tolist() == np.repeat(ids, 10).tolist()


def test_a_torn_tail_and_a_corrupt_record_are_skipped(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    path = tmp_path / "serving.log"
    slog = started(path)
    for i in range(5):
        slog.append(f"r{i}", i, response(rng))
    slog.close()
    size = path.stat().st_size
    rec = size // 5
    with open(path, "r+b") as f:  # flip one item byte in record 1: its CRC no longer matches
        f.seek(rec + HEADER.size + 30)
        b = f.read(1)
        f.seek(rec + HEADER.size + 30)
        f.write(bytes([b[0] ^ 0xFF]))
        f.truncate(size - 17)  # killed mid-write of record 4
    got = read_serving_log(path)
    assert [r.request_id for r in got.requests] == ["r0", "r2", "r3"]
    assert got.torn_records == 2 and got.skipped_bytes == rec + (rec - 17)
    # A restarted server appends after the torn record; the reader resynchronises.
    again = started(path)
    again.append("r5", 5, response(rng))
    again.close()
    got = read_serving_log(path)
    assert [r.request_id for r in got.requests] == ["r0", "r2", "r3", "r5"] and got.torn_records == 2
    # Only a header's worth of bytes, or garbage: nothing read, nothing raised.
    path.write_bytes(b"RSL1\x01")
    assert len(read_serving_log(path).impressions) == 0
    with pytest.raises(NotFound, match="no-such.log"):
        read_serving_log(tmp_path / "no-such.log")


def test_a_writer_that_falls_behind_drops_instead_of_blocking(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    slog = ServingLog(tmp_path / "s.log", max_pending_bytes=2000)
    release, entered = threading.Event(), threading.Event()
    real_write = slog._write

    def stuck_disk(records: list[bytes]) -> None:
        entered.set()
        release.wait()
        real_write(records)

    slog._write = stuck_disk  # type: ignore[method-assign]
    slog.start()
    slog.append("first", 0, response(rng))
    assert entered.wait(30)  # the writer holds "first" and is stuck on the disk
    for i in range(20):  # ~280 B each against a 2000 B queue: the later ones are dropped
        slog.append(f"r{i}", i, response(rng))
    assert slog.dropped > 0 and slog.records == 21 - slog.dropped
    release.set()
    slog.close()
    assert len(read_serving_log(tmp_path / "s.log").requests) == slog.records
    dropped = slog.dropped
    slog.append("late", 0, response(rng))  # a request finishing during shutdown is counted, not failed
    assert slog.dropped == dropped + 1
    with pytest.raises(FailedPrecondition, match="before start"):
        ServingLog(tmp_path / "t.log").append("early", 0, response(rng))


def scrubbed(users: int = 50, items: int = 200) -> ScrubbedCatalog:
    train = ClickLog(np.array([1, 2, 3], np.int64), np.array([10, 20, 30], np.int64), np.array([1, 0, 0], np.uint8))
    return ScrubbedCatalog(num_items=items, num_users=users, num_categories=4, num_tags=8, item_category=np.zeros(items, np.int64),
                           item_tags=Csr(np.zeros(0, np.int64), np.zeros(items + 1, np.int64)),
                           user_history=Csr(np.zeros(0, np.int64), np.zeros(users + 1, np.int64)), train=train)  # fmt: skip


def test_the_train_side_appends_logged_impressions_inside_the_tables(tmp_path: Path) -> None:
    path = tmp_path / "serving.log"
    slog = started(path)
    slog.append("a", 4, Response(np.array([5, 6, 250]), np.zeros(3, np.float32), []))  # item 250: added after the catalog
    slog.append("b", 60, Response(np.array([7]), np.zeros(1, np.float32), []))  # user 60: a new user
    slog.append_clicks("a", 4, np.array([6]))
    slog.close()
    view, dropped = with_impressions(scrubbed(), read_serving_log(path).impressions)
    assert dropped == 2
    assert view.train.user.tolist() == [1, 2, 3, 4, 4] and view.train.item.tolist() == [10, 20, 30, 5, 6]
    assert view.train.label.tolist() == [1, 0, 0, 0, 1] and view.train.label.dtype == np.uint8


def test_recserve_train_serving_log_passes_the_rows_to_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import ranker.pipeline
    from recserve.cli import train_cmd

    path = tmp_path / "serving.log"
    slog = started(path)
    slog.append("a", 4, Response(np.array([5, 6]), np.zeros(2, np.float32), []))
    slog.append_clicks("a", 4, np.array([5]))
    slog.close()
    seen: dict[str, Any] = {}

    def fake_train(catalog: Path, out: Path, config: Any, *, num_shards: int, extra_impressions: ClickLog | None = None) -> Any:
        seen["extra"] = extra_impressions
        return ranker.pipeline.TrainReport({"recall": 0.5}, {"model_version": "m-9"}, {}, "cpu", out, extra_rows=2, extra_dropped=0)

    monkeypatch.setattr(ranker.pipeline, "train_and_export", fake_train)
    args = argparse.Namespace(catalog=tmp_path / "cat", out=tmp_path / "models", serving_log=path, seed=0, device="cpu",
                              no_progress=True, threads=1, epochs=None, shards=2, json=True)  # fmt: skip
    assert train_cmd.run_rankers(args) == 0
    extra = seen["extra"]
    assert extra.user.tolist() == [4, 4] and extra.item.tolist() == [5, 6] and extra.label.tolist() == [1, 0]
    body = json.loads(capsys.readouterr().out)
    assert body["serving_log"]["impressions"] == 2 and body["serving_log"]["clicks"] == 1 and body["serving_log"]["appended"] == 2


def test_the_cascade_logs_every_response(tmp_path: Path) -> None:
    from tests.unit.test_cascade_core import core, run

    c, _, _ = core(np.random.default_rng(4), factory="Flat")
    c.serving_log = started(tmp_path / "s.log")
    results = [run(c, user=u) for u in (1, 2)]
    asyncio.run(c.aclose())  # closes the log: everything queued is written
    got = read_serving_log(tmp_path / "s.log")
    assert got.impressions.item.tolist() == np.concatenate([r.item_ids for r in results]).tolist()
    assert got.impressions.user.tolist() == [1] * 10 + [2] * 10
    assert got.score.tolist() == np.concatenate([r.scores for r in results]).tolist()
    assert {r.model_version for r in got.requests} == {"m-test"} and got.requests[0].index_version == results[0].index_version


def test_the_deep_checks_fixed_recommend_is_not_an_impression(tmp_path: Path) -> None:
    from cascade.service import PROBE_REQUEST_ID
    from tests.unit.test_cascade_core import core

    c, _, _ = core(np.random.default_rng(5), factory="Flat")
    c.serving_log = started(tmp_path / "s.log")
    none = np.zeros(0, np.int64)

    async def both() -> None:
        for rid in (PROBE_REQUEST_ID, "feed-1"):
            await c.recommend(c.query(1, 10, none, none, deadline=c.clock() + 10.0, request_id=rid))
        await c.aclose()

    asyncio.run(both())
    got = read_serving_log(tmp_path / "s.log")
    assert [r.request_id for r in got.requests] == ["feed-1"]
