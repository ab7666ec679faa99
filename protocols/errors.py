"""API errors: one exception type, rendered in the OpenAI or the Anthropic shape.

OpenAI (Chat, Responses): `{"error": {"message", "type", "param", "code"}}`.
Anthropic (Messages): `{"type": "error", "error": {"type", "message"}, "request_id"}`.
Which shape a path gets is decided by `flavor_for_path`: everything under `/v1/messages` is
Anthropic, the rest OpenAI (protocols.md section 1.6).
"""

from __future__ import annotations

from typing import Optional, Sequence

import orjson

OPENAI = "openai"
ANTHROPIC = "anthropic"

_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
    431: "invalid_request_error", 503: "server_error", 529: "server_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
    408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
    429: "rate_limit_error", 431: "request_too_large", 503: "overloaded_error",
    529: "overloaded_error",
}
RETRYABLE_CLIENT_ERRORS = (408, 409, 429)
"""4xx statuses a later retry can fix (timeout, conflict, rate limit): the SDKs' own list."""
_DEFAULT_CODES = {413: "request_too_large", 431: "request_header_fields_too_large",
                  408: "request_timeout", 503: "server_overloaded", 401: "invalid_api_key"}


class ApiError(Exception):
    """A request that fails with an HTTP status and a message for the client.

    param: the request field at fault (OpenAI `param`), e.g. "messages[2].content".
    code: a machine-readable code, e.g. "context_length_exceeded", "unsupported_parameter".
    retry_after: seconds, sent as `retry-after` (queue full).
    headers: more response headers, e.g. `allow` on a 405.
    """

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, retry_after: Optional[int] = None,
                 headers: Sequence[tuple[str, str]] = ()):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _DEFAULT_CODES.get(status)
        self.retry_after = retry_after
        self.headers = tuple(headers)


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """400 naming the field."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def unsupported(param: str, message: str = "is not supported by this server") -> ApiError:
    """400 for a field the engine cannot honour (never silently ignored)."""
    return ApiError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def flavor_for_path(path: str) -> str:
    if path.startswith("/v1/v1/"):
        path = path[3:]
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def error_type(flavor: str, status: int) -> str:
    if flavor == ANTHROPIC:
        return _ANTHROPIC_TYPES.get(status, "api_error")
    return _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_payload(flavor: str, error: ApiError, request_id: Optional[str] = None) -> dict:
    """The JSON object of an error response body (also used for in-band stream errors)."""
    if flavor == ANTHROPIC:
        payload = {"type": "error",
                   "error": {"type": error_type(flavor, error.status), "message": error.message}}
        if request_id:
            payload["request_id"] = request_id
        return payload
    return {"error": {"message": error.message, "type": error_type(flavor, error.status),
                      "param": error.param, "code": error.code}}


def error_headers(flavor: str, error: ApiError,
                  request_id: Optional[str] = None) -> list[tuple[str, str]]:
    headers: list[tuple[str, str]] = []
    if request_id:
        headers.append(("request-id" if flavor == ANTHROPIC else "x-request-id", request_id))
    if error.retry_after is not None:
        headers.append(("retry-after", str(error.retry_after)))
    if error.retry_after is None and error.status not in RETRYABLE_CLIENT_ERRORS:
        # The same request would fail the same way (a bad key, a bad field, a deterministic
        # server failure): tell the SDKs and agents (Claude Code, Codex) not to retry it.
        headers.append(("x-should-retry", "false"))
    headers.extend(error.headers)
    return headers


def error_body(flavor: str, error: ApiError, request_id: Optional[str] = None) -> bytes:
    return orjson.dumps(error_payload(flavor, error, request_id))


def status_error(path: str, status: int, message: str,
                 extra_headers: Sequence[tuple[str, str]] = ()) -> tuple[bytes, list]:
    """Body and headers for an HTTP-level failure (limits, malformed requests)."""
    flavor = flavor_for_path(path)
    error = ApiError(status, message)
    return error_body(flavor, error), error_headers(flavor, error) + list(extra_headers)
