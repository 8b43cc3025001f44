"""Tenants, their members and their API keys."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


def new_account_id() -> str:
    # Cloudflare account ids are 32 lowercase hex characters; keeping that shape lets Workers AI clients
    # that validate ids accept ours.
    return uuid.uuid4().hex


class Account(models.Model):
    id = models.CharField(primary_key=True, max_length=32, default=new_account_id, editable=False)
    name = models.CharField(max_length=100, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership", related_name="accounts")
    paid_plan = models.BooleanField(
        default=False, help_text="Paid accounts are not stopped at the daily free allocation.")
    daily_free_neurons = models.PositiveIntegerField(
        null=True, blank=True, help_text="Overrides HEARTH_DAILY_FREE_NEURONS for this account.")
    monthly_budget_usd = models.DecimalField(
        max_digits=12, decimal_places=4, null=True, blank=True,
        help_text="Hard budget: requests are refused once this calendar month's cost (UTC) reaches it.")
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def free_neurons_per_day(self) -> int:
        if self.daily_free_neurons is not None:
            return self.daily_free_neurons
        return int(settings.HEARTH_DAILY_FREE_NEURONS)


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        MEMBER = "member", "Member"

    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["account", "user"], name="unique_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.account} ({self.role})"


class ApiKey(models.Model):
    class Permission(models.TextChoices):
        READ = "read", "Read only (catalog, usage)"
        RUN = "run", "Run models (and read)"
        ADMIN = "admin", "Run, read and manage the account's keys"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, default="default")
    # The public part of the key, shown in listings and used to find the row; the secret is never stored.
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False)
    permission = models.CharField(max_length=8, choices=Permission.choices, default=Permission.RUN)
    allowed_models = models.JSONField(
        default=list, blank=True, help_text="Model names this key may use; empty means every model.")
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: HEARTH_DEFAULT_REQUESTS_PER_MINUTE; 0: unlimited.")
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: HEARTH_DEFAULT_TOKENS_PER_MINUTE; 0: unlimited.")
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def status(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"
