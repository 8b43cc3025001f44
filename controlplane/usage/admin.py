from __future__ import annotations

from django.contrib import admin

from controlplane.usage.models import UsageDay, UsageEvent, UsageMinute


class ReadOnlyAdmin(admin.ModelAdmin):
    """Metering is written by the API only; the admin shows it."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(UsageEvent)
class UsageEventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "account", "model", "route", "status", "input_tokens", "cached_input_tokens",
                    "output_tokens", "spec_proposed", "spec_accepted", "neurons", "cost_usd", "latency_ms"]
    list_filter = ["status", "route", "source", "model"]
    search_fields = ["request_id", "account__name", "session_affinity"]
    date_hierarchy = "created_at"


@admin.register(UsageMinute)
class UsageMinuteAdmin(ReadOnlyAdmin):
    list_display = ["minute", "account", "model", "key_id", "requests", "errors", "neurons", "cost_usd"]
    list_filter = ["model"]


@admin.register(UsageDay)
class UsageDayAdmin(ReadOnlyAdmin):
    list_display = ["day", "account", "model", "key_id", "requests", "errors", "neurons", "cost_usd"]
    list_filter = ["model"]
