"""The serving (impression) log: every ``Recommend`` response, appended to a rotating file
that ``recserve train --serving-log`` reads back (docs/architecture.md §8).

**Rows.** Read back, the log is the catalog's click-log format
(:class:`recserve.catalog.storage.ClickLog`: int64 ``user``, int64 ``item``, uint8
``label``): each served item is one impression row, in the order it was served. The
label is unknown when the response leaves, so an impression is written without one and
reads back as ``label = 0`` ("shown, no click seen") until a **click record** for the
same request and item is in the log (:meth:`ServingLog.append_clicks`, for a feedback
endpoint): then the reader labels that row 1. An impression without a click inside the
log is a negative, which is what an impression log means once the attribution window
has passed; a log no click was ever appended to therefore trains as all negatives.

**Metadata.** Per row: the score the response carried, its rank in the response and the
request it came from; per request: request id, user, wall time, model_version,
index_version, degraded / degraded_reason, and the degraded stages (``"L2:timeout"``).

**File format** (little-endian), one record per response or click batch::

    header  16 B  magic b"RSL1" | kind u8 | 3 pad | payload_len u32 | crc32 u32
    payload       unix_ms i64 | user i64 | n u32 | meta_len u32
                  | item_ids n x i64 | scores n x f32 (impressions only) | meta JSON utf-8

``crc32`` covers the kind byte and the payload. A record is written whole, by one
writer thread, so a process killed mid-write leaves at most one torn record at the end
of the live file; the reader skips a record whose header, length or CRC is bad and
resynchronises on the next magic (a restarted server appends after a torn record).

**Rotation.** Before a record would take the live file past ``log_max_bytes`` it is
renamed ``PATH.1`` (``PATH.1`` to ``PATH.2``, ...), keeping at most ``log_backups`` old
files, like :class:`logging.handlers.RotatingFileHandler`. :func:`read_serving_log`
reads ``PATH.{backups}`` ... ``PATH.1``, ``PATH``: oldest first.

**Cost on the request path.** :meth:`ServingLog.append` encodes the record (``tobytes``,
``struct.pack``, a small ``json.dumps``) and hands it to a writer thread; the event
loop never touches the file. If the disk falls behind by ``max_pending_bytes`` new
records are dropped and counted (:attr:`ServingLog.dropped`) rather than slowing
``Recommend`` down.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from cascade.report import StageReport
from recserve.catalog.storage import ClickLog
from recserve.config.spec import CascadeConfig
from recserve.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger(__name__)

MAGIC = b"RSL1"
HEADER = struct.Struct("<4sB3xII")  # magic, kind, pad, payload_len, crc32
FIXED = struct.Struct("<qqII")  # unix_ms, user, n, meta_len
KIND_IMPRESSIONS = 1
KIND_CLICKS = 2
# A record larger than this is corrupt (a response carries at most max_k items): the
# reader treats it as torn instead of trusting the length.
MAX_PAYLOAD = 64 << 20
# Records waiting for the writer thread before new ones are dropped (about 40k
# responses of k = 10).
MAX_PENDING_BYTES = 32 << 20


class LoggedResponse(Protocol):
    """What :meth:`ServingLog.append` reads from a response (``cascade.service.Recommendation``)."""

    @property
    def item_ids(self) -> np.ndarray: ...  # int64 [k]

    @property
    def scores(self) -> np.ndarray: ...  # float32 [k]

    @property
    def reports(self) -> list[StageReport]: ...

    @property
    def degraded(self) -> bool: ...

    @property
    def degraded_reason(self) -> str: ...

    @property
    def index_version(self) -> str: ...

    @property
    def model_version(self) -> str: ...


def encode_record(kind: int, unix_ms: int, user_id: int, item_ids: np.ndarray, scores: np.ndarray | None, meta: dict[str, object]) -> bytes:
    """One framed record (see the module docstring). ``item_ids`` [n] int64, ``scores``
    [n] float32 for impressions, None for clicks."""
    items = np.ascontiguousarray(item_ids, dtype="<i8")
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    parts = [FIXED.pack(unix_ms, user_id, items.shape[0], len(meta_bytes)), items.tobytes()]
    if scores is not None:
        s = np.ascontiguousarray(scores, dtype="<f4")
        if s.shape != items.shape:
            raise InvalidArgument(f"serving log: scores has shape {list(s.shape)}; item_ids has {list(items.shape)}: one score per item")
        parts.append(s.tobytes())
    parts.append(meta_bytes)
    payload = b"".join(parts)
    crc = zlib.crc32(payload, zlib.crc32(bytes((kind,))))
    return HEADER.pack(MAGIC, kind, len(payload), crc) + payload


def log_files(path: Path | str, backups: int | None = None) -> list[Path]:
    """The existing files of the log at ``path``, oldest first: ``PATH.{n}`` ... ``PATH.1``,
    ``PATH``. ``backups`` None: every ``PATH.<int>`` there is."""
    p = Path(path)
    numbered: list[tuple[int, Path]] = []
    if p.parent.is_dir():
        for f in p.parent.iterdir():
            suffix = f.name[len(p.name) + 1 :]
            if f.name.startswith(p.name + ".") and suffix.isdigit() and (backups is None or int(suffix) <= backups):
                numbered.append((int(suffix), f))
    files = [f for _, f in sorted(numbered, reverse=True)]
    return files + [p] if p.is_file() else files


class ServingLog:
    """The writer: records are encoded on the caller's thread and written, with rotation,
    by one background thread. ``start()`` opens the file; ``close()`` writes what is
    pending and stops the thread; ``flush()`` waits until everything appended so far is
    in the file (tests, and shutdown)."""

    def __init__(self, path: Path | str, *, max_bytes: int = 64 << 20, backups: int = 3,
                 max_pending_bytes: int = MAX_PENDING_BYTES, wall_clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        if max_bytes < 4096:
            raise InvalidArgument(f"serving log: max_bytes = {max_bytes} is too small; use at least 4096 bytes per file")
        if backups < 1:
            raise InvalidArgument(f"serving log: backups = {backups} is invalid; keep at least 1 rotated file")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.max_pending_bytes = max_pending_bytes
        self.wall_clock = wall_clock
        self.dropped = 0  # records dropped: the writer fell behind, or appended after close()
        self.write_errors = 0
        self.records = 0  # records handed to the writer
        self._pending: deque[bytes | threading.Event | None] = deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._file: int | None = None  # os-level fd, O_APPEND
        self._size = 0

    @classmethod
    def from_config(cls, config: CascadeConfig) -> ServingLog | None:
        """The started log ``config.log_path`` names, or None when it is ``""``."""
        if not config.log_path:
            return None
        return cls(config.log_path, max_bytes=config.log_max_bytes, backups=config.log_backups).start()

    def start(self) -> ServingLog:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._open()
        except OSError as exc:
            raise FailedPrecondition(f"cascade.log_path = {str(self.path)!r} cannot be opened for appending ({exc}); use a writable path") from exc
        self._thread = threading.Thread(target=self._run, name="serving-log", daemon=True)
        self._thread.start()
        return self

    # ---- the request path ------------------------------------------------------------

    def append(self, request_id: str, user_id: int, response: LoggedResponse) -> None:
        """Log one response (its items are its impressions). Never blocks on the disk."""
        stages = [f"{r.stage}:{r.degraded_reason.value}" for r in response.reports if r.degraded]
        meta: dict[str, object] = {"request_id": request_id, "model_version": response.model_version, "index_version": response.index_version,
                                   "degraded": bool(response.degraded), "degraded_reason": response.degraded_reason, "degraded_stages": stages}  # fmt: skip
        self._put(encode_record(KIND_IMPRESSIONS, self._now_ms(), user_id, response.item_ids, response.scores, meta))

    def append_clicks(self, request_id: str, user_id: int, item_ids: np.ndarray) -> None:
        """Log clicks on items of an earlier response ``request_id``: the reader labels
        those impression rows 1 (a click for a request not in the log is counted, unused)."""
        self._put(encode_record(KIND_CLICKS, self._now_ms(), user_id, item_ids, None, {"request_id": request_id}))

    def _now_ms(self) -> int:
        return int(self.wall_clock() * 1000)

    def _put(self, record: bytes) -> None:
        with self._cond:
            if self._thread is None:
                if self._closed:  # a request finishing during shutdown: count it, do not fail it
                    self.dropped += 1
                    return
                raise FailedPrecondition(f"serving log {self.path}: append before start()")
            if self._pending_bytes + len(record) > self.max_pending_bytes:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 10_000 == 0:
                    log.warning("serving log %s is %d bytes behind; %d records dropped so far", self.path, self._pending_bytes, self.dropped)
                return
            self._pending.append(record)
            self._pending_bytes += len(record)
            self.records += 1
            self._cond.notify()

    # ---- lifecycle -------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every record appended before this call is written; False on timeout."""
        done = threading.Event()
        with self._cond:
            if self._thread is None:
                return True
            self._pending.append(done)
            self._cond.notify()
        return done.wait(timeout_s)

    def close(self) -> None:
        """Write what is pending, fsync, stop the writer thread. Idempotent."""
        with self._cond:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._closed = True
            self._pending.append(None)
            self._cond.notify()
        thread.join()
        if self._file is not None:
            try:
                os.fsync(self._file)
            except OSError as exc:
                log.warning("serving log %s: fsync failed: %s", self.path, exc)
            os.close(self._file)
            self._file = None

    # ---- the writer thread -----------------------------------------------------------

    def _open(self) -> None:
        self._file = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._file).st_size

    def _rotate(self) -> None:
        """``PATH.{b-1}`` -> ``PATH.{b}`` ... ``PATH`` -> ``PATH.1`` (the oldest falls off), new ``PATH``."""
        assert self._file is not None
        os.close(self._file)
        self._file = None
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._open()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                batch = list(self._pending)
                self._pending.clear()
                self._pending_bytes = 0
            chunk: list[bytes] = []
            for item in batch:
                if isinstance(item, bytes):
                    chunk.append(item)
                    continue
                self._write(chunk)  # markers see everything queued before them written
                chunk = []
                if item is None:
                    return
                item.set()
            self._write(chunk)

    def _write(self, records: list[bytes]) -> None:
        """Write ``records`` in as few syscalls as rotation allows (a record never spans
        files; one larger than ``max_bytes`` gets a file of its own)."""
        start = 0
        while start < len(records):
            try:
                if self._file is None:  # a failed rotation left no file open
                    self._open()
                assert self._file is not None
                stop, size = start, self._size
                while stop < len(records) and (size + len(records[stop]) <= self.max_bytes or size == 0):
                    size += len(records[stop])
                    stop += 1
                if stop == start:  # the next record does not fit: rotate, then write it
                    self._rotate()
                    continue
            except OSError as exc:  # cannot open or rotate: these records are lost, serving goes on
                self._fail(len(records) - start, exc)
                return
            data = memoryview(b"".join(records[start:stop]))
            written = 0
            try:
                while written < len(data):
                    written += os.write(self._file, data[written:])
            except OSError as exc:  # e.g. disk full: a partial record is a torn one the reader skips
                self._fail(stop - start, exc)
            self._size += written
            start = stop

    def _fail(self, n: int, exc: OSError) -> None:
        self.write_errors += n
        log.error("serving log %s: %d records not written: %s", self.path, n, exc)


