"""Running a claimed run of items on the backend at the BATCH priority class, with their leases kept alive.

The task thread stays synchronous (claims, renewals and the result writes are plain database calls); the engine
work runs as coroutines on one event loop per process shared by every batch item, so a worker with 24 threads
costs one loop, not 24.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings
from django.utils import timezone

from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.batches.item_services import Claim, Outcome, finish_run, renew_run
from controlplane.batches.models import Batch, Item
from controlplane.batches.services import error_json
from controlplane.batches.validation import check_native_body, check_openai_body
from controlplane.catalog.services import get_model
from controlplane.serving import pipeline
from controlplane.serving.dispatch import get_backend
from controlplane.serving.generation import Run, failed_output
from controlplane.serving.job import Job, Work
from controlplane.serving.protocol import ENDPOINTS, NATIVE, Endpoint
from controlplane.usage.models import Source
from controlplane.usage.models import Status as UsageStatus
from controlplane.usage.services import UsageRecord
from inference import Priority
from inference.errors import EngineDeadError, EngineError, EngineOverloadedError

log = logging.getLogger("controlplane.batches")


class Busy(Exception):
    """The platform cannot take the item now (engine queue full, engine restarting): retry later."""


@dataclass(slots=True)
class Plan:
    """A checked item, ready for the engine."""

    item: Item
    batch: Batch
    endpoint: Endpoint
    job: Job


def plan(item: Item, batch: Batch) -> Plan | Outcome:
    """Re-check the request against the catalog as it is now (a model may have gone since the batch was
    accepted); a request that no longer passes fails alone."""
    try:
        if batch.api == Batch.Api.OPENAI:
            job = check_openai_body(batch.endpoint, item.body or {}, tuple(batch.allowed_models),
                                    batch.account_id)
            return Plan(item, batch, ENDPOINTS[batch.endpoint], job)
        entry = get_model(item.model)
        if entry is None or not entry.installed:
            raise errors.unknown_model(item.model)
        return Plan(item, batch, NATIVE, check_native_body(entry, item.body or {}, batch.account_id))
    except ApiError as exc:
        return Outcome(Item.Status.FAILED, error=error_json(exc))


# ------------------------------------------------------------------------------------------------ event loop
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def batch_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="hearth-batch-loop", daemon=True).start()
            _loop = loop
        return _loop


@dataclass(slots=True)
class Report:
    """How a run of items ended on this worker: results stored, claims lost to another worker, and claims to
    give back and retry (the engine was busy; or an unexpected error of our own, which counts as an attempt)."""

    stored: int = 0
    lost: int = 0
    busy: list[Claim] = field(default_factory=list)
    busy_reason: str = ""
    broken: list[Claim] = field(default_factory=list)


# Once one item of a run finishes, the others of the run often finish a step or two later (they went in
# together): waiting this long for them stores them in one transaction instead of one each.
GATHER_S = 0.1


def run_run(taken: list[tuple[Claim, Item]], *, idle: Callable[[], None] | None = None) -> Report:
    """Run claimed items on the engine together, storing results as they finish (those finishing within
    GATHER_S of each other in one transaction) and renewing the leases of those still running every third of
    the lease. An item whose lease another worker took is dropped (its work is void); one whose batch was
    cancelled or expired meanwhile stops (outcome `cancelled`). `idle` is called each time this thread starts
    waiting on the engine (the caller gives back what it need not hold meanwhile)."""
    report = Report()
    ready: list[tuple[Claim, Outcome]] = []
    running: dict[concurrent.futures.Future[Outcome], Claim] = {}
    for claim, item in taken:
        checked = plan(item, claim.batch)
        if isinstance(checked, Outcome):
            ready.append((claim, checked))
        else:
            running[asyncio.run_coroutine_threadsafe(_run(checked), batch_loop())] = claim
    every = max(0.2, settings.HEARTH_BATCH_LEASE_SECONDS / 3)
    renew_at = time.monotonic() + every
    pending = set(running)
    try:
        while True:
            if ready:
                stored = finish_run(ready)
                report.stored += sum(stored)
                report.lost += len(stored) - sum(stored)
                ready = []
                # The counts read back say whether a batch is being stopped: the rest of its items stop now.
                for future in [f for f in pending if _stopping(running[f].batch)]:
                    future.cancel()  # aborts the engine request
                    pending.discard(future)
                    ready.append((running[future], _stopped()))
                if ready:
                    continue
            if not pending:
                return report
            if idle is not None:
                idle()
            done, pending = concurrent.futures.wait(pending, timeout=max(0.0, renew_at - time.monotonic()),
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            if done and pending:
                more, pending = concurrent.futures.wait(pending, timeout=GATHER_S)
                done |= more
            for future in done:
                _collect(future, running[future], ready, report)
            if pending and time.monotonic() >= renew_at:
                _renew(pending, running, ready, report)
                renew_at = time.monotonic() + every
    finally:
        for future in pending:
            future.cancel()  # aborts the engine request: this thread is leaving (an error storing results)


def _collect(future: concurrent.futures.Future[Outcome], claim: Claim, ready: list[tuple[Claim, Outcome]],
             report: Report) -> None:
    try:
        ready.append((claim, future.result()))
    except Busy as exc:
        report.busy.append(claim)
        report.busy_reason = str(exc)
    except Exception:
        # A bug or an outage of our own: the item is given back (counted as an attempt) and tried again later.
        log.exception("batch item %s failed unexpectedly", claim.item_id)
        report.broken.append(claim)


def _renew(pending: set[concurrent.futures.Future[Outcome]], running: dict[concurrent.futures.Future[Outcome], Claim],
           ready: list[tuple[Claim, Outcome]], report: Report) -> None:
    states = renew_run([running[future] for future in pending])
    for future in list(pending):
        claim = running[future]
        state = states[claim.item_id]
        if state == "ok":
            continue
        future.cancel()  # aborts the engine request
        pending.discard(future)
        if state == "lost":
            report.lost += 1
        else:
            ready.append((claim, _stopped()))


def _stopping(batch: Batch) -> bool:
    return batch.cancelling_at is not None or batch.expired_at is not None


def _stopped() -> Outcome:
    return Outcome(Item.Status.CANCELLED, error={
        "status": 400, "openai_status": 400, "code": errors.CODE_INVALID_INPUT, "openai_code": "batch_cancelled",
        "message": "The batch was stopped while this request ran", "param": None})


async def _run(p: Plan) -> Outcome:
    started = time.monotonic()
    try:
        if p.job.work is Work.EMBED:
            return await _embed(p, started)
        return await _generate(p, started)
    except (EngineOverloadedError, EngineDeadError) as exc:
        raise Busy(str(exc)) from None


def _usage(p: Plan, started: float, *, run: Run | None = None, status: str = UsageStatus.OK,
           error: ApiError | None = None, input_tokens: int = 0) -> UsageRecord:
    return pipeline.job_usage(
        p.job, run, account_id=p.batch.account_id, key_id=p.batch.api_key_id, source=Source.BATCH,
        status=status, error=error, started=started,
        first_token_at=run.first_token_time() if run is not None else None, created_at=timezone.now(),
        request_id=run.request_id if run is not None else p.item.request_id, input_tokens=input_tokens)


def _failed(p: Plan, started: float, error: ApiError, run: Run | None = None) -> Outcome:
    """An engine refusal after the request was accepted: recorded, never billable (as interactively)."""
    return Outcome(Item.Status.FAILED, error=error_json(error),
                   usage=_usage(p, started, run=run, status=UsageStatus.ERROR, error=error))


async def _embed(p: Plan, started: float) -> Outcome:
    try:
        result = await get_backend().embed(p.job.model, list(p.job.texts))
    except (EngineOverloadedError, EngineDeadError):
        raise
    except EngineError as exc:
        return _failed(p, started, errors.from_engine(exc, p.job.model))
    response = (NATIVE.embedding_result(result) if p.endpoint is NATIVE
                else p.endpoint.render_embeddings(p.job, result))
    return Outcome(Item.Status.SUCCEEDED, response=response,
                   usage=_usage(p, started, input_tokens=result.prompt_tokens))


async def _generate(p: Plan, started: float) -> Outcome:
    run = Run(p.job, Priority.BATCH, "breq")
    try:
        await run.prepare()
        finals = await run.collect()
    except ApiError as exc:
        return _failed(p, started, exc)
    except (EngineOverloadedError, EngineDeadError):
        raise
    except EngineError as exc:
        return _failed(p, started, errors.from_engine(exc, p.job.model))
    failed = failed_output(run)
    if failed is not None:
        return _failed(p, started, errors.internal(f"The engine failed this request: {failed.error or 'unknown'}"),
                       run)
    if p.endpoint is NATIVE:
        response = NATIVE.result(p.job, run, finals)
    else:
        response = p.endpoint.render(p.job, run, finals, int(time.time()))
    return Outcome(Item.Status.SUCCEEDED, response=response, usage=_usage(p, started, run=run))
