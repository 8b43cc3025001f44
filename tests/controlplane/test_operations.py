"""OpenAPI and its docs page, Prometheus metrics, the admin for every model, production settings."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from cp_support import CHAT_MODEL
from django.apps import apps
from django.contrib.auth import get_user_model
from django.urls import reverse

from controlplane.api.errors import from_engine
from inference.errors import (
    EngineDeadError,
    EngineLostError,
    EngineOverloadedError,
    EngineUnreachableError,
    InvalidRequestError,
    PromptTooLongError,
    TokenizerChangedError,
)

pytestmark = pytest.mark.django_db
REPO = Path(__file__).resolve().parents[2]


def test_openapi_schema_covers_the_api_and_its_bodies(client):
    schema = client.get("/api/schema/").json()
    assert schema["openapi"].startswith("3.1")
    paths = schema["paths"]
    for path, method in [("/client/v4/accounts/{account_id}/ai/run/{model}", "post"),
                         ("/v1/chat/completions", "post"), ("/v1/embeddings", "post"), ("/v1/models", "get"),
                         ("/client/v4/accounts/{account_id}/ai/v1/chat/completions", "post"),
                         ("/client/v4/accounts/{account_id}/ai/usage", "get"),
                         ("/client/v4/accounts/{account_id}/tokens", "post")]:
        assert method in paths[path], path
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages", "stream_options", "max_tokens", "speculation"} <= set(chat["properties"])
    # Every $ref points at a defined component.
    text = json.dumps(schema)
    for name in {part.split('"')[0] for part in text.split("#/components/schemas/")[1:]}:
        assert name in schema["components"]["schemas"], name


def test_docs_page_renders_without_external_assets(client):
    page = client.get("/api/docs/")
    html = page.content.decode()
    assert page.status_code == 200 and "/v1/chat/completions" in html and "NativeTextGeneration" in html
    assert "http://" not in html and "https://" not in html


def test_prometheus_metrics_count_requests_and_tokens(client, tenant):
    client.get("/v1/models", **tenant.auth)
    client.get("/v1/models")
    text = client.get("/metrics").content.decode()
    assert 'hearth_http_requests_total{method="GET",route="v1/models",status="200"}' in text
    assert 'hearth_http_requests_total{method="GET",route="v1/models",status="401"}' in text
    assert "hearth_http_request_duration_seconds_bucket" in text
    for family in ("hearth_tokens_total", "hearth_time_to_first_token_seconds", "hearth_engine_queue_depth",
                   "hearth_engine_kv_usage", "hearth_engine_prefix_cache_hit_rate"):
        assert family in text, family


@pytest.mark.real_model
def test_metrics_show_engine_gauges_once_a_model_ran(client, tenant, backend):
    client.post(f"{tenant.run_url}{CHAT_MODEL}", data={"prompt": "hi", "max_tokens": 2},
                content_type="application/json", **tenant.auth)
    text = client.get("/metrics").content.decode()
    assert f'hearth_engine_kv_blocks_total{{model="{CHAT_MODEL}"}}' in text
    assert f'hearth_engine_mid_step_admissions_total{{model="{CHAT_MODEL}"}}' in text
    assert f'hearth_tokens_total{{kind="output",model="{CHAT_MODEL}"}}' in text
    assert f'hearth_inference_requests_total{{api="native",model="{CHAT_MODEL}",status="ok"}}' in text


def test_metrics_token(client, settings):
    settings.HEARTH_METRICS_TOKEN = "scrape-me"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").status_code == 200


def test_admin_has_every_model_and_its_pages_load(client, tenant):
    admin_user = get_user_model().objects.create_superuser("root", password="pw-root-1")
    client.force_login(admin_user)
    from django.contrib import admin

    ours = [m for m in apps.get_models() if m.__module__.startswith("controlplane.")]
    # A model edited only inside its parent's page (an adapter's files) counts as reachable.
    inline = {i.model for a in admin.site._registry.values() for i in a.inlines}
    assert ours and all(admin.site.is_registered(m) or m in inline for m in ours)
    for model in (m for m in ours if admin.site.is_registered(m)):
        meta = model._meta
        changelist = client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"))
        assert changelist.status_code == 200, meta.label
        row = model.objects.first()
        if row is not None:
            change = client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[row.pk]))
            assert change.status_code == 200, meta.label


def test_admin_creates_a_key_through_the_service_and_shows_the_secret_once(client, tenant):
    from controlplane.accounts.models import ApiKey

    client.force_login(get_user_model().objects.create_superuser("root2", password="pw-root-2"))
    response = client.post(reverse("admin:accounts_apikey_add"), {
        "account": tenant.account.pk, "name": "from-admin", "permission": "run", "allowed_models": "[]",
    }, follow=True)
    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"]]
    secret = next(m.split(": ", 1)[1].split(" ")[0] for m in shown if "API key created" in m)
    from controlplane.accounts.services import authenticate_key

    assert authenticate_key(secret).key_name == "from-admin"
    assert ApiKey.objects.filter(name="from-admin").count() == 1


@pytest.mark.parametrize("exc, status, code", [
    (PromptTooLongError("long", prompt_tokens=9, limit=8), 413, 3006),
    (InvalidRequestError("bad"), 400, 5006),
    (EngineOverloadedError("full"), 429, 3040),
    (EngineDeadError("dead"), 503, 5001),
    (EngineLostError("the replica died"), 503, 5001),
    (EngineUnreachableError("gRPC INTERNAL"), 503, 5001),
    (TokenizerChangedError("encoded by tokenizer revision a; this replica has b"), 503, 5001),
])
def test_engine_errors_map_to_workers_ai_codes(exc, status, code):
    error = from_engine(exc, CHAT_MODEL)
    assert (error.status, error.code) == (status, code)
    assert error.openai_response().status_code == (400 if code == 3006 else status)
    if status == 503:  # what a retry can mend says so, with when to retry; a stopped engine needs its operator
        retry = isinstance(exc, EngineLostError)
        assert ("Retry-After" in error.headers, "retry" in error.message) == (retry, retry)
        assert ("operator" in error.message) == (not retry)


@pytest.mark.once  # subprocesses reading settings: the database under test changes nothing here
def test_check_deploy_passes_with_production_environment(tmp_path):
    env = {**os.environ, "SECRET_KEY": secrets.token_urlsafe(60), "DEBUG": "0", "ALLOWED_HOSTS": "api.example.com",
           "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/hearth", "REDIS_URL": "redis://127.0.0.1:6379/0",
           "HEARTH_DATA_DIR": str(tmp_path), "HEARTH_METRICS_TOKEN": secrets.token_urlsafe(24)}
    check = [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"]
    dump = [sys.executable, "-c", "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', "
            "'controlplane.settings'); django.setup(); from django.conf import settings as s; "
            "print(s.DATABASES['default']['ENGINE'], s.CACHES['default']['BACKEND'], "
            "s.CHANNEL_LAYERS['default']['BACKEND'], s.DEBUG, s.SECURE_SSL_REDIRECT)"]
    # The three processes start together: each spends seconds importing the project, one core each.
    runs = [subprocess.Popen(args, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args, e in [(check, env), (check, {k: v for k, v in env.items() if k != "HEARTH_METRICS_TOKEN"}),
                            (dump, env)]]
    (result, result_err), (open_out, open_err), (settings_out, _) = [p.communicate(timeout=120) for p in runs]
    assert runs[0].returncode == 0, result + result_err
    assert "no issues" in result
    # Without a metrics token the open /metrics is the one warning.
    assert runs[1].returncode != 0 and "hearth.W001" in open_out + open_err
    assert settings_out.split() == [
        "django.db.backends.postgresql", "django.core.cache.backends.redis.RedisCache",
        "channels_redis.core.RedisChannelLayer", "False", "True"]


@pytest.mark.once  # a subprocess reading settings without any service: the database under test is not used
def test_embedded_defaults_need_no_service(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG")}
    env["HEARTH_DATA_DIR"] = str(tmp_path)
    dump = subprocess.run(
        [sys.executable, "-c", "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', "
         "'controlplane.settings'); django.setup(); from django.conf import settings as s; "
         "print(s.DATABASES['default']['ENGINE'], s.DATABASES['default']['NAME'], s.CACHES['default']['BACKEND'], "
         "s.CHANNEL_LAYERS['default']['BACKEND'], s.DEBUG, s.PRODUCTION)"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert dump.stdout.split() == [
        "django.db.backends.sqlite3", str(tmp_path / "hearth.sqlite3"),
        "django.core.cache.backends.locmem.LocMemCache", "channels.layers.InMemoryChannelLayer", "False", "False"]
    assert (tmp_path / "secret_key").stat().st_mode & 0o077 == 0  # generated once, private


def test_healthz_and_root(client):
    assert client.get("/healthz").content == b"ok"
    assert client.get("/").status_code == 302
