"""The draft model's output head over part of the vocabulary: the ids a draft can plausibly need.

A draft model's job is to guess the target's next tokens cheaply. For a small model with a large vocabulary
the head dominates that cost: Qwen2.5-Coder-0.5B's 151,936 x 896 head is over a quarter of its weights, read
once per drafted token. Byte-level BPE vocabularies are numbered in merge order, so low ids are the common
pieces; the head here scores only the first `common` ids plus every id that occurs in the sequence itself
(which covers the names and quoted spans of input-grounded text). Proposals stay greedy, hence one-hot, and
the verifier accepts or rejects them against the full target distribution, so this changes how often a
draft is accepted, never what the engine outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from inference.models.decoder import DecoderLM
from inference.models.layers import Linear


@dataclass(slots=True)
class HeadChoice:
    tokens: list[int]
    confidence: list[float]  # the draft's probability of each token, over the scored ids


@dataclass(slots=True, eq=False)
class SequenceVocab:
    """Ids at or above the common range that one sequence has used, with their head rows."""

    seen: set[int] = field(default_factory=set)
    ids: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # [len(ids), hidden]


class DraftHead:
    def __init__(self, model: DecoderLM, common: int) -> None:
        if common < 1:
            raise ValueError(f"a draft head needs at least one common id, got {common}")
        self.model = model
        self.common = min(common, model.vocab_size)
        self.full = self.common == model.vocab_size
        self.head = model.lm_head if self.full else Linear(model.head_weight[: self.common].contiguous())

    def observe(self, vocab: SequenceVocab, token_ids: Sequence[int]) -> None:
        """Add the rare ids among `token_ids` (typically just the tokens new since the last call)."""
        if self.full:
            return
        fresh = {t for t in token_ids if t >= self.common} - vocab.seen
        if not fresh:
            return
        vocab.seen |= fresh
        vocab.ids = torch.tensor(sorted(vocab.seen), dtype=torch.long, device=self.model.device)
        vocab.rows = self.model.head_weight.index_select(0, vocab.ids)

    def choose(self, hidden: torch.Tensor, vocabs: Sequence[SequenceVocab]) -> HeadChoice:
        """hidden [N, hidden], one row per sequence in `vocabs`: the greedy token of each and its probability."""
        logits = self.model.finish_logits(self.head(hidden))
        tokens: list[int] = []
        confidence: list[float] = []
        for row, vocab in enumerate(vocabs):
            scores = logits[row]
            ids = None
            if vocab.rows is not None:
                extra = self.model.finish_logits(vocab.rows @ hidden[row])
                scores = torch.cat([scores, extra])
                ids = vocab.ids
            best = int(scores.argmax())
            probability = float(torch.softmax(scores, dim=-1)[best])
            tokens.append(best if best < self.common or ids is None else int(ids[best - self.common]))
            confidence.append(probability)
        return HeadChoice(tokens, confidence)
