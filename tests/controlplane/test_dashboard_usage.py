"""The dashboard's Usage pages through the Django test client: the summary's figures (from the rollups written by
usage.services.record), its CSV, the request log's filters and keyset pages, access rules and bad input."""

from __future__ import annotations

import csv
import io
import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from urllib.parse import parse_qsl

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.accounts.models import Membership
from controlplane.accounts.services import issue_key
from controlplane.catalog.models import AiModel
from controlplane.catalog.services import set_price
from controlplane.dashboard import usage_log
from controlplane.usage import reports
from controlplane.usage.models import Source, Status, UsageEvent
from controlplane.usage.services import UsageRecord, record

DAY1 = datetime(2026, 3, 10, tzinfo=UTC)
DAY2 = datetime(2026, 3, 12, tzinfo=UTC)
RANGE = {"since": "2026-03-10", "until": "2026-03-12"}


@pytest.fixture
def priced(catalog) -> None:
    """Prices in effect since 2020, so usage on the fixed days is billed."""
    for name in (CHAT_MODEL, EMBED_MODEL):
        set_price(AiModel.objects.get(name=name), input_neurons=1000, cached_input_neurons=250,
                  output_neurons=4000, effective_at=datetime(2020, 1, 1, tzinfo=UTC))


def use(account, key, at, *, model=CHAT_MODEL, inp=100, cached=0, out=20, status=Status.OK,
        source=Source.INTERACTIVE, latency=40.0) -> UsageEvent:
    return record(UsageRecord(
        account_id=account.pk, key_id=str(key.pk) if key is not None else None, model=model, route="native",
        status=status, error_code="3006" if status == Status.ERROR else "",
        http_status=413 if status == Status.ERROR else 200, source=source, input_tokens=inp,
        cached_input_tokens=cached, output_tokens=out, latency_ms=latency, ttft_ms=latency / 4, created_at=at))


def signed_in(tenant, name="ada", *, staff=False) -> Client:
    user = get_user_model().objects.create_user(name, password="pw", is_staff=staff)
    if not staff:
        Membership.objects.create(account=tenant.account, user=user, role=Membership.Role.MEMBER)
    web = Client()
    web.force_login(user)
    return web


@pytest.fixture
def recorded(priced, tenant, other_tenant) -> dict:
    """Six requests on two days over two models and four kinds of key (named, second named, none, deleted);
    plus one outside the range and one of another account."""
    account = tenant.account
    runner, _ = issue_key(account, name="ci-runner")
    gone, _ = issue_key(account, name="old-key")
    events = [
        use(account, tenant.key, DAY1 + timedelta(hours=10), inp=100, cached=20, out=30),
        use(account, runner, DAY1 + timedelta(hours=11), inp=50, out=10, latency=300.0),
        use(account, runner, DAY2 + timedelta(hours=9), model=EMBED_MODEL, inp=40, out=0),
        use(account, None, DAY2 + timedelta(hours=12), inp=10, out=5),
        use(account, gone, DAY2 + timedelta(hours=13), inp=70, out=7),
        use(account, tenant.key, DAY2 + timedelta(hours=14), status=Status.ERROR),
    ]
    gone_id = str(gone.pk)
    gone.delete()
    use(account, tenant.key, DAY1 - timedelta(days=5))
    use(other_tenant.account, other_tenant.key, DAY1 + timedelta(hours=10), inp=999)
    return {"events": events, "runner": runner, "gone_id": gone_id}


def _sum(events, field):
    return sum((getattr(e, field) for e in events), Decimal(0) if field in ("neurons", "cost_usd") else 0)


def _usage_url(tenant, suffix="") -> str:
    return f"/dashboard/{tenant.account.pk}/usage/{suffix}"


