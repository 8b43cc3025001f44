"""Which account a dashboard page shows, and whether the signed-in user may see it."""

from __future__ import annotations

from django.http import Http404, HttpRequest

from controlplane.accounts.models import Account
from controlplane.accounts.services import accounts_for_user, user_can_access


def account_or_404(request: HttpRequest, account_id: str) -> tuple[Account, list[Account]]:
    """The account being looked at, if the user may see it (else 404: its existence is not the user's business),
    and the accounts the switcher offers."""
    if not user_can_access(request.user, account_id):
        raise Http404("No such account")
    return Account.objects.get(pk=account_id), accounts_for_user(request.user)
