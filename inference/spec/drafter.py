"""The interface every speculative drafter implements.

A drafter proposes up to k tokens per sequence; the verifier (inference.spec.rejection) only ever sees the
proposed tokens and, for drafters that sample, the distribution each was drawn from. Prompt lookup
(NgramDrafter), a draft model, or a later EAGLE/Medusa head all fit behind `Drafter` without the verifier
changing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(slots=True)
class DraftRequest:
    """One sequence asking for a draft this step.

    `token_ids` is the prompt plus the output accepted so far. Drafters may keep incremental state per
    `seq_id` and then read only `len(token_ids)` and the tail appended since their last call, so a lazy
    view over the engine's own token storage is enough; it need not be a fresh list every step.
    """

    seq_id: str
    token_ids: Sequence[int]
    k: int  # the most draft tokens wanted; 0 is allowed (the drafter just catches up)

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ValueError(f"k must be a non-negative integer, got {self.k!r}")


@dataclass(slots=True)
class Draft:
    """What a drafter proposes for one sequence: 0..k tokens.

    `probs` is the draft distribution q each token was drawn from, [len(tokens), V]; None means a
    deterministic proposal (q is one-hot on the token), as for prompt lookup or greedy draft models.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.tokens)):
            raise ValueError(
                f"draft probs must be [len(tokens), V] = [{len(self.tokens)}, V], got {tuple(self.probs.shape)}"
            )


@runtime_checkable
class Drafter(Protocol):
    name: str

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One Draft per request, in order, with at most request.k tokens each."""
        ...

    def release(self, seq_id: str) -> None:
        """The sequence finished or was preempted: drop whatever state is kept for it (unknown ids are fine)."""
        ...
