"""One engine replica: the Ray Serve deployment class that holds an AsyncEngine (or an Embedder).

Serve creates, health-checks and replaces replicas; each publishes routing stats (load, the prefix-cache keys
it holds, resident adapters) that `fleet.router.HearthRouter` reads to place requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from fleet.adapters import DISK_MB_ENV, AdapterBundle, LocalAdapters, budget_bytes
from fleet.routing import KEY_BYTES, RouteHint
from inference import (
    AsyncEngine,
    EngineConfig,
    EngineMetrics,
    GenerationRequest,
    LoRARequest,
    ModelInfo,
    RequestOutput,
)
from inference.constrained import Constraint
from inference.errors import TokenizerChangedError
from inference.models.bert import Embedder
from inference.models.catalog import MARKER_FILE, resolve_model
from inference.prompts import prompt_char_limit

log = logging.getLogger("fleet.replica")
ADAPTER_DISK_MB = 4096  # adapters a node keeps on disk, the least recently used removed past it
SUMMARY_KEYS = 8192  # prefix-cache keys published per stats period (newest first): 64 KiB


def replica_name() -> str:
    """This replica's id inside Serve (the router sees the same), or the process id outside it."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (tests that drive the class directly)
        return f"pid{os.getpid()}"


# Files up to this size count by their content in a model's revision (config, tokenizer, generation config: a
# tokenizer.json of a large vocabulary is tens of MB); larger ones, the weights, by their name and size.
REVISION_CONTENT_BYTES = 64 * 2**20
# What transformers' AutoTokenizer reads a tokenizer and its chat template from: only a change among these files
# changes which tokens a prompt's ids stand for, or how messages are laid out as text before they are encoded.
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template", "spiece",
                   "sentencepiece")
# Files that hold a chat template alone (chat_template.jinja, .json), and the entry of tokenizer_config.json that
# holds one: how messages become text, never which token an id stands for.
TEMPLATE_FILES = ("chat_template",)
TEMPLATE_KEY = "chat_template"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _without_template(path: str) -> bytes | None:
    """tokenizer_config.json's content without its chat template (sorted, so the file's layout counts for nothing);
    None where it is not a JSON object (then its bytes count as they are)."""
    try:
        with open(path, "rb") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    config.pop(TEMPLATE_KEY, None)
    return json.dumps(config, sort_keys=True, default=str).encode()


def _files_digest(model: str, digest: Any, keep: Callable[[str], bool], templates: bool = True) -> str:
    """`digest` updated with the checkpoint's files that `keep` takes by name (in name order): the small ones by
    name and content, larger ones by name and size. The installer's marker (inference/models: when and from what
    it converted, which differs from node to node) is never taken. Without `templates`, tokenizer_config.json
    counts by its content without the chat template."""
    with os.scandir(resolve_model(model)) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if not entry.is_file() or entry.name == MARKER_FILE or not keep(entry.name):
                continue
            stripped = None if templates or entry.name != TOKENIZER_CONFIG else _without_template(entry.path)
            if stripped is not None:
                digest.update(f"{entry.name}\0".encode() + hashlib.sha256(stripped).digest() + b"\n")
                continue
            size = entry.stat().st_size
            digest.update(f"{entry.name}\0{size}\0".encode())
            if size <= REVISION_CONTENT_BYTES:
                with open(entry.path, "rb") as f:
                    digest.update(hashlib.file_digest(f, "sha256").digest())
            digest.update(b"\n")
    return digest.hexdigest()[:16]


def model_revision(model: str, engine_settings: Mapping[str, Any]) -> str:
    """What a replica serves under its model's name, as far as a caller keeps anything of it (fleet.client: the
    model's facts, its character limit, the constraints that compiled): the engine settings and the checkpoint's
    files, the small ones by their content and the weights by their name and size. Everything kept comes from the
    small files and the settings, never from the weights' values. The caller forgets what it kept when the
    revisions its replicas report change, as after a redeploy under the same name with other files or settings.
    Content rather than times of change: each node's own copy of one checkpoint reads as the same revision, so a
    replacement replica placed on another node costs the caller no fetches."""
    digest = hashlib.sha256(json.dumps(dict(engine_settings), sort_keys=True, default=str).encode())
    return _files_digest(model, digest, lambda name: True)


