"""Batches: one row per batch, one per request item (the unit of work and of idempotency), and the files of
the OpenAI surface (uploaded inputs, generated output and error files).

An item's life: queued -> (dispatched: a task message exists) -> running under a claim (token + lease) ->
succeeded | failed | cancelled | expired. Results are written only by the holder of the current claim, with a
conditional UPDATE, so a redelivered message can never write a second result.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone

from controlplane.accounts.models import Account, ApiKey
from controlplane.batches.fields import BulkJSONField


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class File(models.Model):
    class Purpose(models.TextChoices):
        BATCH = "batch", "Batch input"
        BATCH_OUTPUT = "batch_output", "Batch output"

    id = models.CharField(primary_key=True, max_length=40, default=new_file_id, editable=False)
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="batch_files")
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField(default=0)
    # In the database rather than on a disk: every server and worker of a deployment reads the same rows.
    content = models.BinaryField()
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["account", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class Batch(models.Model):
    class Api(models.TextChoices):
        OPENAI = "openai", "OpenAI Batches"
        NATIVE = "native", "Workers AI queueRequest"

    class Status(models.TextChoices):
        VALIDATING = "validating", "Validating"
        IN_PROGRESS = "in_progress", "In progress"
        FINALIZING = "finalizing", "Finalizing"
        COMPLETED = "completed", "Completed"
        FAILED = "failed", "Failed"
        EXPIRED = "expired", "Expired"
        CANCELLING = "cancelling", "Cancelling"
        CANCELLED = "cancelled", "Cancelled"

    TERMINAL = (Status.COMPLETED, Status.FAILED, Status.EXPIRED, Status.CANCELLED)
    LIVE = (Status.VALIDATING, Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING)

    id = models.CharField(primary_key=True, max_length=40, default=new_batch_id, editable=False)
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="batches")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # The key's model scope when the batch was created: lines naming other models fail.
    allowed_models = models.JSONField(default=list, blank=True)
    api = models.CharField(max_length=8, choices=Api.choices)
    endpoint = models.CharField(max_length=64, blank=True)
    model = models.CharField(max_length=200, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    input_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    output_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    completion_window = models.CharField(max_length=8, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(default=list, blank=True)  # batch-level errors (validation of the whole input)
    total_count = models.PositiveIntegerField(default=0)
    completed_count = models.PositiveIntegerField(default=0)
    failed_count = models.PositiveIntegerField(default=0)
    cancelled_count = models.PositiveIntegerField(default=0)  # cancelled or expired before they ran
    dispatched_count = models.PositiveIntegerField(default=0)  # items ever sent to the workers (window refills)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)  # reached a terminal status
    results_purged_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "batches"
        indexes = [models.Index(fields=["account", "-created_at"]), models.Index(fields=["status"])]

    def __str__(self) -> str:
        return f"{self.id} {self.status}"

    @property
    def pending_count(self) -> int:
        return self.total_count - self.completed_count - self.failed_count - self.cancelled_count


class Item(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"
        EXPIRED = "expired", "Expired"

    DONE = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.EXPIRED)

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="items")
    index = models.PositiveIntegerField()  # position in the request list / input file
    custom_id = models.CharField(max_length=512, null=True, blank=True)  # OpenAI custom_id / external_reference
    model = models.CharField(max_length=200, blank=True)
    body = models.JSONField(null=True, blank=True)  # the request body; null when the line was malformed
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED)
    dispatched_at = models.DateTimeField(null=True, blank=True)  # last time a task message was sent for it
    claim_token = models.CharField(max_length=32, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)  # claims taken (a retry or a crash adds one)
    # The answer's body, as the interactive route renders it (thousands of floats for embeddings: fields.py).
    response = BulkJSONField(null=True, blank=True)
    # {"status", "code" (native), "openai_code", "message", "param"} when the item failed
    error = models.JSONField(null=True, blank=True)
    input_tokens = models.PositiveIntegerField(default=0)
    cached_input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "index"]
        constraints = [models.UniqueConstraint(fields=["batch", "index"], name="unique_batch_item_index")]
        indexes = [models.Index(fields=["batch", "status"])]

    def __str__(self) -> str:
        return f"{self.batch_id}[{self.index}] {self.status}"

    @property
    def request_id(self) -> str:
        return f"batch_req_{self.batch_id.removeprefix('batch_')[:20]}_{self.index}"
