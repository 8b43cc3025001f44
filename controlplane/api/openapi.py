"""The OpenAPI 3.1 document (/api/schema/), built from the same pydantic models that validate request bodies,
and a self-contained docs page (/api/docs/) that renders it without any third-party script."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from controlplane.accounts.schemas import KeyCreate
from controlplane.adapters.schemas import FinetuneCreate
from controlplane.api.http import json_response
from controlplane.batches.schemas import BatchCreate, NativePoll, NativeQueueRequest
from controlplane.serving.schemas import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    NativeEmbeddings,
    NativeTextGeneration,
    ResponsesRequest,
)

ACCOUNT = {"name": "account_id", "in": "path", "required": True, "schema": {"type": "string"},
           "description": "The account's 32-character id (printed by create_api_key; see GET /client/v4/accounts)."}
MODEL = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
         "description": "A catalog model name such as @hearth/smollm2-135m-instruct (slashes may be %-encoded)."}
AFFINITY = {"name": "x-session-affinity", "in": "header", "required": False, "schema": {"type": "string"},
            "description": "Opaque session id, recorded on the usage event; on a fleet it keeps the "
            "conversation on one replica (its prefix cache)."}
ENVELOPE = {"type": "object", "properties": {
    "result": {}, "success": {"type": "boolean"},
    "errors": {"type": "array", "items": {"type": "object", "properties": {
        "code": {"type": "integer"}, "message": {"type": "string"}}}},
    "messages": {"type": "array", "items": {"type": "string"}}}}
ANTHROPIC_ERROR = {"type": "object", "properties": {"type": {"const": "error"}, "error": {"type": "object", "properties": {
    "type": {"type": "string"}, "message": {"type": "string"}}}}}
OPENAI_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    tag: str
    style: str = "native"  # native (Cloudflare envelope) | openai | anthropic
    body: tuple[type[BaseModel], ...] = ()
    params: tuple[dict[str, Any], ...] = ()
    streams: bool = False
    description: str = ""
    errors: tuple[int, ...] = (400, 401, 403)
    media: str | None = None  # the success response's media type when it is not JSON
    also: str | None = None  # a second media type the success response may have (a format= query)
    success: int = 200
    form: dict[str, Any] | None = None  # a multipart/form-data body's schema


_NATIVE_RUN = ("Run a model. Text generation takes prompt or messages (stream: true answers with SSE "
               "`data: {\"response\": ...}` lines ending with `data: [DONE]`); embeddings take text. Errors: "
               "5006 invalid input, 5007 unknown model, 5005 LoRA unsupported (400); 3006 too large (413); "
               "3036 daily free allocation or budget used, 3040 out of capacity, 971 rate limited (429).")
_NATIVE_QUEUE = (" Async batch: with ?queueRequest=true (or options.queueRequest), a body {\"requests\": [...]} "
                 "(each a body of this route, with an optional external_reference) is queued and answered at once "
                 "with {status: queued, request_id, model}; POST {\"request_id\"} to poll: queued or running, "
                 "then {responses: [{id, result, success, external_reference}], usage}. Another account's "
                 "request_id is 404.")
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
FILE_ID = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}
BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
PAGE = ({"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
        {"name": "after", "in": "query", "schema": {"type": "string"}})
QUEUE = {"name": "queueRequest", "in": "query", "required": False, "schema": {"type": "boolean"},
         "description": "Queue the body's requests as an async batch (or poll one with a request_id body)."}
FILE_UPLOAD = {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary", "description": "JSONL: one {custom_id, method: POST, url, "
             "body} per line."},
    "purpose": {"type": "string", "enum": ["batch"]},
    "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
    "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000}}}
FINETUNE = {"name": "finetune_id", "in": "path", "required": True, "schema": {"type": "string"},
            "description": "The adapter's id (or its name)."}
FINETUNE_UPLOAD = {"type": "object", "required": ["name", "model", "adapter_config.json", "adapter_model.safetensors"],
                   "properties": {
    "name": {"type": "string"}, "model": {"type": "string"}, "description": {"type": "string"},
    "adapter_config.json": {"type": "string", "format": "binary", "description": "The PEFT LoRA config."},
    "adapter_model.safetensors": {"type": "string", "format": "binary",
                                  "description": "The weights, safetensors only (no .bin or other pickle)."},
    "file": {"type": "array", "items": {"type": "string", "format": "binary"},
             "description": "Instead of the two fields above: two `file` parts whose filenames are the two names."}}}
FINETUNE_ASSET = {"type": "object", "required": ["file"], "properties": {
    "file_name": {"type": "string", "enum": ["adapter_config.json", "adapter_model.safetensors"],
                  "description": "Which of the two files this is (default: the part's filename)."},
    "file": {"type": "string", "format": "binary"}}}
_FINETUNE_ERRORS = ("Errors: 5006 invalid adapter (400; the message says what is wrong), 3039 required files "
                    "missing (400), 5005 the model does not support LoRA (400), 5007 unknown model (400), 409 name "
                    "taken, file already stored or the account's adapter limit, 3006 over HEARTH_LORA_MAX_BYTES (413).")

OPERATIONS: tuple[Operation, ...] = (
    Operation("get", "/client/v4/accounts", "Accounts this key (or signed-in user) belongs to", "Accounts"),
    Operation("get", "/client/v4/accounts/{account_id}/tokens", "List the account's API keys", "API keys",
              params=(ACCOUNT,)),
    Operation("post", "/client/v4/accounts/{account_id}/tokens", "Create an API key (secret shown once)",
              "API keys", body=(KeyCreate,), params=(ACCOUNT,), success=201),
    Operation("get", "/client/v4/accounts/{account_id}/tokens/{token_id}", "One API key", "API keys",
              params=(ACCOUNT, {"name": "token_id", "in": "path", "required": True, "schema": {"type": "string"}}),
              errors=(401, 403, 404)),
    Operation("delete", "/client/v4/accounts/{account_id}/tokens/{token_id}", "Revoke an API key", "API keys",
              params=(ACCOUNT, {"name": "token_id", "in": "path", "required": True, "schema": {"type": "string"}}),
              errors=(401, 403, 404)),
    Operation("post", "/client/v4/accounts/{account_id}/ai/run/{model}", "Run a model (Workers AI)", "Workers AI",
              body=(NativeTextGeneration, NativeEmbeddings, NativeQueueRequest, NativePoll),
              params=(ACCOUNT, MODEL, AFFINITY, QUEUE), streams=True, description=_NATIVE_RUN + _NATIVE_QUEUE,
              errors=(400, 401, 403, 404, 413, 429)),
    Operation("get", "/client/v4/accounts/{account_id}/ai/models/search", "Search the catalog (with prices)",
              "Workers AI", params=(ACCOUNT,
                                    {"name": "search", "in": "query", "schema": {"type": "string"}},
                                    {"name": "task", "in": "query", "schema": {"type": "string"}},
                                    {"name": "page", "in": "query", "schema": {"type": "integer"}},
                                    {"name": "per_page", "in": "query", "schema": {"type": "integer"}})),
    Operation("get", "/client/v4/accounts/{account_id}/ai/finetunes", "LoRA adapters: the account's and published ones",
              "LoRA adapters", params=(ACCOUNT,)),
    Operation("post", "/client/v4/accounts/{account_id}/ai/finetunes", "Create a LoRA adapter (admin key)",
              "LoRA adapters", body=(FinetuneCreate,), form=FINETUNE_UPLOAD, params=(ACCOUNT,),
              errors=(400, 401, 403, 409, 413),
              description="JSON {name, model, description}: a pending adapter, whose two files follow at "
              ".../finetune-assets. Or multipart/form-data with name, model, description and both files: a ready "
              "adapter in one request, all or nothing. " + _FINETUNE_ERRORS),
    Operation("get", "/client/v4/accounts/{account_id}/ai/finetunes/public", "Published LoRA adapters",
              "LoRA adapters", params=(ACCOUNT,)),
    Operation("get", "/client/v4/accounts/{account_id}/ai/finetunes/{finetune_id}", "One LoRA adapter",
              "LoRA adapters", params=(ACCOUNT, FINETUNE), errors=(401, 403, 404)),
    Operation("delete", "/client/v4/accounts/{account_id}/ai/finetunes/{finetune_id}",
              "Delete a LoRA adapter and its files (admin key)", "LoRA adapters", params=(ACCOUNT, FINETUNE),
              errors=(401, 403, 404)),
    Operation("post", "/client/v4/accounts/{account_id}/ai/finetunes/{finetune_id}/finetune-assets",
              "Upload one of an adapter's two files (admin key)", "LoRA adapters", params=(ACCOUNT, FINETUNE),
              form=FINETUNE_ASSET, errors=(400, 401, 403, 404, 409, 413),
              description="The adapter becomes ready once both files are stored and pass validation against the "
              "base model; files cannot be replaced. " + _FINETUNE_ERRORS),
    Operation("get", "/client/v4/accounts/{account_id}/ai/usage", "Usage from the rollups", "Usage",
              params=(ACCOUNT,
                      {"name": "since", "in": "query", "schema": {"type": "string"}},
                      {"name": "until", "in": "query", "schema": {"type": "string"}},
                      {"name": "granularity", "in": "query", "schema": {"enum": ["day", "minute"]}},
                      {"name": "model", "in": "query", "schema": {"type": "string"}},
                      {"name": "key", "in": "query", "schema": {"type": "string"}},
                      {"name": "group_by", "in": "query", "schema": {"type": "string"},
                       "description": "Comma-separated: model, key, day, minute."},
                      {"name": "format", "in": "query", "schema": {"enum": ["json", "csv"]}}), also="text/csv"),
    Operation("get", "/client/v4/accounts/{account_id}/ai/usage/export", "Usage as CSV", "Usage",
              params=(ACCOUNT,), media="text/csv"),
    Operation("get", "/v1/models", "List models (OpenAI)", "OpenAI", style="openai", errors=(401,)),
    Operation("get", "/v1/models/{model}", "Retrieve a model (OpenAI)", "OpenAI", style="openai",
              params=(MODEL,), errors=(401, 404)),
    Operation("post", "/v1/chat/completions", "Chat completions (OpenAI)", "OpenAI", style="openai",
              body=(ChatCompletionRequest,), params=(AFFINITY,), streams=True, errors=(400, 401, 403, 404, 429)),
    Operation("post", "/v1/completions", "Completions (OpenAI)", "OpenAI", style="openai",
              body=(CompletionRequest,), params=(AFFINITY,), streams=True, errors=(400, 401, 403, 404, 429)),
    Operation("post", "/v1/embeddings", "Embeddings (OpenAI)", "OpenAI", style="openai",
              body=(EmbeddingRequest,), params=(AFFINITY,), errors=(400, 401, 403, 404, 429)),
    Operation("post", "/v1/responses", "Create a response (OpenAI Responses)", "OpenAI", style="openai",
              body=(ResponsesRequest,), params=(AFFINITY,), streams=True, errors=(400, 401, 403, 404, 429),
              description="input (a string or items: messages, function_call, function_call_output), "
              "instructions, tools, text.format, stream. store (default true) keeps it for GET and for "
              "previous_response_id (another account's id is a 404); background: true queues it at batch "
              "priority and answers at once with status queued: poll GET."),
    Operation("get", "/v1/responses/{response_id}", "Retrieve a stored response (OpenAI Responses)", "OpenAI",
              style="openai", params=(RESPONSE_ID,), errors=(401, 404)),
    Operation("delete", "/v1/responses/{response_id}", "Delete a stored response (OpenAI Responses)", "OpenAI",
              style="openai", params=(RESPONSE_ID,), errors=(401, 404)),
    Operation("post", "/v1/responses/{response_id}/cancel", "Cancel a background response (OpenAI Responses)",
              "OpenAI", style="openai", params=(RESPONSE_ID,), errors=(400, 401, 404)),
    Operation("post", "/v1/messages", "Messages (Anthropic)", "Anthropic", style="anthropic",
              body=(AnthropicMessagesRequest,), params=(AFFINITY,), streams=True, errors=(400, 401, 403, 404, 429),
              description="The key as `x-api-key` or a bearer token; `anthropic-version` is accepted. Streams "
              "Anthropic's events (message_start, content_block_start/delta/stop, message_delta, message_stop). "
              "Prefix-cache hits are reported as usage.cache_read_input_tokens."),
    Operation("post", "/v1/messages/count_tokens", "Count a conversation's tokens (Anthropic)", "Anthropic",
              style="anthropic", body=(AnthropicCountTokensRequest,), errors=(400, 401, 403, 404, 429)),
    Operation("post", "/v1/files", "Upload a batch input file (OpenAI)", "OpenAI Batches", style="openai",
              form=FILE_UPLOAD, errors=(400, 401, 403, 413)),
    Operation("get", "/v1/files", "List files (OpenAI)", "OpenAI Batches", style="openai",
              params=({"name": "purpose", "in": "query", "schema": {"type": "string"}}, *PAGE), errors=(400, 401)),
    Operation("get", "/v1/files/{file_id}", "Retrieve a file (OpenAI)", "OpenAI Batches", style="openai",
              params=(FILE_ID,), errors=(401, 404)),
    Operation("delete", "/v1/files/{file_id}", "Delete a file (OpenAI)", "OpenAI Batches", style="openai",
              params=(FILE_ID,), errors=(401, 403, 404)),
    Operation("get", "/v1/files/{file_id}/content", "A file's content: input, output or error JSONL (OpenAI)",
              "OpenAI Batches", style="openai", params=(FILE_ID,), errors=(401, 404), media="application/jsonl"),
    Operation("post", "/v1/batches", "Create a batch from an uploaded file (OpenAI)", "OpenAI Batches",
              style="openai", body=(BatchCreate,), errors=(400, 401, 403, 404),
              description="Statuses: validating, in_progress, finalizing, completed, failed, expired, "
              "cancelling, cancelled. A malformed line fails alone, into the error file."),
    Operation("get", "/v1/batches", "List batches (OpenAI)", "OpenAI Batches", style="openai", params=PAGE,
              errors=(400, 401)),
    Operation("get", "/v1/batches/{batch_id}", "Retrieve a batch (OpenAI)", "OpenAI Batches", style="openai",
              params=(BATCH_ID,), errors=(401, 404)),
    Operation("post", "/v1/batches/{batch_id}/cancel", "Cancel a batch (OpenAI)", "OpenAI Batches",
              style="openai", params=(BATCH_ID,), errors=(401, 403, 404, 409)),
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation(op: Operation) -> dict[str, Any]:
    error_schema = {"openai": OPENAI_ERROR, "anthropic": ANTHROPIC_ERROR}.get(op.style, ENVELOPE)
    content: dict[str, Any] = {"application/json": {"schema": ENVELOPE if op.style == "native" else {}}}
    if op.streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    if op.media:
        content = {op.media: {"schema": {"type": "string"}}}
    if op.also:
        content[op.also] = {"schema": {"type": "string"}}
    doc: dict[str, Any] = {
        "summary": op.summary, "tags": [op.tag], "operationId": f"{op.method}_{op.path}",
        "parameters": list(op.params),
        "responses": {str(op.success): {"description": "Created" if op.success == 201 else "OK",
                                        "content": content},
                      **{str(s): {"description": "Error", "content": {"application/json": {"schema": error_schema}}}
                         for s in op.errors}},
    }
    if op.description:
        doc["description"] = op.description
    if op.style == "anthropic":
        doc["security"] = [{"bearer": []}, {"apiKey": []}]
    if op.body:
        schema = _ref(op.body[0]) if len(op.body) == 1 else {"oneOf": [_ref(b) for b in op.body]}
        doc["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if op.form:  # next to a JSON body when the route takes both
        request_body = doc.setdefault("requestBody", {"required": True, "content": {}})
        request_body["content"]["multipart/form-data"] = {"schema": op.form}
    return doc


@functools.cache
def build_schema() -> dict[str, Any]:
    models = sorted({b for op in OPERATIONS for b in op.body}, key=lambda m: m.__name__)
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
        if op.style in ("openai", "anthropic"):
            # The same routes are mounted under the account, as Workers AI does.
            mounted = f"/client/v4/accounts/{{account_id}}/ai{op.path}"
            account_op = _operation(op)
            account_op["operationId"] = f"{op.method}_{mounted}"
            account_op["parameters"] = [ACCOUNT, *op.params]
            paths.setdefault(mounted, {})[op.method] = account_op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Hearth API", "version": "1",
                 "description": "Workers-AI-native and OpenAI-compatible inference, catalog, keys and usage."},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{"bearer": []}],
    }


def schema_view(request: HttpRequest) -> HttpResponse:
    return json_response(build_schema())


def docs_view(request: HttpRequest) -> HttpResponse:
    schema = build_schema()
    operations = [{"method": method.upper(), "path": path, **op} for path, methods in schema["paths"].items()
                  for method, op in methods.items()]
    return render(request, "api/docs.html", {"operations": operations, "schemas": schema["components"]["schemas"]})