# -------------------------------------------------------------------------------------------- summary
@pytest.mark.django_db
def test_totals_and_tables_equal_what_was_recorded(tenant, recorded):
    events = recorded["events"]
    page = signed_in(tenant).get(_usage_url(tenant), RANGE)
    assert page.status_code == 200
    s = page.context["summary"]
    totals = s["totals"]
    assert (totals["requests"], totals["errors"]) == (6, 1)
    for field in ("input_tokens", "cached_input_tokens", "output_tokens"):
        assert totals[field] == _sum(events, field) > 0, field
    assert totals["neurons"] == pytest.approx(float(_sum(events, "neurons"))) and totals["neurons"] > 0
    assert totals["cost_usd"] == pytest.approx(float(_sum(events, "cost_usd"))) and totals["cost_usd"] > 0

    by_model = {row["model"]: row for row in s["by_model"]}
    assert {m: r["requests"] for m, r in by_model.items()} == {CHAT_MODEL: 5, EMBED_MODEL: 1}
    chat = [e for e in events if e.model == CHAT_MODEL]
    assert by_model[CHAT_MODEL]["output_tokens"] == _sum(chat, "output_tokens")
    assert by_model[CHAT_MODEL]["neurons"] == pytest.approx(float(_sum(chat, "neurons")))
    assert by_model[EMBED_MODEL]["input_tokens"] == 40

    by_key = {row["key"]["name"]: row for row in s["by_key"]}
    assert {k: r["requests"] for k, r in by_key.items()} == {
        "default": 2, "ci-runner": 2, "no key": 1, "deleted key": 1}
    assert by_key["deleted key"]["key_id"] == recorded["gone_id"] and by_key["no key"]["key_id"] is None
    assert by_key["ci-runner"]["input_tokens"] == 90 and by_key["default"]["errors"] == 1
    assert by_key["ci-runner"]["p95_latency_ms"] > by_key["no key"]["p95_latency_ms"]  # 300 ms against 40 ms

    assert [(r["time"], r["requests"]) for r in s["by_day"]] == [("2026-03-12", 4), ("2026-03-10", 2)]
    assert s["chart"]["labels"] == ["2026-03-10", "2026-03-11", "2026-03-12"]
    assert s["chart"]["requests"] == [2, 0, 4]
    day2 = [e for e in events if e.created_at >= DAY2]
    assert s["chart"]["cost_usd"][2] == pytest.approx(float(_sum(day2, "cost_usd")))

    html = page.content.decode()
    assert '<span class="value" id="t-requests">6</span>' in html
    for text in ('data-key="ci-runner"', 'data-key="no key"', 'data-key="deleted key"', 'data-day="2026-03-12"',
                 f'data-model="{EMBED_MODEL}"', 'id="daily-chart"', 'id="usage-daily"',
                 "usage/export.csv?since=2026-03-10&amp;until=2026-03-12"):
        assert text in html, text
    assert 'data-day="2026-03-11"' not in html  # the table lists days with requests; the chart has every day


@pytest.mark.django_db
def test_filters_narrow_every_figure(tenant, recorded):
    web = signed_in(tenant)
    embed = web.get(_usage_url(tenant), {**RANGE, "model": EMBED_MODEL}).context["summary"]
    assert embed["totals"]["requests"] == 1 and [r["model"] for r in embed["by_model"]] == [EMBED_MODEL]
    runner = web.get(_usage_url(tenant), {**RANGE, "key": str(recorded["runner"].pk)}).context["summary"]
    assert runner["totals"]["requests"] == 2 and [r["key"]["name"] for r in runner["by_key"]] == ["ci-runner"]
    assert {r["model"] for r in runner["by_model"]} == {CHAT_MODEL, EMBED_MODEL}
    first_day = web.get(_usage_url(tenant), {"since": "2026-03-10", "until": "2026-03-10"})
    assert first_day.context["summary"]["totals"]["requests"] == 2
    assert first_day.context["summary"]["chart"]["labels"] == ["2026-03-10"]
    deleted = web.get(_usage_url(tenant), {**RANGE, "key": recorded["gone_id"]}).context["summary"]
    assert deleted["totals"]["requests"] == 1  # a deleted key's usage stays reportable
    empty = web.get(_usage_url(tenant), {"since": "2026-03-11", "until": "2026-03-11"})
    assert empty.status_code == 200 and empty.context["summary"]["totals"]["requests"] == 0
    assert b'id="usage-empty"' in empty.content and b'id="by-model"' not in empty.content


