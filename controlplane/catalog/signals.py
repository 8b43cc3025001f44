"""Any catalog or price change, from a service, the admin or a shell, drops the cached catalog snapshot."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from controlplane.catalog.models import AiModel, Price
from controlplane.catalog.services import invalidate


@receiver([post_save, post_delete], sender=AiModel)
@receiver([post_save, post_delete], sender=Price)
def _catalog_changed(sender: type, **kwargs: Any) -> None:
    # Now (this process reads its own writes) and again after commit (so no other process caches the
    # pre-commit state it may have read in between).
    invalidate()
    transaction.on_commit(invalidate)
