"""Production mode on the real Redis: rate-limit windows and key contexts shared through the cache."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
from cp_support import CHAT_MODEL, make_tenant, redis_url, seconds_left_in_minute
from django.core.cache import cache
from django.test import override_settings

from controlplane.accounts.services import authenticate_key, revoke_key
from controlplane.api.errors import ApiError
from controlplane.usage import limits

REDIS_URL = redis_url(3)
pytestmark = [pytest.mark.django_db, pytest.mark.redis]


def _redis_up() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def redis_cache():
    if not _redis_up():
        pytest.skip(f"Redis is not reachable at {REDIS_URL}")
    prefix = f"hearth-test-{uuid.uuid4().hex[:8]}"
    caches = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
                          "KEY_PREFIX": prefix}}
    with override_settings(CACHES=caches):
        cache.clear()
        yield redis.Redis.from_url(REDIS_URL), prefix
        cache.clear()


def test_rate_limit_counters_live_in_redis(redis_cache, catalog):
    client, prefix = redis_cache
    tenant = make_tenant("redis-rpm", requests_per_minute=3)
    ctx = authenticate_key(tenant.secret)
    for _ in range(3):
        limits.check_rate(ctx)
    with pytest.raises(ApiError) as refused:
        limits.check_rate(ctx)
    assert refused.value.status == 429 and int(refused.value.headers["Retry-After"]) >= 1
    # The counter is a Redis key every process of the deployment reads.
    keys = [k.decode() for k in client.keys(f"{prefix}:*rl:r:{ctx.key_id}:*")]
    assert len(keys) == 1 and int(client.get(keys[0])) == 4 and client.ttl(keys[0]) > 0


def test_key_context_cached_in_redis_and_dropped_on_revoke(redis_cache, catalog):
    client, prefix = redis_cache
    tenant = make_tenant("redis-keys")
    assert authenticate_key(tenant.secret).account_id == tenant.account.pk
    assert client.keys(f"{prefix}:*apikey:{tenant.key.prefix}")
    revoke_key(tenant.account.pk, str(tenant.key.pk))
    with pytest.raises(ApiError) as refused:
        authenticate_key(tenant.secret)
    assert refused.value.status == 401


@pytest.mark.real_model
def test_http_429_with_retry_after_in_production_mode(redis_cache, client, catalog, backend):
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    for attempt in range(3):
        # The limit counts per calendar minute: a pair of requests straddling a minute boundary is two windows,
        # where a second request is rightly allowed. Such a pair says nothing; take another.
        tenant = make_tenant(f"redis-http-{attempt}", requests_per_minute=1)
        start = time.time()
        first = client.post(f"{tenant.run_url}{CHAT_MODEL}", data=body, content_type="application/json",
                            **tenant.auth)
        assert first.status_code == 200
        before = time.time()
        second = client.post(f"{tenant.run_url}{CHAT_MODEL}", data=body, content_type="application/json",
                             **tenant.auth)
        after = time.time()
        if int(start // 60) == int(after // 60):
            break
    assert second.status_code == 429 and second.json()["errors"][0]["code"] == 971
    assert int(second["Retry-After"]) in seconds_left_in_minute(before, after)
