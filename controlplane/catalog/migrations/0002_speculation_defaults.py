"""Give catalog rows seeded before speculative decoding its per-model defaults (seed_catalog sets them only
when it creates a row). Keys an operator already set are kept."""

from __future__ import annotations

from typing import Any

from django.db import migrations

DRAFT = "@hearth/qwen2.5-coder-0.5b-instruct"
# Frozen copy of controlplane.catalog.services.DEFAULT_ENGINE_SETTINGS as of this migration.
DEFAULTS: dict[str, dict[str, Any]] = {
    "@hearth/qwen2.5-coder-0.5b-instruct": {"speculation": "ngram", "num_speculative_tokens": 8},
    "@hearth/smollm2-135m-instruct": {"speculation": "ngram", "num_speculative_tokens": 8},
    "@hearth/qwen2.5-coder-1.5b-instruct": {"speculation": "draft", "draft_model": DRAFT},
}
NGRAM = {"speculation": "ngram", "num_speculative_tokens": 8}


def add_defaults(apps: Any, schema_editor: Any) -> None:
    AiModel = apps.get_model("catalog", "AiModel")
    draft_installed = AiModel.objects.filter(name=DRAFT, installed=True).exists()
    for row in AiModel.objects.filter(name__in=DEFAULTS):
        defaults = DEFAULTS[row.name]
        if "draft_model" in defaults and not draft_installed:
            defaults = NGRAM
        settings = dict(row.engine_settings or {})
        if any(key in settings for key in ("speculation", "num_speculative_tokens", "draft_model")):
            continue  # the operator chose this model's speculation already
        row.engine_settings = {**settings, **defaults}
        row.save(update_fields=["engine_settings"])


class Migration(migrations.Migration):

    dependencies = [("catalog", "0001_initial")]

    operations = [migrations.RunPython(add_defaults, migrations.RunPython.noop)]
