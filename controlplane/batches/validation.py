"""Checking batch requests with the same schemas and catalog rules as the interactive routes, so a request is
accepted in a batch exactly when it would be accepted on its own (streaming aside)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.catalog.services import ModelEntry, get_model
from controlplane.serving import pipeline
from inference import LoRARequest


@dataclass(frozen=True, slots=True)
class Checked:
    """One batch request as its route would accept it: the model, the parsed body and its LoRA adapter."""

    entry: ModelEntry
    body: Any
    adapter: str = ""  # the adapter's name ("" for the base model), recorded with the usage
    lora: LoRARequest | None = None


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


def sampling(parsed: Any, kind: str) -> Any:
    """The engine's SamplingParams for a text-generation body, as its route builds them (range errors: 400)."""
    if kind == "chat":
        logprobs = (parsed.top_logprobs or 0) if parsed.logprobs else None
        max_tokens = parsed.max_completion_tokens if parsed.max_completion_tokens is not None else parsed.max_tokens
        return pipeline.sampling_params(parsed.model_copy(update={"max_tokens": max_tokens}), logprobs=logprobs)
    if kind == "completions":
        return pipeline.sampling_params(parsed, logprobs=parsed.logprobs)
    from controlplane.serving.views_native import DEFAULT_TEMPERATURE

    return pipeline.sampling_params(parsed, temperature=DEFAULT_TEMPERATURE)


def _common(entry: ModelEntry, parsed: Any, kind: str, account_id: str,
            model_adapter: str | None = None) -> Checked:
    if getattr(parsed, "stream", False):
        raise errors.invalid("stream: batch requests cannot stream; their results are stored", "stream")
    if not entry.is_embedding:
        sampling(parsed, kind)
    named = getattr(parsed, "lora", None)
    if model_adapter and named and named != model_adapter:
        raise errors.invalid(f"model names the adapter {model_adapter!r} but lora names {named!r}", "lora")
    adapter, lora = pipeline.resolve_adapter(account_id, entry, named or model_adapter)
    pipeline.resolve_speculation(entry, getattr(parsed, "speculation", None))
    pipeline.resolve_kv_compression(getattr(parsed, "kv_compression", None))
    return Checked(entry, parsed, adapter, lora)


def check_openai_body(endpoint: str, body: dict[str, Any], allowed_models: tuple[str, ...],
                      account_id: str) -> Checked:
    """The body of one OpenAI batch line, as its endpoint would check it (`model` may be `<base>:<adapter>`)."""
    from controlplane.serving.views_openai import BATCH_ENDPOINTS

    parser, task, _route, kind = BATCH_ENDPOINTS[endpoint]
    name, model_adapter = pipeline.split_model_adapter(body.get("model") if isinstance(body.get("model"), str)
                                                       else None)
    entry = get_model(name) if name else None
    if entry is None or not entry.installed:
        parser(body, None, None)  # a malformed body is reported as such first
        raise errors.unknown_model(str(body.get("model")))
    parsed = parser(body, None, entry)
    check_entry(entry, task, allowed_models)
    return _common(entry, parsed, kind, account_id, model_adapter)


def check_native_body(entry: ModelEntry, body: dict[str, Any], account_id: str) -> Checked:
    """One request of a Workers AI queueRequest, checked as the run route checks a body for this model."""
    from controlplane.serving.views_native import _native_body

    return _common(entry, _native_body(body, None, entry), "native", account_id)


def check_line(line: str, number: int, endpoint: str, allowed_models: tuple[str, ...],
               seen: set[str], account_id: str) -> tuple[str, str, dict[str, Any]]:
    """One line of a batch input file: `{custom_id, method, url, body}`. Returns (custom_id, model, body);
    raises ItemError naming the line."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ItemError(errors.malformed(f"Line {number} is not valid JSON: {exc}")) from None
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
