from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks


def metrics_token_check(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """/metrics names models, accounts' traffic and engine load: in production it wants a bearer token."""
    if settings.DEBUG or settings.HEARTH_METRICS_TOKEN:
        return []
    return [checks.Warning("/metrics is open to anyone who can reach the server: set HEARTH_METRICS_TOKEN "
                           "(Prometheus then sends it as a bearer token)", id="hearth.W001")]


class ServingConfig(AppConfig):
    name = "controlplane.serving"
    label = "serving"
    verbose_name = "Inference APIs"

    def ready(self) -> None:
        checks.register(metrics_token_check, checks.Tags.security, deploy=True)
