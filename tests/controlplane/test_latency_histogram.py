"""p50/p95 latency from the rollups' histogram columns: the buckets, the estimate against exact percentiles of
fresh random samples, and the columns a request adds through record()."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from cp_support import CHAT_MODEL

from controlplane.usage import histogram, reports
from controlplane.usage.models import UsageDay, UsageMinute
from controlplane.usage.services import UsageRecord, record

STEP = math.sqrt(2)  # one bucket's width: the most an estimate may be off by
TOP = histogram.upper_bound(histogram.BUCKETS - 2)  # the open top bucket starts here (131 s)


def test_bucket_edges():
    assert histogram.bucket_of(0) == 0 and histogram.bucket_of(1.0) == 0 and histogram.bucket_of(-5) == 0
    assert histogram.bucket_of(float("nan")) == 0
    assert histogram.bucket_of(1.0001) == 1 and histogram.bucket_of(STEP) == 1 and histogram.bucket_of(1.5) == 2
    assert histogram.bucket_of(1000) == 20  # 2^(19/2) = 724 < 1000 <= 2^10 = 1024
    assert histogram.bucket_of(10**9) == histogram.BUCKETS - 1
    for i in range(1, histogram.BUCKETS - 1):  # every bound falls in its own bucket, just above it in the next
        bound = histogram.upper_bound(i)
        assert histogram.bucket_of(bound) == i and histogram.bucket_of(bound * 1.001) == i + 1


def test_nothing_counted_has_no_percentile():
    assert histogram.percentile([0] * histogram.BUCKETS, 0.5) is None
    assert histogram.quantiles({}, histogram.LATENCY_FIELDS) == (None, None)


@pytest.mark.parametrize("sigma", [0.3, 1.0, 2.0])
def test_estimates_are_within_a_bucket_of_the_exact_percentiles(sigma):
    rng = np.random.default_rng()
    values = rng.lognormal(mean=rng.uniform(2, 8), sigma=sigma, size=int(rng.integers(200, 5000)))
    counts = [0] * histogram.BUCKETS
    for v in values:
        counts[histogram.bucket_of(float(v))] += 1
    for q in (0.5, 0.95, 0.99):
        exact = float(np.quantile(values, q))
        estimate = histogram.percentile(counts, q)
        if exact > TOP:  # past the last bound only "at least 131 s" is known
            assert TOP / STEP <= estimate <= TOP, (q, exact, estimate)
        else:
            assert exact / STEP <= estimate <= exact * STEP, (q, exact, estimate)


def test_values_past_the_top_bound_read_back_as_the_bound():
    counts = [0] * histogram.BUCKETS
    for ms in (200_000.0, 10**6, 5e7):
        counts[histogram.bucket_of(ms)] += 1
    assert histogram.percentile(counts, 0.5) == histogram.percentile(counts, 0.99) == TOP


def test_a_single_value_is_found_in_its_bucket():
    counts = [0] * histogram.BUCKETS
    counts[histogram.bucket_of(40.0)] = 1
    p50, p95 = histogram.percentile(counts, 0.5), histogram.percentile(counts, 0.95)
    assert 40 / STEP <= p50 <= p95 <= 40 * STEP


@pytest.mark.django_db
def test_record_fills_the_histograms_and_reports_read_them(tenant):
    at = datetime(2026, 5, 4, 12, 0, 10, tzinfo=UTC)
    rng = np.random.default_rng()
    latencies = rng.uniform(5, 3000, size=80)
    for i, ms in enumerate(latencies):
        ttft = None if i % 4 == 0 else float(ms) / 10  # a non-streamed request has no time to first token
        record(UsageRecord(account_id=tenant.account.pk, key_id=str(tenant.key.pk), model=CHAT_MODEL,
                           route="native", latency_ms=float(ms), ttft_ms=ttft, created_at=at + timedelta(minutes=i % 3)))
    day = UsageDay.objects.get(account=tenant.account)
    assert sum(getattr(day, f) for f in histogram.LATENCY_FIELDS) == 80
    assert sum(getattr(day, f) for f in histogram.TTFT_FIELDS) == 60
    minutes = UsageMinute.objects.filter(account=tenant.account)
    assert minutes.count() == 3
    for field in (*histogram.LATENCY_FIELDS, *histogram.TTFT_FIELDS):  # minutes add up to the day, bucket by bucket
        assert sum(getattr(m, field) for m in minutes) == getattr(day, field)

    query = reports.parse_query({"since": "2026-05-04", "until": "2026-05-04", "granularity": "minute",
                                 "group_by": "minute"}, at)
    result = reports.report(tenant.account.pk, query)
    totals = result["totals"]
    exact_p50, exact_p95 = np.quantile(latencies, [0.5, 0.95])
    assert exact_p50 / STEP <= totals["p50_latency_ms"] <= exact_p50 * STEP
    assert exact_p95 / STEP <= totals["p95_latency_ms"] <= exact_p95 * STEP
    ttfts = [float(ms) / 10 for i, ms in enumerate(latencies) if i % 4]
    assert np.quantile(ttfts, 0.95) / STEP <= totals["p95_ttft_ms"] <= np.quantile(ttfts, 0.95) * STEP
    assert len(result["rows"]) == 3 and all(r["p50_latency_ms"] <= r["p95_latency_ms"] for r in result["rows"])
    assert not any(name in totals for name in histogram.LATENCY_FIELDS)  # the buckets stay inside
    header = reports.to_csv(result).splitlines()[0].split(",")
    assert {"p50_latency_ms", "p95_latency_ms", "p50_ttft_ms", "p95_ttft_ms"} <= set(header)
