"""Request bodies as pydantic models: basic types and ranges checked, unknown fields kept.

These check what a route needs to be typed (a list where a list goes, numbers in range); what the
fields mean (message content blocks, tools, roles) is read by ``messages`` after ``model_dump``.
Clients send many fields we do not use (``metadata``, ``store``, ``user``, ``parallel_tool_calls``):
they are accepted and ignored rather than rejected, as the official servers do with new fields.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ApiError


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Sampling(Body):
    """Sampling fields shared by the routes (None: the server's default, spark-run's options)."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-2**63, lt=2**64)


class StreamOptions(Body):
    include_usage: bool = False


class ChatCompletionRequest(Sampling):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    model: str | None = None
    prompt: str | list[int] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for this route
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    echo: bool = Field(False, le=False)
    suffix: None = None


class ResponsesRequest(Sampling):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None


class MessagesRequest(Sampling):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None


class CountTokensRequest(Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class TokenizeRequest(Body):
    """llama.cpp server's /tokenize: ``content`` -> ``tokens``."""

    content: str
    add_special: bool = False


class DetokenizeRequest(Body):
    tokens: list[int]


def parse(model: type[Body], data: Any) -> Body:
    """``data`` (parsed JSON) as ``model``, or a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or None
        extra = f" ({len(e.errors()) - 1} more problems)" if len(e.errors()) > 1 else ""
        raise ApiError(400, f"{where}: {err['msg']}{extra}" if where else err["msg"] + extra, where) from None
