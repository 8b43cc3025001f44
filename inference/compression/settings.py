"""What a request asks of KV compression: a rate (keep 1/r of the entries) or a cap on cached tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from inference.errors import InvalidRequestError

MAX_RATE = 1024.0


class EvictionMethod(StrEnum):
    VARIABLE = "variable"  # lowest received attention across all heads and layers: per-head rates vary
    UNIFORM = "uniform"  # the same number of entries evicted from every head (baseline)
    RECENT = "recent"  # keep only the most recent tokens of every head (baseline)


@dataclass(frozen=True, slots=True)
class KVCompressionSettings:
    rate: float | None = None
    max_cache_tokens: int | None = None
    method: EvictionMethod = EvictionMethod.VARIABLE

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.max_cache_tokens is None):
            raise InvalidRequestError("kv_compression takes exactly one of rate or max_cache_tokens")
        if self.rate is not None:
            if isinstance(self.rate, bool) or not isinstance(self.rate, int | float) or not math.isfinite(self.rate) \
                    or not 1.0 <= self.rate <= MAX_RATE:
                raise InvalidRequestError(f"kv_compression rate must be a number in [1, {MAX_RATE:g}]")
            object.__setattr__(self, "rate", float(self.rate))
        if self.max_cache_tokens is not None and (
                isinstance(self.max_cache_tokens, bool) or not isinstance(self.max_cache_tokens, int)
                or self.max_cache_tokens < 1):
            raise InvalidRequestError("kv_compression max_cache_tokens must be a positive integer")
        try:
            object.__setattr__(self, "method", EvictionMethod(self.method))
        except ValueError as exc:
            raise InvalidRequestError(
                f"kv_compression method must be one of {[m.value for m in EvictionMethod]}") from exc

    @property
    def enabled(self) -> bool:
        return self.max_cache_tokens is not None or (self.rate or 1.0) > 1.0

    def budget(self, num_tokens: int) -> int:
        """Entries to keep per head, on average, for a sequence of num_tokens tokens."""
        if self.max_cache_tokens is not None:
            return min(num_tokens, self.max_cache_tokens)
        return max(1, math.ceil(num_tokens / (self.rate or 1.0)))

    @classmethod
    def parse(cls, value: Any) -> KVCompressionSettings:
        """From the API's `{"rate": R}` or `{"max_cache_tokens": N}` (optionally with "method")."""
        if isinstance(value, KVCompressionSettings):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError('kv_compression must be an object: {"rate": R} or {"max_cache_tokens": N}')
        unknown = set(value) - {"rate", "max_cache_tokens", "method"}
        if unknown:
            raise InvalidRequestError(f"kv_compression has unknown fields: {sorted(unknown)}")
        return cls(rate=value.get("rate"), max_cache_tokens=value.get("max_cache_tokens"),
                   method=value.get("method", EvictionMethod.VARIABLE))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method.value}
        if self.rate is not None:
            out["rate"] = self.rate
        else:
            out["max_cache_tokens"] = self.max_cache_tokens
        return out
