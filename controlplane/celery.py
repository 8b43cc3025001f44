"""The Celery app that runs batch items: `celery -A controlplane worker -B`, or the worker thread the ASGI app
starts in embedded mode (controlplane.batches.runtime). Configuration comes from the CELERY_* Django settings."""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from kombu.transport import TRANSPORT_ALIASES

# `filesystem://` (the embedded broker) means our atomic-write variant of kombu's transport: see fs_transport.
TRANSPORT_ALIASES["filesystem"] = "controlplane.batches.fs_transport:Transport"

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

app = Celery("hearth")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["controlplane.batches", "controlplane.serving"])


def ensure_broker_dirs() -> None:
    """The filesystem transport needs its folders before the first message."""
    options = app.conf.broker_transport_options or {}
    for key in ("data_folder_in", "data_folder_out", "control_folder"):
        if options.get(key):
            Path(options[key]).mkdir(parents=True, exist_ok=True)


def use_broker(url: str, *, queue: str | None = None, transport_options: dict | None = None) -> None:
    """Point the app at another broker (tests, benchmarks)."""
    app.conf.broker_url = url
    if transport_options is not None:
        app.conf.broker_transport_options = transport_options
    if queue is not None:
        app.conf.task_default_queue = queue
    # Pools are built lazily from the configuration; forget any built for the previous broker (as Celery itself
    # does after a fork).
    app._after_fork()
