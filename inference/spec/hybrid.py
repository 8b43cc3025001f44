"""Prompt lookup first, a draft model where lookup finds nothing.

Input-grounded text (an edited file, quoted passages) is largely copied from the prompt: there a lookup
proposal is as good as a draft model's and costs nothing, while the draft model spends one forward pass per
drafted token. Where the text is the model's own, lookup has no match and the draft model takes over. Each
sequence uses one drafter per step; the model drafter catches up on the tokens it skipped the next time it
drafts (one batched pass), so switching costs little.
"""

from __future__ import annotations

from collections.abc import Sequence

from inference.spec.drafter import Draft, Drafter, DraftRequest
from inference.spec.ngram import ENGINE_MIN_N

# The shortest match the lookup in front of a draft model trusts. Short matches are weak evidence and the
# draft model usually guesses better (measured: docs/benchmarks.md, draft-model notes).
LOOKUP_FIRST_MIN_N = ENGINE_MIN_N


class LookupFirst:
    def __init__(self, lookup: Drafter, model: Drafter, min_tokens: int = 1) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
        self.lookup = lookup
        self.model = model
        self.min_tokens = min_tokens
        self.name = f"{lookup.name}+{model.name}"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        found = self.lookup.propose(requests)
        rest = [n for n, draft in enumerate(found) if len(draft.tokens) < min(self.min_tokens, requests[n].k)]
        if rest:
            for n, draft in zip(rest, self.model.propose([requests[n] for n in rest]), strict=True):
                found[n] = draft
        return found

    def release(self, seq_id: str) -> None:
        self.lookup.release(seq_id)
        self.model.release(seq_id)
