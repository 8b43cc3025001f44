"""What every API endpoint is: a request schema, parse → job, and render (the whole response, stream events).

An endpoint never reads HTTP and never writes to the database: views hand it an admitted job, batch
execution hands it a job and a finished run, and both get back what the API's clients expect.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, ClassVar

from django.http import StreamingHttpResponse
from django.http.response import HttpResponseBase
from pydantic import BaseModel

from controlplane.api import errors
from controlplane.api.body import parse
from controlplane.api.http import REPLICA_HEADER, SSE_DONE, ResponseWithAfterClose, dumps, dumps_bulk, sse
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.dispatch import EmbeddingResult
from controlplane.serving.generation import Choice, Run
from controlplane.serving.job import Job, Work
from inference import RequestOutput
from inference.errors import EngineError


def event_stream(events: AsyncIterator[bytes]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must pass each event on at once
    return response


def with_replica(response: HttpResponseBase, replica: str) -> HttpResponseBase:
    """Name the fleet replica that served the answer (absent when the engine runs in this process)."""
    if replica:
        response[REPLICA_HEADER] = replica
    return response


class Endpoint(ABC):
    path: ClassVar[str]  # the API path; what a batch line's url names
    route: ClassVar[str]  # the usage route
    style: ClassVar[str]  # the error envelope: "openai" or "native"
    task: ClassVar[str | None]  # the model task it needs; None: decided by the model (native run)

    def model_of(self, raw: dict[str, Any] | None) -> str | None:
        value = raw.get("model") if raw is not None else None
        return value if isinstance(value, str) and value else None

    @abstractmethod
    def job(self, raw: dict[str, Any], entry: ModelEntry, *, batch: bool = False) -> Job:
        """Parse and check a body for this model: the job to run, or ApiError. `batch`: the body is a batch
        item (it must not stream)."""

    def check(self, raw: dict[str, Any] | None, entry: ModelEntry | None) -> Job | None:
        """parse for admission: without a model only the body's shape is checked."""
        if entry is None:
            self.shape(raw or {})
            return None
        return self.job(raw or {}, entry)

    schema: ClassVar[type[BaseModel] | None]  # the request body; None where the model decides (native run)

    def shape(self, raw: dict[str, Any]) -> Any:
        """The body checked against the schema alone (no model known yet)."""
        return parse(self.schema, raw) if self.schema is not None else None

    @abstractmethod
    def render(self, job: Job, run: Run, finals: list[RequestOutput], created: int) -> dict[str, Any]:
        """The whole response of a finished generation job."""

    def render_embeddings(self, job: Job, result: EmbeddingResult) -> dict[str, Any]:
        """The response of an embedding job; a route that only generates refuses one (admission's task check
        keeps such jobs away, so this is the answer if that ever changes, not a path in use)."""
        raise errors.invalid(f"{job.model} is an embedding model and cannot serve this route", "model")

    @abstractmethod
    def events(self, gen: pipeline.Generation, created: int) -> AsyncIterator[bytes]:
        """The SSE events of an opened stream."""

    async def respond(self, adm: pipeline.Admission, *, affinity: str, started: float,
                      on_answer: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> HttpResponseBase:
        """Run an admitted job and answer it: whole, or as a stream. Usage is written once the answer is on
        the wire (a stream's when it ends or the client leaves). `on_answer` gets the whole answer before it is
        sent (a stream's, as its last event went out): the view's way to keep it (stored Responses)."""
        job = adm.job
        if job.work is Work.EMBED:
            result, after = await pipeline.embed(adm, session_affinity=affinity, started=started)
            # Thousands of vectors take seconds to write as JSON: not on the loop every tenant shares, and with
            # an encoder that holds the interpreter (from the engine's thread too) for a small part of that.
            payload = await asyncio.to_thread(lambda: dumps_bulk(self.render_embeddings(job, result)))
            return with_replica(ResponseWithAfterClose(payload, content_type="application/json", after_close=after),
                                result.replica)
        gen = pipeline.Generation(adm=adm, stream=job.stream, session_affinity=affinity, started=started)
        await gen.prepare()
        created = int(time.time())
        if not job.stream:
            finals = await gen.collect()
            record = gen.usage_record()
            answer = self.render(job, gen.run, finals, created)
            if on_answer is not None:
                await on_answer(answer)
            return with_replica(ResponseWithAfterClose(dumps(answer), content_type="application/json",
                                                       after_close=lambda: pipeline.commit_usage(adm, record)),
                                gen.run.replica())
        await gen.open_stream()
        return with_replica(event_stream(self._guarded(gen, created, on_answer)), gen.run.replica())

    async def _guarded(self, gen: pipeline.Generation, created: int,
                       on_answer: Callable[[dict[str, Any]], Awaitable[None]] | None) -> AsyncIterator[bytes]:
        """The stream's events; if the engine fails it mid-way (a fleet replica dies), an error event in the
        route's envelope and the end marker, so clients see a clean end rather than a cut connection. Usage
        records what was produced (the stream's own cleanup meters it)."""
        try:
            async for event in self.events(gen, created):
                yield event
        except EngineError as exc:
            yield self.stream_error(errors.from_engine(exc, gen.job.model))
            return
        final = gen.job.extra.get("final")
        if on_answer is not None and final is not None:
            await on_answer(final)

    def stream_error(self, error: errors.ApiError) -> bytes:
        """The end of a stream that failed after it began: an error event in the route's envelope, then the
        route's end marker."""
        if self.style == "openai":
            event = sse({"error": {"message": error.message, "type": errors.openai_error_type(error.status),
                                   "param": error.param, "code": error.openai_code}})
        else:
            event = sse({"error": {"code": error.code, "message": error.message}})
        return event + SSE_DONE


async def choice_outputs(gen: pipeline.Generation) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """The outputs of an opened stream, closed (and metered) however the consumer leaves."""
    async with aclosing(gen.outputs()) as outputs:
        async for item in outputs:
            yield item
