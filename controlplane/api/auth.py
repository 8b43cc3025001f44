"""Who is calling: an API key (`Authorization: Bearer`), or for management routes a signed-in user.

Every account-scoped route calls `require_account`, so a key can never touch another account's data: the
account in the path must be the key's own, otherwise 403 (whether or not that account exists).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest
from django.middleware.csrf import CsrfViewMiddleware

from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import KeyContext, authenticate_key, parse_bearer, user_can_access
from controlplane.api import errors


def key_context(request: HttpRequest) -> KeyContext:
    return authenticate_key(parse_bearer(request.headers.get("Authorization")))


def require_account(ctx: KeyContext, account_id: str | None) -> None:
    if account_id is not None and account_id != ctx.account_id:
        raise errors.forbidden("This API key does not belong to that account")


def require_permission(ctx: KeyContext, permission: str) -> None:
    if not ctx.can(permission):
        raise errors.forbidden(f"This API key is {ctx.permission}-only; the route needs {str(permission)!r} permission")


class _CsrfCheck(CsrfViewMiddleware):
    def _reject(self, request: HttpRequest, reason: str) -> str:  # type: ignore[override]
        return reason


@dataclass(frozen=True, slots=True)
class Principal:
    key: KeyContext | None
    user: Any | None

    def require(self, account_id: str, permission: str) -> None:
        if self.key is not None:
            require_account(self.key, account_id)
            require_permission(self.key, permission)
            return
        manage = permission == ApiKey.Permission.ADMIN
        if not user_can_access(self.user, account_id, manage=manage):
            raise errors.forbidden("You are not a member of that account" if not manage
                                   else "Only the account's owners (or operators) can do that")


def principal(request: HttpRequest) -> Principal:
    """A key when the request carries one; else the session user (with CSRF enforced on writes); else 401."""
    if request.headers.get("Authorization"):
        return Principal(key=key_context(request), user=None)
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            reason = _CsrfCheck(lambda r: None).process_view(request, None, (), {})
            if reason:
                raise errors.forbidden(f"CSRF check failed: {reason}")
        return Principal(key=None, user=user)
    raise errors.unauthorized("Missing API key: send `Authorization: Bearer <key>`")
