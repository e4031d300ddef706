"""The tiered run's disk floor (issue 9, "the tiered run within 2x of the equal-memory
run"): the bench reports the disk's random direct-read rate and the rows/s it allows,
so a tiered figure can be read against the physics rather than against the software."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recserve.bench import lookup_capacity as cap


def test_io_floor_divides_the_disk_rate_by_the_reads_per_row() -> None:
    # 600 RocksDB reads for 4,096 requested rows at 40,000 reads/s: 273,066.7 rows/s.
    assert cap.io_floor_rows_per_s(40_000.0, 600, 4096) == pytest.approx(40_000.0 * 4096 / 600)
    # Twice the reads for the same rows halve the floor.
    assert cap.io_floor_rows_per_s(40_000.0, 1200, 4096) == pytest.approx(0.5 * cap.io_floor_rows_per_s(40_000.0, 600, 4096))  # type: ignore[operator]


@pytest.mark.parametrize(("disk", "reads", "rows"), [(None, 600, 4096), (40_000.0, 0, 4096), (40_000.0, 600, 0)])
def test_io_floor_is_none_without_a_disk_rate_or_cold_reads(disk: float | None, reads: int, rows: int) -> None:
    assert cap.io_floor_rows_per_s(disk, reads, rows) is None


def test_direct_read_rate_is_none_for_files_smaller_than_a_block(tmp_path: Path) -> None:
    small = tmp_path / "small.sst"
    small.write_bytes(b"x" * (cap.DIRECT_READ_BLOCK_BYTES - 1))
    assert cap.direct_read_rate([small, tmp_path / "absent.sst"], seconds=0.01, threads=2) is None


def test_direct_read_rate_counts_reads_or_reports_no_direct_io(tmp_path: Path) -> None:
    """On a file system with O_DIRECT the rate is positive; where it refuses O_DIRECT
    (tmpfs: at open or at the first read) the probe says None instead of a page-cache
    rate that would hide the disk."""
    f = tmp_path / "data.sst"
    f.write_bytes(os.urandom(16 * cap.DIRECT_READ_BLOCK_BYTES))
    try:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        supported = False
    else:
        import mmap

        buf = mmap.mmap(-1, cap.DIRECT_READ_BLOCK_BYTES)
        try:
            os.preadv(fd, [buf], 0)
            supported = True
        except OSError:
            supported = False
        finally:
            os.close(fd)
    rate = cap.direct_read_rate([f], seconds=0.02, threads=2)
    if supported:
        assert rate is not None and rate > 0
    else:
        assert rate is None
