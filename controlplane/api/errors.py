"""API errors and their two wire shapes: the Cloudflare envelope (native routes) and OpenAI error objects (/v1).

Every refusal the control plane makes is an ApiError carrying both shapes' details, so one code path can raise
it and the route decides how it is rendered.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from django.http import HttpResponse

from inference.errors import (
    EngineDeadError,
    EngineError,
    EngineLostError,
    EngineOverloadedError,
    EngineUnreachableError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    TokenizerChangedError,
)

# Workers AI / Cloudflare API codes used on native routes.
CODE_INVALID_INPUT = 5006
CODE_INCOMPLETE_REQUEST = 3003
CODE_NO_SUCH_MODEL = 5007
CODE_LORA_UNSUPPORTED = 5005
CODE_REQUEST_TOO_LARGE = 3006
CODE_LORA_FILES_MISSING = 3039
CODE_ACCOUNT_LIMITED = 3036
CODE_OUT_OF_CAPACITY = 3040
CODE_AUTHENTICATION = 10000
CODE_FORBIDDEN = 10001
CODE_RATE_LIMITED = 971
CODE_NOT_FOUND = 7003
CODE_METHOD_NOT_ALLOWED = 7001
CODE_INTERNAL = 5000
CODE_UNAVAILABLE = 5001

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                    529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def openai_error_type(status: int) -> str:
    return _OPENAI_TYPES.get(status, "invalid_request_error")


@dataclass(eq=False)
class ApiError(Exception):
    status: int
    code: int
    message: str
    openai_code: str | None = None
    openai_status: int | None = None  # when the OpenAI routes answer with another status than native ones
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def native_response(self) -> HttpResponse:
        body = {"result": None, "success": False,
                "errors": [{"code": self.code, "message": self.message}], "messages": []}
        return _json(body, self.status, self.headers)

    def openai_response(self) -> HttpResponse:
        status = self.openai_status or self.status
        body = {"error": {"message": self.message, "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
                          "param": self.param, "code": self.openai_code}}
        return _json(body, status, self.headers)

    def anthropic_response(self) -> HttpResponse:
        status = self.openai_status or self.status
        return _json(self.anthropic_body(), status, self.headers)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's envelope: {"type": "error", "error": {"type", "message"}}."""
        return {"type": "error", "error": {"type": anthropic_error_type(self.openai_status or self.status),
                                           "message": self.message}}

    def response(self, style: str) -> HttpResponse:
        if style == "anthropic":
            return self.anthropic_response()
        return self.openai_response() if style == "openai" else self.native_response()

    @property
    def wire_code(self) -> str:
        """What the usage event records as the error code (one value for both styles)."""
        return str(self.code)


def _json(body: dict[str, Any], status: int, headers: dict[str, str]) -> HttpResponse:
    response = HttpResponse(json.dumps(body), status=status, content_type="application/json")
    for name, value in headers.items():
        response[name] = value
    return response


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, CODE_INVALID_INPUT, message, openai_code="invalid_value", param=param)


def malformed(message: str) -> ApiError:
    return ApiError(400, CODE_INCOMPLETE_REQUEST, message, openai_code="invalid_json")


def unknown_model(name: str) -> ApiError:
    return ApiError(400, CODE_NO_SUCH_MODEL, f"No such model {name!r} or task", openai_code="model_not_found",
                    openai_status=404, param="model")


def lora_unsupported(model: str) -> ApiError:
    return ApiError(400, CODE_LORA_UNSUPPORTED, f"The model {model} does not support LoRA inference",
                    openai_code="lora_not_supported", param="lora")


def lora_files_missing(message: str, param: str | None = "lora") -> ApiError:
    """An adapter without both of its files: an upload that lacks one, or an adapter used before it is ready."""
    return ApiError(400, CODE_LORA_FILES_MISSING, message, openai_code="adapter_files_missing", param=param)


def conflict(message: str, param: str | None = None) -> ApiError:
    """The request is valid but clashes with what is stored (a taken name, a file that is already there)."""
    return ApiError(409, CODE_INVALID_INPUT, message, openai_code="conflict", param=param)


def request_too_large(message: str = "Request is too large") -> ApiError:
    return ApiError(413, CODE_REQUEST_TOO_LARGE, message, openai_code="request_too_large")


def prompt_too_long(message: str) -> ApiError:
    # OpenAI answers an over-long prompt with 400 context_length_exceeded; Workers AI with 3006 / 413.
    return ApiError(413, CODE_REQUEST_TOO_LARGE, message, openai_code="context_length_exceeded",
                    openai_status=400, param="messages")


def unauthorized(message: str) -> ApiError:
    return ApiError(401, CODE_AUTHENTICATION, message, openai_code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="hearth"'})


def forbidden(message: str) -> ApiError:
    return ApiError(403, CODE_FORBIDDEN, message, openai_code="permission_denied")


def not_found(message: str) -> ApiError:
    return ApiError(404, CODE_NOT_FOUND, message, openai_code="not_found")


def method_not_allowed(allowed: list[str]) -> ApiError:
    return ApiError(405, CODE_METHOD_NOT_ALLOWED, f"Method not allowed; use {', '.join(allowed)}",
                    openai_code="method_not_allowed", headers={"Allow": ", ".join(allowed)})


def retry_headers(retry_after_s: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


def account_limited(message: str, retry_after_s: float) -> ApiError:
    return ApiError(429, CODE_ACCOUNT_LIMITED, message, openai_code="insufficient_quota",
                    headers=retry_headers(retry_after_s))


def rate_limited(message: str, retry_after_s: float) -> ApiError:
    return ApiError(429, CODE_RATE_LIMITED, message, openai_code="rate_limit_exceeded",
                    headers=retry_headers(retry_after_s))


def out_of_capacity(message: str = "Out of capacity: the engine queue is full, retry shortly",
                    retry_after_s: float = 1) -> ApiError:
    return ApiError(429, CODE_OUT_OF_CAPACITY, message, openai_code="engine_overloaded",
                    headers=retry_headers(retry_after_s))


def unavailable(message: str) -> ApiError:
    return ApiError(503, CODE_UNAVAILABLE, message, openai_code="engine_unavailable")


def internal(message: str = "Internal server error") -> ApiError:
    return ApiError(500, CODE_INTERNAL, message, openai_code="internal_error")


def from_engine(exc: EngineError, model: str) -> ApiError:
    """The engine's deliberate errors mapped to the API's; order matters (PromptTooLong is an InvalidRequest)."""
    if isinstance(exc, PromptTooLongError):
        return prompt_too_long(str(exc))
    if isinstance(exc, InvalidRequestError):
        return invalid(str(exc))
    if isinstance(exc, ModelNotFoundError):
        return unknown_model(model)
    if isinstance(exc, EngineOverloadedError):
        return out_of_capacity()
    if isinstance(exc, EngineLostError):
        if isinstance(exc, EngineUnreachableError):
            message = f"The fleet could not reach the engine for {model}; retry the request"
        elif isinstance(exc, TokenizerChangedError):
            message = f"{model} was redeployed with another tokenizer while the request was on its way; retry it"
        else:
            message = f"The replica serving {model} went away during the request; retry it"
        error = unavailable(message)
        error.headers.update(retry_headers(1.0))
        return error
    if isinstance(exc, EngineDeadError):
        return unavailable(f"The engine for {model} stopped; an operator must restart it")
    return internal()
