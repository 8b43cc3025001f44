"""The dashboard benchmark (benchmarks/dashboard.py) at a small scale, so it cannot rot unseen: it writes usage
rows with raw SQL for speed, and a column added to the usage model later (the fleet's `replica`) broke it unseen
for days, until the next run of the benchmark. Both of its databases: SQLite, and PostgreSQL's COPY path when it is up."""

from __future__ import annotations

import pytest

from benchmarks import dashboard

pytestmark = pytest.mark.once  # it starts its own processes and throwaway databases; one pass is enough


def test_the_dashboard_benchmark_fills_its_rows_and_times_every_page() -> None:
    result = dashboard.run(events=400)
    runs = result["runs"]
    assert runs[0]["database"] == "sqlite"
    if dashboard._postgres_up():
        assert [r["database"] for r in runs] == ["sqlite", "postgresql"]
    for run in runs:
        assert run["rows"]["events"] == 400
        assert run["rows"]["minute_rollups"] > 0 and run["rows"]["day_rollups"] > 0
        assert set(run["pages"]) >= {"overview", "usage (30 days)", "request log"}
        assert all(page["median_ms"] > 0 for page in run["pages"].values())
    assert "400 usage events" in dashboard.markdown(result)
