"""Cached key contexts are dropped whenever a key or its account changes, however the change was made."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from controlplane.accounts.models import Account, ApiKey
from controlplane.accounts.services import forget_account_keys, forget_key


@receiver([post_save, post_delete], sender=ApiKey)
def _key_changed(sender: type, instance: ApiKey, **kwargs: Any) -> None:
    forget_key(instance.prefix)


@receiver(post_save, sender=Account)
def _account_changed(sender: type, instance: Account, **kwargs: Any) -> None:
    forget_account_keys(instance.pk)
