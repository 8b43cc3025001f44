"""Checking batch requests with the same schemas and catalog rules as the interactive routes, so a request is
accepted in a batch exactly when it would be accepted on its own (streaming aside)."""

from __future__ import annotations

import json
from typing import Any

from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.api.http import check_json_text
from controlplane.catalog.services import ModelEntry, get_model
from controlplane.serving import pipeline
from controlplane.serving.job import Job
from controlplane.serving.protocol import ENDPOINTS, NATIVE


class ItemError(Exception):
    """One request of a batch is unusable; it fails alone with this error."""

    def __init__(self, error: ApiError, custom_id: str | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.custom_id = custom_id


def check_entry(entry: ModelEntry, task: str, allowed_models: tuple[str, ...]) -> None:
    if allowed_models and entry.name not in allowed_models:
        raise errors.forbidden(f"This API key may not use {entry.name}")
    if entry.task != task:
        raise errors.invalid(f"{entry.name} is a {entry.task} model and cannot serve this endpoint", "model")
    if not entry.supports_batch:
        raise errors.invalid(f"{entry.name} does not accept batch requests", "model")


def check_openai_body(endpoint: str, body: dict[str, Any], allowed_models: tuple[str, ...],
                      account_id: str) -> Job:
    """The body of one OpenAI batch line, as its endpoint would check it (`model` may be `<base>:<adapter>`)."""
    handler = ENDPOINTS[endpoint]
    name, model_adapter = pipeline.split_model_adapter(body.get("model") if isinstance(body.get("model"), str)
                                                       else None)
    entry = get_model(name) if name else None
    if entry is None or not entry.installed:
        handler.shape(body)  # a malformed body is reported as such first
        raise errors.unknown_model(str(body.get("model")))
    handler.shape(body)
    assert handler.task is not None
    check_entry(entry, handler.task, allowed_models)
    return pipeline.resolve(handler.job(body, entry, batch=True), account_id, model_adapter)


def check_native_body(entry: ModelEntry, body: dict[str, Any], account_id: str) -> Job:
    """One request of a Workers AI queueRequest, checked as the run route checks a body for this model."""
    return pipeline.resolve(NATIVE.job(body, entry, batch=True), account_id)


def check_line(line: str, number: int, endpoint: str, allowed_models: tuple[str, ...],
               seen: set[str], account_id: str) -> tuple[str, str, dict[str, Any]]:
    """One line of a batch input file: `{custom_id, method, url, body}`. Returns (custom_id, model, body);
    raises ItemError naming the line."""
    try:
        data = json.loads(line)
        check_json_text(data)
    except ValueError as exc:
        raise ItemError(errors.malformed(f"Line {number} is not valid JSON: {exc}")) from None
    except RecursionError:
        raise ItemError(errors.malformed(f"Line {number} is nested too deeply")) from None
    except ApiError as exc:
        raise ItemError(errors.malformed(f"Line {number}: {exc.message}")) from None
    if not isinstance(data, dict):
        raise ItemError(errors.malformed(f"Line {number} must be a JSON object"))
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ItemError(errors.invalid(f"Line {number}: custom_id must be a non-empty string", "custom_id"))
    if len(custom_id) > 512:
        raise ItemError(errors.invalid(f"Line {number}: custom_id is longer than 512 characters", "custom_id"))
    if custom_id in seen:
        raise ItemError(errors.invalid(f"Line {number}: custom_id {custom_id!r} repeats an earlier line's; each "
                                       "must be unique", "custom_id"), custom_id)
    seen.add(custom_id)
    if data.get("method") != "POST":
        raise ItemError(errors.invalid(f"Line {number}: method must be POST", "method"), custom_id)
    if data.get("url") != endpoint:
        raise ItemError(errors.invalid(f"Line {number}: url {data.get('url')!r} differs from the batch's endpoint "
                                       f"{endpoint}", "url"), custom_id)
    body = data.get("body")
    if not isinstance(body, dict):
        raise ItemError(errors.invalid(f"Line {number}: body must be a JSON object", "body"), custom_id)
    try:
        entry = check_openai_body(endpoint, body, allowed_models, account_id).entry
    except ApiError as exc:
        exc.message = f"Line {number}: {exc.message}"
        raise ItemError(exc, custom_id) from None
    return custom_id, entry.name, body
