"""A job's requests on the backend: encoding, the grammar, the engine requests of every choice, their outputs.

`Run` is the same for an interactive request and a batch item; only the priority and who meters differ.
With `n` > 1 the first choice of each prompt is submitted alone and its siblings when it has produced its
first output: by then the prompt's KV is in the prefix cache, so the siblings adopt it instead of computing it
again, and usage counts the prompt once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from controlplane.serving.dispatch import Backend, get_backend
from controlplane.serving.job import Job, output_budget
from inference import FinishReason, GenerationRequest, Priority, RequestOutput, TokenLogprob, Usage

SEED_SPACE = 2**63


@dataclass(slots=True, eq=False)
class Choice:
    """One sequence of a job: prompt `prompt_index`, choice `index` in the response."""

    index: int
    prompt_index: int
    request: GenerationRequest
    leader: bool  # the first choice of its prompt: its siblings wait for its first output
    final: RequestOutput | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class Run:
    job: Job
    priority: Priority
    id_prefix: str = "req"
    backend: Backend = field(default_factory=get_backend)
    choices: list[Choice] = field(default_factory=list)
    request_id: str = ""
    session: str = ""  # x-session-affinity: a fleet keeps the conversation on one replica

    async def prepare(self) -> None:
        """Compile the grammar (off the event loop, cached by content), encode each prompt, size its output and
        build one engine request per choice. Engine refusals raise EngineError; a prompt too long, ApiError."""
        job = self.job
        assert job.params is not None
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        if job.constraint is not None:
            await self.backend.prepare_constraint(job.model, job.constraint)
        tools = [spec.as_openai() for spec in job.tools.specs] if job.tools is not None else None
        for p, prompt in enumerate(job.prompts):
            ids = await self.backend.encode(job.model, prompt=prompt.text, messages=prompt.messages,
                                            raw=prompt.raw, tools=tools)
            budget = output_budget(job.entry, len(ids), job.max_tokens, job.default_max_tokens)
            for c in range(job.n):
                params = dataclasses.replace(job.params, max_tokens=budget)
                if params.seed is not None and c:
                    params.seed = (params.seed + c) % SEED_SPACE  # each choice its own generator
                index = len(self.choices)
                suffix = f"-{index}" if job.num_choices > 1 else ""
                request = GenerationRequest(
                    prompt_token_ids=ids, params=params, request_id=f"{self.request_id}{suffix}",
                    priority=self.priority, lora=job.lora, speculation=job.speculation,
                    kv_compression=job.kv_compression, constraint=job.constraint)
                self.choices.append(Choice(index, p, request, leader=c == 0))

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every output of every choice as it comes; leaving early (or cancelling) aborts what still runs."""
        queue: asyncio.Queue[tuple[Choice, RequestOutput | BaseException]] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []
        siblings: dict[int, list[Choice]] = {}
        for choice in self.choices:
            if not choice.leader:
                siblings.setdefault(choice.prompt_index, []).append(choice)

        async def pump(choice: Choice) -> None:
            waiting = siblings.pop(choice.prompt_index, []) if choice.leader else []
            try:
                async with aclosing(self.backend.stream(self.job.model, choice.request, self.session)) as stream:
                    async for out in stream:
                        for sibling in waiting:  # the prompt's KV is cached now
                            tasks.append(asyncio.create_task(pump(sibling)))
                        waiting = []
                        queue.put_nowait((choice, out))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                queue.put_nowait((choice, exc))

        tasks.extend(asyncio.create_task(pump(c)) for c in self.choices if c.leader)
        remaining = len(self.choices)
        try:
            while remaining:
                choice, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                choice.logprobs.extend(item.logprobs or ())
                choice.final = item
                if item.finished:
                    remaining -= 1
                yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> list[RequestOutput]:
        """Run every choice to its end; each final output carries all of its logprobs."""
        if len(self.choices) == 1 and self.choices[0].request.params.logprobs is None:
            only = self.choices[0]  # the common case: one wake-up at the end, not one per token
            only.final = await self.backend.generate(self.job.model, only.request, self.session)
        else:
            async with aclosing(self.outputs()) as outputs:
                async for _ in outputs:
                    pass
        finals = []
        for choice in self.choices:
            assert choice.final is not None
            if choice.request.params.logprobs is not None:
                choice.final.logprobs = list(choice.logprobs)
            finals.append(choice.final)
        return finals

    def usage(self) -> Usage:
        """The prompt of each prompt once (its leader's count; siblings read it from the cache), every choice's
        output."""
        total = Usage()
        for choice in self.choices:
            usage = choice.final.usage if choice.final is not None else None
            if usage is None:
                continue
            if choice.leader:
                total.prompt_tokens += usage.prompt_tokens
                total.cached_tokens += usage.cached_tokens
            total.completion_tokens += usage.completion_tokens
        return total

    def speculation(self) -> dict[str, int]:
        proposed = accepted = 0
        for choice in self.choices:
            spec = (choice.final.speculation if choice.final is not None else None) or {}
            proposed += spec.get("proposed", 0)
            accepted += spec.get("accepted", 0)
        return {"proposed": proposed, "accepted": accepted}

    def replica(self) -> str:
        """Which replica served the job (the first choice's; n > 1 siblings follow their leader's prefix), or ""
        when the engine is in this process."""
        for choice in self.choices:
            if choice.final is not None and choice.final.replica:
                return choice.final.replica
        return ""

    def first_token_time(self) -> float | None:
        times = [c.final.metrics.first_token_time for c in self.choices
                 if c.final is not None and c.final.metrics.first_token_time is not None]
        return min(times) if times else None


def failed_output(run: Run) -> RequestOutput | None:
    """The first choice the engine failed, if any."""
    for choice in run.choices:
        if choice.final is not None and choice.final.finish_reason == FinishReason.ERROR:
            return choice.final
    return None

