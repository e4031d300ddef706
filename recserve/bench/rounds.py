"""Interleaved rounds: contenders measured in turn, ratios taken within each round.

This box is shared: the same closed loop reads anywhere from 0.3x to 1x of its best
rows/s over a few minutes (docs/architecture.md §10). One long run per contender, one
after the other, puts each in a different phase of the box, and their ratio swings with
it. ``recserve bench lookup`` therefore measures the C=64 contenders in rounds (client,
then each Redis mode, ``--rounds`` times over, each for ``--seconds / --rounds``) and
reports the **median of the per-round ratios**: each ratio compares runs seconds apart,
in the same phase. The per-round figures and the ratios' spread are reported too.

Pure functions; the bench does the measuring.

Example: rounds ``[{"a": 10, "b": 5}, {"a": 4, "b": 4}, {"a": 9, "b": 3}]`` give
``median_of({"a"...}, "a") == 9`` and ``median_ratio(rounds, "a", "b") == 2.0`` (the
ratios 2, 1, 3), where the ratio of the medians would be 9 / 4.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

Round = Mapping[str, float | None]


def _ratios(rounds: Sequence[Round], num: str, den: str) -> list[float]:
    """Per-round ``num / den``, over the rounds where both were measured (den > 0)."""
    out = []
    for r in rounds:
        a, b = r.get(num), r.get(den)
        if a is not None and b is not None and b > 0:
            out.append(a / b)
    return out


def median_of(rounds: Sequence[Round], name: str) -> float | None:
    """The median of ``name`` over the rounds that measured it (None: none did)."""
    values = [v for v in (r.get(name) for r in rounds) if v is not None]
    return statistics.median(values) if values else None


def median_ratio(rounds: Sequence[Round], num: str, den: str) -> float | None:
    """The median of the per-round ratios ``num / den`` (None: no round has both)."""
    ratios = _ratios(rounds, num, den)
    return statistics.median(ratios) if ratios else None


def ratio_spread(rounds: Sequence[Round], num: str, den: str) -> list[float] | None:
    """``[min, max]`` of the per-round ratios ``num / den`` (None: no round has both)."""
    ratios = _ratios(rounds, num, den)
    return [min(ratios), max(ratios)] if ratios else None


def with_ratios(rounds: Sequence[Round], pairs: Mapping[str, tuple[str, str]]) -> list[dict[str, float | None]]:
    """Each round's figures plus its ratios: ``pairs`` maps a ratio's name to its
    ``(num, den)``; a ratio whose side is missing (or den 0) is None."""
    out = []
    for r in rounds:
        row = dict(r)
        for name, (num, den) in pairs.items():
            got = _ratios([r], num, den)
            row[name] = got[0] if got else None
        out.append(row)
    return out
