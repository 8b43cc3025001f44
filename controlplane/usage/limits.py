"""Per-key rate limits (requests/min and tokens/min) in fixed one-minute windows kept in the Django cache.

The cache is Redis in production, so every process of a deployment shares the counters; the embedded default
(local memory) limits each process on its own.
"""

from __future__ import annotations

import time

from django.core.cache import cache

from controlplane.accounts.services import KeyContext
from controlplane.api import errors

WINDOW_S = 60
# Counters outlive their window a little so a late increment never recreates an expired key at zero.
_TTL_S = WINDOW_S * 2


def _window(now: float) -> tuple[int, float]:
    window = int(now // WINDOW_S)
    return window, (window + 1) * WINDOW_S - now


def _incr(key: str, delta: int) -> int:
    cache.add(key, 0, _TTL_S)
    try:
        return cache.incr(key, delta)
    except ValueError:
        # Expired between add() and incr(): start the window over.
        cache.set(key, delta, _TTL_S)
        return delta


def check_rate(ctx: KeyContext, now: float | None = None) -> None:
    """Count this request against the key's window; 429 with Retry-After when over either limit."""
    now = time.time() if now is None else now
    window, remaining = _window(now)
    if ctx.tokens_per_minute:
        used = cache.get(f"rl:t:{ctx.key_id}:{window}", 0)
        if used >= ctx.tokens_per_minute:
            raise errors.rate_limited(
                f"Rate limit: this key used {used:,} of its {ctx.tokens_per_minute:,} tokens per minute", remaining)
    if ctx.requests_per_minute:
        count = _incr(f"rl:r:{ctx.key_id}:{window}", 1)
        if count > ctx.requests_per_minute:
            raise errors.rate_limited(
                f"Rate limit: this key allows {ctx.requests_per_minute:,} requests per minute", remaining)


def add_tokens(ctx: KeyContext, tokens: int, now: float | None = None) -> None:
    """Charge a finished request's tokens to the key's current window (the next request sees them)."""
    if not ctx.tokens_per_minute or tokens <= 0:
        return
    window, _ = _window(time.time() if now is None else now)
    _incr(f"rl:t:{ctx.key_id}:{window}", tokens)
