"""Request bodies shared by every app's API: strict pydantic schemas, one readable 400 for a body that does not
fit, and reading a body whose error is reported only after the caller is authenticated."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from django.http import HttpRequest
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.api.http import read_json


def _integral(value: Any) -> Any:
    # JSON has one number type: 1751.0 is the integer 1751 to JSON Schema (and to the OpenAPI document), so
    # strict integer fields take it; 1.5 and "5" are still refused.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_integral)]  # an integer field of a request body


class StrictBody(BaseModel):
    # Strict: "5" is not an integer and 1 is not a boolean. Unknown fields are ignored so newer clients work.
    model_config = ConfigDict(strict=True, extra="ignore")


# Union branches name themselves in error locations; they only confuse a reader of the message.
_BRANCH_NAMES = {"str", "list[str]", "list[TextPart]", "int", "list[int]", "list[list[int]]", "bool", "dict[str,any]",
                 "list[ContentPart]"}


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    parts = []
    first_param = None
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "tagged-union")))
        loc = ".".join(p for p in loc.split(".") if p not in _BRANCH_NAMES)
        first_param = first_param or loc or None
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(dict.fromkeys(parts)), first_param


T = TypeVar("T", bound=BaseModel)


def parse(schema: type[T], body: dict[str, Any]) -> T:
    """The body as `schema`, or a 400 naming the first fields that do not fit."""
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        message, param = _describe(exc)
        raise errors.invalid(f"Invalid request body: {message}", param) from None


def read_body(request: HttpRequest) -> tuple[dict[str, Any] | None, ApiError | None]:
    """The JSON body, or the error to raise once the caller is authenticated (an anonymous caller learns
    nothing about the API beyond 401)."""
    try:
        return read_json(request), None
    except ApiError as exc:
        return None, exc
