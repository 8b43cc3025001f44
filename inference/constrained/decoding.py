"""Grammar-constrained decoding inside the engine step.

The engine calls, each step:
1. `propose_jumps(decoding)` before drafting: where a constrained sequence's grammar allows exactly one
   continuation (a key, punctuation, the tail of an enum value), its tokens become the sequence's draft
   (jump-forward). The draft goes through speculative verification like any other, so the output is exactly
   what decoding token by token gives (greedy: the same tokens; sampled: a deterministic draft token is kept
   with the probability the masked distribution gives it), only several tokens come from one pass.
2. `check_drafts(decoding)` after the drafters: a draft (n-gram, draft model) is cut at its first token the
   grammar refuses: no pass is spent on tokens that could never be kept.
3. `mask(chunks, logits)` after the pass, before sampling or verification: one bitmask for the step's rows,
   a row per constrained position (the next token, and the token after each draft prefix), filled from the
   sequence's matcher and applied in place with -inf. Free rows are untouched, so constrained and free
   requests share a batch.
4. Each kept token is accepted by the matcher (`GrammarState.advance`, called from the engine's token
   processing), which also tells when the grammar has ended.

Jump-forward runs whether or not the request speculates and ignores the batch-size gate of speculation: its
tokens are all but certain, so verifying them costs a pass no more than decoding them one by one would. Where a
jump is proposed, the request's drafter does not draft that step: the jump ends exactly where the grammar opens
a choice, which is where the model's own next token (the verification's bonus token) is worth the most, and a
drafter extending it would condition on unverified tokens. Elsewhere (string values, numbers) the drafter
proposes as usual, then `check_drafts` cuts its draft to what the grammar allows.

Reported logprobs come from the masked logits: they describe the distribution the token was drawn from, so
top alternatives are grammar-legal ones and a forced token reports log-probability 0.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from inference.constrained.grammar import GrammarCache
from inference.constrained.state import GrammarState, StopTokens
from inference.scheduler import ScheduledChunk
from inference.sequence import Sequence as Seq
from inference.spec.settings import MAX_SPECULATIVE_TOKENS

log = logging.getLogger(__name__)

# Jump strings repeat (the same keys in every request of a schema): remember their tokens.
_JUMP_TOKENS_MEMO = 4096
# A draft holds at most MAX_SPECULATIVE_TOKENS tokens; this much text covers them (a schema's long constant would
# otherwise be tokenised, and remembered, whole every step).
_JUMP_CHARS = 32 * MAX_SPECULATIVE_TOKENS


@dataclass(slots=True)
class JumpStats:
    proposed: int = 0
    accepted: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted


class ConstrainedDecoding:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int], *,
                 cache_memory: int, jump_forward: bool = True) -> None:
        self.grammars = GrammarCache(tokenizer, vocab_size, eos_token_ids, cache_memory)
        self.vocab_size = vocab_size
        self.stops = StopTokens.build(self.grammars.stop_token_ids, vocab_size)
        self.tokenizer = tokenizer  # the loop thread's: jump strings are tokenised between steps, on that thread
        self.jump_forward = jump_forward
        self.jump_stats = JumpStats()
        self._jump_tokens: OrderedDict[str, list[int]] = OrderedDict()

    def start(self, grammar: xgr.CompiledGrammar) -> GrammarState:
        return GrammarState.start(grammar, self.stops)

    # ----------------------------------------------------------------- drafts
    def propose_jumps(self, decoding: Sequence[Seq], token_limit: int) -> None:
        """Clear every decoding sequence's draft, then draft the grammar's forced continuation where it has one."""
        for seq in decoding:
            seq.draft, seq.draft_probs, seq.draft_forced = [], None, False
            state = seq.grammar
            if state is None or not self.jump_forward:
                continue
            # Leave room for the bonus token, and never draft past max_tokens or the context.
            room = min(MAX_SPECULATIVE_TOKENS, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                       token_limit - seq.num_tokens - 1)
            if room < 1:
                continue
            try:
                text = state.jump_forward_string()
                tokens = self._tokens(text[:_JUMP_CHARS])[:room] if text else []
                tokens = tokens[: state.valid_prefix(tokens)]
            except Exception:  # noqa: BLE001 - a jump is only a shortcut: without one the model decodes as usual
                log.exception("jump-forward failed for request %s", seq.request_id)
                continue
            if tokens:
                seq.draft, seq.draft_forced = tokens, True

    def check_drafts(self, decoding: Sequence[Seq]) -> None:
        """Cut each constrained sequence's draft at its first token the grammar refuses."""
        for seq in decoding:
            state = seq.grammar
            if state is None or not seq.draft or seq.draft_forced:
                continue
            try:
                keep = state.valid_prefix(seq.draft)
            except Exception:  # noqa: BLE001 - drop the draft: the model decodes the next token itself
                log.exception("checking a draft failed for request %s", seq.request_id)
                keep = 0
            if keep < len(seq.draft):
                seq.draft = seq.draft[:keep]
                if seq.draft_probs is not None:
                    seq.draft_probs = seq.draft_probs[:keep] if keep else None

    def record_jump(self, seq: Seq, proposed: int, accepted: int) -> None:
        self.jump_stats.record(proposed, accepted)
        if seq.grammar is not None:
            seq.grammar.jump_proposed += proposed
            seq.grammar.jump_accepted += accepted

    def _tokens(self, text: str) -> list[int]:
        tokens = self._jump_tokens.get(text)
        if tokens is None:
            tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
            self._jump_tokens[text] = tokens
            if len(self._jump_tokens) > _JUMP_TOKENS_MEMO:
                self._jump_tokens.popitem(last=False)
        else:
            self._jump_tokens.move_to_end(text)
        return tokens

    # ----------------------------------------------------------------- masking
    def mask(self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor) -> None:
        """Mask, in place, every logits row a constrained sequence samples or verifies from this step. Rows are
        laid out as the step's sampling reads them: per chunk, one row plus one per draft token."""
        rows: list[tuple[GrammarState, int, list[int]]] = []
        start = 0
        for chunk in chunks:
            state = chunk.seq.grammar
            if state is not None:
                rows.append((state, start, chunk.seq.draft[: chunk.num_draft]))
            start += chunk.num_draft + 1
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        restricting: list[int] = []
        for state, first_row, draft in rows:
            restricting.extend(state.fill_rows(bitmask, first_row, draft))
        if restricting:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=restricting)

    # ----------------------------------------------------------------- reports
    def metrics(self) -> dict:
        stats = self.grammars.stats
        return {"grammar_compiles_total": stats.compiles, "grammar_cache_hits_total": stats.hits,
                "grammar_compile_ms_avg": stats.as_dict()["compile_ms_avg"],
                "jump_forward_proposed": self.jump_stats.proposed,
                "jump_forward_accepted": self.jump_stats.accepted}

    @staticmethod
    def report(seq: Seq) -> dict | None:
        """The request's jump-forward counts, when it is constrained."""
        state = seq.grammar
        if state is None:
            return None
        return {"jump_forward_proposed": state.jump_proposed, "jump_forward_accepted": state.jump_accepted}
