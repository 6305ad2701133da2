"""Errors the server answers with, in the dialect of the route that failed.

OpenAI's clients read ``{"error": {"message", "type", "param", "code"}}``; Anthropic's read
``{"type": "error", "error": {"type", "message"}}`` and pick the exception class from the status.
One table maps a status to each dialect's type, so a route only raises ``ApiError``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Dialect(Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


def dialect_of(path: str) -> Dialect:
    """Anthropic's routes are /v1/messages and below; everything else answers as OpenAI does."""
    return Dialect.ANTHROPIC if path.rstrip("/").startswith("/v1/messages") else Dialect.OPENAI


# status -> (OpenAI error type, Anthropic error type)
ERROR_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    422: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


@dataclass
class ApiError(Exception):
    """A request that gets ``status`` and a one-line ``message``; ``param`` names the field
    (OpenAI shows it), ``code`` is OpenAI's machine-readable code (e.g. context_length_exceeded)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message


def error_body(dialect: Dialect, err: ApiError) -> dict:
    openai_type, anthropic_type = ERROR_TYPES.get(err.status, ERROR_TYPES[500 if err.status >= 500 else 400])
    if dialect is Dialect.ANTHROPIC:
        return {"type": "error", "error": {"type": anthropic_type, "message": err.message}}
    return {"error": {"message": err.message, "type": openai_type, "param": err.param, "code": err.code}}


def context_exceeded(prompt_tokens: int, ctx: int) -> ApiError:
    """OpenAI's wording and code, both numbers named; the request cannot start."""
    return ApiError(400, f"This model's maximum context length is {ctx} tokens (--ctx). However, your messages "
                         f"resulted in {prompt_tokens} tokens, which leaves no room to generate. Please reduce the "
                         "length of the messages.", "messages", "context_length_exceeded")
