"""Prompt-lookup decoding: draft tokens copied from earlier in the sequence itself.

For each sequence, the last n tokens (n from max_n down to min_n, longest first) are looked up among the
earlier positions of prompt + output; the tokens that followed the match are proposed, up to k of them and
never past the end of what exists (no guessing beyond the sequence, as in transformers' and vLLM's prompt
lookup).

Which match: the most recent one. Input-grounded generation (editing a file, quoting a document) copies
runs of the input in order, so once the output has started copying a passage, the latest earlier
occurrence of its last few tokens is most often the place being copied from right now; and "most recent"
is what an index that simply overwrites on insert keeps in O(1). transformers takes the earliest match
instead, which re-proposes a passage's first occurrence even after the text has moved on.

Cost: every sequence keeps a dict from n-gram (a tuple of n token ids) to the latest end position where it
occurred with at least one token after it. A step inserts only the n-grams ending at the tokens appended
since the previous call (max_n - min_n + 1 per token) and does at most that many lookups, so the per-step
work is independent of the sequence length; the one-time indexing of a 32k-token prompt is 32k insertions
per n. Memory is about 100 bytes per n-gram, ~13 MB for a 32k-token sequence with n in 1..4.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from inference.spec.drafter import Draft, DraftRequest

# The shortest match the engine's prompt lookup trusts. One- and two-token matches are weak evidence: in open
# chat they mostly propose tokens the model rejects, and each rejected round costs a verification pass
# (measured: docs/benchmarks.md, speculation notes).
ENGINE_MIN_N = 3


@dataclass(slots=True)
class _SeqIndex:
    tokens: list[int] = field(default_factory=list)  # the drafter's own copy: prompt + accepted output
    # n-gram -> the largest e with tokens[e - n:e] == gram and e < len(tokens) (so tokens[e] follows it)
    latest_end: dict[tuple[int, ...], int] = field(default_factory=dict)


def _read(token_ids: Sequence[int], start: int) -> list[int]:
    """token_ids[start:] as a list of Python ints (lists, arrays, numpy arrays and tensors alike)."""
    tail = token_ids[start:]
    if isinstance(tail, list):
        return tail
    tolist = getattr(tail, "tolist", None)
    return tolist() if tolist is not None else [int(t) for t in tail]


class NgramDrafter:
    """Prompt-lookup drafter (see the module docstring); implements inference.spec.drafter.Drafter."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(f"need integers 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        self.max_n = max_n
        self.min_n = min_n
        self._seqs: dict[str, _SeqIndex] = {}

    def __len__(self) -> int:
        """Sequences with state held."""
        return len(self._seqs)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft(tokens=self._propose_one(r)) for r in requests]

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def _propose_one(self, request: DraftRequest) -> list[int]:
        state = self._sync(request.seq_id, request.token_ids)
        if request.k == 0:
            return []
        tokens = state.tokens
        length = len(tokens)
        # n <= length - 1: the match must end strictly before the suffix it is compared with.
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = state.latest_end.get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end:end + request.k]
        return []

    def _sync(self, seq_id: str, token_ids: Sequence[int]) -> _SeqIndex:
        """The sequence's index, brought up to date with the tokens appended since the last call."""
        state = self._seqs.get(seq_id)
        new_len = len(token_ids)
        if state is not None:
            old_len = len(state.tokens)
            # Sequences only grow; anything else (a reused id, a rewritten sequence) gets a fresh index.
            # Checking the last known token keeps the guard O(1).
            if new_len < old_len or (old_len and int(token_ids[old_len - 1]) != state.tokens[old_len - 1]):
                state = None
        if state is None:
            state = self._seqs[seq_id] = _SeqIndex()
        old_len = len(state.tokens)
        if new_len > old_len:
            state.tokens.extend(_read(token_ids, old_len))
            self._index(state, old_len)
        return state

    def _index(self, state: _SeqIndex, old_len: int) -> None:
        # Ends e (the n-gram tokens[e - n:e], followed by tokens[e]) are indexed once tokens[e] exists: the
        # appended tokens make ends old_len .. len - 1 eligible. The n-grams ending at the last token wait
        # for the next call, so a lookup of the current suffix can only find an earlier occurrence.
        tokens, latest_end = state.tokens, state.latest_end
        min_n, max_n = self.min_n, self.max_n
        for end in range(max(old_len, 1), len(tokens)):
            for n in range(min_n, min(max_n, end) + 1):
                latest_end[tuple(tokens[end - n:end])] = end
