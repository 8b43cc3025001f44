"""Property-based: Schemathesis generates requests from our own OpenAPI document (valid and invalid bodies,
parameters and headers) for every operation, sends them to a live server with a real key, and any 5xx fails.
Seeded and bounded so the run is the same every time and stays well under a minute."""

from __future__ import annotations

import pytest
import schemathesis
from cp_support import make_tenant
from hypothesis import HealthCheck, Phase, settings
from test_live_server import live  # noqa: F401  (a fixture)

from controlplane.api.openapi import build_schema

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.once]

schema = schemathesis.openapi.from_dict(build_schema())
OUTPUT_CAP = 4  # generation is the slow part, and its length is not what this test is about


def _capped(body: object) -> object:
    """Valid inference bodies may ask for thousands of tokens; keep any such request short."""
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > OUTPUT_CAP:
                body[field] = OUTPUT_CAP
        if "max_tokens" not in body and ("prompt" in body or "messages" in body):
            body["max_tokens"] = OUTPUT_CAP
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
    return body


@pytest.fixture
def tenant_url(live):  # noqa: F811
    url, tenant = live
    admin = make_tenant("fuzz", permission="admin")
    return url, admin, tenant


@schema.parametrize()
@settings(max_examples=8, derandomize=True, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_5xx(case, tenant_url):
    url, admin, _ = tenant_url
    if case.path_parameters and "account_id" in case.path_parameters:
        case.path_parameters["account_id"] = admin.account.pk
    case.body = _capped(case.body)
    response = case.call(base_url=url, headers={"Authorization": f"Bearer {admin.secret}"}, timeout=60)
    assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text[:500])
