"""Fixtures for the control-plane tests: accounts and keys made through the services, the catalog seeded from
the real bundled-model specs, the real in-process engine (session-scoped), and a live uvicorn server."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cp_support import BATCH_BROKER, CHAT_MODEL, EMBED_MODEL, Tenant, make_tenant  # noqa: E402
from django.core.cache import cache  # noqa: E402

from controlplane.accounts.models import ApiKey  # noqa: E402
from controlplane.catalog import services as catalog_services  # noqa: E402
from inference.models.catalog import BUNDLED_MODELS  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    # Key contexts, the catalog snapshot and rate-limit windows live in the cache; a rolled-back test must not
    # leave them behind for the next one.
    cache.clear()
    catalog_services.invalidate()
    yield
    cache.clear()


@pytest.fixture
def catalog(db) -> dict:
    """The catalog seeded from every bundled model spec (installed or not), as seed_catalog does."""
    catalog_services.seed(BUNDLED_MODELS.values(), log=lambda line: None)
    return catalog_services.catalog()


@pytest.fixture
def tenant(db, catalog) -> Tenant:
    return make_tenant("acme", permission=ApiKey.Permission.ADMIN)


@pytest.fixture
def other_tenant(db, catalog) -> Tenant:
    return make_tenant("globex", permission=ApiKey.Permission.ADMIN)


def _installed(name: str) -> bool:
    return BUNDLED_MODELS[name].installed


@pytest.fixture(scope="session")
def backend():
    """The real in-process backend with SmolLM2 and MiniLM (skips when `make models` has not run)."""
    missing = [n for n in (CHAT_MODEL, EMBED_MODEL) if not _installed(n)]
    if missing:
        pytest.skip(f"models not installed ({', '.join(missing)}): run `make models`")
    from controlplane.serving.dispatch import InProcessBackend, set_backend

    # Engine settings come from the catalog in production; the session backend must not depend on a test DB.
    # fp32 everywhere: bf16 logits tie often enough that greedy answers could depend on batch shape (prefix-cache
    # hits, speculative verification), and the tests compare greedy answers across those.
    real = InProcessBackend(settings_for=lambda model: {"kv_cache_memory": "256MiB", "max_num_seqs": 16,
                                                        "dtype": "float32"})
    previous = set_backend(real)
    yield real
    set_backend(previous)
    real.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def live_server_url(backend) -> Iterator[str]:
    """uvicorn serving the real ASGI app on loopback, in a thread of this process (so it shares the backend)."""
    import uvicorn

    from controlplane.asgi import application

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


# ---------------------------------------------------------------------------------------------- batches
def redis_up(url: str = BATCH_BROKER) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def batch_queue() -> Iterator[str]:
    """The Celery app pointed at the real Redis, on a queue of this test session's own."""
    if not redis_up():
        pytest.skip(f"Redis is not reachable at {BATCH_BROKER}")
    import uuid

    import redis

    from controlplane.celery import use_broker

    queue = f"hearth-test-{uuid.uuid4().hex[:10]}"
    # Short visibility and restore intervals so a dead worker's messages come back within the test.
    use_broker(BATCH_BROKER, queue=queue, transport_options={
        "visibility_timeout": 3, "unacked_restore_interval": 1, "unacked_restore_throttle": 1})
    yield queue
    redis.Redis.from_url(BATCH_BROKER).delete(queue)


@pytest.fixture(scope="module")
def batch_worker(batch_queue, backend, django_db_setup, django_db_blocker) -> Iterator[object]:
    """The embedded Celery worker (threads, as the ASGI app runs it) consuming the test queue."""
    from controlplane.batches.runtime import EmbeddedWorker

    worker = EmbeddedWorker(concurrency=4, beat=False, rebuild_queue=False, recover=False)
    worker.start()
    yield worker
    with django_db_blocker.unblock():
        worker.stop()


# ---------------------------------------------------------------------------------------------- browser
@pytest.fixture
def browser():
    """Debian's headless Chromium under Playwright (never a downloaded browser)."""
    import shutil

    from browser_support import CHROMIUM, CHROMIUM_ARGS

    if not shutil.which(CHROMIUM):
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian package `chromium`; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def browser_tenant(live_server_url) -> Tenant:
    """An account with a key and an owner who signs in (browser_support.USER). Rows are made before the browser
    starts: Playwright's sync API runs an event loop in this thread, and Django refuses database calls from a
    thread with a running loop."""
    from browser_support import PASSWORD, USER
    from django.contrib.auth import get_user_model

    from controlplane.accounts.models import Membership

    catalog_services.seed(BUNDLED_MODELS.values(), log=lambda line: None)
    tenant = make_tenant("browser")
    user = get_user_model().objects.create_user(USER, password=PASSWORD)
    Membership.objects.create(account=tenant.account, user=user, role=Membership.Role.OWNER)
    return tenant
