"""Django settings for Hearth's control plane.

Embedded defaults (SQLite in the data dir, in-memory cache and channel layer) need no external service, so
`make run` works on a fresh clone. Production reads everything from the environment: DATABASE_URL (PostgreSQL),
REDIS_URL (cache, rate limits, channel layer, Celery broker), SECRET_KEY, ALLOWED_HOSTS, DEBUG.
"""

from __future__ import annotations

import os
import secrets
from decimal import Decimal
from pathlib import Path

import dj_database_url


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name, "").strip()
    return [item.strip() for item in value.split(",") if item.strip()] if value else default


BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("HEARTH_DATA_DIR") or BASE_DIR / ".data").expanduser()


def _local_secret_key() -> str:
    """A key generated once per data dir, so sessions survive restarts without anyone configuring one."""
    path = DATA_DIR / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        DATA_DIR.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(50)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        return key
    except OSError:
        return secrets.token_urlsafe(50)


# A deployment is "production" when it brings its own secret key; then the HTTPS hardening defaults to on.
PRODUCTION = env_bool("HEARTH_PRODUCTION", "SECRET_KEY" in os.environ)
SECRET_KEY = os.environ.get("SECRET_KEY") or _local_secret_key()
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "controlplane.accounts",
    "controlplane.catalog",
    "controlplane.usage",
    "controlplane.serving",
    "controlplane.batches",
    "controlplane.adapters",
    "controlplane.dashboard",
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

MIDDLEWARE = [
    "controlplane.api.middleware.MetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# Key-authenticated API routes (see controlplane.asgi) skip sessions, CSRF, messages and the rest: each
# MiddlewareMixin middleware costs two thread hops per request under ASGI, which was most of the API's latency.
HEARTH_API_MIDDLEWARE = [
    "controlplane.api.middleware.MetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASE_URL = os.environ.get("DATABASE_URL", "").strip()
if DATABASE_URL:
    # Health checks: a connection kept between tasks (batch worker threads) or requests (DB_CONN_MAX_AGE) is
    # tested before its first query, so one the server dropped is replaced instead of failing the work.
    _database = dj_database_url.parse(DATABASE_URL, conn_max_age=env_int("DB_CONN_MAX_AGE", 0),
                                      conn_health_checks=True)
    if (_database["ENGINE"] == "django.db.backends.postgresql" and env_bool("DB_POOL", True)
            and not _database["CONN_MAX_AGE"]):
        # A pool of server sessions. Under ASGI every request runs its database work on a thread of its own, so
        # without one each request opened a new session (~7 ms on loopback: the server starts a process for
        # it) and closed it at the end. A checkout costs a round trip instead: the pool tests a session before
        # lending it, so one the server ended (a restart, an idle timeout) is replaced rather than failing the
        # request. The test is ours (controlplane/db_pool.py: a dead session has every idle one tested at once;
        # psycopg_pool's own, which Django's CONN_HEALTH_CHECKS installs, met them one by one, waiting 1, 2,
        # 4... s between). max_size bounds the sessions this process holds; a request that finds none free
        # waits up to `timeout` seconds for one.
        import controlplane.db_pool  # noqa: F401  (installs the pool's test of a session)

        _database["OPTIONS"] = {**_database.get("OPTIONS", {}), "pool": {
            "min_size": env_int("DB_POOL_MIN_SIZE", 2), "max_size": env_int("DB_POOL_MAX_SIZE", 100),
            "timeout": env_int("DB_POOL_TIMEOUT_S", 30), "max_idle": 300}}
    DATABASES = {"default": _database}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": Path(os.environ.get("HEARTH_SQLITE_PATH") or DATA_DIR / "hearth.sqlite3"),
            "OPTIONS": {
                # WAL + NORMAL: a usage write costs well under a millisecond instead of an fsync per commit.
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                # IMMEDIATE: writers take the lock up front instead of failing on a read->write upgrade.
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
            },
            # A file, not the default shared-cache memory database: live-server tests write from server
            # threads while the test reads, which shared-cache SQLite answers with "table is locked".
            # HEARTH_TEST_SQLITE_PATH lets two test runs share a checkout without sharing a database.
            "TEST": {"NAME": os.environ.get("HEARTH_TEST_SQLITE_PATH") or str(DATA_DIR / "test-hearth.sqlite3")},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL", "").strip()
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "hearth",
        }
    }
    CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "hearth"}}
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
# --- Celery (batches) -------------------------------------------------------------------------------------
# Production brokers through Redis. Without one, kombu's filesystem transport keeps messages as files in the
# data dir: no server, durable across restarts, served by the worker thread the ASGI app starts (see
# docs/architecture.md, "Batches"). Item rows, not messages, are the source of truth either way.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "").strip() or REDIS_URL or "filesystem://"
HEARTH_BROKER_DIR = DATA_DIR / "broker"
# A message a dead worker held comes back after this long (Redis); leases bring its items back sooner.
HEARTH_BATCH_VISIBILITY_TIMEOUT = env_int("HEARTH_BATCH_VISIBILITY_TIMEOUT", 3600)
if CELERY_BROKER_URL.startswith("filesystem://"):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(HEARTH_BROKER_DIR / "queue"), "data_folder_out": str(HEARTH_BROKER_DIR / "queue"),
        "control_folder": str(HEARTH_BROKER_DIR / "control"), "store_processed": False,
        # The queue is a folder polled for new files; a tenth of a second keeps a freed worker thread busy.
        "polling_interval": 0.1,
    }
