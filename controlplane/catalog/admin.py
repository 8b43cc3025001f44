from __future__ import annotations

from django.contrib import admin
from django.utils import timezone

from controlplane.catalog.models import AiModel, Price


class PriceInline(admin.TabularInline):
    model = Price
    extra = 1
    fields = ["effective_at", "neurons_per_m_input", "neurons_per_m_cached_input", "neurons_per_m_output",
              "usd_per_1k_neurons", "batch_discount_percent", "note"]

    def has_delete_permission(self, request, obj=None) -> bool:
        # Usage events point at the prices they were charged at; only future prices may be withdrawn.
        return False


@admin.register(AiModel)
class AiModelAdmin(admin.ModelAdmin):
    list_display = ["name", "task", "context_window", "supports_lora", "supports_batch", "installed", "is_active",
                    "deprecated_on"]
    list_filter = ["task", "installed", "is_active", "supports_lora"]
    search_fields = ["name", "description"]
    inlines = [PriceInline]


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    list_display = ["model", "effective_at", "neurons_per_m_input", "neurons_per_m_cached_input",
                    "neurons_per_m_output", "usd_per_1k_neurons", "batch_discount_percent", "note"]
    list_filter = ["model"]

    def get_readonly_fields(self, request, obj=None):
        if obj is not None and obj.effective_at <= timezone.now():
            return [f.name for f in Price._meta.fields]
        return []

    def has_delete_permission(self, request, obj=None) -> bool:
        return obj is None or obj.effective_at > timezone.now()
