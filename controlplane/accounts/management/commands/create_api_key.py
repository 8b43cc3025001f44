"""Create an API key (and its account when missing); the key is the last line printed."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import expiry_from_days, get_or_create_account, issue_key
from controlplane.api.errors import ApiError


class Command(BaseCommand):
    help = "Create an API key for an account (created if it does not exist). Prints the key last, once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--account", required=True, help="Account name")
        parser.add_argument("--name", default="default", help="Key name")
        parser.add_argument("--models", nargs="*", default=[], metavar="M",
                            help="Model names the key may use (default: every model)")
        parser.add_argument("--permission", choices=[p.value for p in ApiKey.Permission], default="run")
        parser.add_argument("--expires-days", type=float, default=None, help="Expire after this many days")
        parser.add_argument("--requests-per-minute", type=int, default=None)
        parser.add_argument("--tokens-per-minute", type=int, default=None)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            account, created = get_or_create_account(options["account"])
            _, secret = issue_key(
                account, name=options["name"], permission=options["permission"], allowed_models=options["models"],
                expires_at=expiry_from_days(options["expires_days"]),
                requests_per_minute=options["requests_per_minute"], tokens_per_minute=options["tokens_per_minute"])
        except ApiError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"{'Created' if created else 'Using'} account {account.name}")
        self.stdout.write(f"Account id: {account.pk}")
        self.stdout.write("API key (shown once, store it now):")
        self.stdout.write(secret)
