from __future__ import annotations

from django.contrib import admin

from controlplane.serving.models import StoredResponse


@admin.register(StoredResponse)
class StoredResponseAdmin(admin.ModelAdmin):
    """Stored Responses are written by the API and its workers only; the admin shows them."""

    list_display = ["id", "account", "model", "status", "background", "created_at", "expires_at"]
    list_filter = ["status", "background"]
    search_fields = ["id", "account__name", "previous_response_id"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
