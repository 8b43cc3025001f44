"""The synchronous front door: LLM(model).generate(prompts, params) runs the engine to completion."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inference.config import EngineConfig
from inference.constrained.constraint import Constraint
from inference.engine import LLMEngine
from inference.lora.slots import LoRARequest
from inference.outputs import RequestOutput
from inference.prompts import encode_prompt
from inference.sampling_params import SamplingParams
from inference.sequence import GenerationRequest


class LLM:
    def __init__(self, model: str | Path = "@hearth/smollm2-135m-instruct",
                 config: EngineConfig | None = None, **config_kwargs: Any) -> None:
        if config is None:
            config = EngineConfig(**config_kwargs)
        self.engine = LLMEngine.from_model(model, config)
        self.tokenizer = self.engine.tokenizer
        self.info = self.engine.info

    def encode(self, prompt: str | None = None, messages: list | None = None, raw: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt=prompt, messages=messages, raw=raw)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 constraint: Constraint | Sequence[Constraint | None] | None = None) -> list[RequestOutput]:
        """Raw prompts (text is tokenised as is, no chat template) or token id lists; outputs in input order.
        lora: one adapter for all prompts, or one (or None) per prompt; they run in the same batches.
        constraint: a grammar the output must match (JSON schema, regex, ...), for all prompts or per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self.encode(p, raw=True) if isinstance(p, str) else list(p) for p in prompts]
        return self.generate_ids(ids, params, lora, constraint)

    def chat(self, conversations: Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             constraint: Constraint | Sequence[Constraint | None] | None = None) -> list[RequestOutput]:
        return self.generate_ids([self.encode(messages=c) for c in conversations], params, constraint=constraint)

    def generate_ids(self, prompt_ids: Sequence[list[int]],
                     params: SamplingParams | Sequence[SamplingParams] | None = None,
                     lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
                     constraint: Constraint | Sequence[Constraint | None] | None = None) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_ids)
        if lora is None or isinstance(lora, LoRARequest):
            lora = [lora] * len(prompt_ids)
        if constraint is None or isinstance(constraint, Constraint):
            constraint = [constraint] * len(prompt_ids)
        if not len(params) == len(lora) == len(constraint) == len(prompt_ids):
            raise ValueError("give one SamplingParams (LoRARequest, Constraint), or one per prompt")
        return self.generate_requests([
            GenerationRequest(prompt_token_ids=list(p), params=sp, lora=adapter, constraint=grammar)
            for p, sp, adapter, grammar in zip(prompt_ids, params, lora, constraint, strict=True)])

    def generate_requests(self, requests: Sequence[GenerationRequest]) -> list[RequestOutput]:
        """Run fully formed requests (compression, speculation, forced output...) to the end; outputs in order."""
        compiled = []
        for request in requests:  # validate all (and compile their grammars) before queueing any
            self.engine.validate(request)
            compiled.append(None if request.constraint is None else self.engine.compile_constraint(request.constraint))
        for request, grammar in zip(requests, compiled, strict=True):
            self.engine.add_request(request, grammar)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in requests]  # type: ignore[index]
