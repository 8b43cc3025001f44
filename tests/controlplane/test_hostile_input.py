"""Input that once answered 500: each is now a 400 in the route's own envelope, and nothing is created."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from controlplane.accounts.models import ApiKey
from controlplane.batches.models import Batch, File

pytestmark = pytest.mark.django_db


def _native_error(response, fragment: str) -> None:
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["success"] is False and fragment in body["errors"][0]["message"]


def _openai_error(response, param: str) -> None:
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("value", ["²", "1²", "٣", "৪"])  # superscript, Arabic-Indic and Bengali digits
def test_unicode_digits_in_integer_fields(client, tenant, value):
    _openai_error(client.get(f"/v1/files?limit={value}", **tenant.auth), "limit")
    _openai_error(client.get(f"/v1/batches?limit={value}", **tenant.auth), "limit")
    upload = client.post("/v1/files", {"purpose": "batch", "expires_after[anchor]": "created_at",
                                       "expires_after[seconds]": value,
                                       "file": SimpleUploadedFile("in.jsonl", b"{}\n")}, **tenant.auth)
    _openai_error(upload, "expires_after")
    good = client.post("/v1/files", {"purpose": "batch", "file": SimpleUploadedFile("in.jsonl", b"{}\n")},
                       **tenant.auth).json()
    created = client.post("/v1/batches", data=json.dumps({"input_file_id": good["id"], "endpoint":
                          "/v1/chat/completions", "completion_window": f"{value}h"}),
                          content_type="application/json", **tenant.auth)
    _openai_error(created, "completion_window")
    assert not Batch.objects.exists() and File.objects.count() == 1


@pytest.mark.parametrize("query", ["until=9999-12-31", "since=0001-01-01", "until=0001-01-01",
                                   "since=0001-01-01T00:00:00Z", "until=9999-12-31T23:59:59Z"])
def test_dates_out_of_range_in_usage_queries(client, tenant, query):
    base = f"/client/v4/accounts/{tenant.account.pk}/ai/usage"
    _native_error(client.get(f"{base}?{query}", **tenant.auth), "between")
    _native_error(client.get(f"{base}/export?{query}", **tenant.auth), "between")


@pytest.mark.parametrize("body, fragment", [
    ({"expires_on": "2031-02-30T00:00:00Z"}, "expires_on"),
    ({"expires_on": "2031-13-01T00:00:00+00:00"}, "expires_on"),
    ({"requests_per_minute": 2**70}, "requests_per_minute"),
    ({"tokens_per_minute": 2**31}, "tokens_per_minute"),
])
def test_impossible_key_settings(client, tenant, body, fragment):
    before = ApiKey.objects.count()
    response = client.post(f"/client/v4/accounts/{tenant.account.pk}/tokens", data=json.dumps(body),
                           content_type="application/json", **tenant.auth)
    _native_error(response, fragment)
    assert ApiKey.objects.count() == before


def test_the_schema_documents_what_the_server_answers(client):
    paths = client.get("/api/schema/").json()["paths"]
    assert set(paths["/client/v4/accounts/{account_id}/tokens"]["post"]["responses"]) >= {"201"}
    assert "200" not in paths["/client/v4/accounts/{account_id}/tokens"]["post"]["responses"]
    usage = paths["/client/v4/accounts/{account_id}/ai/usage"]["get"]["responses"]["200"]["content"]
    assert {"application/json", "text/csv"} <= set(usage)


def test_nul_characters_are_text(client, tenant, backend):
    """NUL is a valid character in JSON strings and the tokenizer encodes it like any other: accepted."""
    response = client.post(f"{tenant.run_url}@hearth/smollm2-135m-instruct", data=json.dumps(
        {"prompt": "a\u0000b", "raw": True, "max_tokens": 1}), content_type="application/json", **tenant.auth)
    assert response.status_code == 200, response.content
    assert response.json()["result"]["usage"]["prompt_tokens"] >= 3


def test_integral_numbers_are_integers_as_the_schema_says(client, tenant, backend):
    """JSON Schema's integer includes 1751.0; 1.5 is still refused."""
    url = f"{tenant.run_url}@hearth/smollm2-135m-instruct"
    ok = client.post(url, data=json.dumps({"prompt": "Hi", "raw": True, "max_tokens": 2.0}),
                     content_type="application/json", **tenant.auth)
    assert ok.status_code == 200 and ok.json()["result"]["usage"]["completion_tokens"] <= 2
    _native_error(client.post(url, data=json.dumps({"prompt": "Hi", "max_tokens": 1.5}),
                              content_type="application/json", **tenant.auth), "max_tokens")
