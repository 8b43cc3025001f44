from __future__ import annotations

from django.contrib import admin

from controlplane.batches.models import Batch, File, Item


class ReadOnlyAdmin(admin.ModelAdmin):
    """Batches are written by the API and the workers only; the admin shows them."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    list_display = ["id", "account", "api", "endpoint", "model", "status", "total_count", "completed_count",
                    "failed_count", "created_at", "expires_at"]
    list_filter = ["status", "api"]
    search_fields = ["id", "account__name"]
    date_hierarchy = "created_at"


@admin.register(Item)
class ItemAdmin(ReadOnlyAdmin):
    list_display = ["batch", "index", "custom_id", "model", "status", "attempts", "input_tokens", "output_tokens",
                    "finished_at"]
    list_filter = ["status"]
    search_fields = ["batch__id", "custom_id"]


@admin.register(File)
class FileAdmin(ReadOnlyAdmin):
    list_display = ["id", "account", "purpose", "filename", "bytes", "created_at", "expires_at"]
    list_filter = ["purpose"]
    search_fields = ["id", "filename"]
    exclude = ["content"]