def tokenizer_revision(model: str) -> str:
    """The tokenizer a caller that encodes its requests itself keeps (fleet.client), chat template included: its
    files' content. The caller keeps it while replicas with the same tokenizer revision remain. Apart from
    `model_revision`: an update that changes only the weights or the engine settings leaves the tokenizer."""
    return _files_digest(model, hashlib.sha256(b"tokenizer"), lambda name: name.startswith(TOKENIZER_FILES))


def vocabulary_revision(model: str) -> str:
    """What the ids of a prompt encoded by this model's tokenizer stand for: the tokenizer's files without its chat
    template. Each request names that of the tokenizer that encoded it, so that during a rolling update the router
    sends it only to replicas that read its ids as the same tokens, and a replica refuses one it would read as
    others. A new chat template alone (an operator's fix of how messages are laid out) changes the tokenizer the
    caller keeps, not this: the requests its old tokenizer encoded may go to any replica meanwhile, and none of
    them is refused once the update ends."""
    return _files_digest(model, hashlib.sha256(b"vocabulary"),
                         lambda name: name.startswith(TOKENIZER_FILES) and not name.startswith(TEMPLATE_FILES),
                         templates=False)


def adapter_root() -> Path:
    """Where this node keeps adapters it fetched: the data dir when the deployment names one."""
    data = os.environ.get("HEARTH_DATA_DIR")
    return Path(data) / "fleet-adapters" if data else Path(tempfile.gettempdir()) / "hearth-fleet-adapters"


