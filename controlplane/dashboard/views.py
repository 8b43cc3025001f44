"""Dashboard pages. They render from the same service reads as the API and the WebSocket; nothing here writes."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone

from controlplane.accounts.models import Account
from controlplane.accounts.services import accounts_for_user, user_can_access
from controlplane.dashboard import stats


def _account(request: HttpRequest, account_id: str) -> tuple[Account, list[Account]]:
    """The account being looked at, if the user may see it (else 404: its existence is not the user's business),
    and the accounts the switcher offers."""
    if not user_can_access(request.user, account_id):
        raise Http404("No such account")
    return Account.objects.get(pk=account_id), accounts_for_user(request.user)


@login_required
def home(request: HttpRequest) -> HttpResponse:
    accounts = accounts_for_user(request.user)
    if not accounts:
        return render(request, "dashboard/no_account.html", status=200)
    return redirect("dashboard-overview", account_id=accounts[0].pk)


@login_required
def overview(request: HttpRequest, account_id: str) -> HttpResponse:
    account, accounts = _account(request, account_id)
    return render(request, "dashboard/overview.html", {
        "account": account, "accounts": accounts, "page": "overview",
        "snapshot": stats.overview(account, timezone.now())})
