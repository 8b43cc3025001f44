"""A smaller model that shares the target's tokenizer drafts tokens greedily, on its own paged KV cache.

The drafter keeps, per sequence, the tokens whose KV it holds. Each call it rolls back to the longest prefix
it shares with the sequence (dropping rejected drafts by shortening its heads' lengths), computes whatever is
new in one batched pass, then decodes up to k tokens for all sequences together. Drafts are greedy, so each
is a deterministic proposal (q one-hot) and rejection sampling keeps the target's distribution exact.

Two things keep drafting cheap (docs/benchmarks.md has the measurements behind the defaults):
- the head scores a reduced vocabulary (inference.spec.draft_head), not all of it;
- a sequence stops extending its draft after a token the draft itself is unsure of (probability below
  `min_confidence`): later tokens would mostly be rejected, and each costs a draft forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inference.block_manager import BlockManager, SeqBlocks
from inference.config import EngineConfig
from inference.errors import InvalidRequestError
from inference.kv_cache import KVLayout, KVPool
from inference.model_runner import ModelRunner
from inference.models.loader import LoadedModel, load_model
from inference.scheduler import ScheduledChunk
from inference.spec.draft_head import DraftHead, SequenceVocab
from inference.spec.drafter import Draft, DraftRequest

if TYPE_CHECKING:
    from inference.engine import LLMEngine

DEFAULT_DRAFT_VOCAB = 32768
DEFAULT_MIN_CONFIDENCE = 0.5
_PROBE_TEXTS = ["def quicksort(xs):\n    return sorted(xs)", "Héllo wörld! 你好, 🙂 1234567"]


@dataclass(slots=True, eq=False)
class _DraftSeq:
    """What ModelRunner needs of a sequence: its blocks, its tokens and how many are computed."""

    blocks: SeqBlocks
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    draft: list[int] = field(default_factory=list)  # always empty: the draft model does not speculate
    vocab: SequenceVocab = field(default_factory=SequenceVocab)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids(self) -> list[int]:
        return self.tokens

    def token_at(self, index: int) -> int:
        return self.tokens[index]


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelDrafter:
    name = "draft"

    def __init__(self, loaded: LoadedModel, kv_cache_memory: int, block_size: int, *,
                 vocab: int = DEFAULT_DRAFT_VOCAB, min_confidence: float = DEFAULT_MIN_CONFIDENCE) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.loaded = loaded
        model = loaded.model
        self.head = DraftHead(model, vocab)
        self.min_confidence = min_confidence
        layout = KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, block_size, model.dtype)
        self.pool = KVPool.from_budget(layout, kv_cache_memory, model.device)
        self.blocks = BlockManager(layout, self.pool.num_blocks, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.pool)
        self._seqs: dict[str, _DraftSeq] = {}

    @classmethod
    def for_target(cls, name: str, target: LLMEngine, **options: float | int) -> DraftModelDrafter:
        config = target.config
        loaded = load_model(name, EngineConfig(dtype=config.dtype, device=config.device,
                                               max_model_len=target.max_model_len))
        for text in _PROBE_TEXTS:
            if loaded.tokenizer.encode(text) != target.tokenizer.encode(text):
                raise InvalidRequestError(f"draft model {name!r} does not share the target's tokenizer")
        return cls(loaded, int(config.kv_cache_memory), config.block_size, **options)

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.blocks.free(seq.blocks)

    def _run(self, work: list[tuple[_DraftSeq, int]]) -> tuple[list[int], list[float]]:
        """Compute `count` more tokens for each sequence; returns each one's greedy next token and its probability."""
        chunks = [ScheduledChunk(seq, count) for seq, count in work]
        result = self.runner.execute(chunks, head=lambda hidden: hidden)
        order = {id(c.seq): i for i, c in enumerate(result.sampled_chunks)}
        for seq, count in work:
            seq.num_computed += count
        hidden = result.logits[[order[id(seq)] for seq, _ in work]]
        choice = self.head.choose(hidden, [seq.vocab for seq, _ in work])
        return choice.tokens, choice.confidence

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = {r.seq_id: Draft(tokens=[]) for r in requests}
        catch_up: list[tuple[_DraftSeq, int]] = []
        wanted: dict[str, int] = {}
        for request in requests:
            seq = self._seqs.get(request.seq_id)
            if seq is None:
                seq = self._seqs[request.seq_id] = _DraftSeq(self.blocks.new_sequence())
            tokens = list(request.token_ids)
            keep = _common_prefix(seq.tokens, tokens, seq.num_computed)
            if keep < seq.num_computed:  # drop KV of tokens the target rejected
                seq.blocks.lens[:] = keep
                seq.num_computed = keep
            self.head.observe(seq.vocab, tokens[keep:])
            seq.tokens = tokens
            new = len(tokens) - seq.num_computed
            if request.k < 1 or new < 1 or not self.blocks.allocate(seq.blocks, new + request.k):
                continue  # nothing to draft, or no room in the draft cache this step: no draft, no harm
            catch_up.append((seq, new))
            wanted[request.seq_id] = request.k
        if not catch_up:
            return [drafts[r.seq_id] for r in requests]

        active = [(request.seq_id, seq) for request, (seq, _) in
                  zip([r for r in requests if r.seq_id in wanted], catch_up, strict=True)]
        next_tokens, confidence = self._run(catch_up)
        for step in range(max(wanted.values())):
            still: list[tuple[str, _DraftSeq]] = []
            for (seq_id, seq), token, sure in zip(active, next_tokens, confidence, strict=True):
                drafts[seq_id].tokens.append(token)
                if step + 1 < wanted[seq_id] and sure >= self.min_confidence:
                    seq.tokens.append(token)
                    still.append((seq_id, seq))
            if not still:
                break
            active = still
            next_tokens, confidence = self._run([(seq, 1) for _, seq in active])
        return [drafts[r.seq_id] for r in requests]
