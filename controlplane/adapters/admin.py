"""Operators see every adapter and publish one to all accounts (`public`); files are uploaded through the API
only, and deleting here removes the stored files as the API does."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.adapters import services
from controlplane.adapters.models import Adapter, AdapterFile


class AdapterFileInline(admin.TabularInline):
    model = AdapterFile
    extra = 0
    can_delete = False
    fields = readonly_fields = ["file_name", "size_bytes", "sha256", "storage_name", "created_at"]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    list_display = ["name", "account", "base_model", "status", "public", "rank", "size_bytes", "created_at"]
    list_filter = ["status", "public", "base_model"]
    search_fields = ["id", "name", "account__name"]
    date_hierarchy = "created_at"
    fields = ["id", "account", "name", "base_model", "description", "public", "status", "rank", "alpha",
              "scaling", "target_modules", "num_layers", "dtype", "size_bytes", "created_at", "updated_at"]
    # Everything but `public` comes from the upload and its validation.
    readonly_fields = [f for f in fields if f != "public"]
    inlines = [AdapterFileInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Adapter, form: Any, change: bool) -> None:
        services.set_public(obj.pk, obj.public)

    def delete_model(self, request: HttpRequest, obj: Adapter) -> None:
        services.delete_adapter(obj.account_id, obj.pk)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Adapter]) -> None:
        for adapter in queryset:
            services.delete_adapter(adapter.account_id, adapter.pk)

