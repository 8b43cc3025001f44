"""An operator (admin) user and a demo account with an API key, each printed once (idempotent)."""

from __future__ import annotations

import os
import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from controlplane.accounts.models import ApiKey, Membership
from controlplane.accounts.services import get_or_create_account, issue_key

ADMIN_USERNAME = "admin"
DEMO_ACCOUNT = "demo"
DEMO_KEY_NAME = "demo"


class Command(BaseCommand):
    help = ("Create the admin user (password from HEARTH_ADMIN_PASSWORD or generated) and a demo account with "
            "an API key. Re-running prints nothing secret again.")

    def handle(self, *args: Any, **options: Any) -> None:
        User = get_user_model()
        password = os.environ.get("HEARTH_ADMIN_PASSWORD", "")
        user = User.objects.filter(username=ADMIN_USERNAME).first()
        if user is None:
            generated = not password
            password = password or secrets.token_urlsafe(12)
            user = User.objects.create_superuser(ADMIN_USERNAME, email="", password=password)
            self.stdout.write(f"Admin user: {ADMIN_USERNAME}")
            self.stdout.write(f"Admin password: {password}" if generated
                              else "Admin password: the value of HEARTH_ADMIN_PASSWORD")
        elif password:
            user.set_password(password)
            user.save(update_fields=["password"])
            self.stdout.write(f"Admin user: {ADMIN_USERNAME} (password set from HEARTH_ADMIN_PASSWORD)")
        else:
            self.stdout.write(f"Admin user: {ADMIN_USERNAME} exists; its password was printed when it was "
                              "created (set HEARTH_ADMIN_PASSWORD and re-run to change it)")

        account, _ = get_or_create_account(DEMO_ACCOUNT)
        Membership.objects.get_or_create(account=account, user=user, defaults={"role": Membership.Role.OWNER})
        self.stdout.write(f"Demo account: {account.name} (id {account.pk})")
        existing = ApiKey.objects.filter(account=account, name=DEMO_KEY_NAME).order_by("created_at").first()
        if existing is not None:
            self.stdout.write(
                f"Demo API key {existing.prefix}… was created {existing.created_at:%Y-%m-%d %H:%M} UTC and printed "
                "then. Make another with: python manage.py create_api_key --account demo --name another")
            return
        _, secret = issue_key(account, name=DEMO_KEY_NAME, permission=ApiKey.Permission.ADMIN)
        self.stdout.write("Demo API key (shown once, store it now):")
        self.stdout.write(secret)
