"""Hearth's inference engine: plain PyTorch, usable without the control plane.

    from inference import LLM, SamplingParams
    llm = LLM("@hearth/smollm2-135m-instruct")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0].text)
"""

from inference.async_engine import AsyncEngine
from inference.config import EngineConfig
from inference.engine import LLMEngine
from inference.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
)
from inference.llm import LLM
from inference.lora.slots import LoRARequest
from inference.models.loader import ModelInfo
from inference.outputs import EngineMetrics, FinishReason, RequestMetrics, RequestOutput, TokenLogprob, Usage
from inference.sampling_params import SamplingParams
from inference.sequence import GenerationRequest, Priority

__all__ = [
    "LLM", "AsyncEngine", "LLMEngine", "EngineConfig", "EngineMetrics", "SamplingParams", "GenerationRequest",
    "Priority", "RequestOutput", "RequestMetrics", "FinishReason", "TokenLogprob", "Usage", "ModelInfo",
    "EngineError", "InvalidRequestError", "PromptTooLongError", "ModelNotFoundError", "EngineOverloadedError",
    "EngineDeadError", "LoRARequest",
]
