"""Request bodies of the batch routes (validation and the OpenAPI document)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from controlplane.api.body import StrictBody


class BatchCreate(StrictBody):
    """OpenAI: create a batch from an uploaded `batch` file."""

    input_file_id: str = Field(description="A file uploaded with purpose 'batch': JSONL lines "
                               "{custom_id, method: POST, url, body}.")
    endpoint: str = Field(description="/v1/chat/completions, /v1/completions or /v1/embeddings; every line's url.")
    completion_window: str = Field(description="Hours the batch may take, e.g. '24h' (1h to 168h); unfinished "
                                   "requests then expire.")
    metadata: dict[str, Any] | None = Field(None, description="Up to 16 string pairs, returned as given.")


class QueueOptions(StrictBody):
    queueRequest: bool = False  # noqa: N815 (the Workers AI field name)


class NativeQueueRequest(StrictBody):
    """Workers AI async batch: POST to the run route with ?queueRequest=true (or options.queueRequest)."""

    requests: list[dict[str, Any]] = Field(description="Each a body this model's run route accepts (not "
                                           "streaming), with an optional external_reference returned with its "
                                           "response.")
    options: QueueOptions | None = None


class NativePoll(StrictBody):
    """Workers AI async batch: poll with the request_id the queued answer gave."""

    request_id: str
