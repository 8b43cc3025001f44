"""Account and API-key operations. Views and commands call these; nothing else writes these tables.

Keys look like `hth_<12-char prefix><40-char secret>`. Only a SHA-256 of the whole key is stored: the keys are
random (238 bits), so a slow password hash would add latency to every request without adding safety. The
prefix finds the row; the hash comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from controlplane.accounts.models import Account, ApiKey, Membership
from controlplane.api import errors

KEY_PREFIX = "hth_"
_ALPHABET = string.ascii_lowercase + string.digits
_PUBLIC_LEN = 12
_SECRET_LEN = 40
KEY_LENGTH = len(KEY_PREFIX) + _PUBLIC_LEN + _SECRET_LEN
# Re-writing last_used_at on every request would make every read a write; once a minute is plenty.
LAST_USED_RESOLUTION_S = 60.0

_PERMISSION_RANK = {ApiKey.Permission.READ: 0, ApiKey.Permission.RUN: 1, ApiKey.Permission.ADMIN: 2}


@dataclass(frozen=True, slots=True)
class KeyContext:
    """What a request learns about its key: enough to authorise, meter and limit without touching the DB."""

    key_id: str
    key_name: str
    prefix: str
    account_id: str
    account_name: str
    permission: str
    allowed_models: tuple[str, ...]
    requests_per_minute: int  # 0: unlimited
    tokens_per_minute: int  # 0: unlimited
    expires_at: float | None  # unix time
    paid_plan: bool
    free_neurons_per_day: int
    monthly_budget_usd: Decimal | None

    def can(self, permission: str) -> bool:
        return _PERMISSION_RANK[self.permission] >= _PERMISSION_RANK[permission]

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


def _hash(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def _cache_key(prefix: str) -> str:
    return f"apikey:{prefix}"


def forget_key(prefix: str) -> None:
    cache.delete(_cache_key(prefix))


def forget_account_keys(account_id: str) -> None:
    prefixes = ApiKey.objects.filter(account_id=account_id).values_list("prefix", flat=True)
    cache.delete_many([_cache_key(p) for p in prefixes])


def create_account(name: str, *, owner=None, paid_plan: bool = False) -> Account:
    name = name.strip()
    if not name:
        raise errors.invalid("account name must not be empty", "name")
    with transaction.atomic():
        account = Account.objects.create(name=name, paid_plan=paid_plan)
        if owner is not None:
            Membership.objects.create(account=account, user=owner, role=Membership.Role.OWNER)
    return account


def get_or_create_account(name: str) -> tuple[Account, bool]:
    existing = Account.objects.filter(name=name.strip()).first()
    if existing is not None:
        return existing, False
    return create_account(name), True


def _new_secret() -> tuple[str, str]:
    public = "".join(secrets.choice(_ALPHABET) for _ in range(_PUBLIC_LEN))
    secret = "".join(secrets.choice(_ALPHABET) for _ in range(_SECRET_LEN))
    return public, f"{KEY_PREFIX}{public}{secret}"


def issue_key(account: Account, *, name: str = "default", permission: str = ApiKey.Permission.RUN,
              allowed_models: Iterable[str] = (), expires_at: datetime | None = None,
              requests_per_minute: int | None = None, tokens_per_minute: int | None = None,
              created_by=None) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the secret, which exists nowhere else afterwards."""
    if permission not in _PERMISSION_RANK:
        raise errors.invalid(f"permission must be one of {sorted(_PERMISSION_RANK)}", "permission")
    name = name.strip() or "default"
    if len(name) > ApiKey._meta.get_field("name").max_length:
        raise errors.invalid("name must be at most 100 characters", "name")
    models = sorted(set(allowed_models))
    if expires_at is not None and expires_at <= timezone.now():
        raise errors.invalid("expires_on must be in the future", "expires_on")
    for prefix_attempt in range(5):
        public, raw = _new_secret()
        if not ApiKey.objects.filter(prefix=public).exists():
            break
        if prefix_attempt == 4:
            raise errors.internal("could not allocate a unique key prefix")
    key = ApiKey.objects.create(
        account=account, name=name, prefix=public, secret_hash=_hash(raw),
        permission=permission, allowed_models=models, expires_at=expires_at,
        requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute, created_by=created_by)
    return key, raw


def key_id_or_404(value: str) -> str:
    """A key id from a URL or form: a malformed one names no key (404), it is not a server error."""
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise errors.not_found(f"no API key {value} in this account") from None


