"""Latency histograms that live in the rollup rows, so p50/p95 come from rollups like every other figure.

Each rollup row carries a count per bucket for request latency and for time to first token. Buckets are
half-octaves: bucket i holds values in (2^((i-1)/2), 2^(i/2)] ms, bucket 0 everything up to 1 ms and the last one
everything above 2^17 ms (131 s). A request adds 1 to one column of each histogram in the same upsert that adds its
tokens, and any set of rows sums to the histogram of their requests. A percentile read back is exact to within a
bucket (a factor of 1.41) and interpolated geometrically inside it, which is what a dashboard needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

BUCKETS = 36
LATENCY_FIELDS = tuple(f"latency_h{i:02d}" for i in range(BUCKETS))
TTFT_FIELDS = tuple(f"ttft_h{i:02d}" for i in range(BUCKETS))


def bucket_of(ms: float) -> int:
    if not ms > 1.0:  # also NaN
        return 0
    return min(BUCKETS - 1, math.ceil(2 * math.log2(ms) - 1e-9))


def upper_bound(i: int) -> float:
    return 2 ** (i / 2)


def percentile(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (0 < q < 1) of the values counted, or None when there are none."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            share = (rank - seen) / count
            if i == 0:
                return share * upper_bound(0)
            if i == BUCKETS - 1:
                return upper_bound(i - 1)  # the open top bucket: its lower bound is all that is known
            low, high = upper_bound(i - 1), upper_bound(i)
            return low * (high / low) ** share
        seen += count
    return upper_bound(BUCKETS - 2)


def deltas(latency_ms: float, ttft_ms: float | None) -> dict[str, int]:
    """The rollup columns one request adds 1 to."""
    out = {LATENCY_FIELDS[bucket_of(latency_ms)]: 1}
    if ttft_ms is not None:
        out[TTFT_FIELDS[bucket_of(ttft_ms)]] = 1
    return out


def quantiles(row: Mapping[str, Any], prefix_fields: Sequence[str]) -> tuple[float | None, float | None]:
    """p50 and p95 from a row of summed bucket columns (missing or NULL columns count as 0)."""
    counts = [int(row.get(name) or 0) for name in prefix_fields]
    return percentile(counts, 0.5), percentile(counts, 0.95)
