"""Routes: the Cloudflare-style API under /client/v4, OpenAI's under /v1 (and under the account), admin, docs."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import include, path

from controlplane.accounts import views as accounts
from controlplane.adapters import views as adapters
from controlplane.api import openapi
from controlplane.api.views import healthz, metrics
from controlplane.batches import views as batches
from controlplane.catalog import views as catalog
from controlplane.serving import views_anthropic as anthropic
from controlplane.serving import views_native as native
from controlplane.serving import views_openai as openai
from controlplane.serving import views_responses as responses
from controlplane.usage import views as usage


def _openai_routes(prefix: str, name: str) -> list:
    return [
        path(f"{prefix}models", catalog.list_models, name=f"{name}-models"),
        path(f"{prefix}models/<path:model>", catalog.retrieve_model, name=f"{name}-model"),
        path(f"{prefix}chat/completions", openai.chat_completions, name=f"{name}-chat"),
        path(f"{prefix}completions", openai.completions, name=f"{name}-completions"),
        path(f"{prefix}embeddings", openai.embeddings, name=f"{name}-embeddings"),
        path(f"{prefix}responses", responses.responses, name=f"{name}-responses"),
        path(f"{prefix}responses/<str:response_id>", responses.response_detail, name=f"{name}-response"),
        path(f"{prefix}responses/<str:response_id>/cancel", responses.response_cancel,
             name=f"{name}-response-cancel"),
        path(f"{prefix}messages", anthropic.messages, name=f"{name}-messages"),
        path(f"{prefix}messages/count_tokens", anthropic.count_tokens, name=f"{name}-messages-count-tokens"),
        path(f"{prefix}files", batches.files, name=f"{name}-files"),
        path(f"{prefix}files/<str:file_id>", batches.file_detail, name=f"{name}-file"),
        path(f"{prefix}files/<str:file_id>/content", batches.file_content, name=f"{name}-file-content"),
        path(f"{prefix}batches", batches.batches, name=f"{name}-batches"),
        path(f"{prefix}batches/<str:batch_id>", batches.batch_detail, name=f"{name}-batch"),
        path(f"{prefix}batches/<str:batch_id>/cancel", batches.batch_cancel, name=f"{name}-batch-cancel"),
    ]


ACCOUNT = "client/v4/accounts/<str:account_id>/"


def index(request: HttpRequest) -> HttpResponse:
    return redirect("dashboard")


urlpatterns = [
    path("", index),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("admin/", admin.site.urls),
    path("dashboard/", include("controlplane.dashboard.urls")),
    path("api/schema/", openapi.schema_view, name="api-schema"),
    path("api/docs/", openapi.docs_view, name="api-docs"),
    path("client/v4/accounts", accounts.list_accounts, name="accounts"),
    path(f"{ACCOUNT}tokens", accounts.keys, name="keys"),
    path(f"{ACCOUNT}tokens/<str:key_id>", accounts.key_detail, name="key-detail"),
    path(f"{ACCOUNT}ai/run/<path:model>", native.run_model, name="ai-run"),
    path(f"{ACCOUNT}ai/models/search", catalog.search_models, name="ai-models-search"),
    path(f"{ACCOUNT}ai/finetunes", adapters.finetunes, name="ai-finetunes"),
    path(f"{ACCOUNT}ai/finetunes/public", adapters.public_finetunes, name="ai-finetunes-public"),
    path(f"{ACCOUNT}ai/finetunes/<str:ref>", adapters.finetune_detail, name="ai-finetune"),
    path(f"{ACCOUNT}ai/finetunes/<str:ref>/finetune-assets", adapters.finetune_assets, name="ai-finetune-assets"),
    path(f"{ACCOUNT}ai/usage", usage.usage, name="ai-usage"),
    path(f"{ACCOUNT}ai/usage/export", usage.usage_export, name="ai-usage-export"),
    *_openai_routes("v1/", "v1"),
    *_openai_routes(f"{ACCOUNT}ai/v1/", "account-v1"),
]

handler404 = "controlplane.api.views.not_found"
handler500 = "controlplane.api.views.server_error"