else:
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": HEARTH_BATCH_VISIBILITY_TIMEOUT,
        # Scan for abandoned messages a few times per visibility window rather than every ~100 s.
        "unacked_restore_interval": max(1, min(10, HEARTH_BATCH_VISIBILITY_TIMEOUT // 4)),
        "unacked_restore_throttle": 1,
    }
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("HEARTH_BATCH_QUEUE", "hearth-batches")
CELERY_TASK_ACKS_LATE = True  # a message is acknowledged only once its item's result is stored
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Celery's Django fixup closes the database connection around every task unless it may reuse it; a worker
# thread keeps its connection (batches/tasks.py says how long, and drops a broken one), and the fixup then
# closes it only once every this many tasks.
CELERY_DB_REUSE_MAX = 1000
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")
CELERY_BEAT_SCHEDULE = {
    "hearth-batches-sweep": {"task": "batches.sweep", "schedule": float(env_int("HEARTH_BATCH_SWEEP_SECONDS", 30))},
    "hearth-batches-cleanup": {"task": "batches.cleanup", "schedule": 3600.0},
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT") or BASE_DIR / "staticfiles")
# Embedded mode serves static files from the ASGI app itself; production puts a web server or CDN in front.
HEARTH_SERVE_STATIC = env_bool("HEARTH_SERVE_STATIC", not PRODUCTION)

# Uploaded files (LoRA adapters) go through Django's default storage: the local filesystem under the data dir
# unless a deployment configures another backend in STORAGES (then several servers share one store).
MEDIA_ROOT = Path(os.environ.get("HEARTH_MEDIA_ROOT") or DATA_DIR / "media").expanduser()
MEDIA_URL = "/media/"  # never served: adapters are read by the engine, not downloaded

# Request bodies up to the Workers AI limit (10 MB); larger ones are answered 413 / 3006.
HEARTH_MAX_REQUEST_BYTES = env_int("HEARTH_MAX_REQUEST_BYTES", 10 * 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = HEARTH_MAX_REQUEST_BYTES

# Backpressure: an interactive request whose estimated wait for an engine slot is longer than this many seconds
# is refused at once (429, 3040, Retry-After) rather than queued; 0 turns the bound off. Batch items are never
# refused, only held back.
HEARTH_MAX_QUEUE_WAIT_S = float(os.environ.get("HEARTH_MAX_QUEUE_WAIT_S", "30"))

SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
if PRODUCTION:
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
    SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", True)
    CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", True)
    if env_bool("HEARTH_BEHIND_PROXY", False):
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # Health checks and metrics scrapes arrive on plain HTTP inside the cluster.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"controlplane": {"handlers": ["console"], "level": os.environ.get("HEARTH_LOG_LEVEL", "INFO")}},
}

# --- Hearth ---------------------------------------------------------------------------------------------
HEARTH_DATA_DIR = DATA_DIR
HEARTH_ENGINE = os.environ.get("HEARTH_ENGINE", "inprocess")
# Workers AI pricing: dollars = neurons x price per 1,000 neurons; a free daily allocation per account.
HEARTH_USD_PER_1K_NEURONS = Decimal(os.environ.get("HEARTH_USD_PER_1K_NEURONS", "0.011"))
HEARTH_DAILY_FREE_NEURONS = env_int("HEARTH_DAILY_FREE_NEURONS", 10_000)
# Per-key defaults when a key sets no limit of its own; 0 means unlimited.
HEARTH_DEFAULT_REQUESTS_PER_MINUTE = env_int("HEARTH_DEFAULT_REQUESTS_PER_MINUTE", 600)
HEARTH_DEFAULT_TOKENS_PER_MINUTE = env_int("HEARTH_DEFAULT_TOKENS_PER_MINUTE", 200_000)
# How long an API key lookup is cached; revoking or editing a key drops the cached entry at once.
HEARTH_KEY_CACHE_SECONDS = env_int("HEARTH_KEY_CACHE_SECONDS", 60)
# Optional bearer token for /metrics; empty: open (bind it to an internal network).
HEARTH_METRICS_TOKEN = os.environ.get("HEARTH_METRICS_TOKEN", "")

# --- Batches ----------------------------------------------------------------------------------------------
# `inprocess`: the ASGI app runs a Celery worker thread (and beat) next to the engine, so batch items share the
# engine with interactive traffic at the lower priority class; `off`: run `celery -A controlplane worker -B`.
HEARTH_BATCH_WORKER = os.environ.get("HEARTH_BATCH_WORKER", "inprocess" if HEARTH_ENGINE == "inprocess" else "off")
HEARTH_BATCH_BEAT = env_bool("HEARTH_BATCH_BEAT", True)  # the in-process worker also runs the periodic tasks
# Runs of items (messages, below) one worker process works on at once (its thread pool; each thread mostly
# waits on the engine), and the most items a single batch has dispatched at once.
HEARTH_BATCH_CONCURRENCY = env_int("HEARTH_BATCH_CONCURRENCY", 24)
HEARTH_BATCH_WINDOW = env_int("HEARTH_BATCH_WINDOW", 80)
# Items one broker message carries: a worker thread claims them in one statement, runs them on the engine
# together and stores those that finish together in one transaction (per item, that bookkeeping was most of the
# worker's CPU, which the embedded worker takes from the engine's steps).
HEARTH_BATCH_RUN_ITEMS = env_int("HEARTH_BATCH_RUN_ITEMS", 8)
# The engine-side cap on BATCH-priority sequences running at once (EngineConfig.max_batch_class_seqs) for
# models whose catalog engine settings do not set one; the other slots (8 of the default 64) stay free for
# interactive requests, whose prompts also hold batch decoding for a step (docs/architecture.md). A step costs
# little more at 56 sequences than at 48, so the cap is throughput: in the batch benchmark 48 gave the batch 84%
# of the engine's idle tokens/s and 56 gave 91%, with the same interactive TTFT (docs/benchmarks.md). The worker keeps more items in hand
# than the cap so a finished sequence is replaced at the next step.
HEARTH_BATCH_ENGINE_SEQS = env_int("HEARTH_BATCH_ENGINE_SEQS", 56)
HEARTH_KV_COMPRESSION = env_bool("HEARTH_KV_COMPRESSION", True)  # the server-wide KV compression switch
# A claimed item's lease; the worker renews it every third of this while the item runs.
HEARTH_BATCH_LEASE_SECONDS = env_int("HEARTH_BATCH_LEASE_SECONDS", 60)
# A dispatched item nobody claimed for this long is sent again (its message was lost).
HEARTH_BATCH_REDISPATCH_SECONDS = env_int("HEARTH_BATCH_REDISPATCH_SECONDS", 300)
# Runs of one item that ended without an answer (its worker died, an unexpected error) before it fails. Busy
# engines do not count: those items wait and retry for as long as it takes.
HEARTH_BATCH_MAX_ATTEMPTS = env_int("HEARTH_BATCH_MAX_ATTEMPTS", 5)
HEARTH_BATCH_MAX_REQUESTS = env_int("HEARTH_BATCH_MAX_REQUESTS", 50_000)
HEARTH_BATCH_MAX_FILE_BYTES = env_int("HEARTH_BATCH_MAX_FILE_BYTES", 100 * 1024 * 1024)
HEARTH_BATCH_DEFAULT_WINDOW_HOURS = env_int("HEARTH_BATCH_DEFAULT_WINDOW_HOURS", 24)
# Finished batches keep their results (items, output and error files) this long, then the cleanup task
# removes them.
HEARTH_BATCH_RETENTION_HOURS = env_int("HEARTH_BATCH_RETENTION_HOURS", 30 * 24)
# OpenAI Responses stored with store=true (the default) are kept this long, then removed by the periodic cleanup.
HEARTH_RESPONSES_RETENTION_HOURS = env_int("HEARTH_RESPONSES_RETENTION_HOURS", 30 * 24)
# Batch usage is billed at this discount (percent off neurons) unless the model's price row sets its own.
HEARTH_BATCH_DISCOUNT_PERCENT = Decimal(os.environ.get("HEARTH_BATCH_DISCOUNT_PERCENT", "0"))

# --- LoRA adapters ----------------------------------------------------------------------------------------
# Both files of an adapter together (an upload past it is cut off while streaming: 413 / 3006), and how many
# adapters one account may keep (Workers AI's limits: 300 MB, 30).
HEARTH_LORA_MAX_BYTES = env_int("HEARTH_LORA_MAX_BYTES", 300 * 1024 * 1024)
HEARTH_LORA_MAX_PER_ACCOUNT = env_int("HEARTH_LORA_MAX_PER_ACCOUNT", 30)