@pytest.mark.django_db
def test_the_default_range_is_the_last_30_utc_days(priced, tenant):
    now = timezone.now()
    today = now.astimezone(UTC).date()
    use(tenant.account, tenant.key, now)
    use(tenant.account, tenant.key, datetime.combine(today - timedelta(days=29), datetime.min.time(), tzinfo=UTC))
    use(tenant.account, tenant.key, datetime.combine(today - timedelta(days=30), datetime.min.time(),
                                                     tzinfo=UTC) + timedelta(hours=23, minutes=59))
    page = signed_in(tenant).get(_usage_url(tenant))
    assert page.status_code == 200
    assert page.context["form"]["since"] == (today - timedelta(days=29)).isoformat()
    assert page.context["form"]["until"] == today.isoformat()
    assert page.context["summary"]["totals"]["requests"] == 2
    assert len(page.context["summary"]["chart"]["labels"]) == 30


@pytest.mark.django_db
def test_csv_export_has_the_report_columns_and_a_row_per_day_model_and_key(tenant, recorded):
    web = signed_in(tenant)
    response = web.get(_usage_url(tenant, "export.csv"), RANGE)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"] == (
        f'attachment; filename="hearth-usage-{tenant.account.pk}-2026-03-10-to-2026-03-12.csv"')
    reader = csv.DictReader(io.StringIO(response.content.decode()))
    assert tuple(reader.fieldnames) == reports.CSV_COLUMNS
    rows = list(reader)
    key = str(tenant.key.pk)
    runner = str(recorded["runner"].pk)
    assert sorted((r["time"], r["model"], r["key_id"], r["requests"], r["errors"]) for r in rows) == sorted([
        ("2026-03-10", CHAT_MODEL, key, "1", "0"), ("2026-03-10", CHAT_MODEL, runner, "1", "0"),
        ("2026-03-12", EMBED_MODEL, runner, "1", "0"), ("2026-03-12", CHAT_MODEL, "", "1", "0"),
        ("2026-03-12", CHAT_MODEL, recorded["gone_id"], "1", "0"), ("2026-03-12", CHAT_MODEL, key, "1", "1")])
    events = recorded["events"]
    assert sum(int(r["input_tokens"]) for r in rows) == _sum(events, "input_tokens")
    assert sum(float(r["neurons"]) for r in rows) == pytest.approx(float(_sum(events, "neurons")))
    assert all(r["p50_latency_ms"] for r in rows)  # every row had a request, so a latency
    only_embed = list(csv.DictReader(io.StringIO(web.get(_usage_url(tenant, "export.csv"),
                                                         {**RANGE, "model": EMBED_MODEL}).content.decode())))
    assert [(r["model"], r["input_tokens"]) for r in only_embed] == [(EMBED_MODEL, "40")]
    bad = web.get(_usage_url(tenant, "export.csv"), {"since": "2026-03-12", "until": "2026-03-10"})
    assert bad.status_code == 400 and b"is after until" in bad.content


@pytest.mark.django_db
@pytest.mark.parametrize(("params", "message"), [
    ({"since": "yesterday"}, "since must be a date written YYYY-MM-DD"),
    ({"since": "2026-02-30"}, "since must be a date written YYYY-MM-DD"),
    ({"until": "9999-12-31"}, "until must be a date written YYYY-MM-DD"),
    ({"since": "2026-03-12", "until": "2026-03-10"}, "since (2026-03-12) is after until (2026-03-10)"),
    ({"key": "not-a-key"}, "key must be one of the account&#x27;s keys"),
    ({"model": "m" * 201}, "model must be at most 200 characters"),
])
def test_bad_summary_filters_are_a_400_with_the_message_on_the_page(tenant, params, message):
    page = signed_in(tenant).get(_usage_url(tenant), params)
    assert page.status_code == 400
    html = page.content.decode()
    assert 'role="alert"' in html and message in html
    assert 'id="usage-filters"' in html and "Download CSV" not in html  # the form stays, to fix the value


