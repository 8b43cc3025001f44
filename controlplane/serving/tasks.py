"""Background Responses (`background: true`): a Celery task runs each on the batch machinery's event loop at the
BATCH priority, so it waits behind interactive work on the engine, and stores its answer and its usage once."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.batches.execute import batch_loop
from controlplane.batches.tasks import backoff
from controlplane.catalog.services import get_model
from controlplane.celery import app
from controlplane.serving import pipeline, response_store
from controlplane.serving.generation import Run, failed_output
from controlplane.serving.models import StoredResponse
from controlplane.serving.protocol.responses import RESPONSES, use_conversation
from controlplane.usage.models import Source
from controlplane.usage.models import Status as UsageStatus
from controlplane.usage.services import UsageRecord, record
from inference import Priority
from inference.errors import EngineDeadError, EngineError, EngineOverloadedError

log = logging.getLogger("controlplane.serving")


class Busy(Exception):
    """The engine cannot take it now: give the response back to the queue and retry later."""


async def _generate(row: StoredResponse) -> tuple[dict[str, Any], UsageRecord]:
    entry = get_model(row.model)
    if entry is None or not entry.installed:
        raise errors.unknown_model(row.model)
    job = RESPONSES.job(row.body, entry)
    job.extra["response_id"] = row.id
    use_conversation(job, list(row.conversation))
    pipeline.resolve(job, row.account_id)
    started = time.monotonic()
    run = Run(job, Priority.BATCH, "bresp")
    try:
        await run.prepare()
        finals = await run.collect()
    except (EngineOverloadedError, EngineDeadError) as exc:
        raise Busy(str(exc)) from None
    except EngineError as exc:
        raise errors.from_engine(exc, job.model) from None
    failed = failed_output(run)
    if failed is not None:
        raise errors.internal(f"The engine failed this request: {failed.error or 'unknown'}")
    response = RESPONSES.render(job, run, finals, int(row.created_at.timestamp()))
    usage = pipeline.job_usage(job, run, account_id=row.account_id, key_id=row.api_key_id or None,
                               source=Source.BATCH, status=UsageStatus.OK, error=None, started=started,
                               first_token_at=run.first_token_time(), created_at=timezone.now())
    return response, usage


@app.task(name="responses.run", bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
          max_retries=None)
def run_response(self: Any, response_id: str) -> str:
    row = response_store.claim(response_id)
    if row is None:
        return "skipped"  # another worker has it, it finished, or it was cancelled
    try:
        response, usage = asyncio.run_coroutine_threadsafe(_generate(row), batch_loop()).result()
    except Busy as exc:
        StoredResponse.objects.filter(pk=response_id, status=StoredResponse.Status.IN_PROGRESS).update(
            status=StoredResponse.Status.QUEUED)
        log.info("engine busy (%s); background response %s retries", exc, response_id)
        raise self.retry(countdown=backoff(self.request.retries), max_retries=None) from None
    except ApiError as exc:
        response_store.fail(response_id, exc)
        return "failed"
    with transaction.atomic():  # the answer and its billing, together and once
        if not response_store.finish(response_id, response):
            return "cancelled"
        record(usage)
    return "stored"


def send(response_id: str) -> None:
    run_response.delay(response_id)
