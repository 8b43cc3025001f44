"""Seed the catalog from the models installed in the data dir (idempotent)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from controlplane.catalog.services import seed
from inference.models.catalog import INSTALL_HINT, installed_models


class Command(BaseCommand):
    help = "Add or refresh catalog entries (with default prices) for every installed bundled model."

    def handle(self, *args: Any, **options: Any) -> None:
        models = installed_models()
        if not models:
            self.stderr.write(f"No bundled model is installed: {INSTALL_HINT}")
        seed(models, log=lambda line: self.stdout.write(line))
        self.stdout.write(self.style.SUCCESS(f"catalog: {len(models)} installed model(s)"))
