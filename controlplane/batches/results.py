"""How batches, files and results look on the wire: OpenAI batch and file objects, output/error JSONL lines,
and the Workers AI poll answer."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from controlplane.api.errors import openai_error_type
from controlplane.api.http import dumps_bulk
from controlplane.batches.models import Batch, File, Item


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_json(f: File) -> dict[str, Any]:
    return {"id": f.pk, "object": "file", "bytes": f.bytes, "created_at": _ts(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "expires_at": _ts(f.expires_at),
            "status_details": None}


def request_counts(batch: Batch) -> dict[str, int]:
    return {"total": batch.total_count, "completed": batch.completed_count, "failed": batch.failed_count}


def batch_json(batch: Batch) -> dict[str, Any]:
    return {
        "id": batch.pk, "object": "batch", "endpoint": batch.endpoint, "model": batch.model or None,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id or "", "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _ts(batch.created_at), "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at), "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at), "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at), "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at), "request_counts": request_counts(batch),
        "metadata": batch.metadata,
    }


def _line(data: dict[str, Any]) -> bytes:
    return dumps_bulk(data) + b"\n"  # embedding answers: thousands of floats a line


def output_lines(items: list[Item]) -> list[bytes]:
    return [_line({"id": item.request_id, "custom_id": item.custom_id,
                   "response": {"status_code": 200, "request_id": item.request_id, "body": item.response},
                   "error": None})
            for item in items if item.status == Item.Status.SUCCEEDED]


def error_lines(items: list[Item]) -> list[bytes]:
    """Failed requests with the error response the endpoint would have given; requests that never ran
    (cancelled or expired) with just the reason."""
    lines = []
    for item in items:
        if item.status == Item.Status.SUCCEEDED:
            continue
        error = item.error or {}
        code, message = error.get("openai_code"), error.get("message", "")
        response = None
        if item.status == Item.Status.FAILED:
            status = error.get("openai_status") or 500
            response = {"status_code": status, "request_id": item.request_id, "body": {"error": {
                "message": message, "type": openai_error_type(status),
                "param": error.get("param"), "code": code}}}
        lines.append(_line({"id": item.request_id, "custom_id": item.custom_id, "response": response,
                            "error": {"code": code, "message": message}}))
    return lines


def native_status(batch: Batch) -> dict[str, Any]:
    """The poll answer while the batch runs: queued until an item has been picked up, then running."""
    started = batch.completed_count or batch.failed_count or Item.objects.filter(
        batch=batch, status=Item.Status.RUNNING).exists()
    return {"status": "running" if started else "queued", "request_id": batch.pk, "model": batch.model,
            "request_counts": request_counts(batch)}


def native_result(batch: Batch, items: list[Item]) -> dict[str, Any]:
    """The final poll answer: one response per request, by position, with the batch's total usage."""
    responses = []
    prompt = completion = 0
    for item in items:
        prompt += item.input_tokens
        completion += item.output_tokens
        entry: dict[str, Any] = {"id": item.index, "result": item.response,
                                 "success": item.status == Item.Status.SUCCEEDED,
                                 "external_reference": item.custom_id}
        if item.status != Item.Status.SUCCEEDED:
            error = item.error or {}
            entry["errors"] = [{"code": error.get("code", 5000), "message": error.get("message", item.status)}]
        responses.append(entry)
    return {"responses": responses, "status": batch.status, "request_id": batch.pk, "model": batch.model,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
