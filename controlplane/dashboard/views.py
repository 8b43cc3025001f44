"""Dashboard pages. They parse forms and delegate: reads and writes go through the same services as the API."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from controlplane.accounts.models import Account, ApiKey
from controlplane.accounts.services import (
    accounts_for_user,
    expiry_from_days,
    issue_key,
    key_id_or_404,
    revoke_key,
    user_can_access,
)
from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.dashboard import stats
from controlplane.dashboard.access import account_or_404

MAX_EXPIRY_DAYS = 36_500


@login_required
def home(request: HttpRequest) -> HttpResponse:
    accounts = accounts_for_user(request.user)
    if not accounts:
        return render(request, "dashboard/no_account.html", status=200)
    return redirect("dashboard-overview", account_id=accounts[0].pk)


@login_required
def overview(request: HttpRequest, account_id: str) -> HttpResponse:
    account, accounts = account_or_404(request, account_id)
    return render(request, "dashboard/overview.html", {
        "account": account, "accounts": accounts, "page": "overview",
        "snapshot": stats.overview(account, timezone.now())})


@login_required
@require_http_methods(["GET", "POST"])
def keys(request: HttpRequest, account_id: str) -> HttpResponse:
    """The account's API keys. Owners and operators create and revoke; a new key's secret is shown once, in
    the response to its creation, and exists nowhere else afterwards."""
    account, accounts = account_or_404(request, account_id)
    manage = user_can_access(request.user, account_id, manage=True)
    context: dict = {"account": account, "accounts": accounts, "page": "keys", "manage": manage}
    status = 200
    if request.method == "POST":
        if not manage:
            return render(request, "dashboard/keys.html", {**context, "error": "Only the account's owners can "
                          "change its keys.", "keys": _keys(account)}, status=403)
        try:
            if request.POST.get("action") == "revoke":
                revoke_key(account.pk, key_id_or_404(request.POST.get("key_id", "")))
                return redirect("dashboard-keys", account_id=account.pk)
            context["created"] = _create_key(request, account)
        except ApiError as exc:
            context["error"], status = exc.message, exc.status
    return render(request, "dashboard/keys.html", {**context, "keys": _keys(account),
                                                   "permissions": ApiKey.Permission.choices}, status=status)


def _create_key(request: HttpRequest, account: Account) -> dict:
    days = request.POST.get("expires_days", "").strip()
    try:
        number = float(days) if days else None
    except ValueError:
        number = float("nan")
    if number is not None and not 0 < number <= MAX_EXPIRY_DAYS:  # NaN fails every comparison
        raise errors.invalid(f"Expiry must be a number of days between 0 and {MAX_EXPIRY_DAYS:,}", "expires_days")
    key, secret = issue_key(account, name=request.POST.get("name", ""), permission=request.POST.get(
        "permission", ApiKey.Permission.RUN), expires_at=expiry_from_days(number), created_by=request.user)
    return {"key": key, "secret": secret}


def _keys(account: Account) -> list[ApiKey]:
    return list(ApiKey.objects.filter(account=account).order_by("revoked_at", "-created_at"))
