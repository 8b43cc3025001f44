"""Dashboard benchmark: server time of the overview and usage pages with 1,000,000 usage events in the database.

One account holds all the events (the worst case for its pages): 30 days of traffic, heavier today, spread over
the catalog's models and 20 keys, with a realistic mix of statuses, sources, streaming and latencies. The events
are written in bulk and their minute and day rollups are built from the same rows with the same bucket rules as
`usage.services.record`, so the pages read what a month of real traffic would have left. Each page is requested
through Django's test client in this process (routing, middleware, session auth, queries and template rendering:
the server's whole share of a page view) and timed from request to response. Goal: <= 300 ms each.

Run: python -m benchmarks.dashboard [--events N] [--sqlite | --postgres]
     (throwaway databases: a SQLite file, then one on the PostgreSQL at 127.0.0.1:5432 when it is up)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

EVENTS = 1_000_000
KEYS = 20
DAYS = 30
ROUNDS = 15
GOAL_MS = 300.0
PG_DB = "hearth_bench_dashboard"
REPO = Path(__file__).resolve().parent.parent


def _setup_django(postgres: bool, workdir: Path) -> str:
    if postgres:
        import psycopg

        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {PG_DB}")
        os.environ["DATABASE_URL"] = f"postgresql://postgres@127.0.0.1:5432/{PG_DB}"
    else:
        os.environ.pop("DATABASE_URL", None)
        os.environ["HEARTH_SQLITE_PATH"] = str(workdir / "dashboard-bench.sqlite3")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0, interactive=False)
    call_command("seed_catalog", stdout=io.StringIO())
    return connection.vendor


def _insert(model: Any, rows: list[tuple], fields: list[str]) -> None:
    from django.db import connection, transaction

    meta = model._meta
    # Every other column gets what the ORM would write for it (its default; "" for a text field without one): a
    # field added to the model later (as `replica` was, by the fleet) failed its NOT NULL constraint here.
    rest = [f for f in meta.concrete_fields if f.name not in fields and not f.primary_key]
    if rest:
        defaults = tuple(f.get_db_prep_save(f.get_default(), connection) for f in rest)
        rows = [row + defaults for row in rows]
        fields = [*fields, *(f.name for f in rest)]
    quote = connection.ops.quote_name
    columns = ", ".join(quote(meta.get_field(f).column) for f in fields)
    sql = f"INSERT INTO {quote(meta.db_table)} ({columns}) VALUES ({', '.join(['%s'] * len(fields))})"
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":  # COPY: a million single-row INSERTs take minutes
            with cursor.cursor.copy(f"COPY {quote(meta.db_table)} ({columns}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            return
        for start in range(0, len(rows), 20_000):
            cursor.executemany(sql, rows[start:start + 20_000])


def populate(n_events: int, now: datetime) -> tuple[str, list[str]]:
    """n_events usage events for one account, with their rollups; returns (account id, key ids)."""
    from django.db import connection

    from controlplane.accounts.services import create_account, issue_key
    from controlplane.catalog.services import catalog
    from controlplane.usage import histogram
    from controlplane.usage.models import ROLLUP_SUMS, UsageDay, UsageEvent, UsageMinute

    account = create_account("bench-dashboard", paid_plan=True)
    issued = [issue_key(account, name=f"app-{i}")[0] for i in range(KEYS)]
    keys = [str(key.pk) for key in issued]  # rollups name a key by its id as text
    key_columns = {str(key.pk): key._meta.pk.get_db_prep_value(key.pk, connection) for key in issued}
    models = [(name, entry.price_at(now.timestamp())) for name, entry in catalog().items() if entry.installed]
    rng = random.Random(20261121)
    ops = connection.ops
    event_fields = ["created_at", "account", "api_key", "model", "adapter", "request_id", "route", "source",
                    "status", "http_status", "error_code", "stream", "input_tokens", "cached_input_tokens",
                    "output_tokens", "spec_proposed", "spec_accepted", "neurons", "cost_usd", "price", "latency_ms",
                    "ttft_ms", "session_affinity"]
    sums_index = {name: i for i, name in enumerate(ROLLUP_SUMS)}
    minutes: dict[tuple, list] = defaultdict(lambda: [0] * len(ROLLUP_SUMS))
    days: dict[tuple, list] = defaultdict(lambda: [0] * len(ROLLUP_SUMS))
    events = []
    span = DAYS * 86_400
    today_start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    for _ in range(n_events):
        # A fifth of the traffic is today's (the overview's busiest reads), the rest over the month before.
        if rng.random() < 0.2:
            at = now - timedelta(seconds=rng.uniform(0, (now - today_start).total_seconds()))
        else:
            at = now - timedelta(seconds=rng.uniform(0, span))
        model, price = models[rng.randrange(len(models))]
        key = keys[min(int(rng.expovariate(0.25)), KEYS - 1)]  # a few busy keys, a long tail
        roll = rng.random()
        status = "ok" if roll < 0.97 else "error" if roll < 0.99 else "aborted"
        ok = status != "error"
        source = "batch" if rng.random() < 0.1 else "interactive"
        stream = source == "interactive" and rng.random() < 0.6
        tin = rng.randint(10, 2000) if ok else 0
        cached = rng.randint(0, tin) if ok and rng.random() < 0.3 else 0
        tout = rng.randint(1, 400) if ok else 0
        neurons = price.neurons(tin, cached, tout) if price and ok else Decimal(0)
        cost = price.cost_usd(neurons) if price and ok else Decimal(0)
        latency = rng.lognormvariate(6.0, 0.8)
        ttft = rng.lognormvariate(4.0, 0.7) if stream else None
        proposed = rng.randint(0, 64) if rng.random() < 0.2 else 0
        accepted = rng.randint(0, proposed)
        events.append((ops.adapt_datetimefield_value(at), account.pk, key_columns[key], model, "", "", "native", source, status,
                       200 if ok else 500, "" if ok else "3040", stream, tin, cached, tout, proposed, accepted,
                       ops.adapt_decimalfield_value(neurons.quantize(Decimal("0.000001")), 20, 6),
                       ops.adapt_decimalfield_value(cost.quantize(Decimal("0.0000000001")), 20, 10),
                       price.price_id if price and ok else None, latency, ttft, ""))
        deltas = {"requests": 1, "errors": 0 if ok else 1, "input_tokens": tin, "cached_input_tokens": cached,
                  "output_tokens": tout, "spec_proposed": proposed, "spec_accepted": accepted, "neurons": neurons,
                  "cost_usd": cost, "latency_ms_sum": latency, "ttft_ms_sum": ttft or 0.0,
                  "ttft_count": 0 if ttft is None else 1, **histogram.deltas(latency, ttft)}
        utc = at.astimezone(UTC)
        for table, moment in ((minutes, utc.replace(second=0, microsecond=0)), (days, utc.date())):
            row = table[(moment, model, key)]
            for name, value in deltas.items():
                row[sums_index[name]] += value
    _insert(UsageEvent, events, event_fields)
    del events
    for model_cls, table, time_field in ((UsageMinute, minutes, "minute"), (UsageDay, days, "day")):
        adapt = ops.adapt_datetimefield_value if time_field == "minute" else ops.adapt_datefield_value
        rows = []
        for (moment, model, key), sums in table.items():
            values = [ops.adapt_decimalfield_value(Decimal(v), 24, 10) if isinstance(v, Decimal) else v
                      for v in sums]
            rows.append((account.pk, adapt(moment), model, key, *values))
        _insert(model_cls, rows, ["account", time_field, "model", "key_id", *ROLLUP_SUMS])
    with connection.cursor() as cursor:  # planner statistics, as a month-old database would have
        cursor.execute("ANALYZE")
    return account.pk, keys


def _time_pages(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    from django.contrib.auth import get_user_model
    from django.test import Client

    user = get_user_model().objects.create_user("bench-operator", password="x", is_staff=True)
    web = Client()
    web.force_login(user)
    times: dict[str, list[float]] = {name: [] for name in urls}
    for name, url in urls.items():  # warm-up: templates compiled, connections open
        response = web.get(url)
        if response.status_code != 200:
            raise RuntimeError(f"{name}: {url} answered {response.status_code}")
    for _ in range(ROUNDS):  # interleaved so drift in the machine's load hits every page alike
        for name, url in urls.items():
            started = time.perf_counter()
            response = web.get(url)
            times[name].append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200
    return {name: {"median_ms": statistics.median(t), "p90_ms": sorted(t)[int(0.9 * (len(t) - 1))],
                   "max_ms": max(t)} for name, t in times.items()}


def pages(account_id: str, keys: list[str]) -> dict[str, str]:
    """The pages timed: each dashboard page that reads usage, with and without filters."""
    from django.urls import NoReverseMatch, reverse

    from inference.models.catalog import DEFAULT_MODEL

    base = f"/dashboard/{account_id}"
    urls = {"overview": f"{base}/"}
    try:
        usage = reverse("dashboard-usage", args=[account_id])
    except NoReverseMatch:
        return urls
    urls["usage (30 days)"] = usage
    urls["usage, one model and key"] = f"{usage}?model={DEFAULT_MODEL}&key={keys[3]}"
    for name, route in (("request log", "dashboard-usage-requests"),):
        try:
            log = reverse(route, args=[account_id])
        except NoReverseMatch:
            continue
        urls[name] = log
        urls[f"{name}, status=aborted, one key"] = f"{log}?status=aborted&key={keys[KEYS - 1]}"
        urls[f"{name}, status=aborted, source=batch"] = f"{log}?status=aborted&source=batch"
    return urls


def measure(events: int, postgres: bool) -> dict[str, Any]:
    """Fill a throwaway database and time the pages (this process's Django is set up for that database)."""
    with tempfile.TemporaryDirectory(prefix="hearth-dash-bench-") as tmp:
        vendor = _setup_django(postgres, Path(tmp))
        now = datetime.now(UTC)
        started = time.perf_counter()
        account_id, keys = populate(events, now)
        fill_s = time.perf_counter() - started
        from controlplane.usage.models import UsageDay, UsageEvent, UsageMinute

        counts = {"events": UsageEvent.objects.count(), "minute_rollups": UsageMinute.objects.count(),
                  "day_rollups": UsageDay.objects.count()}
        timings = _time_pages(pages(account_id, keys))
        if postgres:
            from django.db import connections

            connections.close_all()
            import psycopg

            # FORCE: the settings' connection pool (PostgreSQL's session pool) keeps connections that
            # close_all does not close, and a plain DROP refused while they were open.
            with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")
    return {"database": vendor, "rows": counts, "fill_s": fill_s, "rounds": ROUNDS, "pages": timings}


def _postgres_up() -> bool:
    try:
        import psycopg

        psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", connect_timeout=2).close()
        return True
    except Exception:
        return False


def run(quick: bool = False, events: int | None = None) -> dict[str, Any]:
    """SQLite (what `make run` uses), then PostgreSQL when one is reachable, each in a fresh process."""
    n = events or (100_000 if quick else EVENTS)
    results = []
    for postgres in (False, True):
        if postgres and not _postgres_up():
            continue
        command = [sys.executable, "-m", "benchmarks.dashboard", "--events", str(n), "--json"]
        out = subprocess.run(command + (["--postgres"] if postgres else []), cwd=REPO, capture_output=True,
                             text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"runs": results}


def markdown(result: dict[str, Any]) -> str:
    first = result["runs"][0]
    lines = [f"{first['rows']['events']:,} usage events in one account; each page requested {first['rounds']} times "
             "through Django's test client as a signed-in operator, pages interleaved; server time from request "
             "to response (routing, session, queries, template).", ""]
    for run_ in result["runs"]:
        rows = run_["rows"]
        lines += [f"**{run_['database']}**: {rows['events']:,} events, {rows['minute_rollups']:,} minute and "
                  f"{rows['day_rollups']:,} day rollup rows (filled in {run_['fill_s']:.0f} s).", "",
                  "| page | median (ms) | p90 (ms) | max (ms) | goal |", "| --- | --- | --- | --- | --- |"]
        for name, t in run_["pages"].items():
            verdict = "met" if t["median_ms"] <= GOAL_MS else "missed"
            lines.append(f"| {name} | {t['median_ms']:.1f} | {t['p90_ms']:.1f} | {t['max_ms']:.1f} | "
                         f"≤ {GOAL_MS:.0f} ms ({verdict}) |")
        lines.append("")
    return "\n".join(lines).rstrip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=EVENTS)
    parser.add_argument("--postgres", action="store_true", help="this database only (default: SQLite, then "
                        "PostgreSQL if reachable)")
    parser.add_argument("--sqlite", action="store_true", help="SQLite only")
    parser.add_argument("--json", action="store_true", help="print one database's result as JSON (run() uses it)")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.events, args.postgres)))
        return
    if args.postgres or args.sqlite:
        result = {"runs": [measure(args.events, args.postgres)]}
    else:
        result = run(events=args.events)
    print(markdown(result))


if __name__ == "__main__":
    main()
