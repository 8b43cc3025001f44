"""Stored responses of OpenAI's Responses API: what GET returns, and what previous_response_id continues."""

from __future__ import annotations

from django.db import models

from controlplane.accounts.models import Account


class StoredResponse(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"  # background: waiting for a worker
        IN_PROGRESS = "in_progress"
        COMPLETED = "completed"
        INCOMPLETE = "incomplete"  # stopped at max_output_tokens
        FAILED = "failed"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=64)
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="responses")
    api_key_id = models.CharField(max_length=64, blank=True)
    model = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices)
    background = models.BooleanField(default=False)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)
    previous_response_id = models.CharField(max_length=64, blank=True)
    body = models.JSONField()  # the request as sent (a background worker builds its job from it)
    conversation = models.JSONField()  # the chat messages the prompt was made of, previous turns included
    response = models.JSONField()  # the response object, as GET returns it
    claimed_at = models.DateTimeField(null=True, blank=True)  # a background run's start (a stale one is re-run)

    class Meta:
        indexes = [models.Index(fields=["account", "-created_at"])]
