"""Production warnings an operator sees in `check --deploy`."""

from __future__ import annotations

from controlplane.serving.apps import metrics_token_check


def test_open_metrics_warn_only_in_production(settings):
    settings.DEBUG, settings.HEARTH_METRICS_TOKEN = False, ""
    assert [w.id for w in metrics_token_check()] == ["hearth.W001"]
    settings.HEARTH_METRICS_TOKEN = "s3cret"
    assert metrics_token_check() == []
    settings.DEBUG, settings.HEARTH_METRICS_TOKEN = True, ""
    assert metrics_token_check() == []
