"""Speculative decoding inside the engine step: who drafts, how many tokens, and what survives verification.

Each step, before scheduling, every running sequence that is decoding and has speculation on asks its drafter
for up to k tokens. The scheduler then computes the last sampled token plus the draft in one pass over the
paged cache; the target's distributions at those k+1 positions decide, by speculative rejection sampling
(greedy: exact match), how many draft tokens survive, and one more token is sampled from the target. KV
entries of rejected tokens are rolled back by shortening each head's length.

Adaptive control keeps speculation from costing speed:
- per sequence, exponential averages of the acceptance rate and of the accepted length: k follows the
  accepted length (about one more than recently survived), and below `min_acceptance` the sequence stops
  drafting for `cooldown_steps` steps (doubling on each repeat), then probes again;
- per step, when more than `max_batch` sequences decode at once the step is compute-bound and verifying
  extra tokens costs more than it saves, so nobody drafts (the thresholds are measured: docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from inference.sampler import SampledToken, Sampler, SamplingRow
from inference.sequence import Sequence
from inference.spec.drafter import Drafter, DraftRequest
from inference.spec.rejection import rejection_sample, verify_greedy
from inference.spec.settings import SpecMode, SpecStats, SpeculationSettings


@dataclass(slots=True)
class AdaptivePolicy:
    min_acceptance: float = 0.3  # EMA of accepted/proposed below which a sequence pauses drafting
    ema_weight: float = 0.3
    cooldown_steps: int = 16
    max_batch: int = 8  # more decoding sequences than this: no drafts this step
    adaptive_k: bool = True  # False: always draft the settings' k (measurements that price a fixed draft length)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_acceptance <= 1.0 or not 0.0 < self.ema_weight <= 1.0:
            raise ValueError("min_acceptance in [0, 1] and ema_weight in (0, 1] please")
        if self.cooldown_steps < 0 or self.max_batch < 1:
            raise ValueError("cooldown_steps >= 0 and max_batch >= 1 please")


@dataclass(slots=True)
class _SeqState:
    ema: float = 1.0  # acceptance rate
    ema_len: float | None = None  # draft tokens accepted per step
    paused_until: int = 0
    pauses: int = 0

    def next_k(self, k_max: int) -> int:
        """Propose about one more token than recently survived: long runs grow k, short ones save work."""
        if self.ema_len is None:
            return k_max
        return max(1, min(k_max, int(self.ema_len * 1.5) + 1))


@dataclass(slots=True)
class Verified:
    tokens: list[SampledToken]  # accepted drafts then the target's own token
    proposed: int
    accepted: int


@dataclass(slots=True)
class SpecController:
    default: SpeculationSettings
    drafters: dict[SpecMode, Drafter]
    sampler: Sampler
    policy: AdaptivePolicy = field(default_factory=AdaptivePolicy)
    stats: SpecStats = field(default_factory=SpecStats)
    _state: dict[str, _SeqState] = field(default_factory=dict)
    _step: int = 0
    batch_paused_steps: int = 0

    def settings_for(self, seq: Sequence) -> SpeculationSettings:
        return seq.request.speculation or self.default

    # ----------------------------------------------------------------- drafting
    def propose(self, decoding: Seq[Sequence], token_room: int, load: int | None = None) -> None:
        """Attach a draft to each eligible sequence (seq.draft, seq.draft_probs).

        load: sequences in the engine (running and waiting). Past max_batch the engine is throughput-bound:
        work queued behind the decoders will fill the batch, so verification would only cost.
        """
        self._step += 1
        for seq in decoding:
            seq.draft, seq.draft_probs = [], None
        if max(len(decoding), load or 0) > self.policy.max_batch:
            self.batch_paused_steps += 1
            return
        wanted: dict[SpecMode, list[tuple[Sequence, DraftRequest]]] = {}
        for seq in decoding:
            settings = self.settings_for(seq)
            if not settings.enabled or settings.mode not in self.drafters:
                continue
            state = self._state.setdefault(seq.request_id, _SeqState())
            if state.paused_until > self._step:
                continue
            # Never draft past max_tokens or the context: those tokens could not be kept anyway.
            k = state.next_k(settings.k) if self.policy.adaptive_k else settings.k
            room = min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                       token_room - seq.num_tokens - 1)
            if room < 1:
                continue
            wanted.setdefault(settings.mode, []).append(
                (seq, DraftRequest(seq.request_id, seq.token_ids(), room)))
        for mode, items in wanted.items():
            drafts = self.drafters[mode].propose([request for _, request in items])
            for (seq, request), draft in zip(items, drafts, strict=True):
                tokens = list(draft.tokens[: request.k])
                seq.draft = tokens
                seq.draft_probs = draft.probs[: len(tokens)] if draft.probs is not None and tokens else None

    # ----------------------------------------------------------------- verification
    def verify(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Verified]:
        """logits: (len(draft)+1) rows per sequence, in order. Returns what each sequence keeps."""
        starts, row = [], 0
        for seq in seqs:
            starts.append(row)
            row += len(seq.draft) + 1
        rows: list[SamplingRow] = []
        for seq in seqs:
            outputs = list(seq.output_token_ids)
            for i in range(len(seq.draft) + 1):
                rows.append(SamplingRow(seq.params, seq.generator, seq.request.prompt_token_ids,
                                        outputs + seq.draft[:i]))
        # Plain greedy rows need only an argmax per position; the rest need full target distributions.
        plain = [n for n, s in enumerate(seqs) if s.params.greedy and not s.params.needs_penalties]
        other = [n for n in range(len(seqs)) if n not in set(plain)]
        kept: dict[int, list[int]] = {}
        if plain:
            kept.update(zip(plain, self._verify_greedy([seqs[n] for n in plain],
                                                       [logits[starts[n]: starts[n] + len(seqs[n].draft) + 1]
                                                        .argmax(dim=-1) for n in plain]), strict=True))
        if other:
            sub_rows = [r for n in other for r in rows[starts[n]: starts[n] + len(seqs[n].draft) + 1]]
            sub_logits = torch.cat([logits[starts[n]: starts[n] + len(seqs[n].draft) + 1] for n in other])
            kept.update(zip(other, self._verify_sampled([seqs[n] for n in other], sub_logits, sub_rows),
                            strict=True))

        results = []
        for n, seq in enumerate(seqs):
            tokens = kept[n]
            span = slice(starts[n], starts[n] + len(tokens))
            results.append(self._verified(seq, self.sampler.score(logits[span], rows[span], tokens)))
        return results

    def verify_argmax(self, seqs: list[Sequence], best: list[list[int]]) -> list[Verified]:
        """`verify` for plain greedy sequences that report no logprobs, from the argmax token at each of their
        len(draft) + 1 positions alone (the step computed no logits: ModelRunner.execute's greedy)."""
        kept = self._verify_greedy(seqs, [torch.tensor(tokens, dtype=torch.long) for tokens in best])
        return [self._verified(seq, [SampledToken(token_id=t, logprob=None, top=None) for t in tokens])
                for seq, tokens in zip(seqs, kept, strict=True)]

    def _verified(self, seq: Sequence, tokens: list[SampledToken]) -> Verified:
        accepted = len(tokens) - 1
        if not seq.draft_forced:  # a grammar's jump-forward is no drafter's guess: its counts are kept apart
            self._observe(seq, len(seq.draft), accepted)
        return Verified(tokens, proposed=len(seq.draft), accepted=accepted)

    @staticmethod
    def _verify_greedy(seqs: list[Sequence], argmax: list[torch.Tensor]) -> list[list[int]]:
        """argmax: per sequence, the target's greedy token at each of its len(draft) + 1 positions."""
        k_max = max(len(s.draft) for s in seqs)
        best = torch.zeros(len(seqs), k_max + 1, dtype=torch.long)
        drafts = torch.zeros(len(seqs), max(k_max, 1), dtype=torch.long)
        for n, (seq, rows) in enumerate(zip(seqs, argmax, strict=True)):
            best[n, : rows.shape[0]] = rows.cpu()
            if seq.draft:
                drafts[n, : len(seq.draft)] = torch.tensor(seq.draft)
        counts = torch.tensor([len(s.draft) for s in seqs], dtype=torch.long)
        return verify_greedy(best, drafts, counts)

    def _verify_sampled(self, seqs: list[Sequence], logits: torch.Tensor,
                        rows: list[SamplingRow]) -> list[list[int]]:
        probs = self.sampler.probabilities(logits, rows)
        vocab = probs.shape[-1]
        k_max = max(len(s.draft) for s in seqs)
        target = torch.zeros(len(seqs), k_max + 1, vocab, dtype=probs.dtype, device=probs.device)
        drafts = torch.zeros(len(seqs), max(k_max, 1), dtype=torch.long, device=probs.device)
        draft_q = torch.zeros(len(seqs), max(k_max, 1), vocab, dtype=probs.dtype, device=probs.device)
        counts = torch.tensor([len(s.draft) for s in seqs], dtype=torch.long, device=probs.device)
        row = 0
        for n, seq in enumerate(seqs):
            m = len(seq.draft)
            target[n, : m + 1] = probs[row: row + m + 1]
            if m:
                drafts[n, :m] = torch.tensor(seq.draft, device=probs.device)
                if seq.draft_probs is not None:
                    draft_q[n, :m] = seq.draft_probs.to(probs.device, probs.dtype)
                else:  # a deterministic proposal: q is one-hot on the proposed token
                    draft_q[n, torch.arange(m), drafts[n, :m]] = 1.0
            row += m + 1
        return rejection_sample(target, drafts, counts, draft_q, [s.generator for s in seqs])

    def _observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.stats.record(proposed, accepted)
        seq.spec_stats.record(proposed, accepted)
        state = self._state.setdefault(seq.request_id, _SeqState())
        w = self.policy.ema_weight
        state.ema = (1 - w) * state.ema + w * (accepted / proposed)
        state.ema_len = accepted if state.ema_len is None else (1 - w) * state.ema_len + w * accepted
        if state.ema < self.policy.min_acceptance:
            # Back off exponentially: text that keeps refusing drafts stops paying for probes.
            state.paused_until = self._step + self.policy.cooldown_steps * 2 ** min(state.pauses, 4)
            state.pauses += 1
            state.ema = self.policy.min_acceptance  # probe again after the pause, not stuck below the bar
        elif accepted:
            state.pauses = 0

    def release(self, seq: Sequence) -> None:
        self._state.pop(seq.request_id, None)
        seq.draft, seq.draft_probs, seq.draft_forced = [], None, False
        for drafter in self.drafters.values():
            drafter.release(seq.request_id)


