"""Errors the server answers with, in the dialect of the route that failed.

OpenAI's clients read ``{"error": {"message", "type", "param", "code"}}``; Anthropic's read
``{"type": "error", "error": {"type", "message"}}`` and pick the exception class from the status.
One table maps a status to each dialect's type, so a route only raises ``ApiError``. Anthropic's
messages have no ``param``: they open with the field in its dotted form (``messages.2.role: ...``),
and clients match on some of them (Claude Code compacts on ``prompt is too long: N tokens > M
maximum``), so an error can carry Anthropic's own wording too.
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
    anthropic: str | None = None  # the message as Anthropic words it, where that differs

    def __str__(self) -> str:
        return self.message


def anthropic_field(param: str) -> str:
    """``messages[2].content[0].type`` as Anthropic names it: ``messages.2.content.0.type``."""
    return param.replace("[", ".").replace("]", "")


def client_message(dialect: Dialect, err: ApiError) -> str:
    """The message the client reads (and the request's log line shows)."""
    if dialect is Dialect.ANTHROPIC and err.anthropic is not None:
        return err.anthropic
    return err.message


def error_body(dialect: Dialect, err: ApiError) -> dict:
    openai_type, anthropic_type = ERROR_TYPES.get(err.status, ERROR_TYPES[500 if err.status >= 500 else 400])
    if dialect is Dialect.ANTHROPIC:
        return {"type": "error", "error": {"type": anthropic_type, "message": client_message(dialect, err)}}
    return {"error": {"message": err.message, "type": openai_type, "param": err.param, "code": err.code}}


def context_exceeded(prompt_tokens: int, ctx: int, param: str) -> ApiError:
    """The request cannot start: OpenAI's wording and code, and Anthropic's wording, which Claude
    Code reads to compact by itself. Anthropic's maximum is the longest prompt that leaves room
    for one token (--ctx minus one), so that its "N > M" holds for every prompt refused."""
    return ApiError(400, f"This model's maximum context length is {ctx} tokens (--ctx). However, your messages "
                         f"resulted in {prompt_tokens} tokens, which leaves no room to generate. Please reduce the "
                         "length of the messages.", param, "context_length_exceeded",
                    anthropic=f"prompt is too long: {prompt_tokens} tokens > {ctx - 1} maximum")