# ---- reading back ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoggedRequest:
    """One logged response's metadata (``unix_ms`` wall time it was logged)."""

    request_id: str
    user_id: int
    unix_ms: int
    model_version: str
    index_version: str
    degraded: bool
    degraded_reason: str
    degraded_stages: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ServingLogContents:
    """A serving log read back.

    ``impressions`` the catalog's click-log format, one row per served item in serving
    order (``user`` [n] int64, ``item`` [n] int64, ``label`` [n] uint8: 1 where a click
    record matched the row); ``score`` [n] float32 the score served; ``position`` [n]
    int32 the rank within its response; ``request`` [n] int64 index into ``requests``.
    ``clicks`` click rows read, ``unmatched_clicks`` those naming a request or item not
    in the log; ``torn_records`` bad spans skipped (``skipped_bytes`` in all).
    """

    impressions: ClickLog
    score: np.ndarray
    position: np.ndarray
    request: np.ndarray
    requests: list[LoggedRequest]
    files: list[Path]
    clicks: int
    unmatched_clicks: int
    torn_records: int
    skipped_bytes: int

    def model_versions(self) -> dict[str, int]:
        """Impression rows per model_version."""
        counts: dict[str, int] = {}
        per_request = np.bincount(self.request, minlength=len(self.requests))
        for req, n in zip(self.requests, per_request.tolist()):
            counts[req.model_version] = counts.get(req.model_version, 0) + n
        return counts


