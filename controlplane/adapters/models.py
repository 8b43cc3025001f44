"""LoRA adapters an account uploaded (Workers AI "finetunes") and their two stored files.

An adapter is `pending` until both files are stored and the pair has passed `inference.lora.format.
inspect_adapter` against its base model; then it is `ready` and carries what the check found (rank, alpha, ...).
Files are immutable once stored: a second upload of the same file is refused, so the sha256 recorded here is the
identity of what the engine loads.
"""

from __future__ import annotations

import uuid

from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from controlplane.accounts.models import Account
from inference.lora.format import CONFIG_FILE, WEIGHTS_FILE

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


def new_adapter_id() -> str:
    return uuid.uuid4().hex


class Adapter(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "Pending (files missing)"
        READY = "ready", "Ready"

    id = models.CharField(primary_key=True, max_length=32, default=new_adapter_id, editable=False)
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=100, validators=[RegexValidator(NAME_PATTERN)])
    base_model = models.CharField(max_length=200, help_text="The catalog model the adapter was made for.")
    description = models.TextField(blank=True, default="")
    public = models.BooleanField(
        default=False, help_text="Published by an operator: every account can see and use it.")
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    # What inspect_adapter found; empty until the adapter is ready.
    rank = models.PositiveIntegerField(null=True, blank=True)
    alpha = models.FloatField(null=True, blank=True)
    scaling = models.FloatField(null=True, blank=True)
    target_modules = models.JSONField(default=list, blank=True)
    num_layers = models.PositiveIntegerField(null=True, blank=True, help_text="Layers it has weights for.")
    dtype = models.CharField(max_length=32, blank=True, default="")
    size_bytes = models.BigIntegerField(default=0, help_text="Both files together.")
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["account", "name"], name="unique_adapter_name")]
        indexes = [models.Index(fields=["account", "-created_at"]),
                   models.Index(fields=["public", "-created_at"])]
        verbose_name = "LoRA adapter"

    def __str__(self) -> str:
        return f"{self.name} ({self.base_model})"

    @property
    def ready(self) -> bool:
        return self.status == self.Status.READY


class AdapterFile(models.Model):
    class Kind(models.TextChoices):
        CONFIG = "config", CONFIG_FILE
        WEIGHTS = "weights", WEIGHTS_FILE

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="files")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    file_name = models.CharField(max_length=64)  # CONFIG_FILE or WEIGHTS_FILE, never the client's name
    storage_name = models.CharField(max_length=255)  # adapters/<account>/<adapter>/<file_name>
    size_bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["kind"]
        constraints = [models.UniqueConstraint(fields=["adapter", "kind"], name="unique_adapter_file")]

    def __str__(self) -> str:
        return f"{self.adapter_id}/{self.file_name}"