def revoke_key(account_id: str, key_id: str) -> ApiKey:
    """Revoke one of the account's keys; another account's key id is simply not found."""
    key = ApiKey.objects.filter(account_id=account_id, pk=key_id).first()
    if key is None:
        raise errors.not_found(f"no API key {key_id} in this account")
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
    forget_key(key.prefix)
    return key


def _context_from_row(key: ApiKey) -> KeyContext:
    account = key.account

    def limit(own: int | None, default: int) -> int:
        return int(default if own is None else own)

    return KeyContext(
        key_id=str(key.pk), key_name=key.name, prefix=key.prefix, account_id=account.pk,
        account_name=account.name, permission=key.permission, allowed_models=tuple(key.allowed_models or ()),
        requests_per_minute=limit(key.requests_per_minute, settings.HEARTH_DEFAULT_REQUESTS_PER_MINUTE),
        tokens_per_minute=limit(key.tokens_per_minute, settings.HEARTH_DEFAULT_TOKENS_PER_MINUTE),
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
        paid_plan=account.paid_plan, free_neurons_per_day=account.free_neurons_per_day,
        monthly_budget_usd=account.monthly_budget_usd)


def parse_bearer(header: str | None) -> str:
    if not header:
        raise errors.unauthorized("Missing API key: send `Authorization: Bearer <key>`")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise errors.unauthorized("Malformed Authorization header: expected `Bearer <key>`")
    return value.strip()


def _split(raw_key: str) -> tuple[str, str]:
    if len(raw_key) != KEY_LENGTH or not raw_key.startswith(KEY_PREFIX):
        raise errors.unauthorized("Invalid API key")
    return raw_key[len(KEY_PREFIX):len(KEY_PREFIX) + _PUBLIC_LEN], _hash(raw_key)


def authenticate_key_cached(raw_key: str) -> KeyContext | None:
    """The fast path for async views: the key's context from the cache alone, or None when answering needs the
    database (not cached yet, or last_used_at is due for its once-a-minute write). Safe on the event loop."""
    prefix, digest = _split(raw_key)
    cached = cache.get(_cache_key(prefix))
    if cached is None:
        return None
    secret_hash, context, last_used = cached
    if not hmac.compare_digest(secret_hash, digest):
        raise errors.unauthorized("Invalid API key")
    now = time.time()
    if context.expires_at is not None and context.expires_at <= now:
        raise errors.unauthorized("This API key has expired")
    return context if now - last_used < LAST_USED_RESOLUTION_S else None


def authenticate_key(raw_key: str) -> KeyContext:
    """The context of a valid, unexpired, unrevoked key of an active account; 401 otherwise."""
    prefix, digest = _split(raw_key)
    cached = cache.get(_cache_key(prefix))
    if cached is None:
        key = ApiKey.objects.select_related("account").filter(prefix=prefix).first()
        if key is None:
            raise errors.unauthorized("Invalid API key")
        if key.revoked_at is not None:
            raise errors.unauthorized("This API key has been revoked")
        if not key.account.is_active:
            raise errors.unauthorized("This API key's account is disabled")
        last_used = key.last_used_at.timestamp() if key.last_used_at else 0.0
        cached = (key.secret_hash, _context_from_row(key), last_used)
        cache.set(_cache_key(prefix), cached, settings.HEARTH_KEY_CACHE_SECONDS)
    secret_hash, context, last_used = cached
    if not hmac.compare_digest(secret_hash, digest):
        raise errors.unauthorized("Invalid API key")
    now = timezone.now()
    if context.expires_at is not None and context.expires_at <= now.timestamp():
        raise errors.unauthorized("This API key has expired")
    if now.timestamp() - last_used >= LAST_USED_RESOLUTION_S:
        ApiKey.objects.filter(pk=context.key_id).update(last_used_at=now)
        cache.set(_cache_key(prefix), (secret_hash, context, now.timestamp()), settings.HEARTH_KEY_CACHE_SECONDS)
    return context


def accounts_for_user(user) -> list[Account]:
    if user.is_staff:
        return list(Account.objects.all())
    return list(Account.objects.filter(memberships__user=user))


def user_can_access(user, account_id: str, *, manage: bool = False) -> bool:
    if user.is_staff:
        return Account.objects.filter(pk=account_id).exists()
    memberships = Membership.objects.filter(user=user, account_id=account_id)
    if manage:
        memberships = memberships.filter(role=Membership.Role.OWNER)
    return memberships.exists()


def expiry_from_days(days: float | None) -> datetime | None:
    return timezone.now() + timedelta(days=days) if days else None