class EngineReplica:
    """A generation model's engine. Every method is called through a DeploymentHandle."""

    def __init__(self, model: str, engine_settings: Mapping[str, Any]) -> None:
        self.model = model
        self.engine = AsyncEngine.from_model(model, EngineConfig.from_settings(engine_settings))
        self.revision = model_revision(model, engine_settings)
        self.tokenizer_revision = tokenizer_revision(model)
        self.vocabulary_revision = vocabulary_revision(model)
        self.name = replica_name()
        self.block_size = self.engine.engine.config.block_size
        self.adapters = LocalAdapters(adapter_root(), budget_bytes(DISK_MB_ENV, ADAPTER_DISK_MB))
        log.info("replica %s of %s ready", self.name, model)

    # ------------------------------------------------------------------ Serve hooks
    def check_health(self) -> None:
        """Serve replaces a replica whose engine loop died."""
        if not self.engine.alive:
            raise RuntimeError(f"the engine of {self.model} stopped")

    def record_routing_stats(self) -> dict[str, Any]:
        m, taken_at = self.engine.stamped_metrics()
        keys = self.engine.engine.blocks.cached_keys(SUMMARY_KEYS)
        return {"running": m.running, "waiting": m.queue_depth, "slots": self.engine.engine.config.max_num_seqs,
                "kv_usage": m.kv_usage, "block_size": self.block_size, "at": taken_at,
                "prefill_tokens": m.interactive_prefill_tokens, "tokenizer_revision": self.tokenizer_revision,
                "vocabulary_revision": self.vocabulary_revision,
                "prefix": b"".join(k[:KEY_BYTES] for k in keys), "adapters": list(m.lora_resident or ())}

    # ------------------------------------------------------------------ engine calls
    # `route` is read by the request router (a retry's replicas to avoid); the replica reads only the tokenizer
    # revision a generation's route names (`_same_tokenizer`).
    async def info(self, route: RouteHint | None = None) -> ModelInfo:
        return self.engine.info

    async def encode(self, prompt: str | None = None, messages: list | None = None, raw: bool = False,
                     tools: list | None = None, route: RouteHint | None = None) -> list[int]:
        return await asyncio.to_thread(self.engine.encode, prompt=prompt, messages=messages, raw=raw, tools=tools)

    async def tokenizer(self, route: RouteHint | None = None) -> Any:
        """The engine's tokenizer, for a caller of an earlier release that encodes its requests itself."""
        return await asyncio.to_thread(self.engine.tokenizer_copy)

    async def tokenizer_and_revision(self, route: RouteHint | None = None) -> tuple[str, Any]:
        """The engine's tokenizer and its `tokenizer_revision`, for a caller of the release before
        `tokenizer_and_revisions`."""
        return self.tokenizer_revision, await asyncio.to_thread(self.engine.tokenizer_copy)

    async def tokenizer_and_revisions(self, route: RouteHint | None = None) -> tuple[str, str, Any]:
        """The engine's tokenizer with its `tokenizer_revision` and `vocabulary_revision`, for a caller that
        encodes its requests itself (fleet.client does): it keeps the tokenizer while the first is served, and
        names the second when it sends them, so that during a rolling update the router keeps them on replicas
        that read the same ids as the same tokens."""
        return (self.tokenizer_revision, self.vocabulary_revision,
                await asyncio.to_thread(self.engine.tokenizer_copy))

    async def char_limit(self, route: RouteHint | None = None) -> tuple[int, int]:
        """Characters past which no prompt fits the context, and the context length."""
        engine = self.engine
        limit = await asyncio.to_thread(prompt_char_limit, engine.tokenizer, engine.engine.max_model_len)
        return limit, engine.engine.max_model_len

    async def compile(self, constraint: Constraint, route: RouteHint | None = None) -> None:
        await self.engine.compile_constraint(constraint)

    async def _local(self, request: GenerationRequest, adapter: AdapterBundle | None) -> GenerationRequest:
        if adapter is None:
            return request
        import ray

        folder = await asyncio.to_thread(self.adapters.folder, adapter, ray.get)
        # Assigned, not replaced: the request's prefix-cache keys already name the adapter, exactly once.
        request.lora = LoRARequest(adapter.name, folder)
        return request

    def _same_tokenizer(self, route: RouteHint | None) -> None:
        """Refuse a prompt encoded by a tokenizer whose ids stand for other tokens than this replica's: the router
        sends one only where its vocabulary is, unless none is left (an update that changed the vocabulary ended
        before the caller noticed). Its ids would be read as other tokens here; refused, nothing ran, and the
        caller encodes it anew. A caller of the release before names only the whole tokenizer's revision."""
        if route is None:
            return
        if route.vocabulary_revision:
            wanted, mine, what = route.vocabulary_revision, self.vocabulary_revision, "vocabulary"
        else:
            wanted, mine, what = route.tokenizer_revision, self.tokenizer_revision, "tokenizer"
        if wanted and wanted != mine:
            raise TokenizerChangedError(
                f"the prompt was encoded by {what} revision {wanted}; this replica of {self.model} has {mine}")

    async def generate(self, request: GenerationRequest, route: RouteHint | None = None,
                       adapter: AdapterBundle | None = None) -> RequestOutput:
        self._same_tokenizer(route)
        out = await self.engine.generate(await self._local(request, adapter))
        out.replica = self.name
        return out

    async def stream(self, request: GenerationRequest, route: RouteHint | None = None,
                     adapter: AdapterBundle | None = None) -> AsyncIterator[RequestOutput]:
        self._same_tokenizer(route)
        chars = tokens = 0  # how much text and how many token ids the outputs sent so far hold
        async for out in self.engine.stream(await self._local(request, adapter)):
            out.replica = self.name
            # An output holds the log probabilities of every token so far (`all_logprobs`): sent whole at each step,
            # a long stream's would cost the square of its length to pickle (~510 bytes a token at 20 alternatives, measured).
            # Each goes with its own step's (`logprobs`); FleetClient.stream adds them up again.
            out.all_logprobs = None
            # So do the text and token ids so far (17.8 MB pickled over a stream of 2,048 tokens, measured): where they
            # are the last ones sent plus this step's deltas, as the engine makes them, they go empty and the
            # client rebuilds them (FleetClient.stream); otherwise they go whole.
            grown = (len(out.text) == chars + len(out.delta_text) and out.text.endswith(out.delta_text)
                     and len(out.token_ids) == tokens + len(out.delta_token_ids))
            chars, tokens = len(out.text), len(out.token_ids)
            if grown:
                out.text, out.token_ids = "", []
            yield out

    async def metrics(self) -> tuple[str, EngineMetrics, int, str, str]:
        """This replica's id, its engine gauges, its sequence slots and what it serves (`model_revision`,
        `tokenizer_revision`)."""
        return (self.name, self.engine.metrics(), self.engine.engine.config.max_num_seqs, self.revision,
                self.tokenizer_revision)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)


class EmbedderReplica:
    """An embedding model. Forward passes run one at a time in a worker thread: the replica's loop stays free."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.embedder = Embedder.from_model(model)
        self.name = replica_name()
        self._lock = asyncio.Lock()

    async def embed(self, texts: list[str], route: RouteHint | None = None) -> dict[str, Any]:
        async with self._lock:
            out = await asyncio.to_thread(self.embedder.embed, texts)
        return {"vectors": out.embeddings.tolist(), "dim": self.embedder.dim, "prompt_tokens": out.prompt_tokens,
                "token_counts": list(out.token_counts), "replica": self.name}
