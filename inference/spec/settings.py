"""How a request speculates: which drafter, and how many tokens it may propose per step."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from inference.errors import InvalidRequestError

MAX_SPECULATIVE_TOKENS = 16


class SpecMode(StrEnum):
    OFF = "off"
    NGRAM = "ngram"  # prompt lookup: continue a repeat of the last n tokens found earlier in the sequence
    DRAFT = "draft"  # a smaller model sharing the target's tokenizer


@dataclass(frozen=True, slots=True)
class SpeculationSettings:
    mode: SpecMode = SpecMode.OFF
    k: int = 4  # most draft tokens per step

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", SpecMode(self.mode))
        except ValueError as exc:
            raise InvalidRequestError(
                f"speculation must be one of {[m.value for m in SpecMode]}, got {self.mode!r}") from exc
        if not isinstance(self.k, int) or isinstance(self.k, bool) or not 1 <= self.k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(f"speculation k must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")

    @property
    def enabled(self) -> bool:
        return self.mode is not SpecMode.OFF


@dataclass(slots=True)
class SpecStats:
    """Counts for one request or for the whole engine."""

    steps: int = 0  # verification steps that had at least one draft token
    proposed: int = 0
    accepted: int = 0
    per_position_proposed: list[int] | None = None
    per_position_accepted: list[int] | None = None

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        if self.per_position_proposed is None:
            self.per_position_proposed, self.per_position_accepted = [], []
        while len(self.per_position_proposed) < proposed:
            self.per_position_proposed.append(0)
            self.per_position_accepted.append(0)  # type: ignore[union-attr]
        for i in range(proposed):
            self.per_position_proposed[i] += 1
            if i < accepted:
                self.per_position_accepted[i] += 1  # type: ignore[index]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per verification step (the bonus token not counted)."""
        return self.accepted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        per_position = [a / p if p else 0.0 for a, p in zip(self.per_position_accepted or [],
                                                              self.per_position_proposed or [], strict=True)]
        return {"steps": self.steps, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "per_position_acceptance": per_position}
