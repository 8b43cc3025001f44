"""One constrained sequence's grammar state: an xgrammar matcher over the tokens accepted so far.

The matcher only ever holds tokens the sequence has kept. Walking a draft (to check it, or to fill the mask of
every position the verifier reads) accepts its tokens and rolls them back before returning, so rejected drafts,
preemption and aborts never leave it ahead of the output. Preemption recomputes only the KV: the tokens were
accepted and the matcher keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
import xgrammar as xgr


class GrammarStep(Enum):
    """What accepting one output token did to the grammar."""

    OPEN = "open"  # the output goes on
    COMPLETE = "complete"  # the token completed the grammar and only a stop token could follow: finish now
    STOP_TOKEN = "stop_token"  # a stop token, allowed because the grammar was complete: finish, emit no text


class GrammarError(RuntimeError):
    """The sequence's output and its grammar parted (an engine bug or an xgrammar failure): it fails alone."""


@dataclass(frozen=True, slots=True)
class StopTokens:
    """The stop ids of one engine's grammars, and a bitmask row with every other token set (to ask whether a
    filled mask allows anything but a stop)."""

    ids: frozenset[int]
    others: torch.Tensor  # int32 [ceil(vocab / 32)]

    @classmethod
    def build(cls, ids: Sequence[int], vocab_size: int) -> StopTokens:
        words = np.full(xgr.get_bitmask_shape(1, vocab_size)[1], 0xFFFFFFFF, dtype=np.uint32)
        for token_id in ids:
            words[token_id // 32] &= ~np.uint32(1 << (token_id % 32))
        return cls(frozenset(int(t) for t in ids), torch.from_numpy(words.view(np.int32)))


@dataclass(slots=True)
class GrammarState:
    matcher: xgr.GrammarMatcher
    stops: StopTokens
    jump_proposed: int = 0  # jump-forward draft tokens proposed and accepted (the request's report)
    jump_accepted: int = 0
    failure: str | None = None  # why the matcher could not fill a mask; the next token then fails the request

    @classmethod
    def start(cls, grammar: xgr.CompiledGrammar, stops: StopTokens) -> GrammarState:
        return cls(xgr.GrammarMatcher(grammar), stops)

    def advance(self, token_id: int) -> GrammarStep:
        """Accept an output token for good (sampled, or a verified draft token); GrammarError if it may not be."""
        if self.failure is not None:
            raise GrammarError(f"the request's grammar failed: {self.failure}")
        if not self.matcher.accept_token(token_id):
            raise GrammarError(f"token {token_id} is not allowed by the request's grammar")
        if self.matcher.is_terminated():
            return GrammarStep.STOP_TOKEN
        if self.matcher.is_completed() and not self._can_continue():
            return GrammarStep.COMPLETE
        return GrammarStep.OPEN

    def _can_continue(self) -> bool:
        """Whether a token other than a stop token is allowed now. Asked only where the grammar is complete (a
        JSON document: only after its closing brace), so it rarely costs a mask fill. Where only a stop could
        follow, the output ends at once instead of spending a forward pass on a forced stop token."""
        row = torch.empty((1, self.stops.others.numel()), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(row, 0)
        return bool((row[0] & self.stops.others).any())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading draft tokens the grammar allows in turn (nothing after a stop token)."""
        matcher = self.matcher
        accepted = 0
        try:
            for token_id in tokens:
                if matcher.is_terminated() or not matcher.accept_token(int(token_id)):
                    break
                accepted += 1
        finally:
            if accepted:
                matcher.rollback(accepted)
        return accepted

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, draft: Sequence[int]) -> list[int]:
        """Fill the mask of every position the verifier reads: first_row for the next token, first_row + j for
        the token after draft[:j]. Returns the rows that restrict anything (an all-allowed row needs no pass).
        The draft must be grammar-valid (`valid_prefix` checked it before scheduling); rows after a stop token
        are left unrestricted, since the sequence ends at that token whatever they hold.

        Should the matcher fail, its rows allow only stop tokens and the failure is kept: the token chosen
        from them fails this request (GrammarError in `advance`), never the step."""
        try:
            return self._fill_rows(bitmask, first_row, draft)
        except Exception as exc:  # noqa: BLE001 - one request's grammar must not stop the engine
            self.failure = f"{type(exc).__name__}: {exc}"
            for j in range(len(draft) + 1):
                bitmask[first_row + j] = ~self.stops.others
            return [first_row + j for j in range(len(draft) + 1)]

    def _fill_rows(self, bitmask: torch.Tensor, first_row: int, draft: Sequence[int]) -> list[int]:
        matcher = self.matcher
        restricting: list[int] = []
        walked = 0
        try:
            for j in range(len(draft) + 1):
                if matcher.is_terminated():
                    break
                if matcher.fill_next_token_bitmask(bitmask, first_row + j):
                    restricting.append(first_row + j)
                if j == len(draft):
                    break
                if not matcher.accept_token(int(draft[j])):
                    raise GrammarError(f"draft token {draft[j]} left the grammar after it was checked")
                walked += 1
        finally:
            if walked:
                matcher.rollback(walked)
        return restricting

    def jump_forward_string(self) -> str:
        """The text the grammar allows as the only continuation from here ('' where there is a choice)."""
        if self.matcher.is_terminated():
            return ""
        try:
            return self.matcher.find_jump_forward_string()
        except UnicodeDecodeError:
            # The forced bytes end inside a character (options sharing a first byte, as "é" and "è" do), which
            # xgrammar's binding cannot hand over as text: no jump here, the model decodes those bytes itself.
            return ""