@dataclasses.dataclass
class _Scan:
    impressions: list[tuple[int, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)  # (request index, items, scores)
    clicks: list[tuple[str, np.ndarray]] = dataclasses.field(default_factory=list)
    requests: list[LoggedRequest] = dataclasses.field(default_factory=list)
    torn: int = 0
    skipped: int = 0


def _parse(kind: int, payload: bytes) -> tuple[int, int, np.ndarray, np.ndarray | None, dict[str, object]]:
    unix_ms, user, n, meta_len = FIXED.unpack_from(payload, 0)
    off = FIXED.size
    n_scores = n if kind == KIND_IMPRESSIONS else 0
    if off + 8 * n + 4 * n_scores + meta_len != len(payload):
        raise ValueError("lengths do not add up")
    items = np.frombuffer(payload, dtype="<i8", count=n, offset=off).astype(np.int64)
    off += 8 * n
    scores = np.frombuffer(payload, dtype="<f4", count=n, offset=off).astype(np.float32) if n_scores else None
    off += 4 * n_scores
    meta = json.loads(payload[off:].decode())
    if not isinstance(meta, dict):
        raise ValueError("metadata is not an object")
    return unix_ms, user, items, scores, meta


def _scan_file(data: bytes, scan: _Scan) -> None:
    """Append the records of one file's bytes to ``scan``; bad spans are skipped."""
    pos, end = 0, len(data)
    bad_from: int | None = None
    while pos < end:
        ok = False
        if pos + HEADER.size <= end:
            magic, kind, length, crc = HEADER.unpack_from(data, pos)
            body = pos + HEADER.size
            if magic == MAGIC and kind in (KIND_IMPRESSIONS, KIND_CLICKS) and length <= MAX_PAYLOAD and body + length <= end:
                payload = data[body : body + length]
                if zlib.crc32(payload, zlib.crc32(bytes((kind,)))) == crc:
                    try:
                        unix_ms, user, items, scores, meta = _parse(kind, payload)
                        ok = True
                    except (ValueError, struct.error, UnicodeDecodeError):
                        pass
        if not ok:  # torn or corrupt: resynchronise on the next magic
            if bad_from is None:
                bad_from = pos
            nxt = data.find(MAGIC, pos + 1)
            pos = end if nxt < 0 else nxt
            continue
        if bad_from is not None:
            scan.torn += 1
            scan.skipped += pos - bad_from
            bad_from = None
        request_id = str(meta.get("request_id", ""))
        if kind == KIND_IMPRESSIONS:
            assert scores is not None
            stages = meta.get("degraded_stages", [])
            scan.requests.append(LoggedRequest(
                request_id=request_id, user_id=int(user), unix_ms=int(unix_ms), model_version=str(meta.get("model_version", "")),
                index_version=str(meta.get("index_version", "")), degraded=bool(meta.get("degraded", False)),
                degraded_reason=str(meta.get("degraded_reason", "")), degraded_stages=tuple(str(s) for s in stages) if isinstance(stages, list) else (),
            ))  # fmt: skip
            scan.impressions.append((len(scan.requests) - 1, items, scores))
        else:
            scan.clicks.append((request_id, items))
        pos = body + length
    if bad_from is not None:
        scan.torn += 1
        scan.skipped += end - bad_from


def read_serving_log(path: Path | str, backups: int | None = None) -> ServingLogContents:
    """Read the log at ``path`` and its rotated files, oldest first, into click-log rows
    plus metadata (:class:`ServingLogContents`). Torn or corrupt records are skipped and
    counted, never raised. NotFound when no file of the log exists.

    Example: a log of two responses with 10 items each and one click on the first reads
    back as 20 rows, ``label.sum() == 1``, ``len(requests) == 2``.
    """
    files = log_files(path, backups)
    if not files:
        raise NotFound(f"serving log {str(path)!r} not found: no {Path(path).name} or {Path(path).name}.N files in {Path(path).parent}; set cascade.log_path and serve some requests")
    # Open every file before reading any, so a live server's rotation between reads
    # cannot make one file be read twice.
    handles = [open(f, "rb") for f in files]
    scan = _Scan()
    try:
        for h in handles:
            _scan_file(h.read(), scan)
    finally:
        for h in handles:
            h.close()
    if scan.torn:
        log.warning("serving log %s: skipped %d torn or corrupt spans (%d bytes)", path, scan.torn, scan.skipped)
    sizes = np.array([items.shape[0] for _, items, _ in scan.impressions], dtype=np.int64)
    n = int(sizes.sum())
    request = np.repeat(np.array([r for r, _, _ in scan.impressions], dtype=np.int64), sizes)
    item = np.concatenate([items for _, items, _ in scan.impressions]) if n else np.zeros(0, np.int64)
    score = np.concatenate([s for _, _, s in scan.impressions]) if n else np.zeros(0, np.float32)
    starts = np.cumsum(sizes) - sizes
    position = (np.arange(n, dtype=np.int64) - np.repeat(starts, sizes)).astype(np.int32)
    user = np.array([r.user_id for r in scan.requests], dtype=np.int64)[request] if n else np.zeros(0, np.int64)
    label, clicks, unmatched = _join_clicks(scan, request, item)
    return ServingLogContents(
        impressions=ClickLog(user, item, label), score=score, position=position, request=request, requests=scan.requests,
        files=files, clicks=clicks, unmatched_clicks=unmatched, torn_records=scan.torn, skipped_bytes=scan.skipped,
    )  # fmt: skip


def _join_clicks(scan: _Scan, request: np.ndarray, item: np.ndarray) -> tuple[np.ndarray, int, int]:
    """``label`` [n] uint8: 1 where a click record names the row's request and item.

    A request id logged twice (a client retry) joins to its latest response."""
    label = np.zeros(item.shape[0], dtype=np.uint8)
    if not scan.clicks:
        return label, 0, 0
    by_id = {r.request_id: i for i, r in enumerate(scan.requests)}
    click_req = np.concatenate([np.full(items.shape[0], by_id.get(rid, -1), np.int64) for rid, items in scan.clicks])
    click_item = np.concatenate([items for _, items in scan.clicks])
    # One int64 key per (request, item): items are < 2**40, requests < 2**23 per log.
    stride = np.int64(1) << np.int64(40)
    row_key = request * stride + item
    click_key = click_req * stride + click_item
    hit = np.isin(row_key, click_key[click_req >= 0])
    label[hit] = 1
    matched = np.isin(click_key, row_key) & (click_req >= 0)
    return label, int(click_key.shape[0]), int((~matched).sum())