# ----------------------------------------------------------------------------------------- request log
def _log(web, tenant, params=None, **headers):
    return web.get(_usage_url(tenant, "requests/"), params or {}, **headers)


def _walk(web, tenant, params) -> list[list[int]]:
    """Every page of the log, following the "older" links as a browser would."""
    pages, query = [], dict(params)
    while True:
        response = _log(web, tenant, query)
        assert response.status_code == 200
        pages.append([row["event"].pk for row in response.context["rows"]])
        older = response.context["older_query"]
        if not older:
            return pages
        assert f"?{older}".replace("&", "&amp;") in response.content.decode()
        query = dict(parse_qsl(older))


@pytest.mark.django_db
def test_keyset_pages_return_every_event_once_newest_first(priced, tenant, monkeypatch):
    rng = random.Random(8)
    base = datetime(2026, 3, 10, 12, tzinfo=UTC)
    # Three events per second, some on the whole second and some not, written out of time order: the log must
    # order by time (not by id) and break ties without losing or repeating a row.
    moments = [base - timedelta(seconds=i // 3, microseconds=250_000 * (i % 2)) for i in range(120)]
    rng.shuffle(moments)
    events = [use(tenant.account, tenant.key if i % 4 else None, at,
                  status=Status.ERROR if i % 3 == 0 else Status.OK) for i, at in enumerate(moments)]
    newest_first = [e.pk for e in sorted(events, key=lambda e: (e.created_at, e.pk), reverse=True)]
    web = signed_in(tenant)
    pages = _walk(web, tenant, {})
    assert [len(p) for p in pages] == [50, 50, 20]
    assert [pk for p in pages for pk in p] == newest_first

    monkeypatch.setattr(usage_log, "PAGE_SIZE", 7)  # filtered walks over several small pages
    errors = [e.pk for e in sorted(events, key=lambda e: (e.created_at, e.pk), reverse=True)
              if e.status == Status.ERROR]
    pages = _walk(web, tenant, {"status": "error"})
    assert [pk for p in pages for pk in p] == errors and len(pages) == 6 and len(errors) == 40
    keyless = [pk for pk in newest_first if UsageEvent.objects.get(pk=pk).api_key_id is None]
    assert [pk for p in _walk(web, tenant, {"key": "none", "status": "ok"}) for pk in p] == [
        pk for pk in keyless if pk not in errors]


@pytest.mark.django_db
def test_log_filters_model_key_status_source_and_time(priced, tenant, other_tenant):
    account = tenant.account
    runner, _ = issue_key(account, name="ci-runner")
    a = use(account, tenant.key, DAY1 + timedelta(hours=1))
    b = use(account, runner, DAY1 + timedelta(hours=2), model=EMBED_MODEL)
    c = use(account, None, DAY1 + timedelta(hours=3), status=Status.ERROR)
    d = use(account, runner, DAY1 + timedelta(hours=4), status=Status.ABORTED)
    e = use(account, runner, DAY2 + timedelta(hours=5), source=Source.BATCH)
    use(other_tenant.account, other_tenant.key, DAY1 + timedelta(hours=1))
    web = signed_in(tenant)

    def ids(params):
        response = _log(web, tenant, params)
        assert response.status_code == 200, response.content
        return [row["event"].pk for row in response.context["rows"]]

    assert ids({}) == [e.pk, d.pk, c.pk, b.pk, a.pk]
    assert ids({"model": EMBED_MODEL}) == [b.pk]
    assert ids({"key": str(runner.pk)}) == [e.pk, d.pk, b.pk]
    assert ids({"key": "none"}) == [c.pk]
    assert ids({"status": "error"}) == [c.pk] and ids({"status": "aborted"}) == [d.pk]
    assert ids({"source": "batch"}) == [e.pk] and e.pk not in ids({"source": "interactive"})
    assert ids({"since": "2026-03-10T02:00", "until": "2026-03-10T03:00"}) == [c.pk, b.pk]  # "until" names its minute
    assert ids({"since": "2026-03-12"}) == [e.pk] and ids({"until": "2026-03-10"}) == [d.pk, c.pk, b.pk, a.pk]
    html = _log(web, tenant, {"status": "error"}).content.decode()
    assert '<span class="status status-error">error</span> <span class="error-code" title="HTTP 413">3006</span>' in html
    assert "no key" in html and "2026-03-10 03:00:00" in html
    row = _log(web, tenant, {"source": "batch"}).content.decode()
    assert "ci-runner" in row and '<span class="badge">batch</span>' in row


@pytest.mark.django_db
@pytest.mark.parametrize(("params", "message"), [
    ({"status": "weird"}, "status must be one of ok, error, aborted"),
    ({"source": "cron"}, "source must be one of interactive, batch"),
    ({"key": "12"}, "key must be one of the account&#x27;s keys"),
    ({"before": "garbage"}, "before must be a cursor"),
    ({"before": "99999999999999999999_1"}, "before must be a cursor"),
    ({"since": "2026-13-01"}, "since must be a date (YYYY-MM-DD) or a time"),
    ({"until": "9999-12-31"}, "until must be a date (YYYY-MM-DD) or a time"),
    ({"since": "2026-03-12", "until": "2026-03-10"}, "since must be before until"),
])
def test_bad_log_filters_are_a_400_with_the_message(tenant, params, message):
    web = signed_in(tenant)
    page = _log(web, tenant, params)
    assert page.status_code == 400 and message in page.content.decode() and b'id="log-filters"' in page.content
    partial = _log(web, tenant, params, HTTP_HX_REQUEST="true")
    assert partial.status_code == 400 and message in partial.content.decode() and b"<html" not in partial.content


@pytest.mark.django_db
def test_htmx_gets_the_log_alone_and_everyone_else_the_page(priced, tenant):
    use(tenant.account, tenant.key, DAY1)
    web = signed_in(tenant)
    page = _log(web, tenant)
    assert b"<html" in page.content and b'id="log-filters"' in page.content and b'id="log-table"' in page.content
    assert b"htmx-2.0.11.min.js" in page.content and 'HX-Request' in page["Vary"]
    partial = _log(web, tenant, HTTP_HX_REQUEST="true")
    assert partial.status_code == 200 and b"<html" not in partial.content
    assert partial.content.lstrip().startswith(b'<section class="card" id="log"') and b'id="log-table"' in partial.content
    restore = _log(web, tenant, HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true")
    assert b"<html" in restore.content  # htmx restoring history wants a whole page


@pytest.mark.django_db
def test_an_empty_log_says_so(priced, tenant):
    web = signed_in(tenant)
    assert b"No requests yet" in _log(web, tenant).content
    use(tenant.account, tenant.key, DAY1)
    filtered = _log(web, tenant, {"status": "error"})
    assert b"No requests match these filters" in filtered.content and b'id="log-older"' not in filtered.content


# ---------------------------------------------------------------------------------------------- access
@pytest.mark.django_db
def test_members_see_only_their_account_and_operators_any(tenant, other_tenant):
    anonymous = Client()
    for suffix in ("", "export.csv", "requests/"):
        response = anonymous.get(_usage_url(tenant, suffix))
        assert response.status_code == 302 and response.url.startswith("/dashboard/login/")
    web = signed_in(tenant)
    for suffix in ("", "export.csv", "requests/"):
        assert web.get(_usage_url(tenant, suffix)).status_code == 200
        assert web.get(_usage_url(other_tenant, suffix)).status_code == 404
    operator = signed_in(tenant, "op", staff=True)
    for who in (tenant, other_tenant):
        for suffix in ("", "export.csv", "requests/"):
            assert operator.get(_usage_url(who, suffix)).status_code == 200


# ----------------------------------------------------------------------------------------- query costs
SUMMARY_MAX_QUERIES = 12  # session, user, access, account, switcher, keys, three reports of two queries each
LOG_MAX_QUERIES = 7  # session, user, access, account, switcher, keys, one page of events
CSV_MAX_QUERIES = 7  # session, user, access, account, switcher, one report of two queries


def _queries(web, url, params=None) -> list[str]:
    with CaptureQueriesContext(connection) as captured:
        assert web.get(url, params or {}).status_code == 200
    return [q["sql"] for q in captured.captured_queries]


@pytest.mark.django_db
def test_query_counts_do_not_grow_with_usage_and_events_are_never_scanned(
        priced, tenant, django_assert_max_num_queries):
    web = signed_in(tenant)
    web.get(_usage_url(tenant))  # the process's catalog snapshot is built once, on first use
    small_summary = _queries(web, _usage_url(tenant), RANGE)
    small_log = _queries(web, _usage_url(tenant, "requests/"))
    keys = [issue_key(tenant.account, name=f"k{i}")[0] for i in range(5)] + [None]
    for i in range(90):
        use(tenant.account, keys[i % len(keys)], DAY1 + timedelta(days=i % 3, minutes=i),
            model=(CHAT_MODEL, EMBED_MODEL)[i % 2])
    with django_assert_max_num_queries(SUMMARY_MAX_QUERIES):
        assert web.get(_usage_url(tenant), RANGE).context["summary"]["totals"]["requests"] == 90
    with django_assert_max_num_queries(LOG_MAX_QUERIES):
        assert len(web.get(_usage_url(tenant, "requests/")).context["rows"]) == 50
    with django_assert_max_num_queries(CSV_MAX_QUERIES):
        web.get(_usage_url(tenant, "export.csv"), RANGE)
    summary = _queries(web, _usage_url(tenant), RANGE)
    log = _queries(web, _usage_url(tenant, "requests/"))
    assert len(summary) == len(small_summary) and len(log) == len(small_log)
    # The summary and its CSV read rollups only; the log reads one bounded page of events, no count, no offset.
    assert not [q for q in summary + _queries(web, _usage_url(tenant, "export.csv"), RANGE)
                if "usage_usageevent" in q]
    event_queries = [q for q in log if "usage_usageevent" in q]
    assert len(event_queries) == 1
    assert "LIMIT 51" in event_queries[0] and "OFFSET" not in event_queries[0] and "COUNT(" not in event_queries[0]


@pytest.mark.django_db
def test_the_log_query_walks_the_accounts_time_index(tenant):
    if connection.vendor != "sqlite":
        pytest.skip("the plan text checked here is SQLite's")
    filters = usage_log.parse_filters({"before": usage_log.Cursor(DAY2, 10).encode(), "source": "batch"})
    plan = usage_log.query(tenant.account.pk, filters).explain()
    assert "SEARCH usage_usageevent USING INDEX usage_usage_account_7583a1_idx (account_id=? AND created_at<?)" in plan
    assert "USE TEMP B-TREE FOR ORDER BY" not in plan  # no sort of the whole match: the index gives the order
    # A status filter (errors and aborts are rare) has an index of its own, so it never walks every event.
    filters = usage_log.parse_filters({"before": usage_log.Cursor(DAY2, 10).encode(), "status": "error"})
    plan = usage_log.query(tenant.account.pk, filters).explain()
    assert "USING INDEX usage_usage_account_5da3cf_idx (account_id=? AND status=? AND created_at<?)" in plan
    assert "USE TEMP B-TREE FOR ORDER BY" not in plan  # only the id tie-break within one instant is sorted
    by_model = usage_log.query(tenant.account.pk, usage_log.parse_filters({"model": CHAT_MODEL})).explain()
    assert "USING INDEX usage_usage_account_731d0a_idx (account_id=? AND model=?)" in by_model
