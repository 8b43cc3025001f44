"""The synchronous front door: LLM(model).generate(prompts, params) runs the engine to completion."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inference.config import EngineConfig
from inference.engine import LLMEngine
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
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Raw prompts (text is tokenised as is, no chat template) or token id lists; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self.encode(p, raw=True) if isinstance(p, str) else list(p) for p in prompts]
        return self.generate_ids(ids, params)

    def chat(self, conversations: Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        return self.generate_ids([self.encode(messages=c) for c in conversations], params)

    def generate_ids(self, prompt_ids: Sequence[list[int]],
                     params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_ids)
        if len(params) != len(prompt_ids):
            raise ValueError("give one SamplingParams, or one per prompt")
        requests = [GenerationRequest(prompt_token_ids=list(p), params=sp) for p, sp in zip(prompt_ids, params, strict=True)]
        for request in requests:  # validate all before queueing any
            self.engine.validate(request)
        for request in requests:
            self.engine.add_request(request)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in requests]  # type: ignore[index]
