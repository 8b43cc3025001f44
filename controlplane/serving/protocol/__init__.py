"""The APIs, one module each: every endpoint owns its request schema, parse → job, and rendering.

Adding an API is one module here plus its routes; views, batch execution and the playground go through the
same `Job` and `Run` whatever the API.
"""

from __future__ import annotations

from controlplane.serving.protocol.base import Endpoint
from controlplane.serving.protocol.native import NATIVE
from controlplane.serving.protocol.openai import CHAT, COMPLETIONS, EMBEDDINGS

# Every endpoint by the path a batch names it with (OpenAI batch lines' `url`; "native" for queueRequest).
ENDPOINTS: dict[str, Endpoint] = {e.path: e for e in (CHAT, COMPLETIONS, EMBEDDINGS, NATIVE)}
# What an OpenAI batch may name as its endpoint.
OPENAI_BATCH_PATHS: tuple[str, ...] = (CHAT.path, COMPLETIONS.path, EMBEDDINGS.path)

__all__ = ["ENDPOINTS", "OPENAI_BATCH_PATHS", "Endpoint", "NATIVE", "CHAT", "COMPLETIONS", "EMBEDDINGS"]
