"""The engine's running counts behind its metrics: tokens in and out, finished requests, preemptions, mid-step
admissions, and the sums behind the mean time to first token and time per output token. The engine bumps them as
it works; `LLMEngine.metrics` reads them beside the scheduler's, the cache's and speculation's own state."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

TOKENS_PER_S_WINDOW_S = 10.0  # tokens/s is over the tokens of the last ten seconds


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0  # of requests that produced a token
    generation_tokens: int = 0
    finished: int = 0
    preemptions: int = 0
    mid_step_admissions: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    tpot_sum: float = 0.0
    tpot_count: int = 0
    recent: deque[float] = field(default_factory=deque)  # when each recent token came out

    def token(self, now: float, first_of_prompt: int | None = None) -> None:
        """A token came out at `now`; the first of a request also counts its prompt's tokens."""
        self.generation_tokens += 1
        self.recent.append(now)
        if first_of_prompt is not None:
            self.prompt_tokens += first_of_prompt

    def request_finished(self, ttft_s: float | None, tpot_s: float | None) -> None:
        self.finished += 1
        if ttft_s is not None:
            self.ttft_sum += ttft_s
            self.ttft_count += 1
        if tpot_s is not None:
            self.tpot_sum += tpot_s
            self.tpot_count += 1

    def tokens_per_s(self, now: float) -> float:
        """Tokens a second over the window (from its first token to now), forgetting older ones."""
        while self.recent and self.recent[0] < now - TOKENS_PER_S_WINDOW_S:
            self.recent.popleft()
        window = now - self.recent[0] if self.recent else 0.0
        return len(self.recent) / window if window > 0 else 0.0

    def metrics(self, now: float) -> dict[str, Any]:
        """These counts as `EngineMetrics` fields."""
        return {"prompt_tokens_total": self.prompt_tokens, "generation_tokens_total": self.generation_tokens,
                "requests_finished_total": self.finished, "preemptions_total": self.preemptions,
                "mid_step_admissions_total": self.mid_step_admissions,
                "ttft_s_avg": self.ttft_sum / self.ttft_count if self.ttft_count else None,
                "tpot_s_avg": self.tpot_sum / self.tpot_count if self.tpot_count else None,
                "tokens_per_s": self.tokens_per_s(now)}
