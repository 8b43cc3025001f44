"""Accounts and API keys over REST (Cloudflare-style envelopes), for the dashboard and for automation."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils.dateparse import parse_datetime

from controlplane.accounts import services
from controlplane.accounts.models import Account, ApiKey
from controlplane.accounts.schemas import KeyCreate
from controlplane.api import errors
from controlplane.api.auth import principal
from controlplane.api.body import parse
from controlplane.api.http import api_view, envelope, json_response, read_json


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def key_json(key: ApiKey) -> dict[str, Any]:
    return {
        "id": str(key.pk), "name": key.name, "prefix": key.prefix, "status": key.status,
        "permission": key.permission, "models": key.allowed_models,
        "requests_per_minute": key.requests_per_minute, "tokens_per_minute": key.tokens_per_minute,
        "expires_on": _iso(key.expires_at), "revoked_on": _iso(key.revoked_at),
        "last_used_on": _iso(key.last_used_at), "created_on": _iso(key.created_at),
    }




@api_view("native", ("GET",))
def list_accounts(request: HttpRequest) -> HttpResponse:
    who = principal(request)
    if who.key is not None:
        accounts = list(Account.objects.filter(pk=who.key.account_id))
    else:
        accounts = services.accounts_for_user(who.user)
    result = [{"id": a.pk, "name": a.name, "type": "standard", "created_on": _iso(a.created_at),
               "settings": {"paid_plan": a.paid_plan}} for a in accounts]
    info = {"page": 1, "per_page": len(result), "count": len(result), "total_count": len(result)}
    return json_response(envelope(result, result_info=info))


@api_view("native", ("GET", "POST"))
def keys(request: HttpRequest, account_id: str) -> HttpResponse:
    who = principal(request)
    if request.method == "GET":
        who.require(account_id, ApiKey.Permission.ADMIN if who.key else ApiKey.Permission.READ)
        rows = ApiKey.objects.filter(account_id=account_id)
        return json_response(envelope([key_json(k) for k in rows]))
    who.require(account_id, ApiKey.Permission.ADMIN)
    body = parse(KeyCreate, read_json(request))
    expires = None
    if body.expires_on:
        try:
            expires = parse_datetime(body.expires_on)
        except ValueError:  # well formed but impossible, such as February 30th
            expires = None
        if expires is None or expires.tzinfo is None:
            raise errors.invalid("expires_on must be an ISO 8601 time with a timezone", "expires_on")
    account = Account.objects.get(pk=account_id)
    key, secret = services.issue_key(
        account, name=body.name, permission=body.permission, allowed_models=body.models, expires_at=expires,
        requests_per_minute=body.requests_per_minute, tokens_per_minute=body.tokens_per_minute,
        created_by=who.user)
    return json_response(envelope({**key_json(key), "value": secret},
                                  messages=["Store the key now: its secret is not shown again."]), status=201)


@api_view("native", ("GET", "DELETE"))
def key_detail(request: HttpRequest, account_id: str, key_id: str) -> HttpResponse:
    who = principal(request)
    if request.method == "GET":
        who.require(account_id, ApiKey.Permission.ADMIN if who.key else ApiKey.Permission.READ)
        key = ApiKey.objects.filter(account_id=account_id, pk=services.key_id_or_404(key_id)).first()
        if key is None:
            raise errors.not_found(f"no API key {key_id} in this account")
        return json_response(envelope(key_json(key)))
    who.require(account_id, ApiKey.Permission.ADMIN)
    key = services.revoke_key(account_id, services.key_id_or_404(key_id))
    return json_response(envelope(key_json(key)))


