from __future__ import annotations

from django.contrib import admin, messages
from django.http import HttpRequest

from controlplane.accounts.models import Account, ApiKey, Membership
from controlplane.accounts.services import issue_key


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ["name", "id", "paid_plan", "daily_free_neurons", "monthly_budget_usd", "is_active", "created_at"]
    list_filter = ["paid_plan", "is_active"]
    search_fields = ["name", "id"]
    readonly_fields = ["id", "created_at"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["account", "user", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["account__name", "user__username"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "account", "permission", "status", "expires_at", "last_used_at", "created_at"]
    list_filter = ["permission", "account"]
    search_fields = ["name", "prefix", "account__name"]
    readonly_fields = ["prefix", "last_used_at", "created_at", "created_by"]
    actions = ["revoke"]

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        # New keys go through the service so the secret is generated, hashed and shown exactly once.
        key, secret = issue_key(
            obj.account, name=obj.name, permission=obj.permission, allowed_models=obj.allowed_models,
            expires_at=obj.expires_at, requests_per_minute=obj.requests_per_minute,
            tokens_per_minute=obj.tokens_per_minute, created_by=request.user)
        obj.pk = key.pk
        obj.prefix = key.prefix
        obj.secret_hash = key.secret_hash
        obj.created_at = key.created_at
        messages.warning(request, f"API key created: {secret} — copy it now, it is not shown again.")

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request: HttpRequest, queryset) -> None:
        from django.utils import timezone

        for key in queryset.filter(revoked_at__isnull=True):
            key.revoked_at = timezone.now()
            key.save(update_fields=["revoked_at"])
